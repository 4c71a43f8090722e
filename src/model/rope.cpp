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

}  // namespace oscar::model
