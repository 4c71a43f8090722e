// AVX-512 VNNI decode kernel for the INT2 middle region: integer dot products
// straight on the packed codes (DESIGN §3.5), the "approximate" tier of CPU
// decode attention (docs/kernels-cpu.md). BF16 rows, INT4 rows and prefill use
// the exact AVX-512 float kernels (attention_avx512.cpp).
//
// Keys. Each query head's (pre-scaled, base-2) query is quantized once per work
// item, per group, to two int8 digits: q ~ sq * (256 qh + ql), sq = max|q| /
// 32512 (kQueryHiLo; one digit: sq = max|q| / 127), and permuted to the packed
// code order of core/quant_format.h. The logit of a row
//   q.k = sum_g [ s_g * sq_g * sum_j (256 qh_j + ql_j) c_j  +  m_g * sum_j q_j ]
// uses vpdpbusd (u8 codes x s8 query digit, 4 channels per 32-bit lane) for the
// first term and the exact float sum of q for the second. 16 rows are done at
// once with rows in lanes: the 16 x (d/16) dwords of packed codes are
// transposed (vpermt2d), so dword k of all 16 rows sits in one register and a
// shift + and of it gives 4 consecutive channels of every row (the quarter-
// stride packing makes each shift a run of consecutive channels). No
// horizontal reductions, no float widening of codes.
//
// Values. sum_t p_t (m_t + s_t c_tj) = sum_t p_t m_t + sum_t w_t c_tj with
// w_t = p_t s_t. Per span of <= kSpan consecutive middle rows of the work item
// (and query head, group) the weights are quantized with one scale to two
// int8 digits, w ~ sw * (256 wh + wl), sw = max w / 32512 (kWeightHiLo); the
// codes of 4 consecutive rows are interleaved per 32-bit lane with one vpermb
// (VBMI) and masked (no shift: the 4^q factor goes into the flush scale), and
// vpdpbusd (u8 codes x s8 weight digit of 4 tokens) accumulates 16 channels x
// 4 tokens per instruction into int32, flushed to the f32 accumulator once per
// span. The p_t m_t term is accumulated in f32.
//
// Error (stated bound, tests/kernels/test_attention.cpp): per logit
// |delta| <= sq_g/2 * sum_j s_g c_j (per group), and per output channel
// |delta o_j| <= 3 * sum_t min(sw/2, w_t) / l over the middle rows, on top of
// the f32 tier. OSCAR_CPU_ATTN=exact selects the float kernels instead.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "core/error.h"
#include "core/half.h"
#include "kernels/cpu/attention_impl.h"

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#include "core/simd_exp.h"

#define OSCAR_TGT \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")))

namespace oscar::kernels::cpu::detail {
namespace vnni {

constexpr int kSpan = 128;  // rows per weight-quantization span (int32 accumulation; may cross pages)
constexpr int kSpanBlocks = kSpan / 16;
constexpr int kPrefetchPages = 4;  // software prefetch distance (OSCAR_VNNI_PREFETCH overrides)
// Query precision: true = two int8 digits (q ~ sq * (256 qh + ql), 16 bits,
// twice the key dot products), false = one int8 (7 bits + sign).
#ifndef OSCAR_VNNI_QUERY_HILO
#define OSCAR_VNNI_QUERY_HILO 1
#endif
constexpr bool kQueryHiLo = OSCAR_VNNI_QUERY_HILO;
// Value weights: true = two int8 digits per span scale (w ~ sw * (256 wh + wl),
// 15 bits: w >= 0), false = one (7 bits).
#ifndef OSCAR_VNNI_WEIGHT_HILO
#define OSCAR_VNNI_WEIGHT_HILO 1
#endif
constexpr bool kWeightHiLo = OSCAR_VNNI_WEIGHT_HILO;
// Two digits: x ~ 256 hi + lo, hi in [-127, 127], lo in [-128, 127] (both int8).
constexpr int kDigitShift = 8;
constexpr float kWeightRange = kWeightHiLo ? 127.0f * 256.0f : 127.0f;
constexpr float kQueryRange = kQueryHiLo ? 127.0f * 256.0f : 127.0f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- 16 x ND dword transpose ------------------------------------------------
// Input: ND registers, register r = rows [r*16/ND, (r+1)*16/ND) of a row-major
// 16 x ND dword matrix. Output: ND registers, register k = column k (16 rows,
// row t in lane t). log2(ND) levels of vpermt2d, each splitting the columns of
// a register pair in halves.
template <int ND>
struct Transpose {
  static constexpr int kLevels = ND == 1 ? 0 : ND == 2 ? 1 : ND == 4 ? 2 : ND == 8 ? 3 : 4;
  struct Idx {
    int32_t v[kLevels > 0 ? kLevels : 1][2][16];
  };
  static constexpr Idx make() {
    Idx x{};
    for (int L = 0; L < kLevels; ++L) {
      const int R = (16 / ND) << L, C = ND >> L;  // rows x cols per input register
      for (int h = 0; h < 2; ++h)
        for (int r = 0; r < 2 * R; ++r)
          for (int c = 0; c < C / 2; ++c)
            x.v[L][h][r * (C / 2) + c] = (r >= R ? 16 : 0) + (r % R) * C + h * (C / 2) + c;
    }
    return x;
  }
  static constexpr Idx kIdx = make();

