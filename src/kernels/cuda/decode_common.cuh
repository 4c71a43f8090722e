// Device code shared by the decode kernels (decode_attention.h; design and
// numbers: docs/kernels-cuda.md): the kernel-side constants, the lanes'
// channel maps, the online-softmax state and where a tile's rows are.
//
// One CTA = one (chunk of 16-token tiles, KV head); 4 warps, each an
// independent flash-decoding worker over every 4th group of 4 tiles of the
// chunk (INT2 tiles staged through a per-warp cp.async ring), merged through
// shared memory at the end; a second kernel (decode_merge.cu) merges the
// chunks of a sequence by log-sum-exp. Middle (INT2) and window (BF16) chunks run as two launches
// of the same template so that each gets its own register budget.
//
// Orientation: tokens are the M dimension and the (up to 8) query heads of the
// KV head the N dimension of m16n8k16, so GQA 1..8 costs one N tile and each
// K/V element is unpacked once for all heads of its group:
//   S^T[16 tok][8 heads] = K[16 tok][d] . Q^T[d][8 heads]
//   O^T[d][8 heads]     += V^T[d][16 tok] . P^T[16 tok][8 heads]
// P^T goes from the accumulator layout to the B-operand layout with movmatrix.
//
// INT2 middle: codes become fp16 x = 1 + c/F (F = 64, 16 or 4 by bit position,
// see CodeWord in mma.cuh) with ~1.25 instructions per pair and feed the tensor
// cores directly; scale and min are folded afterwards (DESIGN §3.5). With the
// query pre-multiplied by F (q' = F q):
//   q.k_hat = sum_groups  s (q'.x - sum q') + m sum q
//   sum_t p v_hat = F (sum_t (p s) x - sum_t p s) + sum_t p m      (per group)
// Because a dot product is invariant under a permutation of channels, the
// query is gathered in the order in which the packed bytes unpack ("virtual
// channels"); the output is scattered back to real channels at the end.
//
// For head_dim 128 / group 128 / GQA <= 4 the keys instead go through int8
// tensor cores with the query as 16-bit hi/lo bytes in the N columns
// (decode_tile_int8.cuh, "Int8-key loop"), and since v13 (the default there)
// the values too, with P s as 16-bit hi/lo bytes ("Int8 K and V loop").
//
// The device headers: decode_common.cuh (this), decode_trace.cuh,
// decode_tile_int2.cuh (INT2 tiles, fp16 tensor cores),
// decode_tile_int8.cuh (INT2 tiles, int8 tensor cores), decode_tile_bf16.cuh,
// decode_ring.cuh (cp.async staging), decode_split_kernel.cuh (the kernel and
// its launcher). Their device code lives in an unnamed namespace: every .cu
// that includes them compiles its own internal copy (llama.cpp's fattn-*.cuh
// use `static __device__` the same way), so the code each kernel gets is the
// same as when they were one file, and each kernel instance belongs to one
// .cu. Only KernelArgs (decode_args.cuh) and the host launchers
// (decode_dispatch.h) cross files.
#pragma once

#include <cuda_runtime.h>

#include <cfloat>
#include <cmath>

#include "kernels/cuda/decode_args.cuh"
#include "kernels/cuda/decode_plan.h"
#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

using namespace detail;
using namespace decode_impl;

constexpr int kThreads = 32 * kWarps;

// ---------------------------------------------------------------------------
// Virtual-channel maps: which real channel sits at position kpos (0..15) of
// k-tile j (K side), or at row rp (0..15) of m-tile i (V side). They mirror
// the unpacking in the tile functions (decode_tile_*.cuh); tests check the end result.

// INT2 K: k-tile jl of group gamma. Lane quad position r = (kpos%8)/2.
__host__ __device__ constexpr int kq_channel(int G, int gamma, int jl, int kpos) {
  const int r = (kpos & 7) >> 1, e = kpos & 1, half = kpos >> 3;
  if (G >= 64) {
    const int nb = G / 16, wi = jl / 4, s = jl % 4;
    return gamma * G + r * nb + 4 * wi + 2 * e + half + s * (G / 4);
  }
  return gamma * 32 + 2 * r + e + (2 * jl + half) * 8;
}
// INT2 V: m-tile i of group gamma, row rp (lane g = rp % 8, half = rp / 8).
__host__ __device__ constexpr int vq_channel(int G, int gamma, int i, int rp) {
  const int g = rp & 7, half = rp >> 3;
  if (G == 128) return gamma * G + 4 * g + 2 * (i / 4) + half + 32 * (i % 4);
  if (G == 64) return gamma * G + 2 * g + half + 16 * i;
  return gamma * 32 + g + 8 * (2 * i + half);
}
// BF16 K: k-tile j.
__host__ __device__ constexpr int kb_channel(int j, int kpos) {
  const int r = (kpos & 7) >> 1, e = kpos & 1, half = kpos >> 3;
  return 32 * (j / 2) + 8 * r + 4 * (j % 2) + 2 * half + e;
}
// BF16 V: m-tile i.
__host__ __device__ constexpr int vb_channel(int i, int rp) {
  const int g = rp & 7, half = rp >> 3;
  return 64 * (i / 4) + 8 * g + 2 * (i % 4) + half;
}

