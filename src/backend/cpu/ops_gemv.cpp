#include "backend/cpu/ops_gemv.h"

#include <immintrin.h>

// GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized inside its own
// _mm512_undefined_* helpers (GCC bug 105593); the warning is about the header.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cpu/ops_amx.h"
#include "backend/cpu/ops_gemm.h"
#include "backend/cpu/ops_threads.h"
#include "core/half.h"

namespace oscar::backend::cpu {

namespace {

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
  return Isa::kScalar;
}
const Isa g_isa = detect_isa();

inline float load_w(const float* w, int64_t i) { return w[i]; }
inline float load_w(const uint16_t* w, int64_t i) { return bf16_to_f32(w[i]); }

// Scalar: rows [r0, r1) for all tokens. Accumulates in fp32 like the SIMD paths.
template <typename W>
void rows_scalar(const W* w, int64_t out, int64_t in, const float* bias, const float* x, int n,
                 float* y, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const W* wr = w + r * in;
    for (int t = 0; t < n; ++t) {
      const float* xt = x + int64_t(t) * in;
      float s = 0.f;
      for (int64_t c = 0; c < in; ++c) s += load_w(wr, c) * xt[c];
      y[int64_t(t) * out + r] = s + (bias ? bias[r] : 0.f);
    }
  }
}

// --- AVX-512: 16 channels per step; NT token rows share each weight load.
__attribute__((target("avx512f,avx512bw,fma"))) inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
__attribute__((target("avx512f,avx512bw,fma"))) inline __m512 load16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

template <int NT, typename W>
__attribute__((target("avx512f,avx512bw,fma"))) void row_avx512(const W* wr, int64_t in,
                                                                 const float* x, float* s) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= in; c += 16) {
    const __m512 wv = load16(wr + c);
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + t * in + c), acc[t]);
  }
  for (int t = 0; t < NT; ++t) {
    float v = _mm512_reduce_add_ps(acc[t]);
    for (int64_t cc = c; cc < in; ++cc) v += load_w(wr, cc) * x[t * in + cc];
    s[t] = v;
  }
}

template <typename W>
__attribute__((target("avx512f,avx512bw,fma"))) void rows_avx512(const W* w, int64_t out,
                                                                  int64_t in, const float* bias,
                                                                  const float* x, int n, float* y,
                                                                  int64_t r0, int64_t r1) {
  float s[4];
  for (int64_t r = r0; r < r1; ++r) {
    const W* wr = w + r * in;
    const float b = bias ? bias[r] : 0.f;
    for (int t0 = 0; t0 < n; t0 += 4) {
      const int nt = std::min(4, n - t0);
      const float* xt = x + int64_t(t0) * in;
      switch (nt) {
        case 1: row_avx512<1>(wr, in, xt, s); break;
        case 2: row_avx512<2>(wr, in, xt, s); break;
        case 3: row_avx512<3>(wr, in, xt, s); break;
        default: row_avx512<4>(wr, in, xt, s); break;
      }
      for (int t = 0; t < nt; ++t) y[int64_t(t0 + t) * out + r] = s[t] + b;
    }
  }
}

// Register tile of R weight rows x NT token rows for the decode GEMV.
template <int R, int NT, typename W>
__attribute__((target("avx512f,avx512bw,fma"))) void tile_avx512(const W* w, int64_t in,
                                                                  const float* x, float* s) {
  __m512 acc[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= in; c += 16) {
    __m512 xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_loadu_ps(x + t * in + c);
    for (int i = 0; i < R; ++i) {
      const __m512 wv = load16(w + i * in + c);
      for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_fmadd_ps(wv, xv[t], acc[i][t]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) {
      float v = _mm512_reduce_add_ps(acc[i][t]);
      for (int64_t cc = c; cc < in; ++cc) v += load_w(w + i * in, cc) * x[t * in + cc];
      s[i * NT + t] = v;
    }
}

// --- AVX2: 8 channels per step.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <int NT, typename W>
__attribute__((target("avx2,fma"))) void row_avx2(const W* wr, int64_t in, const float* x, float* s) {
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= in; c += 8) {
    const __m256 wv = load8(wr + c);
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * in + c), acc[t]);
  }
  for (int t = 0; t < NT; ++t) {
    float v = hsum8(acc[t]);
    for (int64_t cc = c; cc < in; ++cc) v += load_w(wr, cc) * x[t * in + cc];
    s[t] = v;
  }
}

