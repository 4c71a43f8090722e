// Query rotation on the device (rotate_queries, decode_attention.h).
#include <cuda_runtime.h>

#include "kernels/cuda/decode_attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

// One set of rows to rotate: out[row] = (in[row] - mean[head]) R[head / (heads / r_heads)]
// for rows [n][heads][D] (mean optional, [heads][D]).
struct RotJob {
  const float* in;
  float* out;
  const float* R;
  const float* mean;
  int heads, r_heads;
  int64_t rows;  // n * heads
};

// Rotation of rows (out = x R, R [D][D] per head group): one block of 256 threads per
// row. A thread takes 4 adjacent output columns over a slice of the D inputs (16-byte
// loads of R, all in flight), and the slices are summed through shared memory. One
// thread per column over all D inputs (a chain of D dependent loads) took 8.4 us per call
// at batch 1 on the H200. Two jobs per launch (the step's queries and keys: one launch
// instead of two, and the key centering inside it): blocks [0, a.rows) take job a.
template <int D>
__global__ void __launch_bounds__(256) rotate_kernel(const RotJob a, const RotJob b) {
  constexpr int kCols = D / 4;       // column groups of 4
  constexpr int kParts = 256 / kCols;  // slices of the inputs
  constexpr int kJ = D / kParts;     // inputs per slice
  __shared__ float x[D];
  __shared__ float4 part[kParts][kCols];
  detail::pdl_launch_dependents();  // launched as a programmatic dependent: wait for q
  detail::pdl_wait();
  const bool first = int64_t(blockIdx.x) < a.rows;
  const RotJob& j = first ? a : b;
  const int64_t row = first ? int64_t(blockIdx.x) : int64_t(blockIdx.x) - a.rows;
  const int head = static_cast<int>(row % j.heads);
  const float4* R4 = reinterpret_cast<const float4*>(j.R + int64_t(head / (j.heads / j.r_heads)) * D * D);
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    x[i] = j.mean ? j.in[row * D + i] - j.mean[int64_t(head) * D + i] : j.in[row * D + i];
  __syncthreads();  // in == out allowed: every x is read before anyone writes
  const int cg = threadIdx.x % kCols, p = threadIdx.x / kCols;
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 16
  for (int jj = 0; jj < kJ; ++jj) {
    const int k = p * kJ + jj;
    const float4 r = __ldg(R4 + k * kCols + cg);
    const float xk = x[k];
    acc.x = fmaf(xk, r.x, acc.x);
    acc.y = fmaf(xk, r.y, acc.y);
    acc.z = fmaf(xk, r.z, acc.z);
    acc.w = fmaf(xk, r.w, acc.w);
  }
  part[p][cg] = acc;
  __syncthreads();
  const float* pf = reinterpret_cast<const float*>(&part[0][0]);
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kParts; ++k) sum += pf[k * D + c];
    j.out[row * D + c] = sum;
  }
}

bool valid(const RotJob& j) {
  return j.rows >= 0 && j.heads > 0 && j.r_heads > 0 && j.heads % j.r_heads == 0 &&
         (j.rows == 0 || (j.in && j.out && j.R));
}

cudaError_t launch_rotate(const RotJob& a, const RotJob& b, int d, cudaStream_t stream, bool programmatic) {
  if (!valid(a) || !valid(b)) return cudaErrorInvalidValue;
  const int64_t rows = a.rows + b.rows;
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(rows));
  if (d == 64) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<64>, grid, dim3(256), 0, programmatic, stream, a, b));
  } else if (d == 128) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<128>, grid, dim3(256), 0, programmatic, stream, a, b));
  } else if (d == 256) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<256>, grid, dim3(256), 0, programmatic, stream, a, b));
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t rotate_queries(const float* q, int n, int num_q_heads, int d, const float* R,
                           int r_heads, float* q_rot, cudaStream_t stream, bool programmatic, const float* mean) {
  if (n < 0 || num_q_heads <= 0 || !q || !R || !q_rot) return cudaErrorInvalidValue;
  const RotJob a{q, q_rot, R, mean, num_q_heads, r_heads, int64_t(n) * num_q_heads};
  const RotJob none{nullptr, nullptr, nullptr, nullptr, 1, 1, 0};
  return launch_rotate(a, none, d, stream, programmatic);
}

cudaError_t rotate_queries_keys(float* q, int num_q_heads, const float* Rq, float* k, int num_kv_heads,
                                const float* Rk, const float* k_mean, int n, int d, int r_heads, cudaStream_t stream,
                                bool programmatic) {
  if (n < 0 || num_q_heads <= 0 || num_kv_heads <= 0 || !q || !k || !Rq || !Rk) return cudaErrorInvalidValue;
  const RotJob a{q, q, Rq, nullptr, num_q_heads, r_heads, int64_t(n) * num_q_heads};
  const RotJob b{k, k, Rk, k_mean, num_kv_heads, r_heads, int64_t(n) * num_kv_heads};
  return launch_rotate(a, b, d, stream, programmatic);
}

}  // namespace oscar::kernels::cuda
