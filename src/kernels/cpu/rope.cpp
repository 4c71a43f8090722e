#include "kernels/cpu/rope.h"

#include <cmath>

namespace oscar::kernels::cpu {

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

}  // namespace oscar::kernels::cpu
