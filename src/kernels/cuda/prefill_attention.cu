// Fused causal prefill attention (prefill_attention.h). One CTA of 4 (or 8) warps takes
// 64 (128) query rows of one query head (16 per warp) and walks the key tiles of 64 that those rows
// see, with the next tile's K and V copied into shared memory (cp.async) while the
// current one is used. Per tile and warp: S = Q K^T on the tensor cores (m16n8k16, BF16
// in, fp32 out), the causal mask on the tiles that cross the diagonal, the online
// softmax in base 2 (running max and sum per row), and O += P V with P taken straight
// from the score accumulators (their layout is the A fragment's). Scores never reach
// memory. The CTAs with the most keys (the last query tiles) are launched first.
#include "kernels/cuda/prefill_attention.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

using namespace detail;

constexpr int kBc = 64;  // keys per tile

struct PrefillArgs {
  const float* q;
  const uint16_t* K;
  const uint16_t* V;
  float* o;
  int n, L, Lt, Hq, G;
  float scale_log2;  // sm_scale * log2(e)
};

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* p) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* p) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(s));
}

// W warps of 16 query rows each: a CTA takes kBr = 16 W rows.
template <int D, int W>
__global__ void __launch_bounds__(32 * W) prefill_fa_kernel(const PrefillArgs a) {
  constexpr int kBr = 16 * W, kThreads = 32 * W;
  constexpr int S = D + 8;  // padded smem row (BF16): 16-byte aligned, ldmatrix without bank conflicts
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* Qs = smem;              // [kBr][S]
  uint16_t* Ks = Qs + kBr * S;      // [2][kBc][S]
  uint16_t* Vs = Ks + 2 * kBc * S;  // [2][kBc][S]
  const int tiles_q = (a.n + kBr - 1) / kBr;
  const int i0 = (tiles_q - 1 - int(blockIdx.x)) * kBr;  // the longest rows first
  const int h = blockIdx.y, kvh = h / a.G;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int gq = lane / 4, r = lane % 4;
  const uint16_t* Kg = a.K + int64_t(kvh) * a.Lt * D;
  const uint16_t* Vg = a.V + int64_t(kvh) * a.Lt * D;

  // The query tile in BF16; rows past n are zero (computed, never stored).
  for (int e = tid; e < kBr * D / 4; e += kThreads) {
    const int row = e / (D / 4), c = (e % (D / 4)) * 4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (i0 + row < a.n) v = *reinterpret_cast<const float4*>(a.q + (int64_t(i0 + row) * a.Hq + h) * D + c);
    uint2 p;
    p.x = pack_bf162(v.x, v.y);
    p.y = pack_bf162(v.z, v.w);
    *reinterpret_cast<uint2*>(Qs + row * S + c) = p;
  }
  const int last_key = a.L + min(i0 + kBr, a.n) - 1;  // the last key any row of the tile sees
  const int num_tiles = last_key / kBc + 1;
  auto load_kv = [&](int t, int buf) {
    const int j0 = t * kBc;
    for (int e = tid; e < kBc * D / 8; e += kThreads) {
      const int row = e / (D / 8), c = (e % (D / 8)) * 8;
      const bool ok = j0 + row <= last_key;  // keys no row of the tile sees are zeros
      const int64_t src = int64_t(ok ? j0 + row : 0) * D + c;
      cp_async16_zfill(Ks + (buf * kBc + row) * S + c, Kg + src, ok);
      cp_async16_zfill(Vs + (buf * kBc + row) * S + c, Vg + src, ok);
    }
    cp_async_commit();
  };
  load_kv(0, 0);
  __syncthreads();  // the query tile
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) ldsm_x4(qf[kk], Qs + (warp * 16 + lane % 16) * S + kk * 16 + (lane / 16) * 8);

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float acc[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
  const int row0 = i0 + warp * 16 + gq;  // this thread's rows: row0 and row0 + 8
  const int warp_first = a.L + i0 + warp * 16;  // keys up to here are visible to all the warp's rows

  for (int t = 0; t < num_tiles; ++t) {
    const int buf = t & 1;
    if (t + 1 < num_tiles) {
      load_kv(t + 1, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int j0 = t * kBc;
    float s[kBc / 8][4];
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    const uint16_t* Kb = Ks + buf * kBc * S;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBc / 16; ++np) {
        uint32_t b[4];
        ldsm_x4(b, Kb + (np * 16 + lane % 8 + (lane / 16) * 8) * S + kk * 16 + ((lane / 8) % 2) * 8);
        mma_bf16(s[2 * np], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[0], b[1]);
        mma_bf16(s[2 * np + 1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b[2], b[3]);
      }
    }
    // Scale to base 2; mask keys past each row's position on the tiles that need it.
    const bool mask = j0 + kBc - 1 > warp_first;
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[nt][e] * a.scale_log2;
        if (mask && j0 + nt * 8 + 2 * r + (e & 1) > a.L + row0 + (e >> 1) * 8) v = -INFINITY;
        s[nt][e] = v;
        mx[e >> 1] = fmaxf(mx[e >> 1], v);
      }
    float alpha[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
      // Key 0 is visible to every row, so after the first tile the max is finite.
      alpha[i] = fast_exp2(m[i] - mx[i]);
      m[i] = mx[i];
    }
    float rs[2] = {0.0f, 0.0f};
#pragma unroll
    for (int nt = 0; nt < kBc / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = fast_exp2(s[nt][e] - m[e >> 1]);
        rs[e >> 1] += s[nt][e];
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) l[i] = l[i] * alpha[i] + rs[i];  // per thread; summed at the end
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      acc[dt][0] *= alpha[0];
      acc[dt][1] *= alpha[0];
      acc[dt][2] *= alpha[1];
      acc[dt][3] *= alpha[1];
    }
    const uint16_t* Vb = Vs + buf * kBc * S;
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      const uint32_t a0 = pack_bf162(s[2 * kk][0], s[2 * kk][1]), a1 = pack_bf162(s[2 * kk][2], s[2 * kk][3]);
      const uint32_t a2 = pack_bf162(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      const uint32_t a3 = pack_bf162(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t b[4];
        ldsm_x4_trans(b, Vb + (kk * 16 + lane % 8 + ((lane / 8) % 2) * 8) * S + dp * 16 + (lane / 16) * 8);
        mma_bf16(acc[2 * dp], a0, a1, a2, a3, b[0], b[1]);
        mma_bf16(acc[2 * dp + 1], a0, a1, a2, a3, b[2], b[3]);
      }
    }
    __syncthreads();  // the next iteration refills this buffer
  }

  float inv[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    inv[i] = 1.0f / l[i];
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row0 + 8 * i;
    if (row >= a.n) continue;
    float* dst = a.o + (int64_t(row) * a.Hq + h) * D + 2 * r;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<float2*>(dst + dt * 8) = make_float2(acc[dt][2 * i] * inv[i], acc[dt][2 * i + 1] * inv[i]);
  }
}

