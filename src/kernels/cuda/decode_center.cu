// Page centering in the decode (kernels/paged_kv.h MidCenter): the log2 shift
// of every middle page's logits, computed before the middle launch and added
// inside its loop (the kCenter instances of decode_split_kernel.cuh).
#include <cuda_runtime.h>

#include "kernels/cuda/decode_dispatch.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_plan.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

// Page centering (kernels/paged_kv.h MidCenter): the logits of middle page i of sequence b
// move by q̃·δ_h(t_i) = Σ_s A_s cos_s + B_s sin_s − C, one number per (page, query head)
// that the middle loop adds to the page's logits. Both kernels run between the query's
// rotation and the middle launch, on the step's critical path, so they are written for
// latency: every load a warp needs is issued before its first reduction.
//
// center_coef_kernel: per (sequence, query head) A_s = q̃·u[h][s], B_s = q̃·w[h][s],
// C = q̃·mu[h] into coef [batch][Hq][ld] as (A_s, B_s) pairs, C, then zeros up to
// ld = coef_row_floats(S) (the float4 rows page_bias_kernel stages). Grid (batch, Hq,
// ⌈ld/32⌉), four warps of kCoefPerWarp entries each; lane l holds q̃[l·D/32 ..] and the same
// slice of each vector.
constexpr int kCoefPerWarp = 8, kCoefPerBlock = 4 * kCoefPerWarp;
// Row length of the staged coefficient and angle rows: >= 2S + 1 floats, an odd number of
// float4s (the quarter-warps' float4 reads of different rows hit different banks); <= 2S + 8.
__host__ __device__ constexpr int coef_row_floats(int S) { return 4 * (((2 * S + 4) / 4) | 1); }
template <int D>
__global__ void __launch_bounds__(128) center_coef_kernel(const float* q, int num_q_heads, int gqa,
                                                          kv::MidCenter c, float* coef) {
  constexpr int E = D / 32;
  const int b = blockIdx.x, hq = blockIdx.y, h = hq / gqa, S = c.pairs, n = 2 * S + 1, ld = coef_row_floats(S);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int i0 = (blockIdx.z * 4 + warp) * kCoefPerWarp;
  detail::pdl_launch_dependents();
  if (i0 >= ld) return;
  // The centre vectors (constant) are loaded before the wait for the query (the previous launch's).
  float vv[kCoefPerWarp][E];
#pragma unroll
  for (int j = 0; j < kCoefPerWarp; ++j) {
    const int i = i0 + j;
    const float* v = i >= n       ? nullptr
                     : i == 2 * S ? (c.mu ? c.mu + int64_t(h) * D : nullptr)
                                  : ((i & 1) ? c.w : c.u) + (int64_t(h) * S + i / 2) * D;
#pragma unroll
    for (int e = 0; e < E; ++e) vv[j][e] = v ? __ldg(v + lane * E + e) : 0.0f;
  }
  detail::pdl_wait();
  const float* qr = q + (int64_t(b) * num_q_heads + hq) * D + lane * E;
  float qv[E];
#pragma unroll
  for (int e = 0; e < E; ++e) qv[e] = qr[e];
  float acc[kCoefPerWarp];
#pragma unroll
  for (int j = 0; j < kCoefPerWarp; ++j) {
    acc[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) acc[j] += qv[e] * vv[j][e];
  }
  float* out = coef + (int64_t(b) * num_q_heads + hq) * ld;
#pragma unroll
  for (int j = 0; j < kCoefPerWarp; ++j) {
#pragma unroll
    for (int o = 16; o; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
    if (lane == j && i0 + j < ld) out[i0 + j] = acc[j];  // 0 past n
  }
}

// page_bias [mid page][Hq]: the log2-domain shift of each middle page, indexed by its
// page-table slot mid.indptr[b] + i. Grid (batch, ⌈most pages of a sequence / kBiasPages⌉):
// a block stages its pages' angles (MidCenter::angle_row) and its sequence's coefficients
// (kBiasHeads query heads at a time) in shared memory as zero-padded rows of
// coef_row_floats(S), every load of a stage issued before its stores, then each thread sums
// the 2S products of one (page, query head) four at a time.
constexpr int kBiasPages = 8, kBiasHeads = 16, kBiasThreads = 128;
constexpr int kMaxRow4 = coef_row_floats(128) / 4;  // S <= 128
__global__ void __launch_bounds__(kBiasThreads) page_bias_kernel(const int32_t* mid_indptr, int num_q_heads,
                                                                 int S, const float* angles,
                                                                 const int32_t* angle_start, const float* coef,
                                                                 float scale_log2, float* bias) {
  extern __shared__ float4 smem_f4[];
  detail::pdl_launch_dependents();
  const int b = blockIdx.x, i0 = blockIdx.y * kBiasPages, ld = coef_row_floats(S), ld4 = ld / 4;
  const int first = __ldg(mid_indptr + b), np = min(kBiasPages, __ldg(mid_indptr + b + 1) - first - i0);
  if (np <= 0) return;
  float4* s_ang = smem_f4;                  // [kBiasPages][ld4]: (cos, sin) pairs, zeros
  float4* s_cf = smem_f4 + kBiasPages * ld4;  // [kBiasHeads][ld4]: (A, B) pairs, C, zeros
  const int64_t row0 = (angle_start ? int64_t(__ldg(angle_start + b)) : int64_t(first)) + i0;
  if (S % 2 == 0) {  // rows of 2S floats are float4-aligned: float4 loads, all in flight at once
    const int per_row = S / 2;
    const float4* src = reinterpret_cast<const float4*>(angles + row0 * 2 * S);
    constexpr int kIter = (kBiasPages * kMaxRow4 + kBiasThreads - 1) / kBiasThreads;
    float4 t[kIter];
#pragma unroll
    for (int j = 0; j < kIter; ++j) {
      const int k = threadIdx.x + j * kBiasThreads, p = k / ld4, c = k % ld4;
      t[j] = p < np && c < per_row ? __ldg(src + p * per_row + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int j = 0; j < kIter; ++j) {
      const int k = threadIdx.x + j * kBiasThreads;
      if (k < kBiasPages * ld4) s_ang[k] = t[j];
    }
  } else {
    float* sa = reinterpret_cast<float*>(s_ang);
    for (int k = threadIdx.x; k < kBiasPages * ld; k += kBiasThreads) {
      const int p = k / ld, c = k % ld;
      sa[k] = p < np && c < 2 * S ? __ldg(angles + (row0 + p) * 2 * S + c) : 0.0f;
    }
  }
  detail::pdl_wait();  // the coefficients are center_coef_kernel's
  for (int h0 = 0; h0 < num_q_heads; h0 += kBiasHeads) {
    const int nh = min(kBiasHeads, num_q_heads - h0);
    const float4* cf = reinterpret_cast<const float4*>(coef + (int64_t(b) * num_q_heads + h0) * ld);
    constexpr int kIter = (kBiasHeads * kMaxRow4 + kBiasThreads - 1) / kBiasThreads;
    float4 t[kIter];
#pragma unroll
    for (int j = 0; j < kIter; ++j) {
      const int k = threadIdx.x + j * kBiasThreads;
      if (k < nh * ld4) t[j] = cf[k];  // written by the previous launch: not through the read-only path
    }
    __syncthreads();  // the previous heads' reads are done (and the angles are staged)
#pragma unroll
    for (int j = 0; j < kIter; ++j) {
      const int k = threadIdx.x + j * kBiasThreads;
      if (k < nh * ld4) s_cf[k] = t[j];
    }
    __syncthreads();
    for (int o = threadIdx.x; o < np * nh; o += kBiasThreads) {
      const int p = o / nh, hq = o % nh;
      const float4* f = s_cf + hq * ld4;
      const float4* a = s_ang + p * ld4;
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
      for (int k = 0; k < ld4; ++k) {
        const float4 x = f[k], y = a[k];
        acc[0] += x.x * y.x;
        acc[1] += x.y * y.y;
        acc[2] += x.z * y.z;
        acc[3] += x.w * y.w;
      }
      bias[(int64_t(first) + i0 + p) * num_q_heads + h0 + hq] =
          ((acc[0] + acc[1]) + (acc[2] + acc[3]) - reinterpret_cast<const float*>(f)[2 * S]) * scale_log2;
    }
  }
}

}  // namespace

namespace decode_impl {

template <int D>
cudaError_t launch_page_centering(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                                  int gqa, int num_mid_pages, int max_seq_mid_pages, float sm_scale_log2,
                                  float* center_coef, float* page_bias, bool pdl, cudaStream_t stream) {
  if (num_mid_pages <= 0 || max_seq_mid_pages <= 0) return cudaSuccess;
  const int S = kv.center.pairs, ld = coef_row_floats(S);
  OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(center_coef_kernel<D>,
                                                dim3(kv.batch, num_q_heads, (ld + kCoefPerBlock - 1) / kCoefPerBlock),
                                                dim3(128), 0, pdl, stream, q, num_q_heads, gqa, kv.center,
                                                center_coef));
  const size_t smem = sizeof(float) * size_t(kBiasPages + kBiasHeads) * ld;  // S <= 128: < 26 KB
  OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(
      page_bias_kernel, dim3(kv.batch, (max_seq_mid_pages + kBiasPages - 1) / kBiasPages), dim3(kBiasThreads), smem, pdl,
      stream, kv.mid.indptr, num_q_heads, S, kv.center.angles, kv.center.angle_start, center_coef, sm_scale_log2,
      page_bias));
  return cudaGetLastError();
}

#if !defined(OSCAR_CUDA_MIN_INSTANCES)
template cudaError_t launch_page_centering<64>(const kv::PagedKvView&, const float*, int, int, int, int,
                                               float, float*, float*, bool, cudaStream_t);
template cudaError_t launch_page_centering<256>(const kv::PagedKvView&, const float*, int, int, int, int,
                                                float, float*, float*, bool, cudaStream_t);
#endif
template cudaError_t launch_page_centering<128>(const kv::PagedKvView&, const float*, int, int, int, int,
                                                float, float*, float*, bool, cudaStream_t);

}  // namespace decode_impl

}  // namespace oscar::kernels::cuda
