#include "backend/cpu/ops_amx.h"

#include <cpuid.h>
#include <immintrin.h>

// GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized inside its own
// _mm512_undefined_* helpers (GCC bug 105593); the warning is about the header.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include "backend/cpu/ops_threads.h"
#include "core/half.h"

namespace oscar::backend::cpu {

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature's state
constexpr long kXfeatureXtiledata = 18;     // the AMX tile data

bool detect_amx() {
  if (const char* e = std::getenv("OSCAR_CPU_AMX"); e && std::strcmp(e, "0") == 0) return false;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 30));  // avx512f, avx512bw
  if (!amx_bf16 || !amx_tile || !avx512) return false;
  // Linux hands the tile state (8 KiB of XSAVE area per thread) only on request.
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The tile configuration: every tile 16 rows of 64 bytes (C: 16 × 16 fp32; A: 16 weight rows ×
// 32 BF16; B: 16 input pairs × 16 tokens × 2 BF16).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Output blocks of 16 [ob0, ob1), two at a time, for every 32 tokens. Tiles: 0-3 results
// (output block i × token block j at 2i + j), 4-5 weights, 6-7 activations.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void amx_blocks(
    const uint16_t* w, int64_t out, int64_t in, const float* bias, const uint16_t* xp, int n, int n_pad, float* y,
    int64_t ob0, int64_t ob1) {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[4][256];
  const int64_t wstride = in * 2, xstride = int64_t(n_pad) * 4;
  const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(16));
  for (int64_t ob = ob0; ob < ob1; ob += 2) {
    const bool two_o = ob + 1 < ob1;
    const uint16_t* w0 = w + ob * 16 * in;
    const uint16_t* w1 = w0 + 16 * in;
    for (int t0 = 0; t0 < n_pad; t0 += 32) {
      const bool two_t = t0 + 16 < n_pad;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < in; k += 32) {
        const uint16_t* xb = xp + ((k / 2) * n_pad + t0) * 2;
        _tile_loadd(4, w0 + k, wstride);
        _tile_loadd(6, xb, xstride);
        _tile_dpbf16ps(0, 4, 6);
        if (two_t) {
          _tile_loadd(7, xb + 32, xstride);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_o) {
          _tile_loadd(5, w1 + k, wstride);
          _tile_dpbf16ps(2, 5, 6);
          if (two_t) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c[0], 64);
      if (two_t) _tile_stored(1, c[1], 64);
      if (two_o) {
        _tile_stored(2, c[2], 64);
        if (two_t) _tile_stored(3, c[3], 64);
      }
      // c[i][o·16 + t]: output o of block ob + i/2, token t0 + 16·(i%2) + t. Token t's 16 outputs
      // are a column of the tile: gathered, biased, stored as one row of y.
      for (int i = 0; i < (two_o ? 4 : 2); ++i) {
        if (i % 2 == 1 && !two_t) continue;
        const int64_t o0 = (ob + i / 2) * 16;
        const __m512 bv = bias ? _mm512_loadu_ps(bias + o0) : _mm512_setzero_ps();
        const int tb = t0 + 16 * (i % 2);
        for (int t = 0; t < 16 && tb + t < n; ++t) {
          const __m512 v = _mm512_i32gather_ps(col, c[i] + t, 4);
          _mm512_storeu_ps(y + int64_t(tb + t) * out + o0, _mm512_add_ps(v, bv));
        }
      }
    }
  }
  _tile_release();
}

}  // namespace

void pack_activations_bf16(const float* x, int n, int64_t in, uint16_t* xp) {
  // Pair rows in parallel, tokens along each row: the writes are sequential. (Scattering a token's
  // 16 pairs per 32 inputs with AVX-512 measured 1.3-1.5x slower per call on this machine.)
  const int n_pad = (n + 15) / 16 * 16;
  parallel_for(in / 2, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      uint16_t* row = xp + size_t(p) * size_t(n_pad) * 2;
      for (int t = 0; t < n; ++t) {
        row[2 * t] = f32_to_bf16(x[int64_t(t) * in + 2 * p]);
        row[2 * t + 1] = f32_to_bf16(x[int64_t(t) * in + 2 * p + 1]);
      }
      std::memset(row + 2 * n, 0, size_t(n_pad - n) * 4);  // the padding tokens
    }
  });
}

bool amx_available() {
  static const bool ok = detect_amx();
  return ok;
}

void linear_bf16_amx(const uint16_t* w, int64_t out, int64_t in, const float* bias, const float* x, int n,
                     float* y) {
  if (n <= 0) return;
  // Activations: BF16 pairs, [in / 2][n_pad][2], tokens padded to 16 with zeros.
  const int n_pad = (n + 15) / 16 * 16;
  thread_local std::vector<uint16_t> xp;
  xp.resize(size_t(in) * size_t(n_pad));  // every element written by the packing
  uint16_t* xpp = xp.data();
  pack_activations_bf16(x, n, in, xpp);
  parallel_for(out / 16, 2, [&](int64_t b0, int64_t b1) { amx_blocks(w, out, in, bias, xpp, n, n_pad, y, b0, b1); });
}

void linear_bf16_amx_ref(const uint16_t* w, int64_t out, int64_t in, const float* bias, const float* x, int n,
                         float* y) {
  for (int64_t r = 0; r < out; ++r)
    for (int t = 0; t < n; ++t) {
      float s = 0.f;
      for (int64_t k = 0; k < in; ++k) s += bf16_to_f32(w[r * in + k]) * bf16_to_f32(f32_to_bf16(x[int64_t(t) * in + k]));
      y[int64_t(t) * out + r] = s + (bias ? bias[r] : 0.f);
    }
}

}  // namespace oscar::backend::cpu
