// Query rotation on the device (rotate_queries, decode_attention.h).
#include <cuda_runtime.h>

#include "kernels/cuda/decode_attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

// Rotation of rows (out = x R, R [D][D] per head group): one block of 256 threads per
// row. A thread takes 4 adjacent output columns over a slice of the D inputs (16-byte
// loads of R, all in flight), and the slices are summed through shared memory. One
// thread per column over all D inputs (a chain of D dependent loads) took 8.4 us per call
// at batch 1 on the H200.
template <int D>
__global__ void __launch_bounds__(256) rotate_kernel(const float* q, int num_q_heads, const float* R,
                                                    int r_heads, float* out) {
  constexpr int kCols = D / 4;       // column groups of 4
  constexpr int kParts = 256 / kCols;  // slices of the inputs
  constexpr int kJ = D / kParts;     // inputs per slice
  __shared__ float x[D];
  __shared__ float4 part[kParts][kCols];
  detail::pdl_launch_dependents();  // launched as a programmatic dependent: wait for q
  detail::pdl_wait();
  const int64_t row = blockIdx.x;
  const int head = static_cast<int>(row % num_q_heads);
  const float4* R4 = reinterpret_cast<const float4*>(R + int64_t(head / (num_q_heads / r_heads)) * D * D);
  for (int i = threadIdx.x; i < D; i += blockDim.x) x[i] = q[row * D + i];
  __syncthreads();  // q == out allowed: every x is read before anyone writes
  const int cg = threadIdx.x % kCols, p = threadIdx.x / kCols;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
  for (int jj = 0; jj < kJ; ++jj) {
    const int j = p * kJ + jj;
    const float4 r = __ldg(R4 + j * kCols + cg);
    const float xj = x[j];
    acc.x = fmaf(xj, r.x, acc.x);
    acc.y = fmaf(xj, r.y, acc.y);
    acc.z = fmaf(xj, r.z, acc.z);
    acc.w = fmaf(xj, r.w, acc.w);
  }
  part[p][cg] = acc;
  __syncthreads();
  const float* pf = reinterpret_cast<const float*>(&part[0][0]);
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kParts; ++k) sum += pf[k * D + c];
    out[row * D + c] = sum;
  }
}

}  // namespace

cudaError_t rotate_queries(const float* q, int n, int num_q_heads, int d, const float* R,
                           int r_heads, float* q_rot, cudaStream_t stream, bool programmatic) {
  if (n < 0 || num_q_heads <= 0 || r_heads <= 0 || num_q_heads % r_heads != 0 || !q || !R || !q_rot)
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const unsigned rows = static_cast<unsigned>(int64_t(n) * num_q_heads);
  if (d == 64) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<64>, dim3(rows), dim3(256), 0, programmatic, stream, q,
                                                  num_q_heads, R, r_heads, q_rot));
  } else if (d == 128) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<128>, dim3(rows), dim3(256), 0, programmatic, stream, q,
                                                  num_q_heads, R, r_heads, q_rot));
  } else if (d == 256) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<256>, dim3(rows), dim3(256), 0, programmatic, stream, q,
                                                  num_q_heads, R, r_heads, q_rot));
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace oscar::kernels::cuda
