// fp16 / bf16 <-> fp32 conversions, bit-exact round-to-nearest-even, usable on
// the host and (through OSCAR_HD) in CUDA device code. Storage is raw uint16_t
// bits so public headers never need cuda_fp16.h.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define OSCAR_HD __host__ __device__ __forceinline__
#else
#define OSCAR_HD inline
#endif

namespace oscar {

OSCAR_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

OSCAR_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// bf16: the top 16 bits of an fp32, rounded to nearest even; NaN stays NaN.
OSCAR_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

OSCAR_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// IEEE binary16, round to nearest even, overflow to inf, subnormals kept.
OSCAR_HD uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (ax < 0x38800000u) {  // subnormal or zero in fp16
    if (ax < 0x33000000u) return static_cast<uint16_t>(sign);  // rounds to zero
    uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
    int shift = 126 - static_cast<int>(ax >> 23);  // 14..24 (value = mant * 2^(exp-150), unit 2^-24)
    uint32_t half_mant = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1u);
    uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++half_mant;
    return static_cast<uint16_t>(sign | half_mant);
  }
  uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);  // round mantissa to 10 bits
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}

OSCAR_HD float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return f32_from_bits(sign);
    // subnormal: mant * 2^-24
    float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  if (exp == 31) return f32_from_bits(sign | 0x7f800000u | (mant << 13));
  return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

}  // namespace oscar
