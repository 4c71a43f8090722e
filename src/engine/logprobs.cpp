#include "engine/logprobs.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace oscar::engine {

TokenLogprob token_logprob(std::span<const float> logits, int token, int k) {
  const int V = static_cast<int>(logits.size());
  if (token < 0 || token >= V) throw Error(fmt::format("token_logprob: token {} outside [0, {})", token, V));
  if (k < 0 || k > kMaxLogprobs) throw Error(fmt::format("token_logprob: k = {} outside [0, {}]", k, kMaxLogprobs));
  // Pass 1: the max and NaN; the best k kept in a small sorted list (k <= 20, so an insertion is
  // cheap and runs only for logits above the current k-th).
  bool nan = false;
  float mx = -std::numeric_limits<float>::infinity();
  std::vector<TopLogprob> best;  // logit in .logprob for now, sorted by (logit desc, id asc)
  best.reserve(size_t(k) + 1);
  for (int i = 0; i < V; ++i) {
    const float x = logits[size_t(i)];
    if (std::isnan(x)) {
      nan = true;
      continue;
    }
    mx = std::max(mx, x);
    if (k == 0) continue;
    if (static_cast<int>(best.size()) == k && !(x > best.back().logprob)) continue;  // ties: the lower id stays
    auto at = std::upper_bound(best.begin(), best.end(), x,
                               [](float v, const TopLogprob& b) { return v > b.logprob; });
    best.insert(at, {int32_t(i), x});
    if (static_cast<int>(best.size()) > k) best.pop_back();
  }
  // Pass 2: the log of the normalizer.
  double lse = std::numeric_limits<double>::quiet_NaN();
  if (!nan && std::isfinite(mx)) {
    double sum = 0;
    for (int i = 0; i < V; ++i) sum += std::exp(double(logits[size_t(i)]) - double(mx));
    lse = double(mx) + std::log(sum);
  }
  TokenLogprob out;
  out.token = token;
  out.logprob = static_cast<float>(double(logits[size_t(token)]) - lse);
  for (TopLogprob& b : best) b.logprob = static_cast<float>(double(b.logprob) - lse);
  out.top = std::move(best);
  return out;
}

}  // namespace oscar::engine
