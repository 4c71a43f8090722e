// Next-token sampling from one row of logits.
//
// Order of the transforms (as Hugging Face's generate applies them):
//   repetition penalty -> temperature -> top-k -> top-p -> draw.
// temperature == 0 is greedy (argmax after the repetition penalty; ties go to
// the lowest id). All randomness comes from the sampler's own seeded engine, so
// a (seed, logits sequence) pair always gives the same tokens.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace oscar::engine {

struct SamplingParams {
  float temperature = 0.0f;        // 0 = greedy
  int top_k = 0;                   // 0 = off
  float top_p = 1.0f;              // 1 = off; keep the smallest set with mass >= top_p
  float repetition_penalty = 1.0f; // CTRL-style: positive logits / p, negative * p
  uint64_t seed = 0;
  // Validates ranges; throws oscar::Error naming the bad field.
  void validate() const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // logits [vocab]; history: tokens seen so far (prompt + generated) for the
  // repetition penalty.
  int sample(std::span<const float> logits, std::span<const int> history);
  // Greedy with no repetition penalty: the token is the argmax of the logits alone, so
  // the model can pick it where the logits are (Model::forward_argmax).
  bool plain_greedy() const { return p_.temperature == 0.0f && p_.repetition_penalty == 1.0f; }
  // The probabilities sample() draws from (after all transforms), for tests.
  std::vector<double> probabilities(std::span<const float> logits, std::span<const int> history);

 private:
  void transform(std::span<const float> logits, std::span<const int> history);
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<float> work_;            // [vocab] adjusted logits
  std::vector<int> idx_;               // candidate ids after top-k/top-p, by descending logit
  std::vector<double> probs_;          // [candidates]
};

}  // namespace oscar::engine
