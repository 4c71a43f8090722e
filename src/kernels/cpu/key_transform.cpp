#include "kernels/cpu/key_transform.h"

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/cpu/cache_write.h"

namespace oscar::kernels::cpu {

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
  // Query head g uses the matrix of KV head g / (Hq / Hkv): per token, a group's heads are
  // `group` contiguous rows, rotated in place with their KV head's matrix (no per-call copy
  // of the matrices: this runs every decode step).
  const int group = Hq / Hkv;
  for (int64_t r = 0; r < n; ++r)
    for (int h = 0; h < Hkv; ++h) {
      float* x = q + (r * Hq + int64_t(h) * group) * d;
      kernels::cpu::rotate_rows(x, group, d, t.query_matrix(h), x);
    }
}

}  // namespace oscar::kernels::cpu
