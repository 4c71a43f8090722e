// Page centering in the decode (kernels/paged_kv.h MidCenter): each middle
// chunk's log2 shift, computed before the middle launch and added by the
// merge (decode_merge.cu).
#include <cuda_runtime.h>

#include "kernels/cuda/decode_dispatch.h"
#include "kernels/cuda/decode_plan.h"

namespace oscar::kernels::cuda {

namespace {

// Page centering (kernels/paged_kv.h MidCenter): the logits of middle page i of sequence b
// move by q̃·δ_h(t_i) = Σ_s A_s cos_s + B_s sin_s − C. With one page per middle chunk
// (check_decode), that is a shift of the chunk's partial lse, added by merge_kernel.
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

// chunk_bias [chunk id][Hq]: the log2-domain shift of each chunk's partial (0 for window
// chunks). One block per launch-order entry (upload_plan's table).
__global__ void __launch_bounds__(128) chunk_bias_kernel(const int4* chunks, int tiles_per_page, int num_q_heads,
                                                         int S, const float* angles, const float* coef,
                                                         float scale_log2, float* bias) {
  const int4 c = chunks[2 * blockIdx.x], c2 = chunks[2 * blockIdx.x + 1];
  const int b = c.x & 0xffffff, region = c.x >> 24, t0 = c.y, id = c.w;
  for (int hq = threadIdx.x; hq < num_q_heads; hq += blockDim.x) {
    float v = 0.0f;
    if (region == 1) {
      const float* cs = angles + (int64_t(c2.x) + t0 / tiles_per_page) * 2 * S;
      const float* cf = coef + (int64_t(b) * num_q_heads + hq) * (2 * S + 1);
      float acc = -cf[2 * S];
      for (int s = 0; s < S; ++s) acc += cf[2 * s] * cs[2 * s] + cf[2 * s + 1] * cs[2 * s + 1];
      v = acc * scale_log2;
    }
    bias[int64_t(id) * num_q_heads + hq] = v;
  }
}

}  // namespace

namespace decode_impl {

template <int D>
cudaError_t launch_page_centering(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                                  int gqa, const int4* chunks, int num_chunks, float sm_scale_log2,
                                  float* center_coef, float* chunk_bias, cudaStream_t stream) {
  center_coef_kernel<D><<<dim3(kv.batch, num_q_heads), 128, 0, stream>>>(q, num_q_heads, gqa,
                                                                         kv.center, center_coef);
  chunk_bias_kernel<<<num_chunks, 128, 0, stream>>>(chunks, kv.page_size / kTileTokens, num_q_heads,
                                                    kv.center.pairs, kv.center.angles, center_coef,
                                                    sm_scale_log2, chunk_bias);
  return cudaGetLastError();
}

#if !defined(OSCAR_CUDA_MIN_INSTANCES)
template cudaError_t launch_page_centering<64>(const kv::PagedKvView&, const float*, int, int,
                                               const int4*, int, float, float*, float*,
                                               cudaStream_t);
template cudaError_t launch_page_centering<256>(const kv::PagedKvView&, const float*, int, int,
                                                const int4*, int, float, float*, float*,
                                                cudaStream_t);
#endif
template cudaError_t launch_page_centering<128>(const kv::PagedKvView&, const float*, int, int,
                                                const int4*, int, float, float*, float*,
                                                cudaStream_t);

}  // namespace decode_impl

}  // namespace oscar::kernels::cuda
