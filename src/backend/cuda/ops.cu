#include "backend/cuda/ops.cuh"

#include <algorithm>
#include <cfloat>

#include "core/half.h"
#include "core/quant_format.h"
#include "kernels/cuda/bf16x4.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/rotate_row.cuh"

namespace oscar::backend::cuda_ops {

namespace {

constexpr int kThreads = 256;

// Programmatic dependent launch (sm_90): the kernels of a step are launched so that
// the next may be scheduled while this one runs. Each kernel lets its dependents start
// at once (pdl_enter), then waits until the launch before it has completed and its
// writes are visible before it touches anything that launch could have produced or read
// (every input and output but the weights). Off (set_pdl) they are plain launches; the
// instructions are no-ops then.
bool g_pdl = false;
using kernels::cuda::detail::pdl_wait;
__device__ __forceinline__ void pdl_enter() {
  kernels::cuda::detail::pdl_launch_dependents();
  pdl_wait();
}
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t st, Args&&... args) {
  kernels::cuda::detail::launch_pdl(kernel, grid, block, 0, g_pdl, st, std::forward<Args>(args)...);
}

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__global__ void cast_bf16_k(const float* x, __nv_bfloat16* y, int64_t n) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void cast_bf16_4_k(const float* x, __nv_bfloat16* y, int64_t n4) {  // n % 4 == 0, aligned
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n4;
       i += int64_t(gridDim.x) * blockDim.x) {
    reinterpret_cast<uint2*>(y)[i] = kernels::cuda::pack_bf16x4(reinterpret_cast<const float4*>(x)[i]);
  }
}

__global__ void add_bias_k(float* y, const float* b, int rows, int cols) {
  pdl_enter();
  const int64_t n = int64_t(rows) * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    y[i] += b[i % cols];
}

// One block per row. The loads are unrolled so that a thread's few loads are in
// flight together: a rolled loop waits one memory latency per element, and was 10 us
// for a 4096-wide row at batch 1 (measured under Nsight Compute on the H200).
__global__ void rms_norm_k(const float* x, const float* w, int dim, float eps, float* y, __nv_bfloat16* yb) {
  pdl_enter();
  const float* xr = x + int64_t(blockIdx.x) * dim;
  float* yr = y + int64_t(blockIdx.x) * dim;
  double ss = 0;
  if (dim % 4 == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
#pragma unroll 4
    for (int c = threadIdx.x; c < dim / 4; c += blockDim.x) {
      const float4 v = x4[c];
      ss += double(v.x) * v.x + double(v.y) * v.y + double(v.z) * v.z + double(v.w) * v.w;
    }
  } else {
#pragma unroll 4
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += double(xr[c]) * xr[c];
  }
  __shared__ double red[kThreads / 32];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    double v = threadIdx.x < blockDim.x / 32 ? red[threadIdx.x] : 0.0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = static_cast<float>(1.0 / sqrt(red[0] / dim + eps));
  if (dim % 4 == 0) {
    const float4* x4 = reinterpret_cast<const float4*>(xr);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    float4* y4 = reinterpret_cast<float4*>(yr);
#pragma unroll 4
    for (int c = threadIdx.x; c < dim / 4; c += blockDim.x) {
      const float4 v = x4[c], g = w4[c];
      const float4 o = make_float4(v.x * inv * g.x, v.y * inv * g.y, v.z * inv * g.z, v.w * inv * g.w);
      y4[c] = o;
      if (yb) {
        __nv_bfloat162* b2 = reinterpret_cast<__nv_bfloat162*>(yb + int64_t(blockIdx.x) * dim) + 2 * c;
        b2[0] = __floats2bfloat162_rn(o.x, o.y);
        b2[1] = __floats2bfloat162_rn(o.z, o.w);
      }
    }
  } else {
#pragma unroll 4
    for (int c = threadIdx.x; c < dim; c += blockDim.x) {
      const float o = xr[c] * inv * w[c];
      yr[c] = o;
      if (yb) yb[int64_t(blockIdx.x) * dim + c] = __float2bfloat16_rn(o);
    }
  }
}

__global__ void rope_k(float* x, int n, int heads, int d, const float* cos, const float* sin) {
  pdl_enter();
  const int h = d / 2;
  const int64_t total = int64_t(n) * heads * h;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % h);
    const int64_t row = i / h;  // t * heads + g
    const int64_t t = row / heads;
    float* v = x + row * d;
    const float a = v[c], b = v[c + h];
    const float cs = cos[t * h + c], sn = sin[t * h + c];
    v[c] = a * cs - b * sn;
    v[c + h] = b * cs + a * sn;
  }
}

