// The reference quantizer: per-row percentile clipping (DESIGN §3.3) and the
// per-group asymmetric B-bit quantizer (§3.4) in the packed row format of
// core/quant_format.h. This file is the specification every CPU/SIMD/CUDA
// kernel is tested against; it favours clarity over speed.
//
// Non-finite input (documented, tested; never UB):
//  * clip_threshold orders |x| with NaN counted as +inf, so it never returns
//    NaN: the result is in [0, +inf]. A row with fewer than d - floor(c*d) + 1
//    non-finite values gets a finite threshold.
//  * clip_row writes 0 for NaN and clamps +-inf to +-tau like any other value
//    (so +-inf stays +-inf only when tau itself is +inf).
//  * quantize_row treats every non-finite element as 0.0f: it takes part in
//    the group min/max as 0 and is coded like 0.
//    Finite inputs saturate at +-1e30 (keeps fp32 range arithmetic finite).
//    Values beyond the params' storage range saturate: with kF16 params the
//    min is clamped to [-65504, 65504] and the scale to <= 65504, so the
//    stored params are always finite and dequantize_row never yields NaN/inf.
//    (Codes are computed against the saturated params, as for any rounding.)
//
// Arithmetic (kernels must match it to be bit-exact; a kernel that uses a
// reciprocal multiply instead of the division may differ by one code at
// exact .5 ties, which kernel tests should allow and count):
//   lo = min(x_g), hi = max(x_g)            fp32
//   s  = max(hi - lo, kMinRange) / qmax     fp32, then rounded to storage (RNE)
//   m  = lo                                 rounded to storage (RNE)
//   code = clamp(floor((x - m) / s + 0.5f), 0, qmax)   fp32; s == 0 -> code 0
//   x_hat = m + float(code) * s             fp32 (no FMA contraction assumed)
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/quant_format.h"

namespace oscar {

// Element floor(ratio*d) (0-based, clamped to [0,d-1]) of |x| sorted
// ascending; ratio >= 1 gives max|x|. DESIGN §3.3: d=128 -> index 122 for
// c=0.96, 117 for c=0.92, as in the reference implementation (int(c*d)).
// NOTE: DESIGN's formula text says "floor(c*d)-1", which contradicts its own
// worked numbers and the reference; we follow the numbers.   x: [d]
float clip_threshold(const float* x, int d, float ratio);

// Clamps x (in place) to [-tau, tau] with tau = clip_threshold; returns tau.
// NaN elements become 0.   x: [d]
float clip_row(float* x, int d, float ratio);

// The 0-based index into sorted |x| that clip_threshold picks (exposed so
// kernels and tests use the same rule): clamp(floor(ratio*d), 0, d-1).
int clip_index(int d, float ratio);

struct QuantSpec {
  int bits = 2;
  int group_size = 128;
  ScaleDtype scale_dtype = ScaleDtype::kF16;
};

// Throws oscar::Error unless bits in {2,4}, group in {32,64,128}, group <= d,
// d % group == 0 and d > 0.
void validate_spec(const QuantSpec& spec, int d);

// Sizes of one packed row of d channels.
inline int row_code_bytes(int d, const QuantSpec& s) {
  return packed_row_bytes(d, s.bits);
}
inline int row_param_count(int d, const QuantSpec& s) {
  return 2 * (d / s.group_size);
}
inline int row_param_bytes(int d, const QuantSpec& s) {
  return row_param_count(d, s) * (s.scale_dtype == ScaleDtype::kF16 ? 2 : 4);
}

// Quantizes one row of d channels per core/quant_format.h.
//   x:      [d] floats (usually already rotated and clipped)
//   codes:  [d*bits/8] bytes, packed
//   params: [d/group_size][2] (scale, min): uint16_t fp16 bits if kF16, float if kF32
void quantize_row(const float* x, int d, const QuantSpec& spec, uint8_t* codes, void* params);

// Inverse of quantize_row: out[c] = min_g + code_c * scale_g.   out: [d]
void dequantize_row(const uint8_t* codes, const void* params, int d, const QuantSpec& spec,
                    float* out);

// Convenience: rows x[n][d] -> quantize then dequantize into out[n][d]
// (x == out allowed). Used by simulation and error measurements.
void fake_quantize_rows(const float* x, int64_t n, int d, const QuantSpec& spec, float* out);

// Bits per cached element over a sequence of T tokens (DESIGN §5.4): the first
// `sink` and the newest `recent` tokens in 16-bit, the rest at
// row_bits_per_element(bits, group_size, sd). T <= 0 gives 16.
double cache_bits_per_element(int64_t T, int sink, int recent, int bits, int group_size,
                              ScaleDtype sd = ScaleDtype::kF16);

}  // namespace oscar
