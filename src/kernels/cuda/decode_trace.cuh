// The decode kernels' CTA timeline, a build-time diagnostic
// (-DOSCAR_DECODE_TRACE, bench_decode --trace); without it the macros are
// empty and the kernels are as if they were not there.
#pragma once

#include <cuda_runtime.h>

namespace oscar::kernels::cuda {

namespace {

// Build-time diagnostic (-DOSCAR_DECODE_TRACE, bench_decode --trace): every
// CTA of the split and merge kernels records (kind, block, start, first data,
// loop end, end, SM) with %globaltimer into a device buffer set by
// set_decode_trace. "First data": warp 0's first tiles have arrived (split
// kernels) or the wait for the split kernels is over (merge); "loop end":
// warp 0 has left its tile loop (split) or equals the end (merge).
#if defined(OSCAR_DECODE_TRACE)
__device__ unsigned long long* g_decode_trace = nullptr;
__device__ int g_decode_trace_cap = 0;
__device__ __forceinline__ unsigned long long globaltimer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
constexpr int kTraceWords = 10;  // per CTA: id, start, first data, loop end of warps 0-3, end, SM, 0
__device__ __forceinline__ void trace_cta(int kind, unsigned long long t0, unsigned long long t1,
                                          unsigned long long t2) {
  __shared__ unsigned long long s_loop[4];
  const unsigned long long tw = t2 ? t2 : globaltimer_ns();
  if ((threadIdx.x & 31) == 0 && threadIdx.x < 128) s_loop[threadIdx.x >> 5] = tw;
  __syncthreads();
  if (threadIdx.x != 0 || !g_decode_trace) return;
  const unsigned long long i = atomicAdd(g_decode_trace, 1ull);
  if (i >= static_cast<unsigned long long>(g_decode_trace_cap)) return;
  unsigned sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  unsigned long long* e = g_decode_trace + 1 + kTraceWords * i;
  const unsigned long long t3 = globaltimer_ns();
  // Split kernels: head (grid x) and launch position (grid y); merge: q head and sequence.
  const unsigned hi = kind == 2 ? blockIdx.y : blockIdx.x, lo = kind == 2 ? blockIdx.x : blockIdx.y;
  e[0] = (static_cast<unsigned long long>(kind) << 48) | (static_cast<unsigned long long>(hi) << 24) | lo;
  e[1] = t0;
  e[2] = t1 ? t1 : t3;
  for (int w = 0; w < 4; ++w) e[3 + w] = w * 32 < blockDim.x ? s_loop[w] : t3;
  e[7] = t3;
  e[8] = sm;
  e[9] = 0;
}
// This .cu's copy of the buffer's address (every .cu is a device module of
// its own: set_decode_trace sets each, decode_dispatch.h).
inline cudaError_t set_trace_symbols(unsigned long long* buf, int capacity) {
  cudaError_t e = cudaMemcpyToSymbol(g_decode_trace, &buf, sizeof(buf));
  if (e == cudaSuccess) e = cudaMemcpyToSymbol(g_decode_trace_cap, &capacity, sizeof(capacity));
  return e;
}
#define OSCAR_TRACE_BEGIN \
  const unsigned long long trace_t0 = globaltimer_ns(); \
  unsigned long long trace_t1 = 0, trace_t2 = 0
#define OSCAR_TRACE_MARK(v) \
  do {                      \
    if (!v) v = globaltimer_ns(); \
  } while (0)
#define OSCAR_TRACE_END(kind) trace_cta(kind, trace_t0, trace_t1, trace_t2)
#else
#define OSCAR_TRACE_BEGIN
#define OSCAR_TRACE_MARK(v)
#define OSCAR_TRACE_END(kind)
#endif

}  // namespace

}  // namespace oscar::kernels::cuda