// One block per (token, head), one thread per rotate-half pair (c, c + d/2).
__global__ void qkv_heads_k(const float* qkv, int Hq, int Hkv, int d, const float* qn, const float* kn,
                            float eps, const float* cos, const float* sin, float* q, float* k, float* v) {
  pdl_enter();
  const int t = blockIdx.x, g = blockIdx.y, h = d / 2, c = threadIdx.x;
  const bool on = c < h;  // the block is whole warps (the shuffles); lanes past d/2 add 0
  const int Dq = Hq * d, Dkv = Hkv * d;
  const float* src = qkv + int64_t(t) * (Dq + 2 * Dkv) + int64_t(g) * d;
  float a = on ? src[c] : 0.0f, b = on ? src[c + h] : 0.0f;
  if (g >= Hq + Hkv) {  // a value head: copied (block-uniform branch)
    float* dst = v + int64_t(t) * Dkv + int64_t(g - Hq - Hkv) * d;
    if (on) dst[c] = a, dst[c + h] = b;
    return;
  }
  const bool is_q = g < Hq;
  const float* w = is_q ? qn : kn;
  if (w) {
    double ss = double(a) * a + double(b) * b;
    __shared__ double red[32];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (c % 32 == 0) red[c / 32] = ss;
    __syncthreads();
    if (c < 32) {
      double r = c < int(blockDim.x) / 32 ? red[c] : 0.0;
      for (int o = 16; o > 0; o >>= 1) r += __shfl_xor_sync(0xffffffffu, r, o);
      if (c == 0) red[0] = r;
    }
    __syncthreads();
    const float inv = static_cast<float>(1.0 / sqrt(red[0] / d + eps));
    if (!on) return;
    a = a * inv * w[c];
    b = b * inv * w[c + h];
  }
  if (!on) return;
  const float cs = cos[int64_t(t) * h + c], sn = sin[int64_t(t) * h + c];
  float* dst = is_q ? q + int64_t(t) * Dq + int64_t(g) * d : k + int64_t(t) * Dkv + int64_t(g - Hq) * d;
  dst[c] = a * cs - b * sn;
  dst[c + h] = b * cs + a * sn;
}

// One head of d = 64 P channels (64, 128, 256) by one warp: lane l takes the rotate-half pairs
// (c, c + d/2) for c = P l .. P l + P - 1 of the head's row `src`, RMS-norms them with w when it is
// set (the sum in fp64 over shuffles only: every lane must call this), then applies RoPE with the
// token's tables cs / sn [d/2]. lo[j], hi[j]: channels P l + j and P l + j + d/2.
template <int P>
__device__ __forceinline__ void head_pairs(const float* src, const float* w, float eps, const float* cs,
                                           const float* sn, int lane, float (&lo)[P], float (&hi)[P]) {
  constexpr int d = 64 * P, h = d / 2;
  const int c0 = lane * P;
  float a[P], b[P];
#pragma unroll
  for (int j = 0; j < P; ++j) a[j] = src[c0 + j], b[j] = src[c0 + j + h];
  if (w) {
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < P; ++j) ss += double(a[j]) * a[j] + double(b[j]) * b[j];
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = static_cast<float>(1.0 / sqrt(ss / d + eps));
#pragma unroll
    for (int j = 0; j < P; ++j) a[j] = a[j] * inv * w[c0 + j], b[j] = b[j] * inv * w[c0 + j + h];
  }
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const float c = cs[c0 + j], s = sn[c0 + j];
    lo[j] = a[j] * c - b[j] * s;
    hi[j] = b[j] * c + a[j] * s;
  }
}

// The same for d = 64 P (64, 128, 256): one warp per (token, head) (head_pairs). Blocks of
// 8 warps: the kernel above, a block of d/2 threads per (token, head) with two barriers, took
// 0.47 ms for an 8192-token chunk of Qwen3-8B (48 heads; Nsight Compute, H200), ~5x the time
// its 400 MB of traffic need.
template <int P>
__global__ void __launch_bounds__(256) qkv_heads_warp_k(const float* qkv, int n, int Hq, int Hkv, const float* qn,
                                                        const float* kn, float eps, const float* cos,
                                                        const float* sin, float* q, float* k, float* v) {
  pdl_enter();
  constexpr int d = 64 * P, h = d / 2;
  const int lane = threadIdx.x & 31, heads = Hq + 2 * Hkv;
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;  // warp-uniform
  if (item >= int64_t(n) * heads) return;
  const int t = int(item / heads), g = int(item % heads), c0 = lane * P;
  const int Dq = Hq * d, Dkv = Hkv * d;
  const float* src = qkv + int64_t(t) * (Dq + 2 * Dkv) + int64_t(g) * d;
  if (g >= Hq + Hkv) {  // a value head: copied
    float* dst = v + int64_t(t) * Dkv + int64_t(g - Hq - Hkv) * d + c0;
#pragma unroll
    for (int j = 0; j < P; ++j) dst[j] = src[c0 + j], dst[j + h] = src[c0 + j + h];
    return;
  }
  const bool is_q = g < Hq;
  float lo[P], hi[P];
  head_pairs<P>(src, is_q ? qn : kn, eps, cos + int64_t(t) * h, sin + int64_t(t) * h, lane, lo, hi);
  float* dst = (is_q ? q + int64_t(t) * Dq + int64_t(g) * d : k + int64_t(t) * Dkv + int64_t(g - Hq) * d) + c0;
#pragma unroll
  for (int j = 0; j < P; ++j) dst[j] = lo[j], dst[j + h] = hi[j];
}

// The BF16 cache row of token t's KV head h (pools [page][Hkv][page_size][d], as write_bf16_tokens).
__device__ __forceinline__ int64_t cache_row(const QkvHeadsCache& a, int t, int h) {
  return (int64_t(a.pages[t]) * a.Hkv + h) * a.page_size + a.slots[t];
}

// A step's value head h of token t by one warp (qkv_heads_cache_k / qkv_heads_copy_k): copied to
// the f32 output and, rounded to BF16, into its cache row `slot`.
template <int D>
__device__ __forceinline__ void value_head(const QkvHeadsCache& a, const float* row, int t, int h, int64_t slot,
                                           int lane) {
  const float* src = row + int64_t(a.Hq + a.Hkv + h) * D;
  for (int c = lane; c < D; c += 32) {
    const float v = src[c];
    a.v[(int64_t(t) * a.Hkv + h) * D + c] = v;
    a.cache_v[slot * D + c] = f32_to_bf16(v);
  }
}