  OSCAR_TGT static inline void run(__m512i* reg) {
    if constexpr (kLevels > 0) {
      __m512i tmp[ND];
      int nrb = ND, ncb = 1;  // reg[rb * ncb + cb]
#pragma GCC unroll 4
      for (int L = 0; L < kLevels; ++L) {
        const __m512i i0 = _mm512_loadu_si512(kIdx.v[L][0]), i1 = _mm512_loadu_si512(kIdx.v[L][1]);
        const int nrb2 = nrb / 2, ncb2 = ncb * 2;
#pragma GCC unroll 16
        for (int i = 0; i < nrb2; ++i)
#pragma GCC unroll 16
          for (int cb = 0; cb < ncb; ++cb) {
            const __m512i a = reg[(2 * i) * ncb + cb], b = reg[(2 * i + 1) * ncb + cb];
            tmp[i * ncb2 + 2 * cb] = _mm512_permutex2var_epi32(a, i0, b);
            tmp[i * ncb2 + 2 * cb + 1] = _mm512_permutex2var_epi32(a, i1, b);
          }
#pragma GCC unroll 16
        for (int r = 0; r < ND; ++r) reg[r] = tmp[r];
        nrb = nrb2;
        ncb = ncb2;
      }
    }
  }
};

// Byte index for vpermb: 4 rows x 16 bytes ([R0 | R1 | R2 | R3] in 128-bit
// lanes) -> dword j = (R0[j], R1[j], R2[j], R3[j]).
struct QuadIdx {
  int8_t v[64];
};
constexpr QuadIdx make_quad_idx() {
  QuadIdx x{};
  for (int j = 0; j < 16; ++j)
    for (int i = 0; i < 4; ++i) x.v[4 * j + i] = int8_t(16 * i + j);
  return x;
}
alignas(64) constexpr QuadIdx kQuadIdx = make_quad_idx();

// p = 2^(s - m), 16 values (-inf -> 0, NaN stays NaN); same polynomial as the
// float AVX-512 kernel.
OSCAR_TGT static inline __m512 exp2_16(__m512 s, float m) {
  const __m512 x = _mm512_sub_ps(s, _mm512_set1_ps(m));
  const __m512 r = simd::exp2_clamped_avx512(_mm512_max_ps(_mm512_set1_ps(-127.0f), x));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(kNegInf), _CMP_NEQ_UQ), r);
}

// acc += u8 x s8 dot products of 4 bytes per 32-bit lane (vpdpbusd). Inline
// asm ties the accumulator to its register: with the intrinsic GCC 12 copies
// every accumulator at each loop iteration (loop-carried register moves).
OSCAR_TGT static inline __m512i dp(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}
// Same with the signed operand broadcast from one dword in memory ({1to16}).
OSCAR_TGT static inline __m512i dp_bcast(__m512i acc, __m512i u8, const int32_t* s8) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u8), "m"(*s8));
  return acc;
}

// fp16 (scale, min) pairs as dwords -> f32 scale and min vectors.
OSCAR_TGT static inline void split_params(__m512i pair, __m512& scale, __m512& mn) {
  scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pair));
  mn = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pair, 16)));
}

