#include "engine/sampler.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
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
  if (!(presence_penalty >= -2.0f && presence_penalty <= 2.0f))
    throw Error(fmt::format("sampling: presence_penalty {} must be in [-2, 2]", presence_penalty));
  if (!(frequency_penalty >= -2.0f && frequency_penalty <= 2.0f))
    throw Error(fmt::format("sampling: frequency_penalty {} must be in [-2, 2]", frequency_penalty));
  if (!(min_p >= 0.0f && min_p <= 1.0f)) throw Error(fmt::format("sampling: min_p {} must be in [0, 1]", min_p));
}

Sampler::Sampler(const SamplingParams& p, int prompt_tokens)
    : p_(p), prompt_tokens_(std::max(prompt_tokens, 0)), rng_(p.seed) {
  p_.validate();
  static std::atomic<uint64_t> next_serial{1};
  serial_ = next_serial.fetch_add(1, std::memory_order_relaxed);
}

// The passes over the whole vocabulary run in fixed chunks of kChunk ids on the CPU pool
// (backend::cpu::parallel_for; serial inside sample_rows' workers, where the rows are the
// parallel work), each chunk's result combined in chunk order: the same numbers on any number
// of threads.
constexpr int kChunk = 8192;

namespace {

// Max and NaN of w[b, e): eight independent chains (in one chain each max waits for the
// previous one: four cycles an id).
void chunk_max(const float* w, int b, int e, float& max_out, bool& nan_out) {
  constexpr int L = 8;
  float mx[L];
  int nan = 0;
  for (int j = 0; j < L; ++j) mx[j] = w[b];
  int i = b;
  for (; i + L <= e; i += L)
    for (int j = 0; j < L; ++j) {
      const float x = w[i + j];
      nan |= x != x;
      mx[j] = x > mx[j] ? x : mx[j];
    }
  for (; i < e; ++i) {
    nan |= w[i] != w[i];
    mx[0] = w[i] > mx[0] ? w[i] : mx[0];
  }
  float m = mx[0];
  for (int j = 1; j < L; ++j) m = mx[j] > m ? mx[j] : m;
  max_out = m;
  nan_out = nan != 0;
}

}  // namespace

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
  if (counts_generated() && history.size() > size_t(prompt_tokens_)) {
    // Each generated id once, with its count: the ids sorted, then their runs.
    gen_.clear();
    for (size_t i = size_t(prompt_tokens_); i < history.size(); ++i)
      if (history[i] >= 0 && history[i] < V) gen_.push_back(history[i]);
    std::sort(gen_.begin(), gen_.end());
    for (size_t i = 0; i < gen_.size();) {
      size_t e = i + 1;
      while (e < gen_.size() && gen_[e] == gen_[i]) ++e;
      w[gen_[i]] -= std::fma(p_.frequency_penalty, float(e - i), p_.presence_penalty);  // (one rounding, as on a device)
      i = e;
    }
  }
  sorted_ = 0;
  inv_t_ = p_.temperature > 0.0f ? 1.0 / p_.temperature : 1.0;
  // NaN check and the max per chunk, then the max's first id (ties: the lowest). Without
  // want_max the max is left to sorted_prefix (its first candidate).
  const int nc = (V + kChunk - 1) / kChunk;
  chunk_max_.resize(size_t(nc));
  chunk_nan_.resize(size_t(nc));
  backend::cpu::parallel_for(nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      bool nan = false;
      chunk_max(w, int(c) * kChunk, std::min(V, int(c + 1) * kChunk), chunk_max_[size_t(c)], nan);
      chunk_nan_[size_t(c)] = nan;
    }
  });
  for (char nan : chunk_nan_)
    if (nan) throw Error("sampler: NaN in logits");
  have_max_ = want_max;
  if (!want_max) return;
  float m = chunk_max_[0];
  for (float x : chunk_max_) m = x > m ? x : m;
  argmax_ = int(std::find(w, w + V, m) - w);
  max_ = m;
}

