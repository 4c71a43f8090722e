// The decode's merge launch: the chunks' partial outputs of each sequence
// combined by log-sum-exp (plans without fused windows; the fused window
// kernel merges in its own epilogue, decode_split_kernel.cuh).
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/decode_dispatch.h"
#include "kernels/cuda/decode_trace.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

using namespace detail;

// Merges the chunks of each sequence: grid (batch, Hq), kMergeWarps warps.
// A sequence at batch 1 has tens of chunks and the merge is latency-bound:
// warp w takes chunks w, w + kMergeWarps, ..., U at a time with all their
// loads (log-sum-exp and output) in flight, each lane D/32 channels, with a
// running maximum (one pass); the warps combine in shared memory. Launched
// as a programmatic dependent of the split kernels: reads the plan's table
// first, then waits for them.
constexpr int kMergeWarps = 8;
template <int D>
__global__ void __launch_bounds__(32 * kMergeWarps) merge_kernel(const int32_t* seq_chunk_ptr,
                                                                const float* partial_o,
                                                                const float* partial_lse,
                                                                int num_q_heads, float* o, float* lse) {
  constexpr int V = D / 32, U = 4;
  __shared__ float s_m[kMergeWarps];
  __shared__ float s_l[kMergeWarps];
  __shared__ float s_o[kMergeWarps][D];
  OSCAR_TRACE_BEGIN;
  const int b = blockIdx.x, hq = blockIdx.y, tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
  const int c0 = seq_chunk_ptr[b], c1 = seq_chunk_ptr[b + 1];  // uploaded before the step
  pdl_wait();
  OSCAR_TRACE_MARK(trace_t1);
  float M = -INFINITY, L = 0.0f, acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.0f;
  for (int c = c0 + wid; c < c1; c += U * kMergeWarps) {
    float wt[U], x[U][V];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cu = c + u * kMergeWarps;
      const int64_t row = int64_t(cu < c1 ? cu : c) * num_q_heads + hq;
      wt[u] = cu < c1 ? partial_lse[row] : -INFINITY;
      const float* po = partial_o + row * D + lane * V;
      if constexpr (V % 4 == 0) {
#pragma unroll
        for (int v = 0; v < V; v += 4) {
          const float4 t = *reinterpret_cast<const float4*>(po + v);
          x[u][v] = t.x, x[u][v + 1] = t.y, x[u][v + 2] = t.z, x[u][v + 3] = t.w;
        }
      } else {
        static_assert(V == 2, "head_dim 64, 128 or 256");
        const float2 t = *reinterpret_cast<const float2*>(po);
        x[u][0] = t.x, x[u][1] = t.y;
      }
    }
    float Mn = M;
#pragma unroll
    for (int u = 0; u < U; ++u) Mn = fmax_nan(Mn, wt[u]);  // a NaN lse (corrupt row) propagates
    if (Mn == -INFINITY) continue;  // no tokens so far (empty chunks)
    const float sc = exp2f(M - Mn);  // M = -inf -> 0
    L *= sc;
#pragma unroll
    for (int v = 0; v < V; ++v) acc[v] *= sc;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float w = exp2f(wt[u] - Mn);  // -inf (no chunk, empty chunk) -> 0
      L += w;
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += w * x[u][v];
    }
    M = Mn;
  }
#pragma unroll
  for (int v = 0; v < V; ++v) s_o[wid][lane * V + v] = acc[v];
  if (lane == 0) {
    s_m[wid] = M;
    s_l[wid] = L;
  }
  __syncthreads();
  float Mt = -INFINITY;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) Mt = fmax_nan(Mt, s_m[w]);
  float sw[kMergeWarps], Lt = 0.0f;
#pragma unroll
  for (int w = 0; w < kMergeWarps; ++w) {
    sw[w] = Mt == -INFINITY ? 0.0f : exp2f(s_m[w] - Mt);
    Lt += sw[w] * s_l[w];
  }
  const int64_t orow = int64_t(b) * num_q_heads + hq;
  for (int ch = tid; ch < D; ch += 32 * kMergeWarps) {
    float O = 0.0f;
#pragma unroll
    for (int w = 0; w < kMergeWarps; ++w) O += sw[w] * s_o[w][ch];
    o[orow * D + ch] = Lt != 0.0f ? O / Lt : 0.0f;  // empty: Lt == 0 exactly; NaN stays NaN
  }
  if (lse && tid == 0) lse[orow] = Lt != 0.0f ? (Mt + log2f(Lt)) * 0.6931471805599453f : -INFINITY;
  OSCAR_TRACE_END(2);
}

}  // namespace

namespace decode_impl {

template <int D>
cudaError_t launch_merge(dim3 grid, bool pdl, cudaStream_t stream, const int32_t* seq_chunk_ptr,
                         const float* partial_o, const float* partial_lse, int num_q_heads,
                         float* o, float* lse) {
  return launch_pdl(merge_kernel<D>, grid, dim3(32 * kMergeWarps), 0, pdl, stream, seq_chunk_ptr,
                    partial_o, partial_lse, num_q_heads, o, lse);
}

#if !defined(OSCAR_CUDA_MIN_INSTANCES)
template cudaError_t launch_merge<64>(dim3, bool, cudaStream_t, const int32_t*, const float*,
                                      const float*, int, float*, float*);
template cudaError_t launch_merge<256>(dim3, bool, cudaStream_t, const int32_t*, const float*,
                                       const float*, int, float*, float*);
#endif
template cudaError_t launch_merge<128>(dim3, bool, cudaStream_t, const int32_t*, const float*,
                                       const float*, int, float*, float*);

#if defined(OSCAR_DECODE_TRACE)
cudaError_t set_merge_trace(unsigned long long* buf, int capacity) {
  return set_trace_symbols(buf, capacity);
}
#endif

}  // namespace decode_impl

}  // namespace oscar::kernels::cuda
