// Dequantization of ggml block formats to fp32. The block layouts follow
// ggml's (ggml-common.h); the code is ours. All multi-byte fields are little
// endian, fp16 fields are IEEE binary16.
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "core/half.h"
#include "model/gguf.h"

namespace oscar::model::gguf {
namespace {

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

constexpr int64_t kQK = 32;    // elements per block of the *_0/*_1 formats
constexpr int64_t kQKK = 256;  // elements per "K-quant" super-block

// Q4_0: {f16 d; u8 qs[16]}; x[j] = (lo(qs[j]) - 8) d, x[j+16] = (hi(qs[j]) - 8) d.
void deq_q4_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 18, y += kQK) {
    const float d = h2f(b);
    const uint8_t* qs = b + 2;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>((qs[j] & 0xF) - 8) * d;
      y[j + 16] = static_cast<float>((qs[j] >> 4) - 8) * d;
    }
  }
}

// Q4_1: {f16 d; f16 m; u8 qs[16]}; x = q d + m, same nibble order as Q4_0.
void deq_q4_1(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 20, y += kQK) {
    const float d = h2f(b), m = h2f(b + 2);
    const uint8_t* qs = b + 4;
    for (int j = 0; j < 16; ++j) {
      y[j] = static_cast<float>(qs[j] & 0xF) * d + m;
      y[j + 16] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  }
}

// Q5_0: {f16 d; u8 qh[4]; u8 qs[16]}; 5th bit of element j is bit j of qh.
void deq_q5_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 22, y += kQK) {
    const float d = h2f(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    const uint8_t* qs = b + 6;
    for (int j = 0; j < 16; ++j) {
      const int x0 = (qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int x1 = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = static_cast<float>(x0 - 16) * d;
      y[j + 16] = static_cast<float>(x1 - 16) * d;
    }
  }
}

// Q5_1: {f16 d; f16 m; u8 qh[4]; u8 qs[16]}.
void deq_q5_1(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 24, y += kQK) {
    const float d = h2f(b), m = h2f(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    const uint8_t* qs = b + 8;
    for (int j = 0; j < 16; ++j) {
      const int x0 = (qs[j] & 0xF) | static_cast<int>(((qh >> j) & 1u) << 4);
      const int x1 = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1u) << 4);
      y[j] = static_cast<float>(x0) * d + m;
      y[j + 16] = static_cast<float>(x1) * d + m;
    }
  }
}

// Q8_0: {f16 d; i8 qs[32]}.
void deq_q8_0(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 34, y += kQK) {
    const float d = h2f(b);
    for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  }
}

// The 12 scale bytes of Q4_K/Q5_K pack 8 (scale, min) pairs of 6 bits each.
inline void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

// Q4_K: {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}; 8 sub-blocks of 32;
// each 64-element chunk uses 32 bytes: low nibbles first, then high nibbles.
void deq_q4_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 144) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0, is = 0; j < kQKK; j += 64, is += 2, q += 32) {
      uint8_t sc, m;
      scale_min_k4(is, scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(is + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

// Q5_K: {f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]}; the 5th bit
// of sub-block s comes from bit s of qh[l].
void deq_q5_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 176) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* ql = b + 48;
    uint8_t u1 = 1, u2 = 2;
    for (int j = 0, is = 0; j < kQKK; j += 64, is += 2, ql += 32) {
      uint8_t sc, m;
      scale_min_k4(is, scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(is + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l)
        *y++ = d1 * static_cast<float>((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
      for (int l = 0; l < 32; ++l)
        *y++ = d2 * static_cast<float>((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
      u1 = static_cast<uint8_t>(u1 << 2);
      u2 = static_cast<uint8_t>(u2 << 2);
    }
  }
}

// Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}; 16 sub-blocks of 16.
void deq_q6_k(const uint8_t* b, float* y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += 210) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = h2f(b + 208);
    for (int n = 0; n < kQKK; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l + 0] = d * static_cast<float>(sc[is + 0] * q1);
        y[l + 32] = d * static_cast<float>(sc[is + 2] * q2);
        y[l + 64] = d * static_cast<float>(sc[is + 4] * q3);
        y[l + 96] = d * static_cast<float>(sc[is + 6] * q4);
      }
    }
  }
}

}  // namespace

