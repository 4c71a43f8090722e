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
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/view_check.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define OSCAR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define OSCAR_CLONES
#endif

namespace oscar::kernels::cpu {

namespace {

// The k-th largest of each of R rows of keys ([R][256], non-negative float bit patterns), by a
// binary search over the bits: a non-negative float orders as its bits do as a uint32, so the
// largest t with at least k keys >= t, built bit by bit from the top, is the k-th largest key.
// Each of the 31 passes depends on the last (a compare, a count, a branch: latency-bound), so
// R rows go together and their chains overlap; D fixed keeps a row's keys in registers.
template <int D, int R>
inline void kth_largest(const uint32_t (*key)[256], int d, int k, uint32_t* t) {
  const int n_keys = D > 0 ? D : d;
  for (int r = 0; r < R; ++r) t[r] = 0;
  for (int bit = 30; bit >= 0; --bit) {  // keys < 2^31
    for (int r = 0; r < R; ++r) {
      const uint32_t c = t[r] | (1u << bit);
      int n = 0;
      for (int i = 0; i < n_keys; ++i) n += key[r][i] >= c ? 1 : 0;
      if (n >= k) t[r] = c;
    }
  }
}

template <int R>
inline void kth_largest_any(const uint32_t (*key)[256], int d, int k, uint32_t* t) {
  if (d == 64) return kth_largest<64, R>(key, d, k, t);
  if (d == 128) return kth_largest<128, R>(key, d, k, t);
  if (d == 32) return kth_largest<32, R>(key, d, k, t);
  if (d == 256) return kth_largest<256, R>(key, d, k, t);
  kth_largest<0, R>(key, d, k, t);
}

}  // namespace

// clip_threshold of n rows (rows [n][ld]) at one ratio: 4 rows at a time. 31 vectorized
// counting passes instead of nth_element's data-dependent partitioning (63 % of a demotion's
// time at Qwen3-8B shapes, 57 % at SmolLM2's in a perf profile, before).
OSCAR_CLONES void clip_thresholds_select(const float* rows, int64_t ld, int n, int d, float ratio, float* tau) {
  if (d <= 0 || d > 256) throw Error("clip_threshold_select: row length " + std::to_string(d) + " outside [1, 256]");
  const int k = d - clip_index(d, ratio);
  alignas(64) uint32_t key[4][256];
  for (int r0 = 0; r0 < n; r0 += 4) {
    const int m = std::min(4, n - r0);
    for (int r = 0; r < m; ++r)
      for (int i = 0; i < d; ++i) {
        uint32_t b;
        std::memcpy(&b, rows + (r0 + r) * ld + i, sizeof b);
        b &= 0x7fffffffu;                               // |x|
        key[r][i] = b > 0x7f800000u ? 0x7f800000u : b;  // NaN -> +inf (core's abs_key)
      }
    uint32_t t[4] = {0, 0, 0, 0};
    if (k == 1) {
      for (int r = 0; r < m; ++r)
        for (int i = 0; i < d; ++i) t[r] = std::max(t[r], key[r][i]);
    } else if (m == 4) {
      kth_largest_any<4>(key, d, k, t);
    } else {
      for (int r = 0; r < m; ++r) kth_largest_any<1>(key + r, d, k, t + r);
    }
    for (int r = 0; r < m; ++r) std::memcpy(tau + r0 + r, t + r, sizeof(float));
  }
}

float clip_threshold_select(const float* x, int d, float ratio) {
  float tau = 0.0f;
  clip_thresholds_select(x, d, 1, d, ratio, &tau);
  return tau;
}

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
// clip_row + quantize_row (core/quantizer.cpp) with fixed loop structure, written so that the
// compiler vectorizes every loop (the group's min / max over 16 lanes, the codes through an
// int32 staging row) with the same fp32 operations per element.
//   x [d]; codes [d*bits/8]; params [d/G][2] fp16
OSCAR_CLONES void quantize_clipped_row(const float* x, int d, float tau, int bits, int G,
                                       uint8_t* codes, uint16_t* params) {
  alignas(64) float v[256];  // d <= 256 (checked by check_format)
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
    // min / max (the values are finite, so their order does not change them) in 16 lanes.
    // Only a zero minimum's sign depends on the order (it reaches m's fp16 bits): core's
    // quantize_row keeps four chains (element i in chain i % 4, each keeping its first zero)
    // and combines them in chain order, so m is the first zero of the lowest chain that has one.
    // (GCC vector types: lowered to whatever the clone's ISA has; G is a multiple of 16.)
    typedef float f32x16 __attribute__((vector_size(64)));
    f32x16 mn, mx;
    std::memcpy(&mn, xg, sizeof mn);
    mx = mn;
    for (int i = 16; i < G; i += 16) {
      f32x16 x;
      std::memcpy(&x, xg + i, sizeof x);
      mn = x < mn ? x : mn;
      mx = x > mx ? x : mx;
    }
    float lo = mn[0], hi = mx[0];
    for (int j = 1; j < 16; ++j) {
      lo = mn[j] < lo ? mn[j] : lo;
      hi = mx[j] > hi ? mx[j] : hi;
    }
    if (lo == 0.0f) {
      bool found = false;
      for (int a = 0; a < 4 && !found; ++a)
        for (int i = a; i < G; i += 4)
          if (xg[i] == 0.0f) {
            lo = xg[i];
            found = true;
            break;
          }
    }
    const float s = round_f16(std::max(hi - lo, kMinRange) / static_cast<float>(qmax));
    const float m = round_f16(lo);
    params[2 * g] = f32_to_f16(s);
    params[2 * g + 1] = f32_to_f16(m);
    alignas(64) int32_t c32[128];
    if (s > 0.0f) {
      // clamp(floor(y), 0, qmax) of the reference is floor(clamp(y, 0, qmax)) (floor is monotone
      // and 0, qmax are integers), and on [0, qmax] floor is the truncating conversion: the
      // same codes without a rounding call (which the compiler does not vectorize).
      const float top = static_cast<float>(qmax);
      for (int i = 0; i < G; ++i)
        c32[i] = static_cast<int32_t>(std::min(std::max((xg[i] - m) / s + 0.5f, 0.0f), top));
    } else {
      for (int i = 0; i < G; ++i) c32[i] = 0;
    }
    uint8_t* cg = codes + g * per_lane;
    for (int j = 0; j < per_lane; ++j) {
      unsigned byte = 0;
      for (int q = 0; q < lanes; ++q) byte |= unsigned(c32[q * per_lane + j]) << (bits * q);
      cg[j] = static_cast<uint8_t>(byte);
    }
  }
}

