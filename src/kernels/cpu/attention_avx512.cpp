// AVX-512 instance of the attention row kernel (attention_simd.h). Compiled
// with a target attribute, not -mavx512f, because the build targets
// x86-64-v2; attention.cpp only calls it when the CPU reports AVX-512F/BW/DQ/VL.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/attention_impl.h"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 intrinsics use _mm512_undefined_*() as pass-through
// operands, which -Wmaybe-uninitialized reports once inlined: a known false
// positive, silenced for this file only.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#include "core/simd_exp.h"

#define OSCAR_TGT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))

namespace oscar::kernels::cpu::detail {
namespace avx512 {

struct Avx512 {
  static constexpr int W = 16;
  using F = __m512;
  using Table = __m512;  // 16-entry dequantization table m + i*s (INT2: i&3)

  OSCAR_TGT static inline F zero() { return _mm512_setzero_ps(); }
  OSCAR_TGT static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  OSCAR_TGT static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  OSCAR_TGT static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  OSCAR_TGT static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  OSCAR_TGT static inline F set1(float x) { return _mm512_set1_ps(x); }
  OSCAR_TGT static inline float reduce_add(F a) { return _mm512_reduce_add_ps(a); }

  OSCAR_TGT static inline F load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }

  OSCAR_TGT static inline void f16_to_f32(const uint16_t* src, int n, float* dst) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    if (i < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1u);
      _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
    }
  }

  // Same arithmetic as the reference (m + code*s, no fused multiply-add).
  OSCAR_TGT static inline Table make_table(float s, float m, int bits) {
    const __m512 idx = bits == 2 ? _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)
                                 : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_add_ps(_mm512_set1_ps(m), _mm512_mul_ps(idx, _mm512_set1_ps(s)));
  }

  // 16 code bytes (or 8 bytes twice) widened to 16 int32 lanes.
  OSCAR_TGT static inline __m512i load_window(const uint8_t* p, bool dup) {
    __m128i b;
    if (dup) {
      b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      b = _mm_unpacklo_epi64(b, b);
    } else {
      b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    }
    return _mm512_cvtepu8_epi32(b);
  }

  // 16 consecutive channels: per-lane shift, then the permute uses the low 4
  // bits as the table index (INT2: code + 4*next code, table[i] = m + (i&3)*s).
  OSCAR_TGT static inline F dequant_x(__m512i x, const int32_t* shift, bool noshift, const Table& tb,
                                      int /*bits*/) {
    if (!noshift) x = _mm512_srlv_epi32(x, _mm512_load_si512(shift));
    return _mm512_permutexvar_ps(x, tb);
  }

  // out[t] = sum of the 16 lanes of v[t], t < 16, by a transpose-and-add tree
  // (46 shuffles/adds for 16 rows instead of 16 separate reductions).
  OSCAR_TGT static inline void reduce_rows(const F* v, float* out) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; ++i)  // [row 2i: 8 lanes | row 2i+1: 8 lanes]
      w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int j = 0; j < 4; ++j)  // 128-bit block k = 4 lanes of row 4j+k
      x[j] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                           _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
    for (int k = 0; k < 2; ++k)  // block i = [r, r+4, r, r+4] partials, r = 8k+i
      y[k] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * k], x[2 * k + 1]), _mm512_unpackhi_ps(x[2 * k], x[2 * k + 1]));
    // block i = [row i, row i+4, row 8+i, row 12+i]
    const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], 0x44), _mm512_shuffle_ps(y[0], y[1], 0xEE));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, z));
  }

  // p[t] = 2^(s[t] - m) for 16 values (-inf -> 0, NaN stays NaN); returns the sum.
  OSCAR_TGT static inline float exp2_block(const float* s, float m, float* p) {
    const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(s), _mm512_set1_ps(m));
    // NaN in x stays NaN through the clamp and the polynomial
    __m512 r = simd::exp2_clamped_avx512(_mm512_max_ps(_mm512_set1_ps(-127.0f), x));
    r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_UQ), r);
    _mm512_storeu_ps(p, r);
    return _mm512_reduce_add_ps(r);
  }
};

#include "kernels/cpu/attention_simd.h"

OSCAR_TGT void region_entry(const RegionRows& rr, QuerySet& qs) { region_rows<Avx512>(rr, qs); }
OSCAR_TGT void dense_t_entry(const DenseTRows& dr, int d, QuerySet& qs) { dense_t_rows<Avx512>(dr, d, qs); }

}  // namespace avx512

const RowKernels* avx512_kernels() {
  static const RowKernels k{"avx512", &avx512::region_entry, &avx512::dense_t_entry};
  return &k;
}

}  // namespace oscar::kernels::cpu::detail

#else
namespace oscar::kernels::cpu::detail {
const RowKernels* avx512_kernels() { return nullptr; }
}  // namespace oscar::kernels::cpu::detail
#endif
