#include "model/rope.h"

#include <cmath>

namespace oscar::model {

std::vector<float> rope_inv_freq(const ModelConfig& cfg) {
  const int d = cfg.head_dim;
  std::vector<float> f(d / 2);
  for (int i = 0; i < d / 2; ++i)
    f[i] = static_cast<float>(1.0 / std::pow(double(cfg.rope_theta), double(2 * i) / d));
  const RopeScaling& s = cfg.rope_scaling;
  if (s.type == RopeScaling::Type::kLinear) {
    for (float& x : f) x /= s.factor;
  } else if (s.type == RopeScaling::Type::kLlama3) {
    const double old_len = s.original_max_position;
    const double low_wavelen = old_len / s.low_freq_factor;
    const double high_wavelen = old_len / s.high_freq_factor;
    for (float& x : f) {
      const double wavelen = 2.0 * M_PI / x;
      if (wavelen < high_wavelen) continue;  // high frequencies untouched
      if (wavelen > low_wavelen) {
        x = static_cast<float>(x / s.factor);
      } else {
        const double smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        x = static_cast<float>((1.0 - smooth) * x / s.factor + smooth * x);
      }
    }
  }
  return f;
}

void rope_tables(const std::vector<float>& inv_freq, const int32_t* pos, int n, float* cos,
                 float* sin) {
  const int h = static_cast<int>(inv_freq.size());
  for (int t = 0; t < n; ++t) {
    for (int i = 0; i < h; ++i) {
      // The angle is an fp32 product, as in the Hugging Face implementation, so
      // long positions round the same way; cos/sin themselves in double.
      const float a = static_cast<float>(pos[t]) * inv_freq[i];
      cos[int64_t(t) * h + i] = static_cast<float>(std::cos(double(a)));
      sin[int64_t(t) * h + i] = static_cast<float>(std::sin(double(a)));
    }
  }
}

void rope_apply(float* x, int n, int heads, int d, const float* cos, const float* sin) {
  const int h = d / 2;
  for (int t = 0; t < n; ++t) {
    const float* c = cos + int64_t(t) * h;
    const float* s = sin + int64_t(t) * h;
    for (int g = 0; g < heads; ++g) {
      float* v = x + (int64_t(t) * heads + g) * d;
      for (int i = 0; i < h; ++i) {
        const float a = v[i], b = v[i + h];
        v[i] = a * c[i] - b * s[i];
        v[i + h] = b * c[i] + a * s[i];
      }
    }
  }
}

}  // namespace oscar::model