template <typename W>
__attribute__((target("avx2,fma"))) void rows_avx2(const W* w, int64_t out, int64_t in,
                                                   const float* bias, const float* x, int n,
                                                   float* y, int64_t r0, int64_t r1) {
  float s[4];
  for (int64_t r = r0; r < r1; ++r) {
    const W* wr = w + r * in;
    const float b = bias ? bias[r] : 0.f;
    for (int t0 = 0; t0 < n; t0 += 4) {
      const int nt = std::min(4, n - t0);
      const float* xt = x + int64_t(t0) * in;
      switch (nt) {
        case 1: row_avx2<1>(wr, in, xt, s); break;
        case 2: row_avx2<2>(wr, in, xt, s); break;
        case 3: row_avx2<3>(wr, in, xt, s); break;
        default: row_avx2<4>(wr, in, xt, s); break;
      }
      for (int t = 0; t < nt; ++t) y[int64_t(t0 + t) * out + r] = s[t] + b;
    }
  }
}

// Decode GEMV on AVX-512: 4 rows at once (independent FMA chains), token
// blocks of up to 4 sharing each weight load.
template <typename W>
__attribute__((target("avx512f,avx512bw,fma"))) void gemv4_avx512(const W* w, int64_t out,
                                                                   int64_t in, const float* bias,
                                                                   const float* x, int n, float* y,
                                                                   int64_t r0, int64_t r1) {
  float s[16];
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4)
    for (int t = 0; t < n; t += 4) {
      const float* xt = x + int64_t(t) * in;
      const int nt = std::min(4, n - t);
      switch (nt) {
        case 1: tile_avx512<4, 1>(w + r * in, in, xt, s); break;
        case 2: tile_avx512<4, 2>(w + r * in, in, xt, s); break;
        case 3: tile_avx512<4, 3>(w + r * in, in, xt, s); break;
        default: tile_avx512<4, 4>(w + r * in, in, xt, s); break;
      }
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < nt; ++j)
          y[int64_t(t + j) * out + r + i] = s[i * nt + j] + (bias ? bias[r + i] : 0.f);
    }
  if (r < r1) rows_avx512(w, out, in, bias, x, n, y, r, r1);
}

template <typename W>
void gemv(const W* w, int64_t out, int64_t in, const float* bias, const float* x, int n, float* y) {
  // Rows per task: enough work to amortize the hand-off, small enough to balance.
  const int64_t grain = 16;
  parallel_for(out, grain, [&](int64_t r0, int64_t r1) {
    switch (g_isa) {
      case Isa::kAvx512: gemv4_avx512(w, out, in, bias, x, n, y, r0, r1); break;
      case Isa::kAvx2: rows_avx2(w, out, in, bias, x, n, y, r0, r1); break;
      default: rows_scalar(w, out, in, bias, x, n, y, r0, r1); break;
    }
  });
}

}  // namespace

const char* gemv_isa() {
  switch (g_isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

void linear_f32(const float* w, int64_t out, int64_t in, const float* bias, const float* x, int n,
                float* y) {
  if (n < kGemmMinRows) return gemv(w, out, in, bias, x, n, y);
  gemm_f32(n, out, in, x, in, w, in, /*b_nk=*/true, y, out, 1.0f, bias);
}

int amx_min_rows() {
  static const int rows = [] {
    const char* e = std::getenv("OSCAR_CPU_AMX_MIN_ROWS");
    const int v = e ? std::atoi(e) : 0;
    return v > 0 ? v : kGemmMinRows;
  }();
  return rows;
}

void linear_bf16(const uint16_t* w, int64_t out, int64_t in, const float* bias, const float* x,
                 int n, float* y) {
  if (n >= amx_min_rows() && amx_shape_ok(out, in) && amx_available())
    return linear_bf16_amx(w, out, in, bias, x, n, y);
  if (n < kGemmMinRows) return gemv(w, out, in, bias, x, n, y);
  gemm_bf16w(n, out, in, x, in, w, in, y, out, bias);
}

void linear_f32_ref(const float* w, int64_t out, int64_t in, const float* bias, const float* x,
                    int n, float* y) {
  rows_scalar(w, out, in, bias, x, n, y, 0, out);
}
void linear_bf16_ref(const uint16_t* w, int64_t out, int64_t in, const float* bias,
                     const float* x, int n, float* y) {
  rows_scalar(w, out, in, bias, x, n, y, 0, out);
}

}  // namespace oscar::backend::cpu