const char* type_name(GgmlType t) {
  switch (t) {
    case GgmlType::kF32: return "F32";
    case GgmlType::kF16: return "F16";
    case GgmlType::kQ4_0: return "Q4_0";
    case GgmlType::kQ4_1: return "Q4_1";
    case GgmlType::kQ5_0: return "Q5_0";
    case GgmlType::kQ5_1: return "Q5_1";
    case GgmlType::kQ8_0: return "Q8_0";
    case GgmlType::kQ8_1: return "Q8_1";
    case GgmlType::kQ2_K: return "Q2_K";
    case GgmlType::kQ3_K: return "Q3_K";
    case GgmlType::kQ4_K: return "Q4_K";
    case GgmlType::kQ5_K: return "Q5_K";
    case GgmlType::kQ6_K: return "Q6_K";
    case GgmlType::kQ8_K: return "Q8_K";
    case GgmlType::kI8: return "I8";
    case GgmlType::kI16: return "I16";
    case GgmlType::kI32: return "I32";
    case GgmlType::kI64: return "I64";
    case GgmlType::kF64: return "F64";
    case GgmlType::kBF16: return "BF16";
  }
  return "unknown";
}

BlockLayout block_layout(GgmlType t) {
  switch (t) {
    case GgmlType::kF32: return {1, 4};
    case GgmlType::kF16: return {1, 2};
    case GgmlType::kBF16: return {1, 2};
    case GgmlType::kQ4_0: return {32, 18};
    case GgmlType::kQ4_1: return {32, 20};
    case GgmlType::kQ5_0: return {32, 22};
    case GgmlType::kQ5_1: return {32, 24};
    case GgmlType::kQ8_0: return {32, 34};
    case GgmlType::kQ8_1: return {32, 36};
    case GgmlType::kQ2_K: return {256, 84};
    case GgmlType::kQ3_K: return {256, 110};
    case GgmlType::kQ4_K: return {256, 144};
    case GgmlType::kQ5_K: return {256, 176};
    case GgmlType::kQ6_K: return {256, 210};
    case GgmlType::kQ8_K: return {256, 292};
    case GgmlType::kI8: return {1, 1};
    case GgmlType::kI16: return {1, 2};
    case GgmlType::kI32: return {1, 4};
    case GgmlType::kI64: return {1, 8};
    case GgmlType::kF64: return {1, 8};
  }
  return {0, 0};
}

bool can_dequantize(GgmlType t) {
  switch (t) {
    case GgmlType::kF32: case GgmlType::kF16: case GgmlType::kBF16:
    case GgmlType::kQ4_0: case GgmlType::kQ4_1: case GgmlType::kQ5_0: case GgmlType::kQ5_1:
    case GgmlType::kQ8_0: case GgmlType::kQ4_K: case GgmlType::kQ5_K: case GgmlType::kQ6_K:
      return true;
    default:
      return false;
  }
}

void dequantize(GgmlType t, const std::byte* src, float* dst, int64_t n) {
  const BlockLayout bl = block_layout(t);
  if (!can_dequantize(t) || bl.elems == 0)
    throw Error(fmt::format("gguf: no dequantizer for tensor type {} ({})", type_name(t),
                            static_cast<uint32_t>(t)));
  if (n % bl.elems != 0)
    throw Error(fmt::format("gguf: {} elements is not a whole number of {} blocks of {}", n,
                            type_name(t), bl.elems));
  const auto* b = reinterpret_cast<const uint8_t*>(src);
  const int64_t nb = n / bl.elems;
  switch (t) {
    case GgmlType::kF32: std::memcpy(dst, b, static_cast<size_t>(n) * 4); return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < n; ++i) dst[i] = h2f(b + 2 * i);
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, b + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    case GgmlType::kQ4_0: deq_q4_0(b, dst, nb); return;
    case GgmlType::kQ4_1: deq_q4_1(b, dst, nb); return;
    case GgmlType::kQ5_0: deq_q5_0(b, dst, nb); return;
    case GgmlType::kQ5_1: deq_q5_1(b, dst, nb); return;
    case GgmlType::kQ8_0: deq_q8_0(b, dst, nb); return;
    case GgmlType::kQ4_K: deq_q4_k(b, dst, nb); return;
    case GgmlType::kQ5_K: deq_q5_k(b, dst, nb); return;
    case GgmlType::kQ6_K: deq_q6_k(b, dst, nb); return;
    default: break;
  }
}

}  // namespace oscar::model::gguf