double Sampler::total_weight() {
  const int V = static_cast<int>(work_.size()), nc = (V + kChunk - 1) / kChunk;
  chunk_sum_.resize(size_t(nc));
  backend::cpu::parallel_for(nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      double s = 0;
      for (int i = int(c) * kChunk, e = std::min(V, int(c + 1) * kChunk); i < e; ++i) s += weight(i);
      chunk_sum_[size_t(c)] = s;
    }
  });
  double total = 0;
  for (double s : chunk_sum_) total += s;
  return total;
}

void Sampler::select_best(int M) {
  // The best M by one scan per piece of the vocabulary: a heap of (logit, id) whose top is the
  // worst kept; a later id enters only with a larger logit (on a tie its higher id loses), one
  // compare for most ids. Then the best M of the pieces' candidates, sorted. parallel_for
  // gives each thread one piece (units of 64 M ids: a heap's replacements grow as M ln(piece /
  // M) per piece), or the whole vocabulary when nested; the result does not depend on it.
  const float* w = work_.data();
  const int V = static_cast<int>(work_.size()), unit = 64 * M, units = (V + unit - 1) / unit;
  auto better = [](const std::pair<float, int>& a, const std::pair<float, int>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  heap_.resize(size_t(units) * size_t(M));
  chunk_kept_.assign(size_t(units), 0);
  backend::cpu::parallel_for(V, unit, [&](int64_t b64, int64_t e64) {
    const int b = int(b64), e = int(e64), k = std::min(M, e - b), u = b / unit;
    auto* h = heap_.data() + size_t(u) * size_t(M);
    for (int i = 0; i < k; ++i) h[i] = {w[b + i], b + i};
    std::make_heap(h, h + k, better);
    float worst = h[0].first;
    for (int i = b + k; i < e; ++i) {
      if (!(w[i] > worst)) continue;
      std::pop_heap(h, h + k, better);
      h[k - 1] = {w[i], i};
      std::push_heap(h, h + k, better);
      worst = h[0].first;
    }
    chunk_kept_[size_t(u)] = k;
  });
  // Compact the pieces' candidates, then the best M of them.
  size_t n = 0;
  for (int u = 0; u < units; ++u)
    for (int i = 0; i < chunk_kept_[size_t(u)]; ++i) heap_[n++] = heap_[size_t(u) * size_t(M) + size_t(i)];
  std::partial_sort(heap_.begin(), heap_.begin() + M, heap_.begin() + std::ptrdiff_t(n), better);
  for (int i = 0; i < M; ++i) idx_[size_t(i)] = heap_[size_t(i)].second;
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
      select_best(M);
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

double Sampler::next_u() {
  return p_.temperature == 0.0f ? 0.0 : std::uniform_real_distribution<double>(0.0, 1.0)(rng_);
}

int Sampler::sample(std::span<const float> logits, std::span<const int> history) {
  return sample_u(logits, history, next_u());
}

backend::RowDraw Sampler::device_draw(double u) const {
  backend::RowDraw d;
  d.penalty = p_.repetition_penalty;
  d.presence = p_.presence_penalty;
  d.frequency = p_.frequency_penalty;
  if (p_.temperature == 0.0f) {
    d.mode = backend::RowDraw::kArgmax;
  } else {
    d.mode = backend::RowDraw::kSample;
    d.min_p = p_.min_p;
    d.temperature = p_.temperature;
    d.top_k = p_.top_k;
    d.top_p = p_.top_p;
    d.u = u;
  }
  return d;
}

int Sampler::min_p_count() {
  const int V = static_cast<int>(work_.size()), nc = (V + kChunk - 1) / kChunk;
  const double thr = double(p_.min_p);
  chunk_kept_.resize(size_t(nc));
  backend::cpu::parallel_for(nc, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int n = 0;
      for (int i = int(c) * kChunk, e = std::min(V, int(c + 1) * kChunk); i < e; ++i) n += weight(i) >= thr;
      chunk_kept_[size_t(c)] = n;
    }
  });
  int n = 0;
  for (int c = 0; c < nc; ++c) n += chunk_kept_[size_t(c)];
  return std::max(n, 1);
}

