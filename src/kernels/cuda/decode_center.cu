// Page centering in the decode (kernels/paged_kv.h MidCenter): each query's
// coefficients, computed before the middle launch, whose CTAs (the kCenter
// instances of decode_split_kernel.cuh) turn them into their pages' log2 shifts
// and add those inside the loop.
#include <cuda_runtime.h>

#include "kernels/cuda/decode_args.cuh"
#include "kernels/cuda/decode_dispatch.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_plan.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

using decode_impl::coef_row_floats;

// Page centering (kernels/paged_kv.h MidCenter): the logits of middle page i of sequence b
// move by q̃·δ_h(t_i) = Σ_s A_s cos_s + B_s sin_s − C, one number per (page, query head)
// that the middle loop adds to the page's logits (decode_split_kernel.cuh, stage_page_bias).
// This kernel runs between the query's rotation and the middle launch, on the step's critical
// path, so it is written for latency: every load a warp needs is issued before its first
// reduction.
//
// center_coef_kernel: per (sequence, query head) A_s = q̃·u[h][s], B_s = q̃·w[h][s],
// C = q̃·mu[h] into coef [batch][Hq][ld] as (A_s, B_s) pairs, C, then zeros up to
// ld = coef_row_floats(S) (decode_args.cuh). Grid (batch, Hq, ⌈ld/32⌉), four warps of
// kCoefPerWarp entries each; lane l holds q̃[l·D/32 ..] and the same slice of each vector.
constexpr int kCoefPerWarp = 8, kCoefPerBlock = 4 * kCoefPerWarp;
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

}  // namespace

namespace decode_impl {

template <int D>
cudaError_t launch_center_coef(const kv::PagedKvView& kv, const float* q, int num_q_heads, int gqa,
                               float* center_coef, bool pdl, cudaStream_t stream) {
  const int ld = coef_row_floats(kv.center.pairs);
  OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(center_coef_kernel<D>,
                                                dim3(kv.batch, num_q_heads, (ld + kCoefPerBlock - 1) / kCoefPerBlock),
                                                dim3(128), 0, pdl, stream, q, num_q_heads, gqa, kv.center,
                                                center_coef));
  return cudaGetLastError();
}

#if !defined(OSCAR_CUDA_MIN_INSTANCES)
template cudaError_t launch_center_coef<64>(const kv::PagedKvView&, const float*, int, int, float*, bool,
                                              cudaStream_t);
template cudaError_t launch_center_coef<256>(const kv::PagedKvView&, const float*, int, int, float*, bool,
                                              cudaStream_t);
#endif
template cudaError_t launch_center_coef<128>(const kv::PagedKvView&, const float*, int, int, float*, bool,
                                              cudaStream_t);

}  // namespace decode_impl

}  // namespace oscar::kernels::cuda