// Backend::qkv_heads_into_cache for a step of few rows (qkv_heads_cache below), for a layer with a
// transform (qkv_heads_copy_k below: one without): in one launch what three did, the head split,
// QK-norm and RoPE of qkv_heads_warp_k (head_pairs), the query / key transform of kernels/cuda
// rotate_kernel (the same RowRotation product) and the BF16 write of the store's write_bf16. One
// block of 256 threads per (token, query head) and per (token, KV head): warp 0 makes the head's
// row (a key less the key mean) in shared memory, which the block multiplies by the head's
// matrix; the block of KV head h also copies value head h (warp 1). Keys and values go to their f32
// outputs and, rounded to BF16, into their cache slots. The slice of the matrix a thread multiplies
// by is loaded before the wait for the QKV product (it is a constant), so the product starts with
// it in registers (at d <= 128).
template <int P>
__global__ void __launch_bounds__(256) qkv_heads_cache_k(const QkvHeadsCache a) {
  constexpr int D = 64 * P, h2 = D / 2;
  using Rot = kernels::cuda::detail::RowRotation<D>;
  constexpr bool kPrefetch = D <= 128;  // kJ float4 registers: 16 at d = 128, 64 at d = 256
  __shared__ float x[D];
  __shared__ float4 part[Rot::kParts][Rot::kCols];
  const int heads = a.Hq + a.Hkv;
  const int t = int(blockIdx.x / heads), g = int(blockIdx.x % heads);
  const bool is_q = g < a.Hq;
  const int h = is_q ? g : g - a.Hq;  // query head, or KV head
  const float* R = (is_q ? a.Rq : a.Rk) + int64_t(h / ((is_q ? a.Hq : a.Hkv) / a.r_heads)) * D * D;
  const float4* R4 = reinterpret_cast<const float4*>(R);
  const Rot rot;
  float4 rp[kPrefetch ? Rot::kJ : 1];
  if constexpr (kPrefetch)
#pragma unroll
    for (int jj = 0; jj < Rot::kJ; ++jj) rp[jj] = __ldg(rot.r_at(R4, jj));
  pdl_enter();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* row = a.qkv + int64_t(t) * (a.Hq + 2 * a.Hkv) * D;
  const int64_t slot = is_q ? 0 : cache_row(a, t, h);
  if (!is_q && warp == 1) value_head<D>(a, row, t, h, slot, lane);
  if (warp == 0) {
    float lo[P], hi[P];
    head_pairs<P>(row + int64_t(g) * D, is_q ? a.qn : a.kn, a.eps, a.cos + int64_t(t) * h2, a.sin + int64_t(t) * h2,
                  lane, lo, hi);
    const float* mean = !is_q && a.k_mean ? a.k_mean + int64_t(h) * D : nullptr;
#pragma unroll
    for (int j = 0; j < P; ++j) {  // rotate_kernel's x: the key less its mean
      const int c = lane * P + j;
      x[c] = mean ? lo[j] - mean[c] : lo[j];
      x[c + h2] = mean ? hi[j] - mean[c + h2] : hi[j];
    }
  }
  __syncthreads();
  part[rot.p][rot.cg] = rot.partial(x, [&](int jj) {
    if constexpr (kPrefetch)
      return rp[jj];
    else
      return __ldg(rot.r_at(R4, jj));
  });
  __syncthreads();
  float* out = is_q ? a.q + (int64_t(t) * a.Hq + h) * D : a.k + (int64_t(t) * a.Hkv + h) * D;
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    const float sum = Rot::column(part, c);
    out[c] = sum;
    if (!is_q) a.cache_k[slot * D + c] = f32_to_bf16(sum);
  }
}

// The same for a layer without a transform (the BF16 cache, identity layers): nothing goes through
// shared memory, so one warp per (token, query head) and per (token, KV head), eight to a block,
// as qkv_heads_warp_k; a KV head's warp also copies its value head.
template <int P>
__global__ void __launch_bounds__(256) qkv_heads_copy_k(const QkvHeadsCache a) {
  constexpr int D = 64 * P, h2 = D / 2;
  pdl_enter();
  const int heads = a.Hq + a.Hkv, lane = threadIdx.x & 31;
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;  // warp-uniform
  if (item >= int64_t(a.n) * heads) return;
  const int t = int(item / heads), g = int(item % heads);
  const bool is_q = g < a.Hq;
  const int h = is_q ? g : g - a.Hq;
  const float* row = a.qkv + int64_t(t) * (a.Hq + 2 * a.Hkv) * D;
  float lo[P], hi[P];
  head_pairs<P>(row + int64_t(g) * D, is_q ? a.qn : a.kn, a.eps, a.cos + int64_t(t) * h2, a.sin + int64_t(t) * h2,
                lane, lo, hi);
  float* out = is_q ? a.q + (int64_t(t) * a.Hq + h) * D : a.k + (int64_t(t) * a.Hkv + h) * D;
  const int64_t slot = is_q ? 0 : cache_row(a, t, h);
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const int c = lane * P + j;
    out[c] = lo[j];
    out[c + h2] = hi[j];
    if (!is_q) {
      a.cache_k[slot * D + c] = f32_to_bf16(lo[j]);
      a.cache_k[slot * D + c + h2] = f32_to_bf16(hi[j]);
    }
  }
  if (!is_q) value_head<D>(a, row, t, h, slot, lane);
}