// Rows of one span: up to kSpanBlocks blocks of 16 consecutive rows (one
// page each, pages may differ); all blocks full except possibly the last.
struct SpanBlocks {
  const uint8_t* kc[kSpanBlocks];
  const uint8_t* vc[kSpanBlocks];
  const uint16_t* kp[kSpanBlocks];
  const uint16_t* vp[kSpanBlocks];
  const float* shift[kSpanBlocks];  // page centering: the block's page shifts [NQ], or nullptr
};

template <int D, int G, int NQ>
struct Kernel {
  static constexpr int CB = D / 4;    // code bytes per row
  static constexpr int ND = CB / 4;   // code dwords per row (4, 8, 16)
  static constexpr int NG = D / G;    // groups per row
  static constexpr int DG = G / 16;   // code dwords per group
  static constexpr int BG = G / 4;    // code bytes per group
  static constexpr int NC = CB / 16;  // 16-byte value chunks per row (64 channels each)

  // Per work item state, accumulator in kernel order: index c*64 + q*16 + j
  // holds the channel of code byte 16c + j at shift 2q (channel_of below).
  struct State {
    alignas(64) int32_t qp[NQ][ND][4];  // permuted int8 query (high digit), dword per (code dword, shift)
    alignas(64) int32_t ql[NQ][ND][4];  // low digit (kQueryHiLo)
    float qsig[NQ][NG], qsum[NQ][NG];
    alignas(64) float acc[NQ][D];
    __m512 mt[NQ][NG];  // sum_t p_t m_t (value min term) per group, 16 partial sums
    __m512 l[NQ];       // softmax denominators, 16 partial sums
  };

  static constexpr int channel_of(int i) {
    const int c = i / 64, q = (i / 16) % 4, j = i % 16;
    const int b = 16 * c + j, g = b / BG, jj = b % BG;
    return g * G + q * BG + jj;
  }

