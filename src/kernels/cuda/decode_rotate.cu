// Query rotation on the device (rotate_queries, decode_attention.h).
#include <cuda_runtime.h>

#include "kernels/cuda/decode_attention.h"

namespace oscar::kernels::cuda {

namespace {

// Rotation of query rows: one block per row, D threads.
template <int D>
__global__ void __launch_bounds__(256) rotate_kernel(const float* q, int num_q_heads, const float* R,
                                                    int r_heads, float* out) {
  __shared__ float x[D];
  const int64_t row = blockIdx.x;
  const int head = static_cast<int>(row % num_q_heads);
  const float* Rh = R + int64_t(head / (num_q_heads / r_heads)) * D * D;
  x[threadIdx.x] = q[row * D + threadIdx.x];
  __syncthreads();
  float acc = 0.0f;
#pragma unroll 8
  for (int j = 0; j < D; ++j) acc = fmaf(x[j], __ldg(Rh + j * D + threadIdx.x), acc);
  __syncthreads();  // q == out allowed: every thread has read x before anyone writes
  out[row * D + threadIdx.x] = acc;
}

}  // namespace

cudaError_t rotate_queries(const float* q, int n, int num_q_heads, int d, const float* R,
                           int r_heads, float* q_rot, cudaStream_t stream) {
  if (n < 0 || num_q_heads <= 0 || r_heads <= 0 || num_q_heads % r_heads != 0 || !q || !R || !q_rot)
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const unsigned rows = static_cast<unsigned>(int64_t(n) * num_q_heads);
  if (d == 64) {
    rotate_kernel<64><<<rows, 64, 0, stream>>>(q, num_q_heads, R, r_heads, q_rot);
  } else if (d == 128) {
    rotate_kernel<128><<<rows, 128, 0, stream>>>(q, num_q_heads, R, r_heads, q_rot);
  } else if (d == 256) {
    rotate_kernel<256><<<rows, 256, 0, stream>>>(q, num_q_heads, R, r_heads, q_rot);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace oscar::kernels::cuda
