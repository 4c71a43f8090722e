// Fast cache-write kernels. Same results as cache_write_ref.cpp: quantized
// rows are bit-exact (same fp32 operations in the same order as
// core/quantizer.cpp, only without the per-element index arithmetic);
// rotation accumulates in fp32 instead of fp64 (tested to a tolerance).
// The hot loops are compiled for AVX-512 / AVX2 / baseline and picked at load
// time (GCC target_clones), since the build targets x86-64-v2 only.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/quantizer.h"
#include "kernels/cpu/cache_write.h"
#include "kernels/cpu/view_check.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OSCAR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define OSCAR_CLONES
#endif

namespace oscar::kernels::cpu {

namespace {

constexpr float kF16Max = 65504.0f;
constexpr float kInputLimit = 1e30f;  // core/quantizer.cpp saturates inputs here

// out[c] = sum_j x[j] * R[j][c], accumulated as axpys of R's rows (unit stride).
OSCAR_CLONES void rotate_one(const float* x /*[d]*/, int d, const float* R /*[d][d]*/,
                             float* acc /*[d]*/) {
  for (int c = 0; c < d; ++c) acc[c] = 0.0f;
  for (int j = 0; j < d; ++j) {
    const float xj = x[j];
    const float* r = R + int64_t(j) * d;
    for (int c = 0; c < d; ++c) acc[c] += xj * r[c];
  }
}

inline float round_f16(float v) { return f16_to_f32(f32_to_f16(std::clamp(v, -kF16Max, kF16Max))); }

// Clip with tau, then quantize and pack one row: the arithmetic of
// clip_row + quantize_row (core/quantizer.cpp) with fixed loop structure.
//   x [d]; codes [d*bits/8]; params [d/G][2] fp16
OSCAR_CLONES void quantize_clipped_row(const float* x, int d, float tau, int bits, int G,
                                       uint8_t* codes, uint16_t* params) {
  float v[256];  // d <= 256 (checked by check_format)
  for (int i = 0; i < d; ++i) {
    float a = x[i];
    a = std::isnan(a) ? 0.0f : std::clamp(a, -tau, tau);               // clip_row
    a = std::isfinite(a) ? std::clamp(a, -kInputLimit, kInputLimit) : 0.0f;  // finite_or_zero
    v[i] = a;
  }
  const int qmax = (1 << bits) - 1;
  const int lanes = 8 / bits;
  const int per_lane = G / lanes;  // bytes per group
  for (int g = 0; g < d / G; ++g) {
    const float* xg = v + g * G;
    float lo = xg[0], hi = xg[0];
    for (int i = 1; i < G; ++i) {
      lo = std::min(lo, xg[i]);
      hi = std::max(hi, xg[i]);
    }
    const float s = round_f16(std::max(hi - lo, kMinRange) / static_cast<float>(qmax));
    const float m = round_f16(lo);
    params[2 * g] = f32_to_f16(s);
    params[2 * g + 1] = f32_to_f16(m);
    uint8_t c8[128];
    for (int i = 0; i < G; ++i) {
      const float t = std::floor((xg[i] - m) / s + 0.5f);
      c8[i] = s > 0.0f ? static_cast<uint8_t>(std::clamp(t, 0.0f, static_cast<float>(qmax))) : 0;
    }
    uint8_t* cg = codes + g * per_lane;
    for (int j = 0; j < per_lane; ++j) {
      unsigned byte = 0;
      for (int q = 0; q < lanes; ++q) byte |= unsigned(c8[q * per_lane + j]) << (bits * q);
      cg[j] = static_cast<uint8_t>(byte);
    }
  }
}

void quantize_into(const kv::PagedKvView& kv, const float* row /*[d]*/, float ratio, bool value,
                   int32_t page, int h, int slot) {
  const int d = kv.head_dim;
  const float tau = clip_threshold(row, d, ratio);
  const int64_t r = kv.quant_row_index(page, h, slot);
  uint8_t* codes = (value ? kv.quant.v_codes : kv.quant.k_codes) + r * kv.row_code_bytes();
  uint16_t* params = (value ? kv.quant.v_params : kv.quant.k_params) + r * kv.row_groups() * 2;
  quantize_clipped_row(row, d, tau, kv.bits, kv.group_size, codes, params);
}

OSCAR_CLONES void bf16_row_to_f32(const uint16_t* src, int d, float* dst) {
  for (int c = 0; c < d; ++c) dst[c] = bf16_to_f32(src[c]);
}

// Per-channel keys of slots [s0, s0 + kKeySpan) of one head (kChannel): the
// reference's quantize_key_span with quantize_clipped_row at tau = +inf (no
// clip; NaN -> 0 and +-inf -> 0 as in quantize_row), codes scattered into
// the rows' packed bytes.
void quantize_key_span(const kv::PagedKvView& kv, const uint16_t* bf16_rows /*[kKeySpan][d]*/,
                       int32_t page, int h, int s0) {
  constexpr int n = kv::kKeySpan;
  const int d = kv.head_dim, bits = kv.bits, G = kv.group_size, cb = kv.row_code_bytes();
  const int lanes = 8 / bits, per_lane = n / lanes, mask = (1 << bits) - 1;
  uint16_t* params = kv.quant.k_params + kv.key_span_params_offset(page, h, s0);
  uint8_t* codes0 = kv.quant.k_codes + kv.quant_row_index(page, h, s0) * cb;
  std::memset(codes0, 0, size_t(n) * cb);
  float col[n];
  uint8_t cc[n];  // packed codes of the column (n * bits / 8 <= n bytes)
  for (int c = 0; c < d; ++c) {
    for (int i = 0; i < n; ++i) col[i] = bf16_to_f32(bf16_rows[int64_t(i) * d + c]);
    quantize_clipped_row(col, n, std::numeric_limits<float>::infinity(), bits, n, cc, params + 2 * c);
    const int byte = code_byte(c, G, bits), shift = code_shift(c, G, bits);
    for (int i = 0; i < n; ++i)
      codes0[int64_t(i) * cb + byte] |= static_cast<uint8_t>(((cc[i % per_lane] >> (bits * (i / per_lane))) & mask) << shift);
  }
}

}  // namespace

void rotate_rows(const float* x, int64_t n, int d, const float* R, float* out) {
  if (n < 0 || d <= 0) throw Error("rotate_rows: bad shape n=" + std::to_string(n) + " d=" + std::to_string(d));
  if (n == 0) return;
  if (!x || !R || !out) throw Error("rotate_rows: null pointer");
  std::vector<float> acc(d);
  for (int64_t i = 0; i < n; ++i) {
    rotate_one(x + i * d, d, R, acc.data());
    std::memcpy(out + i * d, acc.data(), sizeof(float) * d);  // x == out allowed
  }
}

void rotate_heads(const float* x, int64_t n, int num_heads, int d, const float* R, int r_heads,
                  float* out) {
  if (num_heads <= 0 || (r_heads != 1 && r_heads != num_heads))
    throw Error("rotate_heads: r_heads " + std::to_string(r_heads) + " must be 1 or num_heads " +
                std::to_string(num_heads));
  if (n < 0 || d <= 0) throw Error("rotate_heads: bad shape");
  if (n == 0) return;
  if (!x || !R || !out) throw Error("rotate_heads: null pointer");
  std::vector<float> acc(d);
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < num_heads; ++h) {
      const int64_t off = (t * num_heads + h) * d;
      rotate_one(x + off, d, R + (r_heads == 1 ? 0 : int64_t(h) * d * d), acc.data());
      std::memcpy(out + off, acc.data(), sizeof(float) * d);
    }
}

