#include "core/layer_error.h"

#include <vector>

namespace oscar {

KvErrors layer_kv_errors(const LayerTargets& t, const float* k, const float* v, int64_t T,
                         const LayerCalibration& L, const QuantSpec& spec) {
  KvErrors out;
  const int H = t.n_kv_heads, d = t.d;
  const size_t dd = static_cast<size_t>(d) * d;
  std::vector<double> Rk(dd), Rv(dd);
  for (int h = 0; h < H; ++h) {
    const float* rk = L.k_rot(h, d);
    const float* rv = L.v_rot(h, d);
    for (size_t i = 0; i < dd; ++i) Rk[i] = rk[i], Rv[i] = rv[i];
    const int64_t stride = int64_t(H) * d;
    out.k +=
        quant_error_sums(k + int64_t(h) * d, T, stride, d, Rk.data(), L.k_clip_of(h), spec, t.q(h));
    out.v +=
        quant_error_sums(v + int64_t(h) * d, T, stride, d, Rv.data(), L.v_clip_of(h), spec, t.v(h));
  }
  return out;
}

}  // namespace oscar
