#include "engine/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace oscar::engine {

void SamplingParams::validate() const {
  if (!(temperature >= 0.0f) || !std::isfinite(temperature))
    throw Error(fmt::format("sampling: temperature {} must be >= 0", temperature));
  if (top_k < 0) throw Error(fmt::format("sampling: top_k {} must be >= 0", top_k));
  if (!(top_p > 0.0f && top_p <= 1.0f))
    throw Error(fmt::format("sampling: top_p {} must be in (0, 1]", top_p));
  if (!(repetition_penalty > 0.0f) || !std::isfinite(repetition_penalty))
    throw Error(fmt::format("sampling: repetition_penalty {} must be > 0", repetition_penalty));
}

Sampler::Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) { p_.validate(); }

void Sampler::transform(std::span<const float> logits, std::span<const int> history) {
  const int V = static_cast<int>(logits.size());
  if (V == 0) throw Error("sampler: empty logits");
  work_.assign(logits.begin(), logits.end());
  for (float x : work_)
    if (std::isnan(x)) throw Error("sampler: NaN in logits");
  if (p_.repetition_penalty != 1.0f) {
    // Each distinct token is penalized once, however often it appeared.
    std::vector<char> done(V, 0);
    for (int t : history) {
      if (t < 0 || t >= V || done[t]) continue;
      done[t] = 1;
      float& x = work_[t];
      x = x > 0 ? x / p_.repetition_penalty : x * p_.repetition_penalty;
    }
  }
  idx_.resize(V);
  std::iota(idx_.begin(), idx_.end(), 0);
  auto by_logit = [&](int a, int b) { return work_[a] > work_[b] || (work_[a] == work_[b] && a < b); };
  if (p_.temperature == 0.0f) {
    idx_.assign(1, *std::min_element(idx_.begin(), idx_.end(), by_logit));
    probs_.assign(1, 1.0);
    return;
  }
  int keep = V;
  if (p_.top_k > 0 && p_.top_k < V) {
    keep = p_.top_k;
    std::partial_sort(idx_.begin(), idx_.begin() + keep, idx_.end(), by_logit);
    idx_.resize(keep);
  } else {
    std::sort(idx_.begin(), idx_.end(), by_logit);
  }
  // Softmax over the candidates at the temperature, in double.
  const double inv_t = 1.0 / p_.temperature;
  const double mx = work_[idx_[0]];
  probs_.resize(keep);
  double sum = 0;
  for (int i = 0; i < keep; ++i) sum += (probs_[i] = std::exp((work_[idx_[i]] - mx) * inv_t));
  for (double& q : probs_) q /= sum;
  if (p_.top_p < 1.0f) {
    double cum = 0;
    int n = 0;
    while (n < keep) {
      cum += probs_[n++];
      if (cum >= p_.top_p) break;
    }
    idx_.resize(n);
    probs_.resize(n);
    for (double& q : probs_) q /= cum;
  }
}

int Sampler::sample(std::span<const float> logits, std::span<const int> history) {
  transform(logits, history);
  if (probs_.size() == 1) return idx_[0];
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  double cum = 0;
  for (size_t i = 0; i < probs_.size(); ++i) {
    cum += probs_[i];
    if (u < cum) return idx_[i];
  }
  return idx_.back();  // rounding left u above the last partial sum
}

std::vector<double> Sampler::probabilities(std::span<const float> logits,
                                           std::span<const int> history) {
  transform(logits, history);
  std::vector<double> p(logits.size(), 0.0);
  for (size_t i = 0; i < idx_.size(); ++i) p[idx_[i]] = probs_[i];
  return p;
}

}  // namespace oscar::engine