int Sampler::sample_u(std::span<const float> logits, std::span<const int> history, double u) {
  const int V = static_cast<int>(logits.size());
  // The candidates: the top_k best (or every id) and, with min_p, those of at least min_p times
  // the best's weight; their total weight.
  int keep = p_.top_k > 0 && p_.top_k < V ? p_.top_k : V;
  const bool min_p = p_.min_p > 0.0f && p_.temperature > 0.0f;
  prepare(logits, history, p_.temperature == 0.0f || keep == V || min_p);
  if (p_.temperature == 0.0f) return argmax_;
  if (min_p) keep = std::min(keep, min_p_count());
  double total = 0;
  if (keep < V) {
    sorted_prefix(INFINITY, false, keep);
    total = cum_[size_t(keep) - 1];
  } else {
    total = total_weight();
  }
  // top_p: the smallest prefix holding that share of the candidates' probability.
  int n = keep;
  double mass = total;
  if (p_.top_p < 1.0f) {
    n = sorted_prefix(double(p_.top_p) * total, false, keep);
    mass = cum_[size_t(n) - 1];
  }
  if (n == 1) return sorted_ > 0 ? idx_[0] : argmax_;  // (unsorted: a one-token vocabulary)
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
  int keep = p_.top_k > 0 && p_.top_k < V ? p_.top_k : V;
  if (p_.min_p > 0.0f) keep = std::min(keep, min_p_count());
  sorted_prefix(INFINITY, false, keep);
  int n = keep;
  if (p_.top_p < 1.0f) n = sorted_prefix(double(p_.top_p) * cum_[size_t(keep) - 1], false, keep);
  const double mass = cum_[size_t(n) - 1];
  for (int i = 0; i < n; ++i) p[size_t(idx_[size_t(i)])] = weight(idx_[size_t(i)]) / mass;
  return p;
}

int reference_sample(const SamplingParams& p, std::mt19937_64& rng, std::span<const float> logits,
                     std::span<const int> history, int prompt_tokens) {
  std::vector<float> w(logits.begin(), logits.end());
  const int V = int(w.size());
  if (V == 0) throw Error("sampler: empty logits");
  for (float x : w)
    if (std::isnan(x)) throw Error("sampler: NaN in logits");
  if (p.repetition_penalty != 1.0f) {
    std::vector<char> done(size_t(V), 0);
    for (int t : history) {
      if (t < 0 || t >= V || done[size_t(t)]) continue;
      done[size_t(t)] = 1;
      w[size_t(t)] = w[size_t(t)] > 0 ? w[size_t(t)] / p.repetition_penalty : w[size_t(t)] * p.repetition_penalty;
    }
  }
  if (p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
    std::vector<int> count(size_t(V), 0);
    for (size_t i = size_t(std::max(prompt_tokens, 0)); i < history.size(); ++i)
      if (history[i] >= 0 && history[i] < V) ++count[size_t(history[i])];
    for (int t = 0; t < V; ++t)
      if (count[size_t(t)] > 0) w[size_t(t)] -= std::fma(p.frequency_penalty, float(count[size_t(t)]), p.presence_penalty);
  }
  if (p.temperature == 0.0f) {
    int best = 0;
    for (int i = 1; i < V; ++i)
      if (w[size_t(i)] > w[size_t(best)]) best = i;
    return best;
  }
  const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
  return backend::reference_draw(w.data(), V, p.temperature, p.top_k, p.top_p, u, p.min_p);
}

void sample_rows(std::span<SampleJob> jobs) {
  backend::cpu::parallel_for(int64_t(jobs.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      SampleJob& j = jobs[size_t(r)];
      try {
        j.token = j.u >= 0 ? j.sampler->sample_u(j.logits, j.history, j.u) : j.sampler->sample(j.logits, j.history);
      } catch (const std::exception& ex) {
        j.token = -1;
        j.error = ex.what();
      }
    }
  });
}

}  // namespace oscar::engine
