// One draw of a next token from a row of logits, given its uniform number u: the part of
// sampling a backend can run where the logits are (Backend::sample_rows), and its
// specification on the host (reference_draw).
//
// A draw at temperature T > 0 with top_k k (0: off) and top_p p (1: off), as
// engine::Sampler and engine::reference_sample define it:
//   every id ordered by (logit descending, id ascending); the first k kept (all when k is 0
//   or >= the vocabulary); weights w_i = exp((x_i - x_max) · (1 / T)) in double; with min_p
//   only those of them with w_i >= min_p (a prefix too); top-p keeps
//   the smallest prefix whose running weight reaches p · (sum of the kept weights); the token
//   is the first of that prefix whose running weight exceeds u · (the prefix's weight), the
//   last one when none does (u rounds to 1).
// Implementations sum the same weights in other orders, so they may differ where u · weight
// falls within rounding (~1e-16 relative) of a running weight; nowhere else.
// A repetition penalty p != 1 comes first: each listed id's logit x becomes x / p when x > 0,
// else x · p (engine::Sampler's CTRL-style rule), for argmax rows and draws alike; the ids are
// the row's distinct history tokens, passed beside the draws, or kept by the backend from call to
// call in a penalty slot (RowDraw::pen_slot; apply_penalty_slot below is the rule). Then the
// presence and frequency penalties (OpenAI's): each id generated c > 0 times so far loses
// fma(frequency, c, presence) (one rounding), the (id, c) pairs passed beside the draws.
#pragma once

#include <cstdint>

namespace oscar::backend {

struct RowDraw {
  enum Mode : int32_t {
    kSkip = 0,    // no token wanted from this row (a prefill chunk that is not the last)
    kArgmax = 1,  // greedy: the argmax (ties: the lowest id; NaN never wins)
    kSample = 2,  // the draw above, with temperature / top_k / top_p / min_p / u
    kHost = 3,    // the caller draws it on the host from the row's logits
  };
  int32_t mode = kSkip;
  float temperature = 1.0f;
  int32_t top_k = 0;
  float top_p = 1.0f;
  double u = 0.0;  // in [0, 1)
  float penalty = 1.0f;  // repetition penalty (1: none)
  int32_t hist_off = 0;  // its ids: [hist_off, hist_off + hist_len) of the step's id list
  int32_t hist_len = 0;
  // A penalty slot in [0, Backend::penalty_slots()), or -1: with a slot the backend keeps the ids
  // from call to call, and this row's list holds only what is new to the slot. The slot is updated
  // (apply_penalty_slot: cleared first when pen_reset, then the list added) for every row that
  // names it, whatever its mode, before any row is drawn, and the penalty acts on the slot's ids.
  // At most one row of a call names a slot.
  int32_t pen_slot = -1;
  int32_t pen_reset = 0;
  float presence = 0.0f;   // presence penalty (0: none)
  float frequency = 0.0f;  // frequency penalty (0: none)
  // The generated ids' counts: (id, count) pairs at [cnt_off, cnt_off + 2 · cnt_len) of the
  // step's id list, each id once.
  int32_t cnt_off = 0;
  int32_t cnt_len = 0;
  float min_p = 0.0f;  // min_p (reference_draw; 0 = off)
};
static_assert(sizeof(RowDraw) == 64, "RowDraw is copied to devices as it is");

// What sample_rows returns for a row that has no token.
inline constexpr int32_t kDrawHost = -1;     // kHost, no finite logit, or a row too flat for the device
inline constexpr int32_t kDrawNaN = -2;      // a NaN in a kSample row (argmax skips NaN)
inline constexpr int32_t kDrawSkipped = -3;  // kSkip

// The specification of a kSample row (logits after any penalty, V >= 1, the fields valid:
// T > 0, k >= 0, p in (0, 1], u in [0, 1), min_p in [0, 1]): every id sorted, the plain way.
// kDrawNaN when a logit is NaN. min_p > 0 keeps, of the top_k, the ids whose weight is at least
// min_p (the best's weight is 1).
int32_t reference_draw(const float* logits, int V, float temperature, int top_k, float top_p, double u,
                       float min_p = 0.0f);

// The update of a penalty slot (a bitmap of `vocab` bits, 64 to a word) by one row: cleared when
// `reset`, then every id of `ids` in [0, vocab) set. Adding an id twice changes nothing, so a
// list sent again (a step that failed after or before the update) leaves the same slot.
void apply_penalty_slot(uint64_t* slot, int vocab, bool reset, const int32_t* ids, int n);

}  // namespace oscar::backend