template <int D, int W>
cudaError_t launch(const PrefillArgs& a, cudaStream_t stream) {
  constexpr int kBr = 16 * W;
  const size_t smem = size_t(kBr + 4 * kBc) * (D + 8) * sizeof(uint16_t);
  cudaError_t e = cudaFuncSetAttribute(prefill_fa_kernel<D, W>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem));
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((a.n + kBr - 1) / kBr), static_cast<unsigned>(a.Hq));
  prefill_fa_kernel<D, W><<<grid, 32 * W, smem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

bool prefill_attention_supported(int head_dim) { return head_dim == 64 || head_dim == 128; }

cudaError_t prefill_attention_bf16(const float* q, const uint16_t* K, const uint16_t* V, int n, int L, int Lt,
                                   int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, float* o,
                                   cudaStream_t stream, int warps) {
  if (warps != 4 && warps != 8) return cudaErrorInvalidValue;
  if (n < 0 || L < 0 || Lt < L + n || num_kv_heads <= 0 || num_q_heads <= 0 || num_q_heads % num_kv_heads != 0 ||
      num_q_heads > 65535 || !prefill_attention_supported(head_dim) || !(sm_scale > 0.0f))
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!q || !K || !V || !o || reinterpret_cast<uintptr_t>(q) % 16 || reinterpret_cast<uintptr_t>(K) % 16 ||
      reinterpret_cast<uintptr_t>(V) % 16 || reinterpret_cast<uintptr_t>(o) % 8)
    return cudaErrorInvalidValue;
  const PrefillArgs a{q, K, V, o, n, L, Lt, num_q_heads, num_q_heads / num_kv_heads,
                      sm_scale * 1.4426950408889634f};
  if (head_dim == 64) return warps == 4 ? launch<64, 4>(a, stream) : launch<64, 8>(a, stream);
  return warps == 4 ? launch<128, 4>(a, stream) : launch<128, 8>(a, stream);
}

}  // namespace oscar::kernels::cuda