// Argmax of each row in two kernels: blocks of kArgChunk columns each find their best
// (value, index), then one block per row reduces those. One block per row alone (a rolled
// loop of 600 loads per thread) took 150 us for 151,936 columns on the H200.
constexpr int kArgChunk = 4096;
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
  return v == v && (bi < 0 || v > bv || (v == bv && i < bi));
}
// The block's best (bv, bi) into thread 0's (bv, bi).
__device__ __forceinline__ void block_best(float& bv, int& bi) {
  for (int o = 16; o > 0; o >>= 1) {
    const float v = __shfl_xor_sync(0xffffffffu, bv, o);
    const int i = __shfl_xor_sync(0xffffffffu, bi, o);
    if (i >= 0 && better(v, i, bv, bi)) bv = v, bi = i;
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int si[kThreads / 32];
  if (threadIdx.x % 32 == 0) sv[threadIdx.x / 32] = bv, si[threadIdx.x / 32] = bi;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < int(blockDim.x) / 32; ++w)
      if (si[w] >= 0 && better(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
}
__global__ void argmax_part_k(const float* x, int cols, float* pv, int* pi) {
  pdl_enter();
  const float* row = x + int64_t(blockIdx.y) * cols;
  const int c0 = blockIdx.x * kArgChunk, c1 = min(cols, c0 + kArgChunk);
  float bv = 0.0f;
  int bi = -1;
#pragma unroll 4
  for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
    const float v = row[c];
    if (better(v, c, bv, bi)) bv = v, bi = c;
  }
  block_best(bv, bi);
  if (threadIdx.x == 0) {
    pv[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = bv;
    pi[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = bi;
  }
}
__global__ void argmax_final_k(const float* pv, const int* pi, int chunks, int32_t* out) {
  pdl_enter();
  float bv = 0.0f;
  int bi = -1;
  for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
    const float v = pv[int64_t(blockIdx.x) * chunks + c];
    const int i = pi[int64_t(blockIdx.x) * chunks + c];
    if (i >= 0 && better(v, i, bv, bi)) bv = v, bi = i;
  }
  block_best(bv, bi);
  if (threadIdx.x == 0) out[blockIdx.x] = bi < 0 ? 0 : bi;
}

// gemv_bf16: each warp takes R consecutive rows of W and all N activation rows; per
// step a lane loads 8 weights (16 bytes) of each of its R rows and the 8 matching x of
// each activation row, U steps in flight. Rows of W are split over the grid, not K.
template <int N, int R>
__global__ void __launch_bounds__(256) gemv_bf16_k(const uint16_t* __restrict__ W, const float* __restrict__ x,
                                                   int out, int in, const float* __restrict__ bias, float beta,
                                                   float* __restrict__ y) {
  constexpr int U = 4;
  kernels::cuda::detail::pdl_launch_dependents();
  // The weights do not depend on earlier launches: the first loads are issued before
  // the wait, so a step's weight stream starts while the kernels before it finish.
  bool waited = false;
  const int lane = threadIdx.x % 32;
  const int warps = int(gridDim.x * blockDim.x / 32);
  for (int o0 = int((blockIdx.x * blockDim.x + threadIdx.x) / 32) * R; o0 < out; o0 += warps * R) {
    float acc[N][R];
#pragma unroll
    for (int t = 0; t < N; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r) acc[t][r] = 0.0f;
    const uint4* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const uint4*>(W + int64_t(min(o0 + r, out - 1)) * in);
    const int chunks = in / 8;  // 8 weights each
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
      uint4 wv[U][R];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r)
          if (c0 + 32 * u < chunks) wv[u][r] = __ldcs(wr[r] + c0 + 32 * u);  // streamed once: no L2 keep
      if (!waited) pdl_wait(), waited = true;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
        if (c >= chunks) break;
#pragma unroll
        for (int t = 0; t < N; ++t) {
          // x in fp32 as it is (rounding it to BF16 as cuBLAS takes it cost 4 % of the kernel's time and
          // did not make a row's logits independent of its batch: docs/history.md).
          const float4 xa = __ldg(reinterpret_cast<const float4*>(x + int64_t(t) * in) + 2 * c);
          const float4 xb = __ldg(reinterpret_cast<const float4*>(x + int64_t(t) * in) + 2 * c + 1);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const uint4 w = wv[u][r];
            float a = acc[t][r];
            a = fmaf(xa.x, __uint_as_float(w.x << 16), a);
            a = fmaf(xa.y, __uint_as_float(w.x & 0xffff0000u), a);
            a = fmaf(xa.z, __uint_as_float(w.y << 16), a);
            a = fmaf(xa.w, __uint_as_float(w.y & 0xffff0000u), a);
            a = fmaf(xb.x, __uint_as_float(w.z << 16), a);
            a = fmaf(xb.y, __uint_as_float(w.z & 0xffff0000u), a);
            a = fmaf(xb.z, __uint_as_float(w.w << 16), a);
            a = fmaf(xb.w, __uint_as_float(w.w & 0xffff0000u), a);
            acc[t][r] = a;
          }
        }
      }
    }
    if (!waited) pdl_wait(), waited = true;  // lanes past the last chunk read y below
#pragma unroll
    for (int t = 0; t < N; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int s = 16; s > 0; s >>= 1) acc[t][r] += __shfl_xor_sync(0xffffffffu, acc[t][r], s);
    // Lane t * R + r writes (t, o0 + r).
#pragma unroll
    for (int t = 0; t < N; ++t)
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (lane == (t * R + r) % 32 && o0 + r < out) {
          float v = acc[t][r];
          if (bias) v += bias[o0 + r];
          float* yp = y + int64_t(t) * out + o0 + r;
          *yp = beta != 0.0f ? v + beta * *yp : v;
        }
  }
}

template <int N>
void launch_gemv(const uint16_t* W, const float* x, int out, int in, const float* bias, float beta, float* y,
                 cudaStream_t st) {
  constexpr int R = N >= 4 ? 4 : 2;
  const int warps = (out + R - 1) / R;
  // Up to 8 resident blocks of 256 threads per SM on 132 SMs; more warps than rows idle.
  const int blocks = std::min((warps + 7) / 8, 132 * 8);
  launch(gemv_bf16_k<N, R>, blocks, 256, st, W, x, out, in, bias, beta, y);
}

