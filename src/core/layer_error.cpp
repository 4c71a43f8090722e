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
    if (!L.has_key_transform()) {
      out.k += quant_error_sums(k + int64_t(h) * d, T, stride, d, Rk.data(), L.k_clip_of(h), spec,
                                t.q(h));
    } else {
      // Key transform (docs/core.md "Key transform"): rows (k − μ)/s, weight diag(s)·C_Q·diag(s); the
      // weighted error is the logit error either way, the raw error is in the scaled basis.
      const float* mu = L.k_mean.empty() ? nullptr : L.k_mean.data() + size_t(h) * d;
      const float* sc = L.k_scale.empty() ? nullptr : L.k_scale.data() + size_t(h) * d;
      std::vector<float> rows(static_cast<size_t>(T) * d);
      for (int64_t r = 0; r < T; ++r)
        for (int c = 0; c < d; ++c)
          rows[size_t(r) * d + c] =
              (k[r * stride + int64_t(h) * d + c] - (mu ? mu[c] : 0.0f)) / (sc ? sc[c] : 1.0f);
      std::vector<double> W(t.q(h), t.q(h) + dd);
      if (sc)
        for (int i = 0; i < d; ++i)
          for (int j = 0; j < d; ++j) W[size_t(i) * d + j] *= double(sc[i]) * sc[j];
      out.k += quant_error_sums(rows.data(), T, d, d, Rk.data(), L.k_clip_of(h), spec, W.data());
    }
    out.v +=
        quant_error_sums(v + int64_t(h) * d, T, stride, d, Rv.data(), L.v_clip_of(h), spec, t.v(h));
  }
  return out;
}

}  // namespace oscar