  OSCAR_TGT static void prepare(const QuerySet& qs, State& st) {
    alignas(64) int8_t q8[D], q8l[D];
    for (int h = 0; h < NQ; ++h) {
      const float* q = qs.q + h * D;
      for (int g = 0; g < NG; ++g) {
        __m512 mx = _mm512_setzero_ps(), sum = _mm512_setzero_ps(), fin = _mm512_setzero_ps();
        for (int j = g * G; j < (g + 1) * G; j += 16) {
          const __m512 x = _mm512_loadu_ps(q + j);
          mx = _mm512_max_ps(mx, _mm512_abs_ps(x));
          sum = _mm512_add_ps(sum, x);
          fin = _mm512_add_ps(fin, _mm512_mul_ps(x, _mm512_setzero_ps()));  // NaN iff some x is NaN/inf
        }
        const float m = _mm512_reduce_max_ps(mx), poison = _mm512_reduce_add_ps(fin);
        const __m512 inv = _mm512_set1_ps(m > 0.0f ? kQueryRange / m : 0.0f);
        // A non-finite query makes the logits NaN, as in the exact path.
        st.qsig[h][g] = m / kQueryRange + poison;
        st.qsum[h][g] = _mm512_reduce_add_ps(sum);
        for (int j = g * G; j < (g + 1) * G; j += 16) {
          // NaN -> clamp value (the logits are poisoned by qsig anyway).
          const __m512 r = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(q + j), inv), _mm512_set1_ps(-kQueryRange)),
                                         _mm512_set1_ps(kQueryRange));
          if constexpr (kQueryHiLo) {
            // ri = round(r) in [-32512, 32512] = 256 hi + lo, hi = floor((ri + 128) / 256).
            const __m512i ri = _mm512_cvtps_epi32(r);
            const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(ri, _mm512_set1_epi32(128)), kDigitShift);
            const __m512i lo = _mm512_sub_epi32(ri, _mm512_slli_epi32(hi, kDigitShift));
            _mm_store_si128(reinterpret_cast<__m128i*>(q8 + j), _mm512_cvtepi32_epi8(hi));
            _mm_store_si128(reinterpret_cast<__m128i*>(q8l + j), _mm512_cvtepi32_epi8(lo));
          } else {
            _mm_store_si128(reinterpret_cast<__m128i*>(q8 + j), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
          }
        }
      }
      // Permute to the packed order: dword k at shift s = channels g*G + s*G/4 + 4k' + (0..3).
      for (int k = 0; k < ND; ++k) {
        const int g = k / DG, kk = k - g * DG;
        for (int s = 0; s < 4; ++s) {
          std::memcpy(&st.qp[h][k][s], q8 + g * G + s * BG + 4 * kk, 4);
          if constexpr (kQueryHiLo) std::memcpy(&st.ql[h][k][s], q8l + g * G + s * BG + 4 * kk, 4);
        }
      }
      for (int i = 0; i < D; ++i) st.acc[h][i] = qs.acc[h * D + channel_of(i)];
      for (int g = 0; g < NG; ++g) st.mt[h][g] = _mm512_setzero_ps();
      st.l[h] = _mm512_maskz_mov_ps(1, _mm512_set1_ps(qs.l[h]));
    }
  }

  OSCAR_TGT static void finish(QuerySet& qs, const State& st) {
    for (int h = 0; h < NQ; ++h) {
      float mt[NG];
      for (int g = 0; g < NG; ++g) mt[g] = _mm512_reduce_add_ps(st.mt[h][g]);
      for (int i = 0; i < D; ++i) {
        const int ch = channel_of(i);
        qs.acc[h * D + ch] = st.acc[h][i] + mt[ch / G];
      }
      qs.l[h] = _mm512_reduce_add_ps(st.l[h]);
    }
  }

  // Logits of 16 rows (rows in lanes) into s[h][16].
  // Not inlined: keeps GCC from hoisting the query broadcasts out of the
  // block loop (they stay embedded {1to16} memory operands).
  __attribute__((noinline)) OSCAR_TGT static void logits16(const uint8_t* kc, const uint16_t* kp, const State& st,
                                        float (*s)[kSpan], int t0) {
    __m512i col[ND];
    for (int r = 0; r < ND; ++r) col[r] = _mm512_loadu_si512(kc + 64 * r);
    Transpose<ND>::run(col);
    __m512i par[NG];
    for (int r = 0; r < NG; ++r) par[r] = _mm512_loadu_si512(kp + 32 * r);
    Transpose<NG>::run(par);
    const __m512i m3 = _mm512_set1_epi8(3);
    __m512 lg[NQ];
    for (int h = 0; h < NQ; ++h) lg[h] = _mm512_setzero_ps();
    // NA independent accumulators per head (vpdpbusd latency ~5 cycles: one
    // chain per head would make the dot products latency-bound).
    // With two query digits: NA/2 chains per digit, a[h][0..NA/2) high, the rest low.
    constexpr int NA = NQ <= 4 ? 4 : 2;
    constexpr int NH = kQueryHiLo ? NA / 2 : NA;
#pragma GCC unroll 8
    for (int g = 0; g < NG; ++g) {
      __m512i a[NQ][NA];
      for (int h = 0; h < NQ; ++h)
        for (int i = 0; i < NA; ++i) a[h][i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = g * DG; k < (g + 1) * DG; ++k) {
        const __m512i x = col[k];
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const __m512i c = _mm512_and_si512(q == 0 ? x : _mm512_srli_epi32(x, 2 * q), m3);
          for (int h = 0; h < NQ; ++h) {
            a[h][q % NH] = dp_bcast(a[h][q % NH], c, &st.qp[h][k][q]);
            if constexpr (kQueryHiLo)
              a[h][NH + q % NH] = dp_bcast(a[h][NH + q % NH], c, &st.ql[h][k][q]);
          }
        }
      }
      __m512 sc, mn;
      split_params(par[g], sc, mn);
      for (int h = 0; h < NQ; ++h) {
        __m512i sum = a[h][0];
        for (int i = 1; i < NH; ++i) sum = _mm512_add_epi32(sum, a[h][i]);
        if constexpr (kQueryHiLo) {
          __m512i lo = a[h][NH];
          for (int i = NH + 1; i < NA; ++i) lo = _mm512_add_epi32(lo, a[h][i]);
          sum = _mm512_add_epi32(_mm512_slli_epi32(sum, kDigitShift), lo);
        }
        const __m512 dot = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(st.qsig[h][g]));
        lg[h] = _mm512_fmadd_ps(sc, dot, _mm512_fmadd_ps(mn, _mm512_set1_ps(st.qsum[h][g]), lg[h]));
      }
    }
    for (int h = 0; h < NQ; ++h) _mm512_store_ps(s[h] + t0, lg[h]);
  }

  // Value codes of the span, staged once for all heads: for chunk c and quad
  // u (rows 4u..4u+3), cq[c][u][q] = the 16 bytes 16c..16c+15 of the 4 rows
  // interleaved per dword (vpermb) and masked to shift q (value code * 4^q).
  OSCAR_TGT static inline void stage_values(const SpanBlocks& bl, int nquads, __m512i (*cq)[kSpan / 4][4]) {
    const __m512i qidx = _mm512_loadu_si512(kQuadIdx.v);
    for (int u = 0; u < nquads; ++u) {
      const uint8_t* r0 = bl.vc[u / 4] + 4 * (u % 4) * CB;
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) {
        __m512i x;
        if constexpr (CB == 16) {
          x = _mm512_loadu_si512(r0);
        } else if constexpr (CB == 32) {
          const __m512i z1 = _mm512_loadu_si512(r0), z2 = _mm512_loadu_si512(r0 + 64);
          x = c == 0 ? _mm512_shuffle_i64x2(z1, z2, 0x88) : _mm512_shuffle_i64x2(z1, z2, 0xDD);
        } else {
          x = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 16 * c)));
          x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + CB + 16 * c)), 1);
          x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 2 * CB + 16 * c)), 2);
          x = _mm512_inserti32x4(x, _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + 3 * CB + 16 * c)), 3);
        }
        x = _mm512_permutexvar_epi8(qidx, x);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) _mm512_store_si512(&cq[c][u][q], _mm512_and_si512(x, _mm512_set1_epi8(char(3 << (2 * q)))));
      }
    }
  }

  // Value accumulation of chunk c for head h over the span's quads (staged
  // codes from L1, weights as broadcast int8 quads), flushed to the f32 acc.
  // w0/w1: weight quads of the chunk's group (w1: lanes 8..15 when G = 32);
  // with two weight digits, wl0/wl1 are the low digits.
  OSCAR_TGT static inline __m512i weight(const int32_t* x0, const int32_t* x1, int u) {
    __m512i w = _mm512_set1_epi32(x0[u]);
    if constexpr (BG < 16) w = _mm512_mask_set1_epi32(w, 0xFF00, x1[u]);
    return w;
  }

  OSCAR_TGT static inline void values_head(const __m512i (*cq)[4], int nquads, const int32_t* w0, const int32_t* w1,
                                           const int32_t* wl0, const int32_t* wl1, float s0, float s1, float* dst) {
    __m512i a[4], b[4];  // high digit (or even quads), low digit (or odd quads)
    for (int q = 0; q < 4; ++q) a[q] = b[q] = _mm512_setzero_si512();
    if constexpr (kWeightHiLo) {
      for (int u = 0; u < nquads; ++u) {
        const __m512i wa = weight(w0, w1, u), wb = weight(wl0, wl1, u);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const __m512i c = _mm512_load_si512(&cq[u][q]);
          a[q] = dp(a[q], c, wa);
          b[q] = dp(b[q], c, wb);
        }
      }
      for (int q = 0; q < 4; ++q) a[q] = _mm512_add_epi32(_mm512_slli_epi32(a[q], kDigitShift), b[q]);
    } else {
      int u = 0;
      // Two independent accumulator sets (latency of vpdpbusd).
      for (; u + 1 < nquads; u += 2) {
        const __m512i wa = weight(w0, w1, u), wb = weight(w0, w1, u + 1);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          a[q] = dp(a[q], _mm512_load_si512(&cq[u][q]), wa);
          b[q] = dp(b[q], _mm512_load_si512(&cq[u + 1][q]), wb);
        }
      }
      if (u < nquads) {
        const __m512i wa = weight(w0, w1, u);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) a[q] = dp(a[q], _mm512_load_si512(&cq[u][q]), wa);
      }
      for (int q = 0; q < 4; ++q) a[q] = _mm512_add_epi32(a[q], b[q]);
    }
    __m512 mult = _mm512_set1_ps(s0);
    if constexpr (BG < 16) mult = _mm512_mask_mov_ps(mult, 0xFF00, _mm512_set1_ps(s1));
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512 m = _mm512_mul_ps(mult, _mm512_set1_ps(1.0f / float(1 << (2 * q))));
      _mm512_store_ps(dst + q * 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[q]), m, _mm512_load_ps(dst + q * 16)));
    }
  }

  // One span of n <= kSpan rows starting at a 16-aligned slot of a page.
  OSCAR_TGT static void span(const SpanBlocks& bl, int n, QuerySet& qs, State& st) {
    alignas(64) float s[NQ][kSpan];
    alignas(64) float vsc[NG][kSpan], vmn[NG][kSpan];
    const int nb = (n + 15) / 16;
    for (int b = 0; b < nb; ++b) {
      logits16(bl.kc[b], bl.kp[b], st, s, 16 * b);
      if (const float* sh = bl.shift[b])  // page centering: the block's page moves every logit
        for (int h = 0; h < NQ; ++h)
          _mm512_store_ps(s[h] + 16 * b, _mm512_add_ps(_mm512_load_ps(s[h] + 16 * b), _mm512_set1_ps(sh[h])));
      __m512i par[NG];
      for (int r = 0; r < NG; ++r) par[r] = _mm512_loadu_si512(bl.vp[b] + 32 * r);
      Transpose<NG>::run(par);
      for (int g = 0; g < NG; ++g) {
        __m512 sc, mn;
        split_params(par[g], sc, mn);
        _mm512_store_ps(vsc[g] + 16 * b, sc);
        _mm512_store_ps(vmn[g] + 16 * b, mn);
      }
    }
    // Online softmax over the span, then int8 weights per (head, group).
    alignas(64) int32_t wq[NQ][NG][kSpan / 4], wl[NQ][NG][kSpan / 4];
    float sw[NQ][NG];
    for (int h = 0; h < NQ; ++h) {
      __m512 mx = _mm512_set1_ps(kNegInf);
      for (int b = 0; b < nb; ++b) {
        const int rem = n - 16 * b;
        const __mmask16 valid = rem >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rem) - 1u);
        mx = _mm512_mask_max_ps(mx, valid, mx, _mm512_load_ps(s[h] + 16 * b));
      }
      const float bm = _mm512_reduce_max_ps(mx);
      if (bm == kNegInf) {  // nothing visible (not expected: no causal limit here)
        for (int g = 0; g < NG; ++g) {
          sw[h][g] = 0.0f;
          for (int u = 0; u < kSpan / 4; ++u) wq[h][g][u] = wl[h][g][u] = 0;
        }
        continue;
      }
      const float m_new = std::max(qs.m[h], bm);
      const float alpha = m_new == qs.m[h] ? 1.0f : std::exp2(qs.m[h] - m_new);
      if (alpha != 1.0f) {
        const __m512 av = _mm512_set1_ps(alpha);
        for (int i = 0; i < D; i += 16) _mm512_store_ps(st.acc[h] + i, _mm512_mul_ps(_mm512_load_ps(st.acc[h] + i), av));
        for (int g = 0; g < NG; ++g) st.mt[h][g] = _mm512_mul_ps(st.mt[h][g], av);
        st.l[h] = _mm512_mul_ps(st.l[h], av);
      }
      qs.m[h] = m_new;
      __m512 p[kSpan / 16];
      for (int b = 0; b < nb; ++b) {
        const int rem = n - 16 * b;
        const __mmask16 valid = rem >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rem) - 1u);
        p[b] = _mm512_maskz_mov_ps(valid, exp2_16(_mm512_load_ps(s[h] + 16 * b), m_new));
        st.l[h] = _mm512_add_ps(st.l[h], p[b]);
      }
      for (int g = 0; g < NG; ++g) {
        __m512 wmax = _mm512_setzero_ps(), msum = st.mt[h][g];
        __m512 w[kSpan / 16];
        for (int b = 0; b < nb; ++b) {
          const int rem = n - 16 * b;
          const __mmask16 valid = rem >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << rem) - 1u);
          w[b] = _mm512_maskz_mul_ps(valid, p[b], _mm512_load_ps(vsc[g] + 16 * b));
          wmax = _mm512_max_ps(wmax, w[b]);
          msum = _mm512_fmadd_ps(w[b], _mm512_setzero_ps(), msum);  // NaN weight (NaN in the cache) -> NaN output
          msum = _mm512_mask3_fmadd_ps(p[b], _mm512_load_ps(vmn[g] + 16 * b), msum, valid);
        }
        const float wm = _mm512_reduce_max_ps(wmax);
        sw[h][g] = wm / kWeightRange;
        st.mt[h][g] = msum;
        const __m512 inv = _mm512_set1_ps(wm > 0.0f ? kWeightRange / wm : 0.0f);
        for (int b = 0; b < nb; ++b) {
          const __m512i iw = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_mul_ps(w[b], inv), _mm512_set1_ps(kWeightRange)));
          if constexpr (kWeightHiLo) {
            // iw in 0..32512 = 256 hi + lo, hi = floor((iw + 128) / 256) in 0..127, lo in -128..127.
            const __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(iw, _mm512_set1_epi32(128)), kDigitShift);
            const __m512i lo = _mm512_sub_epi32(iw, _mm512_slli_epi32(hi, kDigitShift));
            _mm_store_si128(reinterpret_cast<__m128i*>(&wq[h][g][4 * b]), _mm512_cvtepi32_epi8(hi));
            _mm_store_si128(reinterpret_cast<__m128i*>(&wl[h][g][4 * b]), _mm512_cvtepi32_epi8(lo));
          } else {
            _mm_store_si128(reinterpret_cast<__m128i*>(&wq[h][g][4 * b]), _mm512_cvtepi32_epi8(iw));
          }
        }
      }
    }
    const int nquads = (n + 3) / 4;
    // Rows n..4*nquads-1 have weight 0 (masked above); their codes are read but add nothing.
    alignas(64) __m512i cq[NC][kSpan / 4][4];
    stage_values(bl, nquads, cq);
    for (int c = 0; c < NC; ++c) {
      const int g0 = 16 * c / BG, g1 = BG < 16 ? g0 + 1 : g0;
      for (int h = 0; h < NQ; ++h)
        values_head(cq[c], nquads, wq[h][g0], wq[h][g1], wl[h][g0], wl[h][g1], sw[h][g0], sw[h][g1], st.acc[h] + c * 64);
    }
  }
};

