#include "backend/sample.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace oscar::backend {

int32_t reference_draw(const float* w, int V, float temperature, int top_k, float top_p, double u, float min_p) {
  for (int i = 0; i < V; ++i)
    if (std::isnan(w[i])) return kDrawNaN;
  std::vector<int> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  auto by_logit = [w](int a, int b) { return w[a] > w[b] || (w[a] == w[b] && a < b); };
  int keep = top_k > 0 && top_k < V ? top_k : V;
  if (keep < V)
    std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), by_logit);
  else
    std::sort(idx.begin(), idx.end(), by_logit);
  // Running weights in that order.
  const double inv_t = 1.0 / double(temperature);
  std::vector<double> run(static_cast<size_t>(keep));
  double c = 0;
  int kept = keep;
  for (int i = 0; i < keep; ++i) {
    const double wi = std::exp((double(w[idx[size_t(i)]]) - w[idx[0]]) * inv_t);
    if (min_p > 0.0f && i > 0 && !(wi >= double(min_p))) {  // min_p: the rest of the order weighs less still
      kept = i;
      break;
    }
    run[size_t(i)] = (c += wi);
  }
  keep = kept;
  int n = keep;
  if (top_p < 1.0f) {
    n = 0;
    while (n < keep && !(run[size_t(n)] >= double(top_p) * run[size_t(keep) - 1])) ++n;
    n = std::min(keep, n + 1);
  }
  const double need = u * run[size_t(n) - 1];
  for (int i = 0; i < n; ++i)
    if (run[size_t(i)] > need) return idx[size_t(i)];
  return idx[size_t(n) - 1];
}

void apply_penalty_slot(uint64_t* slot, int vocab, bool reset, const int32_t* ids, int n) {
  if (reset) std::fill(slot, slot + (size_t(std::max(vocab, 0)) + 63) / 64, uint64_t(0));
  for (int j = 0; j < n; ++j)
    if (ids[j] >= 0 && ids[j] < vocab) slot[size_t(ids[j]) / 64] |= uint64_t(1) << (ids[j] % 64);
}

}  // namespace oscar::backend