// gemv_mma: the same product for 2-8 activation rows on the tensor cores (mma.sync
// m16n8k16, bf16 in, fp32 accumulation): W is the A operand (output rows x k), x^T the
// B operand (k x up to 8 activation rows), so one MMA does 16 x 16 weights for every
// row at once and each weight is read from memory once. A CTA owns 16 * MT output rows;
// its 8 warps split K into contiguous ranges of 32-wide chunks and reduce through
// shared memory.
//
// Fragment trick: the sum over k does not care in which order the MMA sees k, as long
// as A and B agree. Lane (g = lane/4, t = lane%4) loads 16 bytes = 8 consecutive
// weights k0 + 8t .. 8t+7 of rows g, g+8 (, g+16, g+24) and the 8 matching x of
// activation row g; the first MMA takes weights 0-3 of that slice as the fragment's
// k (2t, 2t+1) and (2t+8, 2t+9), the second MMA weights 4-7. So every load is a full
// 16-byte vector, with no shuffles and no shared-memory staging. Lanes with g >= n
// (activation rows past n) feed zeros. x is rounded to BF16 (as on the cuBLAS path).
constexpr int kGemvMmaWarps = 8;
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}
// MT: 16-row MMA tiles per CTA (and per warp); U: chunks of 32 k in flight per warp.
// Each warp streams one contiguous range of chunks. Measured on the H200 (bench_gemv,
// a Qwen3-8B layer at 2 rows): 78-82 % of copy bandwidth; with the chunks interleaved over
// the warps 69 % (MT 2, U 4), 61 % (MT 4, U 2), 70 % (MT 1, U 8).
template <int MT, int U>
__global__ void __launch_bounds__(32 * kGemvMmaWarps)
    gemv_mma_k(const uint16_t* __restrict__ W, const float* __restrict__ x, int n, int out, int in,
               const float* __restrict__ bias, float beta, float* __restrict__ y) {
  constexpr int kRows = 16 * MT;
  kernels::cuda::detail::pdl_launch_dependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int o0 = blockIdx.x * kRows;
  // Row pointers (rows past `out` read the last row; their results are not written).
  const uint4* wr[2 * MT];
#pragma unroll
  for (int i = 0; i < 2 * MT; ++i)
    wr[i] = reinterpret_cast<const uint4*>(W + int64_t(min(o0 + 8 * i + g, out - 1)) * in + 8 * t);
  const bool xon = g < n;
  const float4* xr = reinterpret_cast<const float4*>(x + int64_t(xon ? g : 0) * in + 8 * t);
  const int chunks = in / 32;
  const int per = (chunks + kGemvMmaWarps - 1) / kGemvMmaWarps;
  const int first = warp * per, last = min(chunks, first + per);
  float c[MT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) c[m][0] = c[m][1] = c[m][2] = c[m][3] = 0.0f;
  bool waited = false;
  for (int c0 = first; c0 < last; c0 += U) {
    uint4 wv[U][2 * MT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c0 + u;
#pragma unroll
      for (int i = 0; i < 2 * MT; ++i)
        if (cc < last) wv[u][i] = __ldcs(wr[i] + int64_t(cc) * 4);  // 32 weights = 4 uint4 per chunk
    }
    if (!waited) pdl_wait(), waited = true;  // x (and y below) come from earlier launches
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int cc = c0 + u;
      if (cc >= last) break;
      float4 xa = make_float4(0.f, 0.f, 0.f, 0.f), xb = xa;
      if (xon) xa = __ldg(xr + int64_t(cc) * 8), xb = __ldg(xr + int64_t(cc) * 8 + 1);
      const uint32_t b0 = pack_bf16x2(xa.x, xa.y), b1 = pack_bf16x2(xa.z, xa.w);
      const uint32_t b2 = pack_bf16x2(xb.x, xb.y), b3 = pack_bf16x2(xb.z, xb.w);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const uint4 lo = wv[u][2 * m], hi = wv[u][2 * m + 1];  // rows 16m + g and 16m + 8 + g
        kernels::cuda::detail::mma_bf16(c[m], lo.x, hi.x, lo.y, hi.y, b0, b1);
        kernels::cuda::detail::mma_bf16(c[m], lo.z, hi.z, lo.w, hi.w, b2, b3);
      }
    }
  }
  if (!waited) pdl_wait();
  // c[m][0..1] = (row 16m + g, activation rows 2t, 2t+1), c[m][2..3] = (row 16m + 8 + g, same).
  __shared__ float red[kGemvMmaWarps][kRows][8];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    red[warp][16 * m + g][2 * t] = c[m][0];
    red[warp][16 * m + g][2 * t + 1] = c[m][1];
    red[warp][16 * m + 8 + g][2 * t] = c[m][2];
    red[warp][16 * m + 8 + g][2 * t + 1] = c[m][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * 8; i += blockDim.x) {
    const int nn = i / kRows, r = i % kRows, o = o0 + r;
    if (nn >= n || o >= out) continue;
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kGemvMmaWarps; ++w) v += red[w][r][nn];
    if (bias) v += bias[o];
    float* yp = y + int64_t(nn) * out + o;
    *yp = beta != 0.0f ? v + beta * *yp : v;
  }
}
constexpr int kGemvMmaTiles = 2, kGemvMmaChunks = 4;

