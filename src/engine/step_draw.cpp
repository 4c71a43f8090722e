#include "engine/step_draw.h"

#include <fmt/format.h>

#include "core/error.h"

namespace oscar::engine {

void StepDrawer::run(model::Model& m, std::span<const model::SeqStep> steps, kv::KvCache& cache,
                     std::span<SampleJob> jobs) {
  for (const model::SeqStep& s : steps)
    if (s.all_logits) throw Error("StepDrawer: steps with every position's logits are not drawn from");
  const int V = m.config().vocab_size;
  draws_.assign(steps.size(), backend::RowDraw{});
  hist_.clear();
  for (SampleJob& j : jobs) {
    if (j.row < 0 || j.row >= static_cast<int>(steps.size()) || draws_[size_t(j.row)].mode != backend::RowDraw::kSkip)
      throw Error(fmt::format("StepDrawer: job row {} of {} (or twice)", j.row, steps.size()));
    j.u = j.sampler->next_u();
    backend::RowDraw& d = draws_[size_t(j.row)];
    d = j.sampler->device_draw(j.u);
    if (d.penalty != 1.0f) {  // the history's distinct ids (the penalty acts once per id)
      seen_.resize(size_t(V), 0);
      d.hist_off = static_cast<int32_t>(hist_.size());
      for (int t : j.history)
        if (t >= 0 && t < V && !seen_[size_t(t)]) seen_[size_t(t)] = 1, hist_.push_back(t);
      d.hist_len = static_cast<int32_t>(hist_.size()) - d.hist_off;
      for (size_t i = size_t(d.hist_off); i < hist_.size(); ++i) seen_[size_t(hist_[i])] = 0;
    }
    j.token = -1;
    j.error.clear();
  }
  m.forward_sample(steps, cache, draws_, hist_, tokens_);

  host_.clear();
  host_of_.clear();
  for (size_t k = 0; k < jobs.size(); ++k) {
    const int32_t t = tokens_[size_t(jobs[k].row)];
    if (t >= 0) {
      jobs[k].token = t;
    } else if (t == backend::kDrawNaN) {
      jobs[k].error = "sampler: NaN in logits";
    } else {
      host_.push_back(jobs[k]);
      host_of_.push_back(k);
    }
  }
  host_rows_ = static_cast<int>(host_.size());
  if (host_.empty()) return;
  logits_.resize(host_.size() * size_t(V));
  for (size_t i = 0; i < host_.size(); ++i) {
    std::span<float> row(logits_.data() + i * size_t(V), size_t(V));
    m.output_logits(host_[i].row, row);
    host_[i].logits = row;
  }
  sample_rows(host_);
  for (size_t i = 0; i < host_.size(); ++i) {
    jobs[host_of_[i]].token = host_[i].token;
    jobs[host_of_[i]].error = host_[i].error;
  }
}

}  // namespace oscar::engine
