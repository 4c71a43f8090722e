// Log probabilities of tokens under the model (the OpenAI API's `logprobs`, `top_logprobs` and
// `echo`): the log-softmax of a row of raw logits, before any repetition penalty, temperature,
// top-k or top-p (what the model says, not what the sampler drew from; vLLM's default too).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace oscar::engine {

// The most alternatives a request may ask for per position (OpenAI's limit for top_logprobs).
inline constexpr int kMaxLogprobs = 20;

struct TopLogprob {
  int32_t token = -1;
  float logprob = 0;
};

// One position: the token's log probability and the `top` most likely ids of its row, by
// (logprob descending, id ascending).
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
  std::vector<TopLogprob> top;
};

// log_softmax(logits)[token] and the k (0 <= k <= kMaxLogprobs) best ids of the row, computed in
// double: lse = max + log Σ exp(x - max). A row holding a NaN gives NaN for every log probability
// (the top ids are still the k best of the non-NaN logits); so does a row whose largest logit is
// infinite (all -inf, or a +inf).
// Throws oscar::Error when token is outside [0, vocab) or k outside [0, kMaxLogprobs].
TokenLogprob token_logprob(std::span<const float> logits, int token, int k);

}  // namespace oscar::engine