__global__ void silu_mul_k(const float* gu, int n, int inter, float* out, __nv_bfloat16* outb) {
  pdl_enter();
  const int64_t total = int64_t(n) * inter;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / inter, j = i % inter;
    const float g = gu[t * 2 * inter + j], u = gu[t * 2 * inter + inter + j];
    const float o = g / (1.0f + expf(-g)) * u;
    out[i] = o;
    if (outb) outb[i] = __float2bfloat16_rn(o);
  }
}

// The same four columns at a time (inter % 4 == 0, 16-byte aligned rows): float4 loads and
// stores, one index division per four outputs. The scalar kernel took 0.57 ms for an 8192-token
// chunk of Qwen3-8B (Nsight Compute, H200), 1.4 GB of traffic.
__global__ void silu_mul4_k(const float* gu, int n, int inter, float* out, __nv_bfloat16* outb) {
  pdl_enter();
  const int q = inter / 4;
  const int64_t total = int64_t(n) * q;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / q;
    const int j = int(i - t * q) * 4;
    const float4 g = *reinterpret_cast<const float4*>(gu + t * 2 * inter + j);
    const float4 u = *reinterpret_cast<const float4*>(gu + t * 2 * inter + inter + j);
    float4 o;
    o.x = g.x / (1.0f + expf(-g.x)) * u.x;
    o.y = g.y / (1.0f + expf(-g.y)) * u.y;
    o.z = g.z / (1.0f + expf(-g.z)) * u.z;
    o.w = g.w / (1.0f + expf(-g.w)) * u.w;
    *reinterpret_cast<float4*>(out + t * inter + j) = o;
    if (outb) *reinterpret_cast<uint2*>(outb + t * inter + j) = kernels::cuda::pack_bf16x4(o);
  }
}

__global__ void add_k(float* x, const float* y, int64_t n) {
  pdl_enter();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    x[i] += y[i];
}

__global__ void embed_k(const void* emb, bool bf16, const int32_t* tokens, int hidden, float* x) {
  pdl_enter();
  const int64_t row = tokens[blockIdx.x];
  float* xr = x + int64_t(blockIdx.x) * hidden;
  if (bf16) {
    const uint16_t* e = static_cast<const uint16_t*>(emb) + row * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) xr[c] = bf16_to_f32(e[c]);
  } else {
    const float* e = static_cast<const float*>(emb) + row * hidden;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) xr[c] = e[c];
  }
}

// One thread per (head, token, channel) of the gathered K and V.
template <typename T>
__global__ void gather_kv_k(kv::PagedKvView kv, int b, int L, const float* k_new,
                            const float* v_new, int Lt, T* K, T* V) {
  const int d = kv.head_dim, H = kv.num_kv_heads, ps = kv.page_size;
  const int64_t total = int64_t(H) * Lt * d;
  const int sink = kv.sink.len[b], mid = kv.mid.len[b];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(i % d);
    const int t = int((i / d) % Lt);
    const int h = int(i / (int64_t(d) * Lt));
    float kx, vx;
    if (t >= L) {
      const int64_t o = (int64_t(t - L) * H + h) * d + c;
      kx = k_new[o];
      vx = v_new[o];
    } else if (t < sink || t >= sink + mid) {
      const bool in_sink = t < sink;
      const int r = in_sink ? t : t - sink - mid;
      const kv::RegionTable& rt = in_sink ? kv.sink : kv.recent;
      const int32_t page = rt.indices[rt.indptr[b] + r / ps];
      const int64_t off = (int64_t(page) * H * ps + int64_t(h) * ps + r % ps) * d + c;
      kx = bf16_to_f32(kv.bf16.k[off]);
      vx = bf16_to_f32(kv.bf16.v[off]);
    } else {
      const int r = t - sink;
      const int32_t page = kv.mid.indices[kv.mid.indptr[b] + r / ps];
      const int64_t row = (int64_t(page) * H + h) * ps + r % ps;
      const int g = c / kv.group_size;
      const int64_t po = (row * (d / kv.group_size) + g) * 2;
      const int cb = d * kv.bits / 8;
      const uint8_t* kc = kv.quant.k_codes + row * cb;
      const uint8_t* vc = kv.quant.v_codes + row * cb;
      kx = f16_to_f32(kv.quant.k_params[po + 1]) +
           float(get_code(kc, c, kv.group_size, kv.bits)) * f16_to_f32(kv.quant.k_params[po]);
      if (kv.center.pairs > 0) {
        // Page centering (kernels/paged_kv.h): the key is x̂ + δ_h(t) of its page.
        const int S = kv.center.pairs;
        const int64_t row = (kv.center.angle_start ? kv.center.angle_start[b] : kv.mid.indptr[b]) + r / ps;
        const float* cs = kv.center.angles + row * 2 * S;
        float dl = kv.center.mu ? -kv.center.mu[int64_t(h) * d + c] : 0.0f;
        for (int s = 0; s < S; ++s)
          dl += cs[2 * s] * kv.center.u[(int64_t(h) * S + s) * d + c] +
                cs[2 * s + 1] * kv.center.w[(int64_t(h) * S + s) * d + c];
        kx += dl;
      }
      vx = f16_to_f32(kv.quant.v_params[po + 1]) +
           float(get_code(vc, c, kv.group_size, kv.bits)) * f16_to_f32(kv.quant.v_params[po]);
    }
    K[i] = from_f32<T>(kx);
    V[i] = from_f32<T>(vx);
  }
}

// Element i of q/o [nc][Hq][d] (token t, head g = h * G + j, channel c) and
// its index in the permuted layout [Hkv][nc * G][d].
__device__ __forceinline__ int64_t permuted_index(int64_t i, int nc, int Hq, int Hkv, int d) {
  const int G = Hq / Hkv;
  const int c = int(i % d);
  const int g = int((i / d) % Hq);
  const int t = int(i / (int64_t(d) * Hq));
  return ((int64_t(g / G) * nc + t) * G + g % G) * d + c;
}