// Software prefetch into L2 of [p, p + bytes).
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const uint8_t*>(p) + o, 0, 2);
}

template <int D, int G, int NQ>
OSCAR_TGT void region_quant(const RegionRows& rr, QuerySet& qs) {
  using K = Kernel<D, G, NQ>;
  const kv::PagedKvView& kv = *rr.kv;
  const int ps = kv.page_size;
  alignas(64) typename K::State st;
  K::prepare(qs, st);
  constexpr int cb = K::CB, ng = K::NG;
  static const int pf = [] {
    const char* e = std::getenv("OSCAR_VNNI_PREFETCH");
    return e ? std::max(1, std::atoi(e)) : kPrefetchPages;
  }();
  SpanBlocks bl;
  int nblk = 0, span_rows = 0;
  for (int i = rr.i0; i < rr.i1;) {
    const int32_t page = rr.r->indices[rr.r->indptr[rr.b] + i / ps];
    const int slot = i % ps;
    const int n = std::min(ps - slot, rr.i1 - i);
    // Software prefetch kPrefetchPages pages ahead (pages are scattered in the
    // pool and each head's rows of a page are short runs in 4 arrays, so the
    // hardware prefetchers do not help); at the item start, all of them.
    for (int ahead = i == rr.i0 ? 1 : pf; ahead <= pf; ++ahead) {
      const int first = i + n + (ahead - 1) * ps;
      if (first >= rr.i1) break;
      const int32_t next = rr.r->indices[rr.r->indptr[rr.b] + first / ps];
      const int nn = std::min(ps, rr.i1 - first);
      const int64_t row = kv.quant_row_index(next, rr.h, 0);
      prefetch_bytes(kv.quant.k_codes + row * cb, int64_t(nn) * cb);
      prefetch_bytes(kv.quant.v_codes + row * cb, int64_t(nn) * cb);
      prefetch_bytes(kv.quant.k_params + row * ng * 2, int64_t(nn) * ng * 4);
      prefetch_bytes(kv.quant.v_params + row * ng * 2, int64_t(nn) * ng * 4);
    }
    const int64_t row = kv.quant_row_index(page, rr.h, slot);
    const float* shift = rr.page_shift(i);  // page centering: this page's shifts, or nullptr
    for (int t0 = 0; t0 < n; t0 += 16) {
      const int64_t r = row + t0;
      bl.shift[nblk] = shift;
      bl.kc[nblk] = kv.quant.k_codes + r * cb;
      bl.vc[nblk] = kv.quant.v_codes + r * cb;
      bl.kp[nblk] = kv.quant.k_params + r * ng * 2;
      bl.vp[nblk] = kv.quant.v_params + r * ng * 2;
      ++nblk;
      span_rows += std::min(16, n - t0);
      // A partial block can only be the item's last (page runs are multiples
      // of 16 rows except at the end of the region): flushed after the loop.
      if (nblk == kSpanBlocks) {
        K::span(bl, span_rows, qs, st);
        nblk = span_rows = 0;
      }
    }
    i += n;
  }
  if (nblk > 0) K::span(bl, span_rows, qs, st);
  K::finish(qs, st);
}

