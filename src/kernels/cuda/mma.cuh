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

// TF32 tensor-core product, m16n8k8, fp32 accumulation: one tf32 value (an fp32 bit pattern, the
// low 13 mantissa bits ignored) per register. Fragment layout (PTX ISA, mma.m16n8k8 .tf32):
//   A (16x8, row):  a0 = (row g, k r)    a1 = (row g+8, k r)    a2 = (row g, k r+4)   a3 = (row g+8, k r+4)
//   B (8x8,  col):  b0 = (k r,  col g)   b1 = (k r+4, col g)
//   C (16x8):       as m16n8k16.
__device__ __forceinline__ void mma_tf32(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// x = hi + lo for a 3xTF32 product: hi the nearest tf32 (ties away from zero, what
// cvt.rna.tf32.f32 gives, in two integer operations), lo the rest as fp32 bits (the tensor cores
// read its top 19 bits: truncating lo costs ~2^-21 of x).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
  lo = __float_as_uint(x - __uint_as_float(hi));
}

// Integer tensor-core product, m16n8k32: A unsigned bytes (row), B signed bytes
// (col), s32 accumulators. Fragment layout (4 bytes per register, the lowest
// k in the lowest byte):
//   A: a0 = (row g, k 4r..4r+3)   a1 = (row g+8, k 4r..4r+3)
//      a2 = (row g, k 16+4r..+3)  a3 = (row g+8, k 16+4r..+3)
//   B: b0 = (k 4r..4r+3, col g)   b1 = (k 16+4r..+3, col g)
//   C: as m16n8k16.
__device__ __forceinline__ void mma_u8s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same shape with unsigned bytes on both sides; d = A.B + c (c need not be d).
__device__ __forceinline__ void mma_u8u8(int (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1, const int (&c)[4]) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%11,%12,%13};\n"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]),
        "r"(c[3]));
}

// Programmatic dependent launch (sm_90): let the next kernel of the stream
// start launching / wait until the previous one has completed and its
// writes are visible. No-ops when the launch did not ask for it.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// A flag between grids running at once (the step write and the window
// launch, v40): the writer stores its data, fences, and publishes with a
// release store; the reader's acquire load that sees the value orders its
// later reads after that data.
__device__ __forceinline__ void st_release_gpu(uint32_t* p, uint32_t v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
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

// 16-byte asynchronous global -> shared copy (L2 only), grouped by commit.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// The same with zero fill: src_bytes 0 writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16_zfill(void* smem, const void* gmem, bool copy) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(copy ? 16 : 0)
               : "memory");
}
// 4-byte asynchronous copy with zero fill (sources that are not 16-byte aligned).
__device__ __forceinline__ void cp_async4_zfill(void* smem, const void* gmem, bool copy) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(copy ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  return __byte_perm(a, b, sel);
}

// INT2 code -> fp16 without a conversion instruction: OR-ing a code c into
// mantissa bits [b, b+1] of 1.0 (0x3C00) gives exactly 1 + c / F with
// F = 2^(10-b). A packed word holds four codes per byte at bits 2s (s = 0..3).
// Bytes 0/2 ("lo", the low byte of each 16-bit half) and 1/3 ("hi") of w,
// w << 6 and w >> 6 hold every code at mantissa bits 4-5, 6-7 or 8-9, so each
// f16x2 operand costs one LOP3 (plus two shifts per word):
//   lo s=0: (w<<6) bits 6-7  F=16    hi s=0: w      bits 8-9  F=4
//   lo s=1: (w<<6) bits 8-9  F=4     hi s=1: (w>>6) bits 4-5  F=64
//   lo s=2: w      bits 4-5  F=64    hi s=2: (w>>6) bits 6-7  F=16
//   lo s=3: w      bits 6-7  F=16    hi s=3: (w>>6) bits 8-9  F=4
// The kernels fold the affine map back: sum q (1 + c/F) = sum q + (q.c)/F,
// with the query pre-multiplied by F so that its products with c are plain.

// (a & m) | c as ONE LOP3: written as C++ the compiler emits two LOP3s, since
// each takes a single immediate and both constants were immediates.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t m, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(m), "r"(c));
  return d;
}
__host__ __device__ constexpr uint32_t code_mask(int bit) { return 0x00030003u << bit; }
__host__ __device__ constexpr int lo_bit(int s) { return s == 0 ? 6 : s == 1 ? 8 : s == 2 ? 4 : 6; }
__host__ __device__ constexpr int hi_bit(int s) { return s == 0 ? 8 : s == 1 ? 4 : s == 2 ? 6 : 8; }
// F of a code at shift s of a lo / hi byte.
__host__ __device__ constexpr float lo_factor(int s) { return float(1 << (10 - lo_bit(s))); }
__host__ __device__ constexpr float hi_factor(int s) { return float(1 << (10 - hi_bit(s))); }

struct CodeWord {
  uint32_t w, l6, r6;  // w, w << 6, w >> 6
  __device__ __forceinline__ explicit CodeWord(uint32_t x) : w(x), l6(x << 6), r6(x >> 6) {}
  // Codes of bytes 0 and 2 at shift s, as f16x2 (1 + c / lo_factor(s)).
  __device__ __forceinline__ uint32_t lo(int s) const {
    return and_or(s < 2 ? l6 : w, code_mask(lo_bit(s)), 0x3C003C00u);
  }
  // Codes of bytes 1 and 3 at shift s (1 + c / hi_factor(s)).
  __device__ __forceinline__ uint32_t hi(int s) const {
    return and_or(s == 0 ? w : r6, code_mask(hi_bit(s)), 0x3C003C00u);
  }
};

// max(a, b) that returns NaN if either is NaN (fmaxf returns the other).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
  return y;
}
// 2^x for x <= 0 (softmax weights): one MUFU.EX2; results below 2^-126 flush to 0.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x, one MUFU.RCP (approximate, ~1 ulp; subnormal x flushes: inf).
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
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