// Before a window tile that holds a step write's new row (sequence b, KV
// head h): wait for that row's published parts (v40, v42: lane l < F
// polls flag l of the pair), else for the write launch to complete (which
// it does only after the middle launch). The write's CTAs all started
// before this launch could (the write triggers its dependents at its
// start, and the demotion between them at its own), and they publish before
// they wait for anything: the spin ends.
__device__ __forceinline__ void wait_step_write(const KernelArgs& a, int b, int h, int lane) {
  if (a.write_done) {
    const int flags = a.write_flags;  // <= 2 D/32 <= 16
    if (lane < flags) {
      const uint32_t* f = a.write_done + (int64_t(b) * a.kv.num_kv_heads + h) * flags + lane;
      while (ld_acquire_gpu(f) != a.write_epoch) __nanosleep(64);
    }
    __syncwarp();
  } else {
    pdl_wait();
  }
}

// Per-warp online-softmax state for the lane's two head columns 2r, 2r+1.
template <int D, int NG>
struct WarpState {
  float o[D / 16][4];   // O^T accumulators, m-tile i: rows (channels) g, g+8; cols 2r, 2r+1
  float sp[NG][4];      // INT2 only: sum_t fp16(p s) per group, as an MMA accumulator
                        // (c0,c1 = heads 2r, 2r+1; c2,c3 the same values)
  float pm[NG][2];      // INT2 only: sum_t p m
  float m[2];           // running max (log2 domain)
  float l[2];           // this lane's partial row sum
};

template <int D, int NG>
__device__ __forceinline__ void state_init(WarpState<D, NG>& st) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[i][e] = 0.0f;
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) {
    st.sp[gm][0] = st.sp[gm][1] = st.sp[gm][2] = st.sp[gm][3] = 0.0f;
    st.pm[gm][0] = st.pm[gm][1] = 0.0f;
  }
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.0f;
}

// Online softmax step for N tiles at once (one max reduction and at most one
// rescale per step): s[u][4] are the lane's logits of tile u (log2 domain,
// masked ones -inf), c0,c1 token g / c2,c3 token g+8; returns p in place.
template <int D, int NG, int N>
__device__ __forceinline__ void softmax_step(WarpState<D, NG>& st, float (&s)[N][4]) {
  float mx[2] = {fmaxf(s[0][0], s[0][2]), fmaxf(s[0][1], s[0][3])};
#pragma unroll
  for (int u = 1; u < N; ++u) {
    mx[0] = fmaxf(mx[0], fmaxf(s[u][0], s[u][2]));
    mx[1] = fmaxf(mx[1], fmaxf(s[u][1], s[u][3]));
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], 4));
    mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], 8));
    mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], 16));
  }
  const float mn0 = fmaxf(st.m[0], mx[0]), mn1 = fmaxf(st.m[1], mx[1]);
  // Rescale only when some column's max grew (rare after the first tiles).
  if (__any_sync(0xffffffffu, mn0 > st.m[0] || mn1 > st.m[1])) {
    const float sc0 = mn0 > st.m[0] ? fast_exp2(st.m[0] - mn0) : 1.0f;
    const float sc1 = mn1 > st.m[1] ? fast_exp2(st.m[1] - mn1) : 1.0f;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      st.o[i][0] *= sc0;
      st.o[i][1] *= sc1;
      st.o[i][2] *= sc0;
      st.o[i][3] *= sc1;
    }
#pragma unroll
    for (int gm = 0; gm < NG; ++gm) {
      st.sp[gm][0] *= sc0;
      st.sp[gm][1] *= sc1;
      st.sp[gm][2] *= sc0;
      st.sp[gm][3] *= sc1;
      st.pm[gm][0] *= sc0;
      st.pm[gm][1] *= sc1;
    }
    st.l[0] *= sc0;
    st.l[1] *= sc1;
    st.m[0] = mn0;
    st.m[1] = mn1;
  }
  // A column with no finite logit yet keeps m = -inf; use 0 as the base so
  // exp2(-inf - base) = 0 instead of NaN.
  const float b0 = st.m[0] == -INFINITY ? 0.0f : st.m[0];
  const float b1 = st.m[1] == -INFINITY ? 0.0f : st.m[1];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    s[u][0] = fast_exp2(s[u][0] - b0);
    s[u][1] = fast_exp2(s[u][1] - b1);
    s[u][2] = fast_exp2(s[u][2] - b0);
    s[u][3] = fast_exp2(s[u][3] - b1);
    st.l[0] += s[u][0] + s[u][2];
    st.l[1] += s[u][1] + s[u][3];
  }
}

// Page and slot of region-relative tile t (tiles never cross pages since the
// page size is a multiple of 16 and regions start at slot 0). The page id is
// looked up separately (page_of) so that loops can fetch it one step early.
struct TileLoc {
  uint32_t row0;  // quant_row_index / bf16 row of the tile's first token, head h (pools < 2^32 rows)
  int valid;     // tokens of the tile inside the region (1..16)
};
__device__ __forceinline__ int32_t page_of(const int32_t* pages, const FastDiv& tpp, int t) {
  return __ldg(pages + tpp.div(static_cast<uint32_t>(t)));
}
__device__ __forceinline__ TileLoc tile_loc(int32_t page, const FastDiv& tpp, int len, int page_size,
                                            int num_kv_heads, int h, int t) {
  const int ts = t * kTileTokens;
  const int slot0 = (t - static_cast<int>(tpp.div(static_cast<uint32_t>(t)) * tpp.d)) * kTileTokens;
  TileLoc loc;
  loc.row0 = (static_cast<uint32_t>(page) * num_kv_heads + h) * page_size + slot0;
  loc.valid = min(kTileTokens, len - ts);
  return loc;
}

}  // namespace

}  // namespace oscar::kernels::cuda
