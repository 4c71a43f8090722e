// The one AVX-512 exp2 polynomial of the CPU kernels (attention softmax,
// dense calibration attention, SwiGLU). Callers clamp the argument and mask
// special values themselves, each for its own contract.
#pragma once

#include <immintrin.h>

namespace oscar::simd {

// 2^x for x already clamped to [-127, 127]: x = n + f with n = round(x) and
// f in [-0.5, 0.5]; 2^f by a degree-6 polynomial (Taylor coefficients of
// e^(f ln 2), relative error < 3e-8 on the interval), times 2^n (scalef).
// NaN propagates. Inlines into any caller compiled with AVX-512F.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp2_clamped_avx512(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);                  // ln2^6/720
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5/120
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4/24
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3/6
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2/2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace oscar::simd
