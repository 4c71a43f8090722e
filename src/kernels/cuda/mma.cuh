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

// INT2 code -> fp16 without a conversion instruction: OR-ing a code c into
// mantissa bits [6,7] or [8,9] of 1.0 (0x3C00) gives exactly 1 + c/16 or
// 1 + c/4. A packed word holds four codes per byte at bits 2s (s = 0..3);
// four shifted copies of the word (<<6, <<2 for bytes 0/2; >>2, >>6 for
// bytes 1/3) put every code at bits 6-7 (s even) or 8-9 (s odd), so each
// f16x2 operand then costs one LOP3. The kernels fold the affine map back:
// sum q*(1 + c*F^-1) = sum q + (q.c)/F with F = 16 (s even) or 4 (s odd);
// the query is pre-multiplied by F so that its products with c are plain.
struct CodeWord {
  uint32_t l6, l2, r2, r6;  // w << 6, w << 2, w >> 2, w >> 6
  __device__ __forceinline__ explicit CodeWord(uint32_t w) : l6(w << 6), l2(w << 2), r2(w >> 2), r6(w >> 6) {}
  // Codes of bytes 0 and 2 at shift s, as f16x2 (1 + c / code_factor(s)).
  __device__ __forceinline__ uint32_t lo(int s) const {
    return ((s < 2 ? l6 : l2) & (s & 1 ? 0x03000300u : 0x00C000C0u)) | 0x3C003C00u;
  }
  // Codes of bytes 1 and 3 at shift s.
  __device__ __forceinline__ uint32_t hi(int s) const {
    return ((s < 2 ? r2 : r6) & (s & 1 ? 0x03000300u : 0x00C000C0u)) | 0x3C003C00u;
  }
};
// F for codes at shift s: the unpacked value is 1 + c / F.
__host__ __device__ constexpr float code_factor(int s) { return (s & 1) ? 4.0f : 16.0f; }

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
