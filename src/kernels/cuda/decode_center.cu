// Page centering in the decode (kernels/paged_kv.h MidCenter): the log2 shift
// of every middle page's logits, computed before the middle launch and added
// inside its loop (the kCenter instances of decode_split_kernel.cuh).
#include <cuda_runtime.h>

#include "kernels/cuda/decode_dispatch.h"
#include "kernels/cuda/decode_plan.h"

namespace oscar::kernels::cuda {

namespace {

// Page centering (kernels/paged_kv.h MidCenter): the logits of middle page i of sequence b
// move by q̃·δ_h(t_i) = Σ_s A_s cos_s + B_s sin_s − C, one number per (page, query head)
// that the middle loop adds to the page's logits.
// center_coef_kernel: per (sequence, query head) A_s = q̃·u[h][s], B_s = q̃·w[h][s],
// C = q̃·mu[h] into coef [batch][Hq][2S+1] (one warp per dot product).
template <int D>
__global__ void __launch_bounds__(128) center_coef_kernel(const float* q, int num_q_heads, int gqa,
                                                          kv::MidCenter c, float* coef) {
  const int b = blockIdx.x, hq = blockIdx.y, h = hq / gqa, S = c.pairs;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* qr = q + (int64_t(b) * num_q_heads + hq) * D;
  float* out = coef + (int64_t(b) * num_q_heads + hq) * (2 * S + 1);
  for (int i = warp; i < 2 * S + 1; i += 4) {
    const float* v = i == 2 * S ? (c.mu ? c.mu + int64_t(h) * D : nullptr)
                                : ((i & 1) ? c.w : c.u) + (int64_t(h) * S + i / 2) * D;
    float acc = 0.0f;
    if (v)
      for (int k = lane; k < D; k += 32) acc += qr[k] * v[k];
#pragma unroll
    for (int o = 16; o; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) out[i] = acc;
  }
}

// page_bias [mid page][Hq]: the log2-domain shift of each middle page (indexed like the angle
// table: the global page-table slot, mid.indptr[b] + i). Each block takes `per_block` pages
// of every query head; a page's sequence is found by bisection of mid.indptr.
__global__ void __launch_bounds__(128) page_bias_kernel(const int32_t* mid_indptr, int batch, int num_pages,
                                                        int per_block, int num_q_heads, int S,
                                                        const float* angles, const float* coef,
                                                        float scale_log2, float* bias) {
  const int first = blockIdx.x * per_block;
  for (int i = threadIdx.x; i < per_block * num_q_heads; i += blockDim.x) {
    const int page = first + i / num_q_heads, hq = i % num_q_heads;
    if (page >= num_pages) break;
    int lo = 0, hi = batch;  // the b with indptr[b] <= page < indptr[b + 1]
    while (hi - lo > 1) {
      const int mid = (lo + hi) >> 1;
      if (__ldg(mid_indptr + mid) <= page) lo = mid; else hi = mid;
    }
    const float* cs = angles + int64_t(page) * 2 * S;
    const float* cf = coef + (int64_t(lo) * num_q_heads + hq) * (2 * S + 1);
    float acc = -cf[2 * S];
    for (int s = 0; s < S; ++s) acc += cf[2 * s] * cs[2 * s] + cf[2 * s + 1] * cs[2 * s + 1];
    bias[int64_t(page) * num_q_heads + hq] = acc * scale_log2;
  }
}

}  // namespace

namespace decode_impl {

template <int D>
cudaError_t launch_page_centering(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                                  int gqa, int num_mid_pages, float sm_scale_log2,
                                  float* center_coef, float* page_bias, cudaStream_t stream) {
  if (num_mid_pages <= 0) return cudaSuccess;
  center_coef_kernel<D><<<dim3(kv.batch, num_q_heads), 128, 0, stream>>>(q, num_q_heads, gqa,
                                                                         kv.center, center_coef);
  const int per_block = num_q_heads >= 128 ? 1 : 128 / num_q_heads;
  page_bias_kernel<<<(num_mid_pages + per_block - 1) / per_block, 128, 0, stream>>>(
      kv.mid.indptr, kv.batch, num_mid_pages, per_block, num_q_heads, kv.center.pairs, kv.center.angles,
      center_coef, sm_scale_log2, page_bias);
  return cudaGetLastError();
}

#if !defined(OSCAR_CUDA_MIN_INSTANCES)
template cudaError_t launch_page_centering<64>(const kv::PagedKvView&, const float*, int, int,
                                               int, float, float*, float*,
                                               cudaStream_t);
template cudaError_t launch_page_centering<256>(const kv::PagedKvView&, const float*, int, int,
                                                int, float, float*, float*,
                                                cudaStream_t);
#endif
template cudaError_t launch_page_centering<128>(const kv::PagedKvView&, const float*, int, int,
                                                int, float, float*, float*,
                                                cudaStream_t);

}  // namespace decode_impl

}  // namespace oscar::kernels::cuda
