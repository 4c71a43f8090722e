// Next-token sampling from one row of logits.
//
// Order of the transforms (as Hugging Face's generate applies them, with vLLM's presence and
// frequency penalties after the repetition penalty):
//   repetition penalty -> presence / frequency penalties -> temperature -> top-k and min-p -> top-p
//   -> draw.
// min_p (vLLM's and llama.cpp's) keeps the ids whose probability is at least min_p times the
// best one's; with top-k it keeps the shorter of the two prefixes (both are prefixes of the
// descending order), and top-p takes its share of what they keep.
// The repetition penalty acts on every token seen (prompt + generated), the presence and
// frequency penalties on the generated ones only (vLLM's and SGLang's reading of OpenAI's "the
// text so far"): an id generated c > 0 times loses frequency_penalty · c + presence_penalty.
// temperature == 0 is greedy (argmax after the penalties; ties go to
// the lowest id). All randomness comes from the sampler's own seeded engine, so
// a (seed, logits sequence) pair always gives the same tokens. The draw is the
// inverse CDF in descending-logit order: u in [0, 1) picks the first candidate
// whose running probability exceeds u (one u per token at temperature > 0, none
// when greedy), computed over a sorted prefix of the vocabulary only as long as the
// draw needs (a full sort of a 152K vocabulary took ~20 ms per token). The u is
// taken before the logits exist (next_u), so a backend can draw the token where the
// logits are (backend/sample.h) with the same result.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "backend/sample.h"

namespace oscar::engine {

struct SamplingParams {
  float temperature = 0.0f;        // 0 = greedy
  int top_k = 0;                   // 0 = off
  float top_p = 1.0f;              // 1 = off; keep the smallest set with mass >= top_p
  float repetition_penalty = 1.0f; // CTRL-style: positive logits / p, negative * p
  uint64_t seed = 0;
  float presence_penalty = 0.0f;   // OpenAI's, in [-2, 2]: minus this once per generated id
  float frequency_penalty = 0.0f;  // OpenAI's, in [-2, 2]: minus this per occurrence of a generated id
  float min_p = 0.0f;              // in [0, 1]; 0 = off
  // Validates ranges; throws oscar::Error naming the bad field.
  void validate() const;
};

class Sampler {
 public:
  // prompt_tokens: the history's first tokens that are the prompt (the presence and frequency
  // penalties count the tokens after them).
  explicit Sampler(const SamplingParams& p, int prompt_tokens = 0);
  // logits [vocab]; history: tokens seen so far (prompt + generated) for the penalties.
  int sample(std::span<const float> logits, std::span<const int> history);
  // The same in two halves: the next u from the engine (a greedy sampler draws none and
  // returns 0; sample_u ignores it), then the draw with it.
  double next_u();
  int sample_u(std::span<const float> logits, std::span<const int> history, double u);
  // The draw as a backend can run it (Backend::sample_rows): kArgmax when greedy, else kSample
  // with u; the penalties in RowDraw::penalty / presence / frequency (the caller lists the
  // history's ids and the generated ids' counts).
  backend::RowDraw device_draw(double u) const;
  const SamplingParams& params() const { return p_; }
  int prompt_tokens() const { return prompt_tokens_; }
  // A number no other Sampler of the process has (a copy keeps it): engine::PenaltyIds tells a
  // new request's sampler from an earlier one at the same address by it.
  uint64_t serial() const { return serial_; }
  // Whether the presence or the frequency penalty is on.
  bool counts_generated() const { return p_.presence_penalty != 0.0f || p_.frequency_penalty != 0.0f; }
  // The probabilities sample() draws from (after all transforms), for tests.
  std::vector<double> probabilities(std::span<const float> logits, std::span<const int> history);

 private:
  // work_ = the logits after the repetition penalty (NaN refused); with want_max their max and
  // its (lowest) id, else sorted_prefix takes them from its first candidate.
  void prepare(std::span<const float> logits, std::span<const int> history, bool want_max);
  double weight(int id) const { return std::exp((double(work_[id]) - max_) * inv_t_); }
  // The candidates in descending logit order (ties: lower id), only as many as a draw needs:
  // idx_[0, n) / cum_[0, n) (running sum of weight()) for the smallest n <= limit whose sum
  // reaches `need` (strict: exceeds it), or n = limit. Selects the best M (O(vocab)) and sorts
  // those, M growing 4× until enough, so a peaked row sorts a few hundred ids, not the vocabulary.
  int sorted_prefix(double need, bool strict, int limit);
  // idx_[0, M): the best M ids, sorted (M <= vocab / 16).
  void select_best(int M);
  // Σ weight(i) over the vocabulary.
  double total_weight();
  // Ids whose weight is at least min_p (the max known; at least 1).
  int min_p_count();

  SamplingParams p_;
  int prompt_tokens_ = 0;
  uint64_t serial_ = 0;
  std::mt19937_64 rng_;
  std::vector<float> work_;            // [vocab] adjusted logits
  std::vector<char> seen_;             // [vocab] repetition penalty: ids already penalized
  std::vector<int> gen_;               // presence / frequency: the generated ids, sorted
  std::vector<int> idx_;               // candidate ids by descending logit (a sorted prefix)
  std::vector<double> cum_;            // running sums of their weights
  std::vector<std::pair<float, int>> heap_;  // select_best: [chunk][M] heaps, then the candidates
  std::vector<int> chunk_kept_;        // select_best: candidates per chunk; min_p_count: ids per chunk
  std::vector<float> chunk_max_;       // prepare: per chunk of the vocabulary
  std::vector<char> chunk_nan_;
  std::vector<double> chunk_sum_;      // total_weight
  double max_ = 0, inv_t_ = 1;
  int argmax_ = 0;
  int sorted_ = 0;                     // idx_ / cum_ entries valid for this row (0 after prepare)
  bool have_max_ = false;              // max_ / argmax_ known for this row
};

// The specification of one draw, written the plain way (the sampler before the sorted prefix;
// tests compare Sampler with it token for token, bench_sampler times it as the baseline):
// the repetition penalty, the presence / frequency penalties; greedy: the argmax; else one u from rng and backend::reference_draw
// (every id sorted by (logit desc, id asc), the top_k by a partial sort, the softmax at the
// temperature in double, top-p, the first candidate whose running probability exceeds u).
int reference_sample(const SamplingParams& p, std::mt19937_64& rng, std::span<const float> logits,
                     std::span<const int> history, int prompt_tokens = 0);

// One draw per row, the rows spread over the CPU thread pool (backend::cpu::parallel_for):
// each row's sampler draws from its own engine, so the tokens are those of a serial loop.
// A row whose sampler throws (NaN logits) gets token -1 and its message in `error`; the
// other rows are drawn.
struct SampleJob {
  Sampler* sampler = nullptr;
  std::span<const float> logits;
  std::span<const int> history;
  int token = -1;
  std::string error;
  int row = 0;      // StepDrawer: the step's output row
  double u = -1.0;  // >= 0: the draw's u, taken before (Sampler::sample_u); else sample() takes one
  // StepDrawer: the history extends the one this sampler's previous job passed (a request's tokens
  // are only ever appended: the scheduler's and the generator's case), so the penalty bookkeeping
  // need not compare it with the one it kept (engine::PenaltyIds; ~0.4 ms a step at 128 rows of
  // 8K tokens).
  bool appends = false;
};
void sample_rows(std::span<SampleJob> jobs);

}  // namespace oscar::engine
