#include "engine/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "backend/cpu/ops_threads.h"
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

void Sampler::prepare(std::span<const float> logits, std::span<const int> history, bool want_max) {
  const int V = static_cast<int>(logits.size());
  if (V == 0) throw Error("sampler: empty logits");
  work_.assign(logits.begin(), logits.end());
  float* w = work_.data();
  if (p_.repetition_penalty != 1.0f) {
    // Each distinct token is penalized once, however often it appeared.
    seen_.assign(size_t(V), 0);
    for (int t : history) {
      if (t < 0 || t >= V || seen_[size_t(t)]) continue;
      seen_[size_t(t)] = 1;
      w[t] = w[t] > 0 ? w[t] / p_.repetition_penalty : w[t] * p_.repetition_penalty;
    }
  }
  // NaN check and max in one pass, eight independent chains (in one chain each max waits for
  // the previous one: four cycles an id); then the max's first id (ties: the lowest). Without
  // want_max the max is left to sorted_prefix (its first candidate).
  sorted_ = 0;
  inv_t_ = p_.temperature > 0.0f ? 1.0 / p_.temperature : 1.0;
  have_max_ = want_max;
  constexpr int L = 8;
  if (!want_max) {
    int nan = 0;
    for (int i = 0; i < V; ++i) nan |= w[i] != w[i];
    if (nan) throw Error("sampler: NaN in logits");
    return;
  }
  float mx[L];
  int nan = 0;
  for (int j = 0; j < L; ++j) mx[j] = w[0];
  int i = 0;
  for (; i + L <= V; i += L)
    for (int j = 0; j < L; ++j) {
      const float x = w[i + j];
      nan |= x != x;
      mx[j] = x > mx[j] ? x : mx[j];
    }
  for (; i < V; ++i) {
    nan |= w[i] != w[i];
    mx[0] = w[i] > mx[0] ? w[i] : mx[0];
  }
  if (nan) throw Error("sampler: NaN in logits");
  float m = mx[0];
  for (int j = 1; j < L; ++j) m = mx[j] > m ? mx[j] : m;
  argmax_ = int(std::find(w, w + V, m) - w);
  max_ = m;
}

int Sampler::sorted_prefix(double need, bool strict, int limit) {
  const int V = static_cast<int>(work_.size());
  auto reached = [&](double c) { return strict ? c > need : c >= need; };
  // The prefix sorted so far (this row's earlier calls) may already hold the answer.
  const int have = std::min(sorted_, limit);
  for (int i = 0; i < have; ++i)
    if (reached(cum_[size_t(i)])) return i + 1;
  if (have == limit) return limit;
  const float* w = work_.data();
  auto by_logit = [w](int a, int b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
  for (int M = std::min(limit, std::max(256, 4 * sorted_));; M = std::min(limit, 4 * M)) {
    idx_.resize(size_t(V));
    if (M <= V / 16) {
      // The best M by one scan: a heap of (logit, id) whose top is the worst kept; a later id
      // enters only with a larger logit (on a tie its higher id loses), one compare for most.
      auto better = [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      };
      heap_.resize(size_t(M));
      for (int i = 0; i < M; ++i) heap_[size_t(i)] = {w[i], i};
      std::make_heap(heap_.begin(), heap_.end(), better);
      float worst = heap_.front().first;
      for (int i = M; i < V; ++i) {
        if (!(w[i] > worst)) continue;
        std::pop_heap(heap_.begin(), heap_.end(), better);
        heap_.back() = {w[i], i};
        std::push_heap(heap_.begin(), heap_.end(), better);
        worst = heap_.front().first;
      }
      std::sort_heap(heap_.begin(), heap_.end(), better);
      for (int i = 0; i < M; ++i) idx_[size_t(i)] = heap_[size_t(i)].second;
    } else {
      std::iota(idx_.begin(), idx_.end(), 0);
      if (M < V) std::nth_element(idx_.begin(), idx_.begin() + M, idx_.end(), by_logit);
      std::sort(idx_.begin(), idx_.begin() + M, by_logit);
    }
    if (!have_max_) {  // the first candidate is the max
      max_ = w[idx_[0]];
      argmax_ = idx_[0];
      have_max_ = true;
    }
    cum_.resize(size_t(M));
    double c = 0;
    for (int i = 0; i < M; ++i) cum_[size_t(i)] = (c += weight(idx_[size_t(i)]));
    sorted_ = M;
    for (int i = have; i < M; ++i)
      if (reached(cum_[size_t(i)])) return i + 1;
    if (M == limit) return M;
  }
}

int Sampler::sample(std::span<const float> logits, std::span<const int> history) {
  const int V = static_cast<int>(logits.size());
  // The candidates: the top_k best, or every id; their total weight.
  const int keep = p_.top_k > 0 && p_.top_k < V ? p_.top_k : V;
  prepare(logits, history, p_.temperature == 0.0f || keep == V);
  if (p_.temperature == 0.0f) return argmax_;
  double total = 0;
  if (keep < V) {
    sorted_prefix(INFINITY, false, keep);
    total = cum_[size_t(keep) - 1];
  } else {
    for (int i = 0; i < V; ++i) total += weight(i);
  }
  // top_p: the smallest prefix holding that share of the candidates' probability.
  int n = keep;
  double mass = total;
  if (p_.top_p < 1.0f) {
    n = sorted_prefix(double(p_.top_p) * total, false, keep);
    mass = cum_[size_t(n) - 1];
  }
  if (n == 1) return sorted_ > 0 ? idx_[0] : argmax_;  // (unsorted: a one-token vocabulary)
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
  // The first candidate whose running weight exceeds u · mass.
  const int i = sorted_prefix(u * mass, true, n);
  return idx_[size_t(i) - 1];
}

std::vector<double> Sampler::probabilities(std::span<const float> logits,
                                           std::span<const int> history) {
  prepare(logits, history, true);
  const int V = static_cast<int>(work_.size());
  std::vector<double> p(size_t(V), 0.0);
  if (p_.temperature == 0.0f) {
    p[size_t(argmax_)] = 1.0;
    return p;
  }
  const int keep = p_.top_k > 0 && p_.top_k < V ? p_.top_k : V;
  sorted_prefix(INFINITY, false, keep);
  int n = keep;
  if (p_.top_p < 1.0f) n = sorted_prefix(double(p_.top_p) * cum_[size_t(keep) - 1], false, keep);
  const double mass = cum_[size_t(n) - 1];
  for (int i = 0; i < n; ++i) p[size_t(idx_[size_t(i)])] = weight(idx_[size_t(i)]) / mass;
  return p;
}

void sample_rows(std::span<SampleJob> jobs) {
  backend::cpu::parallel_for(int64_t(jobs.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      SampleJob& j = jobs[size_t(r)];
      try {
        j.token = j.sampler->sample(j.logits, j.history);
      } catch (const std::exception& ex) {
        j.token = -1;
        j.error = ex.what();
      }
    }
  });
}

}  // namespace oscar::engine
