// AVX2 + FMA instance of the attention row kernel (attention_simd.h), for
// CPUs without AVX-512. Compiled with a target attribute (the build targets
// x86-64-v2); attention.cpp only calls it when the CPU reports AVX2 and FMA.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/attention_impl.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define OSCAR_TGT __attribute__((target("avx2,fma,f16c")))

namespace oscar::kernels::cpu::detail {
namespace avx2 {

struct Avx2 {
  static constexpr int W = 8;
  using F = __m256;
  struct Table {
    __m256 t;     // INT2: 8-entry permute table m + (i&3)*s
    __m256 s, m;  // INT4: broadcast scale and min
  };

  OSCAR_TGT static inline F zero() { return _mm256_setzero_ps(); }
  OSCAR_TGT static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  OSCAR_TGT static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  OSCAR_TGT static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  OSCAR_TGT static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  OSCAR_TGT static inline F set1(float x) { return _mm256_set1_ps(x); }
  OSCAR_TGT static inline float reduce_add(F a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }

  OSCAR_TGT static inline F load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }

  OSCAR_TGT static inline void f16_to_f32(const uint16_t* src, int n, float* dst) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    for (; i < n; ++i) dst[i] = oscar::f16_to_f32(src[i]);
  }

  // Same arithmetic as the reference (m + code*s, no fused multiply-add).
  OSCAR_TGT static inline Table make_table(float s, float m, int bits) {
    const __m256 sv = _mm256_set1_ps(s), mv = _mm256_set1_ps(m);
    if (bits != 2) return Table{mv, sv, mv};
    const __m256 idx = _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3);
    return Table{_mm256_add_ps(mv, _mm256_mul_ps(idx, sv)), sv, mv};
  }

  // 8 code bytes (bytes per lane run >= 8 always) widened to 8 int32 lanes.
  OSCAR_TGT static inline __m256i load_window(const uint8_t* p, bool /*dup*/) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }

  // 8 consecutive channels: shift, mask, m + code*s (no fused multiply-add:
  // the reference's arithmetic).
  OSCAR_TGT static inline F dequant_x(__m256i x, const int32_t* shift, bool noshift, const Table& tb, int bits) {
    if (!noshift) x = _mm256_srlv_epi32(x, _mm256_load_si256(reinterpret_cast<const __m256i*>(shift)));
    // INT2: the permute reads the low 3 bits = code + 4*(next code's low bit).
    if (bits == 2) return _mm256_permutevar8x32_ps(tb.t, x);
    const __m256i c = _mm256_and_si256(x, _mm256_set1_epi32((1 << bits) - 1));
    return _mm256_add_ps(tb.m, _mm256_mul_ps(_mm256_cvtepi32_ps(c), tb.s));
  }

  // out[t] = sum of the 8 lanes of v[t], t < 16: two hadd trees of 8 rows.
  OSCAR_TGT static inline void reduce_rows(const F* v, float* out) {
    for (int r = 0; r < kBlock; r += 8) {
      const __m256 h01 = _mm256_hadd_ps(v[r + 0], v[r + 1]), h23 = _mm256_hadd_ps(v[r + 2], v[r + 3]);
      const __m256 h45 = _mm256_hadd_ps(v[r + 4], v[r + 5]), h67 = _mm256_hadd_ps(v[r + 6], v[r + 7]);
      const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);  // [rows r..r+3 | same] per half
      _mm256_storeu_ps(out + r, _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)));
    }
  }

  OSCAR_TGT static inline __m256 exp2_8(__m256 x) {
    const __m256 xc = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);  // NaN in x stays NaN
    const __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(xc, n);
    __m256 r = _mm256_set1_ps(1.540353039e-4f);
    r = _mm256_fmadd_ps(r, f, _mm256_set1_ps(1.333355815e-3f));
    r = _mm256_fmadd_ps(r, f, _mm256_set1_ps(9.618129108e-3f));
    r = _mm256_fmadd_ps(r, f, _mm256_set1_ps(5.550410866e-2f));
    r = _mm256_fmadd_ps(r, f, _mm256_set1_ps(2.402265070e-1f));
    r = _mm256_fmadd_ps(r, f, _mm256_set1_ps(6.931471806e-1f));
    r = _mm256_fmadd_ps(r, f, _mm256_set1_ps(1.0f));
    // 2^n through the exponent field; n = -127 gives +0 (and -inf inputs too).
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(r, _mm256_castsi256_ps(e));
  }

  OSCAR_TGT static inline float exp2_block(const float* s, float m, float* p) {
    const __m256 mv = _mm256_set1_ps(m);
    const __m256 a = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(s), mv));
    const __m256 b = exp2_8(_mm256_sub_ps(_mm256_loadu_ps(s + 8), mv));
    _mm256_storeu_ps(p, a);
    _mm256_storeu_ps(p + 8, b);
    return reduce_add(_mm256_add_ps(a, b));
  }
};

#include "kernels/cpu/attention_simd.h"

OSCAR_TGT void region_entry(const RegionRows& rr, QuerySet& qs) { region_rows<Avx2>(rr, qs); }
OSCAR_TGT void dense_t_entry(const DenseTRows& dr, int d, QuerySet& qs) { dense_t_rows<Avx2>(dr, d, qs); }

}  // namespace avx2

const RowKernels* avx2_kernels() {
  static const RowKernels k{"avx2", &avx2::region_entry, &avx2::dense_t_entry};
  return &k;
}

}  // namespace oscar::kernels::cpu::detail

#else
namespace oscar::kernels::cpu::detail {
const RowKernels* avx2_kernels() { return nullptr; }
}  // namespace oscar::kernels::cpu::detail
#endif
