// THE packed row format of the quantized KV cache. Every packer, unpacker and
// kernel (CPU reference, SIMD, CUDA) follows this header; tests/core pins it.
//
// A row is one token of one KV head: d channels (after rotation and clipping),
// split into d/G groups of G consecutive channels (G in {32, 64, 128}, G <= d).
//
// Codes (B bits each, B in {2, 4}; L = 8/B codes per byte):
//   group g owns the G*B/8 bytes [g*G*B/8, (g+1)*G*B/8) of the row's code block;
//   inside a group, element i (0 <= i < G) lives in byte  i % (G/L)
//   at bit shift  B * (i / (G/L)).
// So for INT2 byte j of a group holds elements j, j+G/4, j+G/2, j+3G/4
// (quarter-strided lanes, as in the reference implementation when G = d), and
// `(byte >> 2q) & 3` over the group's consecutive bytes yields the consecutive
// elements q*G/4 .. (q+1)*G/4 - 1: one shift+mask of a SIMD register of code
// bytes gives a contiguous run of channels.
//
// Params: per group a (scale, min) pair, fp16 by default (fp32 optional for
// offline simulation). Dequantization: x_hat = min + code * scale.
//
// Quantizer (asymmetric, per group), qmax = 2^B - 1:
//   m = min(x), M = max(x), s = max(M - m, kMinRange) / qmax;
//   (m, s) are rounded to the storage dtype FIRST, and the codes are computed
//   against the rounded values so dequantization uses exactly what was stored:
//   code = clamp(floor((x - m) / s + 0.5), 0, qmax)   (s == 0 after rounding -> code 0).
#pragma once

#include <cstdint>

#include "core/half.h"

namespace oscar {

inline constexpr float kMinRange = 1e-6f;

enum class ScaleDtype : uint8_t { kF16 = 0, kF32 = 1 };

// Bytes of packed codes for a row of d channels at `bits` bits per code.
OSCAR_HD constexpr int packed_row_bytes(int d, int bits) { return d * bits / 8; }

// Byte offset (within the row's code block) and bit shift of element `c` (0 <= c < d).
OSCAR_HD constexpr int code_byte(int c, int group_size, int bits) {
  const int lanes = 8 / bits;
  const int per_lane = group_size / lanes;  // bytes per group
  const int g = c / group_size, i = c % group_size;
  return g * per_lane + i % per_lane;
}
OSCAR_HD constexpr int code_shift(int c, int group_size, int bits) {
  const int lanes = 8 / bits;
  const int per_lane = group_size / lanes;
  return bits * ((c % group_size) / per_lane);
}

OSCAR_HD int get_code(const uint8_t* row_codes, int c, int group_size, int bits) {
  return (row_codes[code_byte(c, group_size, bits)] >> code_shift(c, group_size, bits)) &
         ((1 << bits) - 1);
}

// Bits per element of a stored row: B bits of code + two params per group.
OSCAR_HD constexpr double row_bits_per_element(int bits, int group_size, ScaleDtype sd) {
  return bits + 2.0 * (sd == ScaleDtype::kF16 ? 16.0 : 32.0) / group_size;
}

}  // namespace oscar
