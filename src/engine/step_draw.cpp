#include "engine/step_draw.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <iterator>

#include "core/error.h"

namespace oscar::engine {

void PenaltyIds::begin_step() {
  for (Entry* e : pending_) e->pending = SIZE_MAX;  // a step that never committed
  pending_.clear();
  for (auto it = rows_.begin(); it != rows_.end();) {
    if (it->second.step == step_) {
      ++it;
      continue;
    }
    if (it->second.slot >= 0) slot_used_[size_t(it->second.slot)] = 0;
    it = rows_.erase(it);
  }
  ++step_;
}

namespace {
// Fibonacci hashing: the top bits of id · 2^64/φ (ids that share their low bits spread too).
size_t gen_slot(int32_t t, size_t table) {
  return size_t((uint64_t(uint32_t(t)) * 0x9E3779B97F4A7C15ull) >> (64 - std::countr_zero(table)));
}
}  // namespace

size_t PenaltyIds::gen_pair(Entry& r, int32_t t) {
  if (r.gen_pos.size() < 2 * (r.gen_pairs.size() / 2 + 1)) {  // grow (and rehash) to keep it half empty at most
    r.gen_pos.assign(std::max<size_t>(64, 2 * r.gen_pos.size()), 0);
    for (size_t j = 0; j < r.gen_pairs.size(); j += 2) {
      const uint64_t key = uint64_t(uint32_t(r.gen_pairs[j]) + 1) << 32;
      size_t h = gen_slot(r.gen_pairs[j], r.gen_pos.size());
      while (r.gen_pos[h]) h = (h + 1) & (r.gen_pos.size() - 1);
      r.gen_pos[h] = key | j;
    }
  }
  const uint64_t key = uint64_t(uint32_t(t) + 1) << 32;
  size_t h = gen_slot(t, r.gen_pos.size());
  for (;; h = (h + 1) & (r.gen_pos.size() - 1)) {
    const uint64_t e = r.gen_pos[h];
    if ((e & ~uint64_t(0xFFFFFFFFu)) == key) return size_t(uint32_t(e));
    if (!e) break;
  }
  r.gen_pos[h] = key | r.gen_pairs.size();
  r.gen_pairs.push_back(t), r.gen_pairs.push_back(0);
  return r.gen_pairs.size() - 2;
}

PenaltyIds::Entry& PenaltyIds::update(Entry& r, std::span<const int> history, int vocab, bool force_reset,
                                      uint64_t identity, bool appends) {
  if (identity != r.identity) force_reset = true, r.identity = identity;  // another owner at this key
  // The same history again in this step (row() then generated() for one sampler): nothing new.
  if (!force_reset && r.step == step_ && r.vocab == vocab && history.data() == r.seen_data &&
      history.size() == r.seen.size())
    return r;
  r.step = step_;
  r.seen_data = history.data();
  const bool extends =
      !force_reset && r.vocab == vocab && r.seen.size() <= history.size() &&
      (appends ? r.seen.empty() || history[r.seen.size() - 1] == r.seen.back()  // (the caller's promise)
               : std::equal(r.seen.begin(), r.seen.end(), history.begin()));
  if (!extends) {
    r.seen.clear();
    r.distinct.clear();
    r.bits.assign((size_t(vocab) + 63) / 64, 0);
    r.slot_valid = false;  // the slot's ids are another history's
    r.slot_count = 0;
    ++r.epoch;
    if (r.gen_from >= 0) {
      r.gen_pos.clear();
      r.gen_pairs.clear();
    }
    r.vocab = vocab;
  }
  for (size_t i = r.seen.size(); i < history.size(); ++i) {
    const int t = history[i];
    if (t < 0 || t >= vocab) continue;
    uint64_t& w = r.bits[size_t(t) / 64];
    const uint64_t bit = uint64_t(1) << (t % 64);
    if (!(w & bit)) w |= bit, r.distinct.push_back(t);
    if (r.gen_from >= 0 && i >= size_t(r.gen_from)) {
      ++r.gen_pairs[gen_pair(r, t) + 1];
    }
  }
  r.seen.insert(r.seen.end(), history.begin() + std::ptrdiff_t(r.seen.size()), history.end());
  return r;
}

PenaltyIds::Row PenaltyIds::row(const void* key, std::span<const int> history, int vocab, int slots,
                                uint64_t identity, bool appends) {
  Entry& r = rows_[key];
  if (slots > 0 && r.step == step_ && r.pending != SIZE_MAX && r.identity == identity) {
    // Named twice in one step: the slot stays as the first row left it; this row's ids from
    // scratch (the entry keeps the first row's history).
    std::vector<uint64_t> bits((size_t(std::max(vocab, 0)) + 63) / 64, 0);
    scratch_.clear();
    for (int t : history)
      if (t >= 0 && t < vocab && !(bits[size_t(t) / 64] & (uint64_t(1) << (t % 64))))
        bits[size_t(t) / 64] |= uint64_t(1) << (t % 64), scratch_.push_back(t);
    return {scratch_, -1, false};
  }
  update(r, history, vocab, false, identity, appends);
  if (slots <= 0) return {r.distinct, -1, false};
  r.pending_epoch = r.epoch;
  if (r.slot >= slots) {  // fewer slots than when it was taken (another backend)
    slot_used_[size_t(r.slot)] = 0;
    r.slot = -1;
  }
  if (r.slot < 0) {
    const auto free = std::find(slot_used_.begin(), slot_used_.begin() + std::min<size_t>(slot_used_.size(), size_t(slots)), 0);
    const size_t s = size_t(free - slot_used_.begin());
    if (s >= size_t(slots)) return {r.distinct, -1, false};  // every slot taken
    if (s == slot_used_.size()) slot_used_.push_back(0);
    slot_used_[s] = 1;
    r.slot = int32_t(s);
    r.slot_valid = false;
    r.slot_count = 0;
  }
  const bool reset = !r.slot_valid;
  const size_t from = reset ? 0 : r.slot_count;
  r.pending = r.distinct.size();
  pending_.push_back(&r);
  return {std::span<const int32_t>(r.distinct).subspan(from), r.slot, reset};
}

void PenaltyIds::commit() {
  for (Entry* e : pending_) {
    if (e->epoch == e->pending_epoch) {  // (else taken from scratch since: the slot is reset next time)
      e->slot_valid = true;
      e->slot_count = e->pending;
    }
    e->pending = SIZE_MAX;
  }
  pending_.clear();
}

std::span<const int32_t> PenaltyIds::generated(const void* key, std::span<const int> history, int prompt_tokens,
                                               int vocab, uint64_t identity, bool appends) {
  Entry& r = rows_[key];
  prompt_tokens = std::max(prompt_tokens, 0);
  const bool start = r.gen_from != prompt_tokens;  // counting starts (or from another point): from scratch
  if (start) {
    r.gen_from = prompt_tokens;
    r.gen_pos.clear();
    r.gen_pairs.clear();
  }
  return update(r, history, vocab, start, identity, appends).gen_pairs;
}

void StepDrawer::run(model::Model& m, std::span<const model::SeqStep> steps, kv::KvCache& cache,
                     std::span<SampleJob> jobs) {
  size_t R = 0;  // output rows: every position of an all_logits step, else its last
  for (const model::SeqStep& s : steps) R += s.all_logits ? s.tokens.size() : 1;
  const int V = m.config().vocab_size;
  const int slots = m.penalty_slots();
  draws_.assign(R, backend::RowDraw{});
  hist_.clear();
  penalty_ids_.begin_step();
  for (SampleJob& j : jobs) {
    if (j.row < 0 || size_t(j.row) >= R || draws_[size_t(j.row)].mode != backend::RowDraw::kSkip)
      throw Error(fmt::format("StepDrawer: job row {} of {} (or twice)", j.row, R));
    j.u = j.sampler->next_u();
    backend::RowDraw& d = draws_[size_t(j.row)];
    d = j.sampler->device_draw(j.u);
    // The generated ids' counts (presence / frequency penalties; first: a sampler's first counting
    // step takes its history from scratch, before row() sends anything to its slot).
    if (j.sampler->counts_generated()) {
      const std::span<const int32_t> c =
          penalty_ids_.generated(j.sampler, j.history, j.sampler->prompt_tokens(), V, j.sampler->serial(), j.appends);
      d.cnt_off = static_cast<int32_t>(hist_.size());
      hist_.insert(hist_.end(), c.begin(), c.end());
      d.cnt_len = static_cast<int32_t>(c.size() / 2);
    }
    if (d.penalty != 1.0f) {  // the history's distinct ids (the penalty acts once per id), or those new to its slot
      const PenaltyIds::Row p = penalty_ids_.row(j.sampler, j.history, V, slots, j.sampler->serial(), j.appends);
      d.hist_off = static_cast<int32_t>(hist_.size());
      hist_.insert(hist_.end(), p.ids.begin(), p.ids.end());
      d.hist_len = static_cast<int32_t>(p.ids.size());
      d.pen_slot = p.slot;
      d.pen_reset = p.reset ? 1 : 0;
    }
    j.token = -1;
    j.error.clear();
  }
  m.forward_sample(steps, cache, draws_, hist_, tokens_);
  penalty_ids_.commit();

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