template <int D, int G>
OSCAR_TGT void region_dg(const RegionRows& rr, QuerySet& qs) {
  switch (qs.nq) {
    case 1: return region_quant<D, G, 1>(rr, qs);
    case 2: return region_quant<D, G, 2>(rr, qs);
    case 3: return region_quant<D, G, 3>(rr, qs);
    case 4: return region_quant<D, G, 4>(rr, qs);
    case 5: return region_quant<D, G, 5>(rr, qs);
    case 6: return region_quant<D, G, 6>(rr, qs);
    case 7: return region_quant<D, G, 7>(rr, qs);
    case 8: return region_quant<D, G, 8>(rr, qs);
    default: throw Error("attention: query set of " + std::to_string(qs.nq) + " (1..8)");
  }
}

void region_entry(const RegionRows& rr, QuerySet& qs) {
  const kv::PagedKvView& kv = *rr.kv;
  // Spans start at 16-aligned slots (splits are page-aligned, pages are
  // multiples of 16): reading up to the next multiple of 16 rows stays in the page.
  const bool aligned = rr.i0 % 16 == 0;
  // Per-channel keys (kivi2) take the exact AVX-512 float kernel below.
  if (rr.quantized && kv.bits == 2 && aligned && kv.key_axis == kv::KeyAxis::kToken) {
    const int d = kv.head_dim, G = kv.group_size;
    if (d == 64 && G == 32) return region_dg<64, 32>(rr, qs);
    if (d == 64 && G == 64) return region_dg<64, 64>(rr, qs);
    if (d == 128 && G == 32) return region_dg<128, 32>(rr, qs);
    if (d == 128 && G == 64) return region_dg<128, 64>(rr, qs);
    if (d == 128 && G == 128) return region_dg<128, 128>(rr, qs);
    if (d == 256 && G == 32) return region_dg<256, 32>(rr, qs);
    if (d == 256 && G == 64) return region_dg<256, 64>(rr, qs);
    if (d == 256 && G == 128) return region_dg<256, 128>(rr, qs);
  }
  avx512_kernels()->region(rr, qs);  // BF16 rows, INT4 rows, per-channel keys: the exact float kernel
}

void dense_t_entry(const DenseTRows& dr, int d, QuerySet& qs) { avx512_kernels()->dense_t(dr, d, qs); }

}  // namespace vnni

const RowKernels* avx512_vnni_kernels() {
  static const RowKernels k{"avx512vnni", &vnni::region_entry, &vnni::dense_t_entry, /*exact=*/false,
                            vnni::kQueryRange, vnni::kWeightRange, vnni::kSpan};
  return avx512_kernels() ? &k : nullptr;
}

}  // namespace oscar::kernels::cpu::detail

#else
namespace oscar::kernels::cpu::detail {
const RowKernels* avx512_vnni_kernels() { return nullptr; }
}  // namespace oscar::kernels::cpu::detail
#endif
