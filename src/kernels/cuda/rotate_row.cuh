// One row times a D x D matrix (out = x R) by a block of 256 threads: the product that
// rotate_kernel (decode_rotate.cu) and the CUDA backend's one-launch attention inputs
// (backend/cuda/ops.cu qkv_heads_cache_k) share, so that both add in one order. Thread
// (p, cg) takes the 4 output columns 4 cg .. 4 cg + 3 over the inputs p kJ .. p kJ + kJ - 1
// (16-byte loads of R), and the kParts slices are summed through shared memory.
#pragma once

#include <cuda_runtime.h>

namespace oscar::kernels::cuda::detail {

template <int D>
struct RowRotation {
  static constexpr int kCols = D / 4;          // column groups of 4
  static constexpr int kParts = 256 / kCols;   // slices of the inputs
  static constexpr int kJ = D / kParts;        // inputs per slice
  int cg, p;                                   // this thread's column group and slice
  __device__ __forceinline__ RowRotation() : cg(int(threadIdx.x) % kCols), p(int(threadIdx.x) / kCols) {}
  // The float4 of R this thread multiplies its input p kJ + jj by.
  __device__ __forceinline__ const float4* r_at(const float4* R4, int jj) const {
    return R4 + (p * kJ + jj) * kCols + cg;
  }
  // The thread's partial product from x [D] (shared memory); r(jj) gives *r_at(R4, jj).
  template <class R>
  __device__ __forceinline__ float4 partial(const float* x, R r) const {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
    for (int jj = 0; jj < kJ; ++jj) {
      const float4 w = r(jj);
      const float xk = x[p * kJ + jj];
      acc.x = fmaf(xk, w.x, acc.x);
      acc.y = fmaf(xk, w.y, acc.y);
      acc.z = fmaf(xk, w.z, acc.z);
      acc.w = fmaf(xk, w.w, acc.w);
    }
    return acc;
  }
  // Output column c from the partials part[kParts][kCols] (shared memory, written and synced).
  __device__ __forceinline__ static float column(const float4 (&part)[kParts][kCols], int c) {
    const float* pf = reinterpret_cast<const float*>(&part[0][0]);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kParts; ++k) sum += pf[k * D + c];
    return sum;
  }
};

}  // namespace oscar::kernels::cuda::detail
