// One forward step and the tokens it yields: the step of the scheduler and of the generator.
//
// Each job names an output row of the step (SampleJob::row) whose token is wanted. Before the
// forward, every sampled row takes its u from its own sampler (Sampler::next_u), so the token
// does not depend on where it is drawn. The backend draws what it can where the logits are
// (Backend::sample_rows: the plain argmax rows everywhere; on a device every row, a repetition
// penalty applied there from the distinct ids of the row's history); the other rows (the CPU
// backend's draws, a device row it could not draw) copy their logits to the host and are drawn
// there with the same u, the rows in parallel (sample_rows). A row
// that cannot be drawn (NaN logits) gets token -1 and its message in SampleJob::error; the
// other rows are drawn.
#pragma once

#include <span>
#include <vector>

#include "backend/sample.h"
#include "engine/sampler.h"
#include "kv/kv_cache.h"
#include "model/forward.h"

namespace oscar::engine {

class StepDrawer {
 public:
  // Runs the step (Model::forward_sample) and fills jobs' tokens. steps' output rows are one
  // per step (SeqStep::all_logits false). Throws what the forward throws.
  void run(model::Model& m, std::span<const model::SeqStep> steps, kv::KvCache& cache, std::span<SampleJob> jobs);

  // Rows the last run drew on the host (tests and metrics).
  int host_rows() const { return host_rows_; }

 private:
  std::vector<backend::RowDraw> draws_;
  std::vector<int32_t> hist_;       // the penalized rows' distinct history ids
  std::vector<char> seen_;          // [vocab] for the distinct ids
  std::vector<int32_t> tokens_;
  std::vector<float> logits_;       // the host rows' logits
  std::vector<SampleJob> host_;     // their draws
  std::vector<size_t> host_of_;     // host_[i] is jobs[host_of_[i]]
  int host_rows_ = 0;
};

}  // namespace oscar::engine
