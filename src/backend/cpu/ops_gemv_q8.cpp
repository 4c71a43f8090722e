#include "backend/cpu/ops_gemv_q8.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "backend/cpu/ops_threads.h"

// GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized inside its own
// _mm512_undefined_* helpers (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace oscar::backend::cpu {

namespace {

bool detect() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
}
const bool g_q8 = detect();

#define Q8_TARGET __attribute__((target("avx512f,avx512bw,fma")))

Q8_TARGET inline __m512 load_q16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// R weight rows x NT token rows; each 32-channel block: 2 loads + 2 FMAs per
// (row, token) into a block partial, then one FMA by the block scale.
template <int R, int NT>
Q8_TARGET void tile_q8(const int8_t* q, const float* sc, int64_t in, const float* x, float* out) {
  __m512 acc[R][NT];
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) acc[i][t] = _mm512_setzero_ps();
  const int64_t nb = in / kQ8Block;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t c = b * kQ8Block;
    __m512 x0[NT], x1[NT];
    for (int t = 0; t < NT; ++t) {
      x0[t] = _mm512_loadu_ps(x + t * in + c);
      x1[t] = _mm512_loadu_ps(x + t * in + c + 16);
    }
    for (int i = 0; i < R; ++i) {
      const __m512 w0 = load_q16(q + i * in + c), w1 = load_q16(q + i * in + c + 16);
      const __m512 s = _mm512_set1_ps(sc[i * nb + b]);
      for (int t = 0; t < NT; ++t) {
        const __m512 p = _mm512_fmadd_ps(w1, x1[t], _mm512_mul_ps(w0, x0[t]));
        acc[i][t] = _mm512_fmadd_ps(p, s, acc[i][t]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) out[i * NT + t] = _mm512_reduce_add_ps(acc[i][t]);
}

// Rows [r0, r1) for all n tokens. Few tokens: one row at a time, token blocks
// of 4 (decode, memory-bound). Many: 4x4 tiles over 64-token chunks (prefill).
Q8_TARGET void rows_q8(const int8_t* q, const float* sc, int64_t out, int64_t in,
                       const float* bias, const float* x, int n, float* y, int64_t r0, int64_t r1) {
  const int64_t nb = in / kQ8Block;
  float s[16];
  auto put = [&](int64_t r, int t, float v) { y[int64_t(t) * out + r] = v + (bias ? bias[r] : 0.f); };
  auto one_row = [&](int64_t r, int t0, int te) {
    const int8_t* qr = q + r * in;
    const float* sr = sc + r * nb;
    for (int t = t0; t < te; t += 4) {
      const float* xt = x + int64_t(t) * in;
      switch (std::min(4, te - t)) {
        case 1: tile_q8<1, 1>(qr, sr, in, xt, s); break;
        case 2: tile_q8<1, 2>(qr, sr, in, xt, s); break;
        case 3: tile_q8<1, 3>(qr, sr, in, xt, s); break;
        default: tile_q8<1, 4>(qr, sr, in, xt, s); break;
      }
      for (int j = 0; j < std::min(4, te - t); ++j) put(r, t + j, s[j]);
    }
  };
  if (n < 16) {
    // Four rows at once: four independent FMA chains hide the FMA latency
    // that a single row's dependent chain would expose.
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4)
      for (int t = 0; t < n; t += 4) {
        const float* xt = x + int64_t(t) * in;
        const int nt = std::min(4, n - t);
        switch (nt) {
          case 1: tile_q8<4, 1>(q + r * in, sc + r * nb, in, xt, s); break;
          case 2: tile_q8<4, 2>(q + r * in, sc + r * nb, in, xt, s); break;
          case 3: tile_q8<4, 3>(q + r * in, sc + r * nb, in, xt, s); break;
          default: tile_q8<4, 4>(q + r * in, sc + r * nb, in, xt, s); break;
        }
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < nt; ++j) put(r + i, t + j, s[i * nt + j]);
      }
    for (; r < r1; ++r) one_row(r, 0, n);
    return;
  }
  constexpr int kChunk = 64;
  for (int tc = 0; tc < n; tc += kChunk) {
    const int te = std::min(n, tc + kChunk);
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
      int t = tc;
      for (; t + 4 <= te; t += 4) {
        tile_q8<4, 4>(q + r * in, sc + r * nb, in, x + int64_t(t) * in, s);
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < 4; ++j) put(r + i, t + j, s[i * 4 + j]);
      }
      for (; t < te; ++t) {
        tile_q8<4, 1>(q + r * in, sc + r * nb, in, x + int64_t(t) * in, s);
        for (int i = 0; i < 4; ++i) put(r + i, t, s[i]);
      }
    }
    for (; r < r1; ++r) one_row(r, tc, te);
  }
}

}  // namespace

bool q8_supported() { return g_q8; }

void quantize_q8(const float* w, int64_t out, int64_t in, int8_t* q, float* scale) {
  const int64_t nb = in / kQ8Block;
  for (int64_t r = 0; r < out; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = w + r * in + b * kQ8Block;
      float amax = 0.f;
      for (int i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::abs(src[i]));
      const float s = amax / 127.f;
      scale[r * nb + b] = s;
      const float inv = s > 0 ? 1.f / s : 0.f;
      for (int i = 0; i < kQ8Block; ++i)
        q[r * in + b * kQ8Block + i] =
            static_cast<int8_t>(std::clamp(std::nearbyint(src[i] * inv), -127.f, 127.f));
    }
}

void linear_q8(const int8_t* q, const float* scale, int64_t out, int64_t in, const float* bias,
               const float* x, int n, float* y) {
  if (!g_q8) return linear_q8_ref(q, scale, out, in, bias, x, n, y);
  parallel_for(out, 16, [&](int64_t r0, int64_t r1) { rows_q8(q, scale, out, in, bias, x, n, y, r0, r1); });
}

void linear_q8_ref(const int8_t* q, const float* scale, int64_t out, int64_t in,
                   const float* bias, const float* x, int n, float* y) {
  const int64_t nb = in / kQ8Block;
  for (int t = 0; t < n; ++t)
    for (int64_t r = 0; r < out; ++r) {
      double acc = 0;
      for (int64_t c = 0; c < in; ++c)
        acc += double(q[r * in + c]) * scale[r * nb + c / kQ8Block] * x[int64_t(t) * in + c];
      y[int64_t(t) * out + r] = static_cast<float>(acc) + (bias ? bias[r] : 0.f);
    }
}

}  // namespace oscar::backend::cpu