template <typename T>
__global__ void permute_q_k(const float* q, int t0, int nc, int Hq, int Hkv, int d, T* Qp) {
  const int64_t total = int64_t(nc) * Hq * d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    Qp[permuted_index(i, nc, Hq, Hkv, d)] = from_f32<T>(q[i + int64_t(t0) * Hq * d]);
}

__global__ void unpermute_o_k(const float* Op, int t0, int nc, int Hq, int Hkv, int d, float* o) {
  const int64_t total = int64_t(nc) * Hq * d;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x)
    o[i + int64_t(t0) * Hq * d] = Op[permuted_index(i, nc, Hq, Hkv, d)];
}

// One block per row.
template <typename T>
__global__ void causal_softmax_k(const float* S, int nc, int G, int Lt, int L, int t0,
                                 float sm_scale, T* P) {
  const int64_t row = blockIdx.x;  // (h * nc + t) * G + j
  const int t = int((row / G) % nc);
  const int valid = L + t0 + t + 1;
  const float* s = S + row * Lt;
  T* p = P + row * Lt;
  __shared__ float red[kThreads / 32];
  __shared__ float bcast;
  float m = -FLT_MAX;
  for (int c = threadIdx.x; c < valid; c += blockDim.x) m = fmaxf(m, s[c]);
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    float v = red[0];
    for (int w = 1; w < int(blockDim.x / 32); ++w) v = fmaxf(v, red[w]);
    bcast = v;
  }
  __syncthreads();
  m = bcast;
  float sum = 0;
  for (int c = threadIdx.x; c < valid; c += blockDim.x) sum += expf((s[c] - m) * sm_scale);
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    float v = 0;
    for (int w = 0; w < int(blockDim.x / 32); ++w) v += red[w];
    bcast = 1.0f / v;
  }
  __syncthreads();
  const float inv = bcast;
  for (int c = threadIdx.x; c < Lt; c += blockDim.x)
    p[c] = from_f32<T>(c < valid ? expf((s[c] - m) * sm_scale) * inv : 0.0f);
}

inline unsigned grid_cap(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 * 8 ? (b < 1 ? 1 : b) : 65535 * 8);
}

}  // namespace

void set_pdl(bool on) { g_pdl = on; }
bool pdl() { return g_pdl; }

void cast_bf16(const float* x, __nv_bfloat16* y, int64_t n, cudaStream_t st) {
  if (n % 4 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(y) % 8 == 0)
    return launch(cast_bf16_4_k, grid_cap(n / 4), kThreads, st, x, y, n / 4);
  launch(cast_bf16_k, grid_cap(n), kThreads, st, x, y, n);
}
void add_bias(float* y, const float* b, int rows, int cols, cudaStream_t st) {
  launch(add_bias_k, grid_cap(int64_t(rows) * cols), kThreads, st, y, b, rows, cols);
}
void rms_norm(const float* x, const float* w, int rows, int dim, float eps, float* y, __nv_bfloat16* yb,
              cudaStream_t st) {
  if (rows > 0) launch(rms_norm_k, rows, kThreads, st, x, w, dim, eps, y, yb);
}
void rope(float* x, int n, int heads, int d, const float* cos, const float* sin, cudaStream_t st) {
  launch(rope_k, grid_cap(int64_t(n) * heads * d / 2), kThreads, st, x, n, heads, d, cos, sin);
}
void silu_mul(const float* gu, int n, int inter, float* out, __nv_bfloat16* outb, cudaStream_t st) {
  auto a16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (inter % 4 == 0 && a16(gu) && a16(out) && reinterpret_cast<uintptr_t>(outb) % 8 == 0)
    return launch(silu_mul4_k, grid_cap(int64_t(n) * inter / 4), kThreads, st, gu, n, inter, out, outb);
  launch(silu_mul_k, grid_cap(int64_t(n) * inter), kThreads, st, gu, n, inter, out, outb);
}
void add(float* x, const float* y, int64_t n, cudaStream_t st) {
  launch(add_k, grid_cap(n), kThreads, st, x, y, n);
}

void gemv_bf16(const uint16_t* W, const float* x, int n, int out, int in, const float* bias, float beta, float* y,
               int mma_from, cudaStream_t st) {
  if (n >= 1 && n <= kGemvMaxRows && n >= mma_from && in % 32 == 0 && out > 0) {
    const int blocks = (out + 16 * kGemvMmaTiles - 1) / (16 * kGemvMmaTiles);
    return launch(gemv_mma_k<kGemvMmaTiles, kGemvMmaChunks>, blocks, 32 * kGemvMmaWarps, st, W, x, n, out, in,
                  bias, beta, y);
  }
  switch (n) {
    case 1: return launch_gemv<1>(W, x, out, in, bias, beta, y, st);
    case 2: return launch_gemv<2>(W, x, out, in, bias, beta, y, st);
    case 3: return launch_gemv<3>(W, x, out, in, bias, beta, y, st);
    case 4: return launch_gemv<4>(W, x, out, in, bias, beta, y, st);
    case 5: return launch_gemv<5>(W, x, out, in, bias, beta, y, st);
    case 6: return launch_gemv<6>(W, x, out, in, bias, beta, y, st);
    case 7: return launch_gemv<7>(W, x, out, in, bias, beta, y, st);
    case 8: return launch_gemv<8>(W, x, out, in, bias, beta, y, st);
    default: return;
  }
}