// One row, clipped at tau, into its quantized slot.
void quantize_at(const kv::PagedKvView& kv, const float* row /*[d]*/, float tau, bool value, int32_t page, int h,
                 int slot) {
  const int d = kv.head_dim;
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
  const int d = kv.head_dim, H = kv.num_kv_heads;
  float tk[256], tv[256];  // thresholds of one token's heads, up to 256 at a time
  for (int t = 0; t < n; ++t) {
    for (int h0 = 0; h0 < H; h0 += 256) {
      const int m = std::min(256, H - h0);
      const int64_t src = (int64_t(t) * H + h0) * d;
      clip_thresholds_select(k + src, d, m, d, clip.k, tk);
      clip_thresholds_select(v + src, d, m, d, clip.v, tv);
      for (int h = 0; h < m; ++h) {
        quantize_at(kv, k + src + int64_t(h) * d, tk[h], false, pages[t], h0 + h, slots[t]);
        quantize_at(kv, v + src + int64_t(h) * d, tv[h], true, pages[t], h0 + h, slots[t]);
      }
    }
  }
}

void demote_page(const kv::PagedKvView& kv, int32_t bf16_page, int32_t quant_page, ClipRatios clip,
                 int num_tokens, const float* key_offset, const ClipRatios* head_clips) {
  num_tokens = detail::check_demote(kv, bf16_page, quant_page, detail::min_key_clip(kv, clip, head_clips), num_tokens,
                                    "demote_page");
  const bool kchan = kv.key_axis == kv::KeyAxis::kChannel;
  if (kchan && key_offset) throw Error("demote_page: page centering needs per-token keys");
  const int d = kv.head_dim;
  if (kchan)
    for (int h = 0; h < kv.num_kv_heads; ++h)
      for (int s0 = 0; s0 < num_tokens; s0 += kv::kKeySpan)
        quantize_key_span(kv, kv.bf16.k + kv.bf16_row_offset(bf16_page, h, s0), quant_page, h, s0);
  // The rows on the kernels' pool, in tasks of 16 slots of one head (each row is written by
  // one task: the same bytes as the serial order); a task's K rows, then its V rows, get their
  // clip thresholds together.
  constexpr int kSlots = 16;
  const int per_head = (num_tokens + kSlots - 1) / kSlots;
  parallel_for(int64_t(kv.num_kv_heads) * per_head, [&](int64_t task) {
    const int h = static_cast<int>(task / per_head), s0 = static_cast<int>(task % per_head) * kSlots;
    const int m = std::min(num_tokens, s0 + kSlots) - s0;
    const ClipRatios& c = head_clips ? head_clips[h] : clip;
    alignas(64) float rows[kSlots][256];
    float tau[kSlots];
    for (int value = kchan ? 1 : 0; value < 2; ++value) {
      for (int j = 0; j < m; ++j) {
        const uint16_t* src = (value ? kv.bf16.v : kv.bf16.k) + kv.bf16_row_offset(bf16_page, h, s0 + j);
        bf16_row_to_f32(src, d, rows[j]);
        if (!value && key_offset)
          for (int i = 0; i < d; ++i) rows[j][i] -= key_offset[int64_t(h) * d + i];
      }
      clip_thresholds_select(&rows[0][0], 256, m, d, value ? c.v : c.k, tau);
      for (int j = 0; j < m; ++j) quantize_at(kv, rows[j], tau[j], value, quant_page, h, s0 + j);
    }
  });
}

}  // namespace oscar::kernels::cpu
