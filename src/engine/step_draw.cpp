#include "engine/step_draw.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>

#include "core/error.h"

namespace oscar::engine {

void PenaltyIds::begin_step() {
  for (auto it = rows_.begin(); it != rows_.end();)
    it = it->second.step == step_ ? std::next(it) : rows_.erase(it);
  ++step_;
}

std::span<const int32_t> PenaltyIds::distinct(const void* key, std::span<const int> history, int vocab) {
  Row& r = rows_[key];
  r.step = step_;
  const bool extends = r.vocab == vocab && r.seen.size() <= history.size() &&
                       std::equal(r.seen.begin(), r.seen.end(), history.begin());
  if (!extends) {
    r.seen.clear();
    r.distinct.clear();
    r.bits.assign((size_t(vocab) + 63) / 64, 0);
    r.vocab = vocab;
  }
  for (size_t i = r.seen.size(); i < history.size(); ++i) {
    const int t = history[i];
    if (t < 0 || t >= vocab) continue;
    uint64_t& w = r.bits[size_t(t) / 64];
    const uint64_t bit = uint64_t(1) << (t % 64);
    if (!(w & bit)) w |= bit, r.distinct.push_back(t);
  }
  r.seen.insert(r.seen.end(), history.begin() + std::ptrdiff_t(r.seen.size()), history.end());
  return r.distinct;
}

void StepDrawer::run(model::Model& m, std::span<const model::SeqStep> steps, kv::KvCache& cache,
                     std::span<SampleJob> jobs) {
  size_t R = 0;  // output rows: every position of an all_logits step, else its last
  for (const model::SeqStep& s : steps) R += s.all_logits ? s.tokens.size() : 1;
  const int V = m.config().vocab_size;
  draws_.assign(R, backend::RowDraw{});
  hist_.clear();
  penalty_ids_.begin_step();
  for (SampleJob& j : jobs) {
    if (j.row < 0 || size_t(j.row) >= R || draws_[size_t(j.row)].mode != backend::RowDraw::kSkip)
      throw Error(fmt::format("StepDrawer: job row {} of {} (or twice)", j.row, R));
    j.u = j.sampler->next_u();
    backend::RowDraw& d = draws_[size_t(j.row)];
    d = j.sampler->device_draw(j.u);
    if (d.penalty != 1.0f) {  // the history's distinct ids (the penalty acts once per id)
      const std::span<const int32_t> ids = penalty_ids_.distinct(j.sampler, j.history, V);
      d.hist_off = static_cast<int32_t>(hist_.size());
      hist_.insert(hist_.end(), ids.begin(), ids.end());
      d.hist_len = static_cast<int32_t>(ids.size());
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