size_t argmax_scratch_bytes(int rows, int cols) {
  return size_t(rows) * size_t((cols + kArgChunk - 1) / kArgChunk) * 8;
}
void argmax_rows(const float* x, int rows, int cols, void* scratch, int32_t* out, cudaStream_t st) {
  if (rows <= 0 || cols <= 0) return;
  const int chunks = (cols + kArgChunk - 1) / kArgChunk;
  float* pv = static_cast<float*>(scratch);
  int* pi = reinterpret_cast<int*>(pv + int64_t(rows) * chunks);
  launch(argmax_part_k, dim3(unsigned(chunks), unsigned(rows)), kThreads, st, x, cols, pv, pi);
  launch(argmax_final_k, rows, kThreads, st, pv, pi, chunks, out);
}

void qkv_heads(const float* qkv, int n, int Hq, int Hkv, int d, const float* qn, const float* kn, float eps,
               const float* cos, const float* sin, float* q, float* k, float* v, cudaStream_t st) {
  if (n <= 0) return;
  if (d == 64 || d == 128 || d == 256) {
    const int64_t warps = int64_t(n) * (Hq + 2 * Hkv);
    const unsigned blocks = unsigned((warps + 7) / 8);
    if (d == 64) return launch(qkv_heads_warp_k<1>, blocks, 256, st, qkv, n, Hq, Hkv, qn, kn, eps, cos, sin, q, k, v);
    if (d == 128) return launch(qkv_heads_warp_k<2>, blocks, 256, st, qkv, n, Hq, Hkv, qn, kn, eps, cos, sin, q, k, v);
    return launch(qkv_heads_warp_k<4>, blocks, 256, st, qkv, n, Hq, Hkv, qn, kn, eps, cos, sin, q, k, v);
  }
  // Other head sizes: one thread per pair, in whole warps (the norm's shuffles take every lane).
  const int threads = (d / 2 + 31) / 32 * 32;
  launch(qkv_heads_k, dim3(unsigned(n), unsigned(Hq + 2 * Hkv)), threads, st, qkv, Hq, Hkv, d, qn, kn, eps, cos,
         sin, q, k, v);
}
void qkv_heads_cache(const QkvHeadsCache& a, int d, cudaStream_t st) {
  if (a.n <= 0) return;
  if (!a.Rq) {  // no transform: a warp per head
    const unsigned blocks = unsigned((int64_t(a.n) * (a.Hq + a.Hkv) + 7) / 8);
    if (d == 64) return launch(qkv_heads_copy_k<1>, blocks, 256, st, a);
    if (d == 128) return launch(qkv_heads_copy_k<2>, blocks, 256, st, a);
    if (d == 256) return launch(qkv_heads_copy_k<4>, blocks, 256, st, a);
    return;
  }
  const unsigned blocks = unsigned(int64_t(a.n) * (a.Hq + a.Hkv));
  if (d == 64) return launch(qkv_heads_cache_k<1>, blocks, 256, st, a);
  if (d == 128) return launch(qkv_heads_cache_k<2>, blocks, 256, st, a);
  if (d == 256) return launch(qkv_heads_cache_k<4>, blocks, 256, st, a);
}
void embed(const void* emb, bool bf16, const int32_t* tokens, int n, int hidden, float* x,
           cudaStream_t st) {
  if (n > 0) launch(embed_k, n, kThreads, st, emb, bf16, tokens, hidden, x);
}

template <typename T>
void gather_kv(const kv::PagedKvView& kv, int b, int L, const float* k_new, const float* v_new,
               int Lt, T* K, T* V, cudaStream_t st) {
  gather_kv_k<T><<<grid_cap(int64_t(kv.num_kv_heads) * Lt * kv.head_dim), kThreads, 0, st>>>(
      kv, b, L, k_new, v_new, Lt, K, V);
}
template <typename T>
void permute_q(const float* q, int t0, int nc, int Hq, int Hkv, int d, T* Qp, cudaStream_t st) {
  permute_q_k<T><<<grid_cap(int64_t(nc) * Hq * d), kThreads, 0, st>>>(q, t0, nc, Hq, Hkv, d, Qp);
}
void unpermute_o(const float* Op, int t0, int nc, int Hq, int Hkv, int d, float* o,
                 cudaStream_t st) {
  unpermute_o_k<<<grid_cap(int64_t(nc) * Hq * d), kThreads, 0, st>>>(Op, t0, nc, Hq, Hkv, d, o);
}
template <typename T>
void causal_softmax(const float* S, int Hkv, int nc, int G, int Lt, int L, int t0, float sm_scale,
                    T* P, cudaStream_t st) {
  const int rows = Hkv * nc * G;
  if (rows > 0) causal_softmax_k<T><<<rows, kThreads, 0, st>>>(S, nc, G, Lt, L, t0, sm_scale, P);
}

template void gather_kv<float>(const kv::PagedKvView&, int, int, const float*, const float*, int,
                               float*, float*, cudaStream_t);
template void gather_kv<__nv_bfloat16>(const kv::PagedKvView&, int, int, const float*,
                                       const float*, int, __nv_bfloat16*, __nv_bfloat16*,
                                       cudaStream_t);
template void permute_q<float>(const float*, int, int, int, int, int, float*, cudaStream_t);
template void permute_q<__nv_bfloat16>(const float*, int, int, int, int, int, __nv_bfloat16*,
                                       cudaStream_t);
template void causal_softmax<float>(const float*, int, int, int, int, int, int, float, float*,
                                    cudaStream_t);
template void causal_softmax<__nv_bfloat16>(const float*, int, int, int, int, int, int, float,
                                            __nv_bfloat16*, cudaStream_t);

}  // namespace oscar::backend::cuda_ops
