#include "kv/key_transform.h"

#include <fmt/format.h>

#include <vector>

#include "core/error.h"
#include "kernels/cpu/cache_write.h"

namespace oscar::kv {

void transform_keys(const KeyTransform& t, float* k, int64_t n, int Hkv) {
  if (n == 0) return;
  const int d = t.d;
  if (t.n != 1 && t.n != Hkv)
    throw Error(fmt::format("key transform: {} matrices for {} KV heads", t.n, Hkv));
  if (!t.mean.empty())
    for (int64_t r = 0; r < n; ++r)
      for (int h = 0; h < Hkv; ++h) {
        float* x = k + (r * Hkv + h) * d;
        const float* m = t.mean.data() + int64_t(h) * d;
        for (int c = 0; c < d; ++c) x[c] -= m[c];
      }
  kernels::cpu::rotate_heads(k, n, Hkv, d, t.key.data(), t.n, k);
}

void transform_queries(const KeyTransform& t, float* q, int64_t n, int Hq, int Hkv) {
  if (n == 0) return;
  const int d = t.d;
  if (t.n == 1) {
    kernels::cpu::rotate_heads(q, n, Hq, d, t.query.data(), 1, q);
    return;
  }
  if (Hkv <= 0 || Hq % Hkv != 0 || t.n != Hkv)
    throw Error(fmt::format("key transform: {} query heads for {} KV heads ({} matrices)", Hq, Hkv, t.n));
  // Query head g uses the matrix of KV head g / (Hq / Hkv).
  const int group = Hq / Hkv;
  std::vector<float> M(size_t(Hq) * d * d);
  for (int g = 0; g < Hq; ++g)
    std::copy(t.query_matrix(g / group), t.query_matrix(g / group) + size_t(d) * d,
              M.begin() + ptrdiff_t(g) * d * d);
  kernels::cpu::rotate_heads(q, n, Hq, d, M.data(), Hq, q);
}

}  // namespace oscar::kv
