// Tensor-core and bit-twiddling primitives shared by the decode kernels (sm_80+;
// built for sm_90). Fragment layouts are those of PTX mma.m16n8k16: with
// lane = 4*g + r (g = lane/4, r = lane%4)
//   A (16x16, row):  a0 = (row g,   cols 2r,2r+1)   a1 = (row g+8, cols 2r,2r+1)
//                    a2 = (row g,   cols 2r+8,+9)   a3 = (row g+8, cols 2r+8,+9)
//   B (16x8,  col):  b0 = (rows 2r,2r+1, col g)     b1 = (rows 2r+8,2r+9, col g)
//   C (16x8):        c0,c1 = (row g, cols 2r,2r+1)  c2,c3 = (row g+8, cols 2r,2r+1)
// Each 32-bit register holds two 16-bit values, the lower index in the low half.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace oscar::kernels::cuda::detail {

__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Transposes an 8x8 matrix of 16-bit values held in C/A-fragment layout
// (lane holds row g, cols 2r..2r+1) so that the lane holds row g of the
// transpose: turns the S^T accumulator (tokens x heads) into the B operand
// (tokens x heads, "col") of the P.V product without shared memory.
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}

// INT2 code -> fp16 without a conversion instruction: placing code c in the two
// top mantissa bits of 1.0 (0x3C00) gives exactly 1 + c/4. One shift and one
// LOP3 turn two codes into an f16x2 operand. The kernels fold the affine
// offset back: sum q*(1 + c/4) = sum q + (q.c)/4.
// lo_pair: codes at bits [2s, 2s+1] of bytes 0 and 2 of w.
__device__ __forceinline__ uint32_t lo_pair(uint32_t w, int s) {
  return ((w << (8 - 2 * s)) & 0x03000300u) | 0x3C003C00u;
}
// hi_pair: codes at bits [2s, 2s+1] of bytes 1 and 3 of w.
__device__ __forceinline__ uint32_t hi_pair(uint32_t w, int s) {
  return ((w >> (2 * s)) & 0x03000300u) | 0x3C003C00u;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_bf162(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ float half_lo(uint32_t x) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x & 0xffffu)));
}
__device__ __forceinline__ float half_hi(uint32_t x) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x >> 16)));
}
__device__ __forceinline__ float bf16_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t x) { return __uint_as_float(x & 0xffff0000u); }

}  // namespace oscar::kernels::cuda::detail
