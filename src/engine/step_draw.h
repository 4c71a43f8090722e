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

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "backend/sample.h"
#include "engine/sampler.h"
#include "kv/kv_cache.h"
#include "model/forward.h"

namespace oscar::engine {

// The distinct ids of each penalized row's history, in first-occurrence order (what the penalty
// acts on: once per id), kept per sampler from step to step. A request's history grows by its new
// tokens, so a step compares the history with the one seen before (a sequential compare) and adds
// only the ids past it, instead of deduplicating the whole history again (random accesses: ~2.8 ms
// a step for 128 rows of 8192 ids on a 2-core machine). A history that does not extend the
// stored one is taken from scratch; the result is the same either way.
//
// On a backend with penalty slots (Backend::penalty_slots) the ids stay on the backend too: each
// sampler holds a slot while it is used from step to step, and a step sends only the ids the slot
// has not received yet (usually the last token, or none), with a reset when the slot is new to the
// sampler or its history was taken from scratch. What the slot has received counts only once a
// step has gone through (commit): a step that failed sends the same ids again (adding an id twice
// changes nothing, backend::apply_penalty_slot).
//
// For the presence and frequency penalties it also counts each generated id (the history after the
// prompt), from step to step the same way.
class PenaltyIds {
 public:
  // What one row sends: `ids` its distinct ids (slot -1) or those new to `slot`.
  struct Row {
    std::span<const int32_t> ids;
    int32_t slot = -1;
    bool reset = false;
  };

  // Starts a step: keys not used since the last begin_step are dropped (finished requests), and
  // their slots freed. Within a step a history is not changed between the calls that pass it.
  void begin_step();
  // The distinct ids in [0, vocab) of `history`, for the sampler `key`: with `slots` = 0 (a backend
  // without penalty slots) all of them, else those new to the key's slot. A key named twice in
  // one step, or one that finds every slot taken, gets its whole list without a slot. Valid until
  // the next call. `identity` (optional): what the key's owner is (Sampler::serial); another
  // identity under a key is another history, taken from scratch. `appends`: the caller promises
  // that the history extends the one last passed under this key and identity, so it is not
  // compared (only its length and the last token seen).
  Row row(const void* key, std::span<const int> history, int vocab, int slots, uint64_t identity = 0,
          bool appends = false);
  // The step's rows reached the backend: their slots hold what row() sent.
  void commit();
  // The (id, count) pairs of the ids of history[prompt_tokens, end) in [0, vocab), each id once
  // in first-occurrence order (RowDraw::cnt_off / cnt_len); valid until the next call.
  std::span<const int32_t> generated(const void* key, std::span<const int> history, int prompt_tokens, int vocab,
                                     uint64_t identity = 0, bool appends = false);
  size_t keys() const { return rows_.size(); }

 private:
  struct Entry {
    std::vector<int> seen;          // the history this row was computed from
    const int* seen_data = nullptr;  // where the caller's copy of it was in this step
    uint64_t identity = 0;           // its owner's (row() / generated())
    std::vector<int32_t> distinct;  // its distinct ids in order
    std::vector<uint64_t> bits;     // [vocab / 64] the ids in `distinct`
    int vocab = 0;
    uint64_t step = 0;
    int32_t slot = -1;            // its penalty slot, or -1
    bool slot_valid = false;      // the slot holds distinct[0, slot_count) (and nothing else)
    size_t slot_count = 0;
    size_t pending = SIZE_MAX;    // what the slot holds after this step's row, once committed
    uint64_t epoch = 0;           // + 1 whenever the history is taken from scratch
    uint64_t pending_epoch = 0;   // ... when row() ran (commit skips an entry reset since)
    int gen_from = -1;            // counting history[gen_from, end) (-1: not counting)
    std::vector<int32_t> gen_pairs;   // (id, count) of the counted ids, in first-occurrence order
    // id -> its pair: an open-addressing table of (id + 1) << 32 | index into gen_pairs, 0 empty,
    // a power of two at least twice the pairs (not a [vocab] table: 600 KB a request at 151,936 ids)
    std::vector<uint64_t> gen_pos;
  };
  // gen_pairs' index of id t's pair, the pair added (count 0) when t has none.
  static size_t gen_pair(Entry& r, int32_t t);
  Entry& update(Entry& r, std::span<const int> history, int vocab, bool force_reset = false, uint64_t identity = 0,
                bool appends = false);

  std::unordered_map<const void*, Entry> rows_;
  std::vector<char> slot_used_;   // [slot] taken by a key
  std::vector<int32_t> scratch_;  // a second row of one key in a step
  std::vector<Entry*> pending_;   // the entries row() gave a slot to in this step
  uint64_t step_ = 0;
};

class StepDrawer {
 public:
  // Runs the step (Model::forward_sample) and fills jobs' tokens. SampleJob::row is an output row
  // of the step (every position of an all_logits step, else its last; Model::forward's order);
  // rows without a job yield none. Every row's logits stay readable through Model::output_logits
  // until the next step. Throws what the forward throws.
  void run(model::Model& m, std::span<const model::SeqStep> steps, kv::KvCache& cache, std::span<SampleJob> jobs);

  // Rows the last run drew on the host (tests and metrics).
  int host_rows() const { return host_rows_; }

 private:
  std::vector<backend::RowDraw> draws_;
  std::vector<int32_t> hist_;       // the penalized rows' distinct history ids
  PenaltyIds penalty_ids_;          // ... kept per sampler across steps
  std::vector<int32_t> tokens_;
  std::vector<float> logits_;       // the host rows' logits
  std::vector<SampleJob> host_;     // their draws
  std::vector<size_t> host_of_;     // host_[i] is jobs[host_of_[i]]
  int host_rows_ = 0;
};

}  // namespace oscar::engine