void write_quant_tokens(const kv::PagedKvView& kv, int n, const int32_t* pages,
                        const int32_t* slots, const float* k, const float* v, ClipRatios clip) {
  detail::check_format(kv, "write_quant_tokens");
  detail::check_slots(kv, n, pages, slots, "write_quant_tokens");
  if (n == 0) return;
  detail::check_quant_pool(kv, "write_quant_tokens");
  if (kv.key_axis == kv::KeyAxis::kChannel)
    throw Error("write_quant_tokens: per-channel keys are quantized a page at a time (demote_page)");
  if (!k || !v) throw Error("write_quant_tokens: null k/v rows");
  const int d = kv.head_dim;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < kv.num_kv_heads; ++h) {
      const int64_t src = (int64_t(t) * kv.num_kv_heads + h) * d;
      quantize_into(kv, k + src, clip.k, false, pages[t], h, slots[t]);
      quantize_into(kv, v + src, clip.v, true, pages[t], h, slots[t]);
    }
}

void demote_page(const kv::PagedKvView& kv, int32_t bf16_page, int32_t quant_page, ClipRatios clip,
                 int num_tokens, const float* key_offset) {
  num_tokens = detail::check_demote(kv, bf16_page, quant_page, clip.k, num_tokens, "demote_page");
  const bool kchan = kv.key_axis == kv::KeyAxis::kChannel;
  if (kchan && key_offset) throw Error("demote_page: page centering needs per-token keys");
  const int d = kv.head_dim;
  float row[256];
  if (kchan)
    for (int h = 0; h < kv.num_kv_heads; ++h)
      for (int s0 = 0; s0 < num_tokens; s0 += kv::kKeySpan)
        quantize_key_span(kv, kv.bf16.k + kv.bf16_row_offset(bf16_page, h, s0), quant_page, h, s0);
  for (int h = 0; h < kv.num_kv_heads; ++h)
    for (int s = 0; s < num_tokens; ++s)
      for (int value = kchan ? 1 : 0; value < 2; ++value) {
        const uint16_t* src = (value ? kv.bf16.v : kv.bf16.k) + kv.bf16_row_offset(bf16_page, h, s);
        bf16_row_to_f32(src, d, row);
        if (!value && key_offset)
          for (int c = 0; c < d; ++c) row[c] -= key_offset[int64_t(h) * d + c];
        quantize_into(kv, row, value ? clip.v : clip.k, value, quant_page, h, s);
      }
}

}  // namespace oscar::kernels::cpu
