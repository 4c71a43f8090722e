// Decode attention kernels (see decode_attention.h and docs/kernels-cuda.md).
//
// One CTA = one (chunk of 16-token tiles, KV head); 4 warps, each an
// independent flash-decoding worker over every 4th group of 4 tiles of the
// chunk (INT2 tiles staged through a per-warp cp.async ring), merged through
// shared memory at the end; a second kernel merges the chunks of a sequence
// by log-sum-exp. Middle (INT2) and window (BF16) chunks run as two launches
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
// tensor cores with the query as 16-bit hi/lo bytes in the N columns (see
// "Int8-key loop" below), and since v13 (the default there) the values too,
// with P s as 16-bit hi/lo bytes (see "Int8 K and V loop").
#include "kernels/cuda/decode_attention.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <string>
#include <type_traits>

#include "core/half.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

using namespace detail;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxGqa = 8;
constexpr float kLog2e = 1.4426950408889634f;
// Tiles a warp works on per loop iteration in the INT2 path; the next
// iteration's tiles are loaded before this one's are computed, so up to
// 2*kQuantTilesPerIter tiles per warp are in flight.
constexpr int kQuantTilesPerIter = 2;
// A BF16 tile moves ~7x the bytes of an INT2 tile (16 vs 2.25 bits).
constexpr int kBf16TileCost = 7;
// Fused window + merge launch where the plan allows it (v27); 0 = never.
#ifndef OSCAR_FUSE_WINDOWS
#define OSCAR_FUSE_WINDOWS 1
#endif
// Bytes of one INT2 tile image: K and V codes [16][D/4], K and V params [16][D/G][2] fp16.
__host__ __device__ constexpr int quant_tile_bytes(int D, int G) { return 8 * D + 128 * (D / G); }

// ---------------------------------------------------------------------------
// Virtual-channel maps: which real channel sits at position kpos (0..15) of
// k-tile j (K side), or at row rp (0..15) of m-tile i (V side). They mirror
// the unpacking in the tile functions below; tests check the end result.

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

// ---------------------------------------------------------------------------
// Division by the run-time tiles-per-page without an integer divide
// (multiply-high by a magic number; exact for 0 <= n < 2^31).
struct FastDiv {
  uint32_t d = 1, magic = 0, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    while ((1u << shift) < d) ++shift;
    magic = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, magic) + n) >> shift; }
};

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

struct KernelArgs {
  kv::PagedKvView kv;
  const float* q;          // [batch][Hq][D]
  int num_q_heads;
  int gqa;
  float sm_scale_log2;     // sm_scale * log2(e)
  FastDiv tiles_per_page;  // page_size / 16
  const int4* chunks;      // [num_chunks][2] in launch order: {b | region << 24, t0, t1, chunk id},
                           // {page-table offset, region length, 0, 0} (upload_plan); fused window
                           // chunks (region 3): t0..t1 = the middle chunk ids, then {sink offset,
                           // sink length, recent offset, recent length}
  int first;               // this launch's first entry (blockIdx.y counts from it)
  const int32_t* first_pages;  // [num_chunks][4] in launch order (v44: DecodePlan::first_pages) or nullptr
  float* partial_o;        // [num_chunks][Hq][D]
  float* partial_lse;      // [num_chunks][Hq], log2 domain
  int step_write;          // the launch sequence writes new rows (DecodeParams::write)
  // Fused window + merge launch (v27, plan.fused_windows): the final outputs.
  float* o;                // [batch][Hq][D]
  float* lse;              // [batch][Hq] natural log, or nullptr
  // Step write (v40, v42): each block of the write launch publishes
  // write_epoch in its flag once its channels of the new K and/or V row are
  // written (flags of sequence b, KV head h: [(b Hkv + h) F, + F), F =
  // write_flags blocks per token and head, write_bf16_tokens_dependent);
  // the window tile holding the new rows waits for those instead of for the
  // write grid's completion (which follows the middle's). nullptr: pdl_wait.
  const uint32_t* write_done;
  uint32_t write_epoch;
  int write_flags;
};

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

// A fused window chunk merges at most this many middle chunks (one lane each).
constexpr int kFuseMaxChunks = 32;
// ... and covers at most this many window tiles per (sequence, KV head).
constexpr int kFuseMaxWindowTiles = 64;

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

// ---------------------------------------------------------------------------
// INT2 tiles.
template <int D, int G>
struct QuantTile {
  static constexpr int NG = D / G;
  static constexpr int KW = G >= 64 ? G / 64 : 1;  // K code words per token and group
  uint32_t kw[2][NG][KW];  // K codes, tokens g and g+8
  uint32_t vw[4][NG];      // V codes, tokens 2r, 2r+1, 2r+8, 2r+9 (1, 2 or 4 bytes used)
  uint32_t kp[2][NG];      // K (scale, min) fp16 pairs, tokens g, g+8
  uint32_t vp[2][NG];      // V (scale, min), tokens g, g+8
  int valid;
};

// The lane's fragments of one tile from its four arrays (global memory or a
// shared-memory copy of the same bytes): K/V codes [16 tokens][D/4] bytes and
// K/V params [16 tokens][D/G] (scale, min) words. In the shared-memory copy
// the V code rows are swizzled (ring_v_row): the lanes of one V load read
// rows 2r + dt, r = 0..3, which with 32-byte rows would put r = 0 and r = 2
// (and 1 and 3) on the same 8 banks; swapping rows 4k+4 <-> 4k+5 and 4k+6 <->
// 4k+7 spreads them over all 32 (ncu on v13: 26% of shared wavefronts were
// bank conflicts).
__host__ __device__ constexpr int ring_v_row(int row) { return row ^ ((row >> 2) & 1); }
template <bool kShared, typename T>
__device__ __forceinline__ T ld(const T* p) {
  if constexpr (kShared)
    return *p;
  else
    return __ldg(p);
}

template <bool kShared, int D, int G>
__device__ __forceinline__ void load_quant_fragments(QuantTile<D, G>& T, const uint8_t* kc0,
                                                     const uint8_t* vc0, const uint32_t* kp0,
                                                     const uint32_t* vp0, int g, int r) {
  constexpr int NG = D / G, RB = D / 4;
  constexpr int KB = G == 128 ? 8 : G == 64 ? 4 : 2;  // K code bytes per lane and group
  constexpr int VB = G / 32;                          // V code bytes per lane and group
  const uint8_t* kc = kc0 + (g * RB + KB * r);
  // Rows of tokens 2r + dt, dt = 0, 1 (+8): in shared memory row 2r + (dt ^ (r >> 1)).
  // (Global memory: one base, so that every offset below is an immediate.)
  const int sw = r >> 1;
  const uint8_t* vc_even = vc0 + ((2 * r + (kShared ? sw : 0)) * RB + VB * g);
  const uint8_t* vc_odd = kShared ? vc0 + ((2 * r + 1 - sw) * RB + VB * g) : vc_even + RB;
  const uint32_t* kp = kp0 + g * NG;
  const uint32_t* vp = vp0 + g * NG;
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
#pragma unroll
    for (int gm = 0; gm < NG; ++gm) {
      const uint8_t* p = kc + (8 * tt * RB + gm * (G / 4));
      if constexpr (G == 128) {
        const uint2 w = ld<kShared>(reinterpret_cast<const uint2*>(p));
        T.kw[tt][gm][0] = w.x;
        T.kw[tt][gm][1] = w.y;
      } else if constexpr (G == 64) {
        T.kw[tt][gm][0] = ld<kShared>(reinterpret_cast<const uint32_t*>(p));
      } else {
        const uint32_t v = ld<kShared>(reinterpret_cast<const unsigned short*>(p));
        T.kw[tt][gm][0] = prmt(v, 0u, 0x4140u);  // [b0, 0, b1, 0]
      }
      T.kp[tt][gm] = ld<kShared>(kp + (8 * tt * NG + gm));
      T.vp[tt][gm] = ld<kShared>(vp + (8 * tt * NG + gm));
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    // tokens 2r, 2r+1, 2r+8, 2r+9
#pragma unroll
    for (int gm = 0; gm < NG; ++gm) {
      const uint8_t* p = ((k & 1) ? vc_odd : vc_even) + (8 * (k >> 1) * RB + gm * (G / 4));
      if constexpr (G == 128)
        T.vw[k][gm] = ld<kShared>(reinterpret_cast<const uint32_t*>(p));
      else if constexpr (G == 64)
        T.vw[k][gm] = ld<kShared>(reinterpret_cast<const unsigned short*>(p));
      else
        T.vw[k][gm] = ld<kShared>(p);
    }
  }
}

// v48: the lane's byte offsets into a shared-memory tile image (the ring),
// computed once per kernel: load_quant_fragments<true> recomputed them from
// the lane index at every step (the loop is short of registers, and the
// compiler rematerialized the whole chain there instead of keeping them).
struct RingFrag {
  uint32_t k, ve, vo, p;  // K codes, V codes of even and odd rows, K params (V params: +64 D/G)
};
template <int D, int G>
__device__ __forceinline__ RingFrag ring_frag(int g, int r) {
  constexpr int NG = D / G, RB = D / 4;
  constexpr int KB = G == 128 ? 8 : G == 64 ? 4 : 2;
  constexpr int VB = G / 32;
  const int sw = r >> 1;
  RingFrag F{static_cast<uint32_t>(g * RB + KB * r), static_cast<uint32_t>(16 * RB + (2 * r + sw) * RB + VB * g),
             static_cast<uint32_t>(16 * RB + (2 * r + 1 - sw) * RB + VB * g),
             static_cast<uint32_t>(32 * RB + 4 * g * NG)};
  // Opaque to the compiler, so that it keeps them instead of recomputing.
  asm("" : "+r"(F.k), "+r"(F.ve), "+r"(F.vo), "+r"(F.p));
  return F;
}
// load_quant_fragments<true> on the tile image at ti, from the lane's offsets.
template <int D, int G>
__device__ __forceinline__ void load_ring_fragments(QuantTile<D, G>& T, const uint8_t* ti, const RingFrag& F) {
  static_assert(D == 128 && G == 128, "the int8 rings: head_dim 128, group 128");
  constexpr int RB = D / 4;
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const uint2 w = *reinterpret_cast<const uint2*>(ti + F.k + 8 * tt * RB);
    T.kw[tt][0][0] = w.x;
    T.kw[tt][0][1] = w.y;
    T.kp[tt][0] = *reinterpret_cast<const uint32_t*>(ti + F.p + 32 * tt);
    T.vp[tt][0] = *reinterpret_cast<const uint32_t*>(ti + F.p + 64 + 32 * tt);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k)
    T.vw[k][0] = *reinterpret_cast<const uint32_t*>(ti + ((k & 1) ? F.vo : F.ve) + 8 * (k >> 1) * RB);
}

template <int D, int G>
__device__ __forceinline__ void load_quant_tile(QuantTile<D, G>& T, const kv::PagedKvView& kv,
                                                int32_t page, const FastDiv& tpp, int len, int h,
                                                int t, int g, int r) {
  constexpr int NG = D / G, RB = D / 4;  // RB: code bytes per row
  const TileLoc loc = tile_loc(page, tpp, len, kv.page_size, kv.num_kv_heads, h, t);
  T.valid = loc.valid;
  // One 64-bit address per array and tile; the per-token offsets below are
  // immediates (the lane's own offsets are folded into the base).
  const uint64_t row0 = loc.row0;
  load_quant_fragments<false>(T, kv.quant.k_codes + row0 * RB, kv.quant.v_codes + row0 * RB,
                       reinterpret_cast<const uint32_t*>(kv.quant.k_params) + row0 * NG,
                       reinterpret_cast<const uint32_t*>(kv.quant.v_params) + row0 * NG, g, r);
}

// Per-block query operands for the INT2 path.
template <int D, int G>
struct QuantQuery {
  static constexpr int NG = D / G;
  uint32_t qf[D / 16][2];  // B fragments (fp16x2) of q' = F q, virtual channel order
  float qsum[NG][2];       // sum over each group of the fp16 query, head columns 2r, 2r+1
  float qsump[NG][2];      // the same for q'
  float f[2];              // logit factor (amax * sm_scale * log2 e), head columns 2r, 2r+1
};

// Code factor F of k-tile jl of a group at fragment half `half` (kpos / 8):
// G >= 64 unpacks half 0 from lo bytes and half 1 from hi bytes at s = jl % 4;
// G = 32 unpacks both halves from lo bytes at s = 2 jl + half.
template <int G>
__host__ __device__ constexpr float k_code_factor(int jl, int half) {
  return G >= 64 ? (half ? hi_factor(jl % 4) : lo_factor(jl % 4)) : lo_factor(2 * jl + half);
}

template <int D, int G>
__device__ __forceinline__ void load_quant_query(QuantQuery<D, G>& Q, const float* qrow,
                                                 bool head_ok, float sm_scale_log2, int g, int r) {
  constexpr int NG = D / G, KTG = G / 16;
  float v[D / 16][4];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int kpos = 2 * r + (k & 1) + 8 * (k >> 1);
      v[j][k] = head_ok ? __ldg(qrow + kq_channel(G, j / KTG, j % KTG, kpos)) : 0.0f;
      amax = fmax_nan(amax, fabsf(v[j][k]));  // a NaN query gives NaN logits
    }
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  // Normalizing by max|q| keeps fp16 far from overflow (|q'| <= 16); the
  // factor returns in f. (A zero query gives zero logits either way.)
  const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
  float part[NG], partp[NG];
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) part[gm] = partp[gm] = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const float f0 = k_code_factor<G>(j % KTG, 0), f1 = k_code_factor<G>(j % KTG, 1);
    Q.qf[j][0] = pack_half2(v[j][0] * inv * f0, v[j][1] * inv * f0);
    Q.qf[j][1] = pack_half2(v[j][2] * inv * f1, v[j][3] * inv * f1);
    // The sums use the rounded values so that the folded offset cancels exactly
    // (scaling by a power of two commutes with the rounding).
    const float s0 = half_lo(Q.qf[j][0]) + half_hi(Q.qf[j][0]);
    const float s1 = half_lo(Q.qf[j][1]) + half_hi(Q.qf[j][1]);
    partp[j / KTG] += s0 + s1;
    part[j / KTG] += s0 / f0 + s1 / f1;
  }
  const float fh = amax * sm_scale_log2;
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) {
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      part[gm] += __shfl_xor_sync(0xffffffffu, part[gm], o);
      partp[gm] += __shfl_xor_sync(0xffffffffu, partp[gm], o);
    }
    // Lane (g, r) now holds head g's sums; lane needs heads 2r and 2r+1.
    Q.qsum[gm][0] = __shfl_sync(0xffffffffu, part[gm], (2 * r) * 4);
    Q.qsum[gm][1] = __shfl_sync(0xffffffffu, part[gm], (2 * r + 1) * 4);
    Q.qsump[gm][0] = __shfl_sync(0xffffffffu, partp[gm], (2 * r) * 4);
    Q.qsump[gm][1] = __shfl_sync(0xffffffffu, partp[gm], (2 * r + 1) * 4);
  }
  Q.f[0] = __shfl_sync(0xffffffffu, fh, (2 * r) * 4);
  Q.f[1] = __shfl_sync(0xffffffffu, fh, (2 * r + 1) * 4);
}

// Code factor F of INT2 V m-tile i of a group at row half `half` (rp / 8).
template <int G>
__host__ __device__ constexpr float v_code_factor(int i, int half) {
  return G == 128 ? (half ? hi_factor(i % 4) : lo_factor(i % 4))
                  : G == 64 ? (half ? hi_factor(i) : lo_factor(i)) : lo_factor(2 * i + half);
}

// Logits of one INT2 tile (s[4], log2 domain, masked -inf) and the value
// params of tokens g, g+8 (zero for padding slots).
template <int D, int G>
__device__ __forceinline__ void quant_logits(const QuantTile<D, G>& T, const QuantQuery<D, G>& Q,
                                             int g, float (&s)[4], float (&vs)[2][D / G],
                                             float (&vm)[2][D / G]) {
  constexpr int NG = D / G, KTG = G / 16;
  // --- logits: S^T = K Q'^T, one accumulator per group (scales differ per group)
  float sacc[NG][4];
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) {
    sacc[gm][0] = sacc[gm][1] = sacc[gm][2] = sacc[gm][3] = 0.0f;
    if constexpr (G >= 64) {
#pragma unroll
      for (int wi = 0; wi < G / 64; ++wi) {
        const CodeWord w0(T.kw[0][gm][wi]), w1(T.kw[1][gm][wi]);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int j = gm * KTG + wi * 4 + s;
          mma_f16(sacc[gm], w0.lo(s), w1.lo(s), w0.hi(s), w1.hi(s), Q.qf[j][0], Q.qf[j][1]);
        }
      }
    } else {
      const CodeWord w0(T.kw[0][gm][0]), w1(T.kw[1][gm][0]);
#pragma unroll
      for (int jl = 0; jl < 2; ++jl) {
        const int j = gm * KTG + jl;
        mma_f16(sacc[gm], w0.lo(2 * jl), w1.lo(2 * jl), w0.lo(2 * jl + 1), w1.lo(2 * jl + 1),
                Q.qf[j][0], Q.qf[j][1]);
      }
    }
  }
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const bool ok = g + 8 * tt < T.valid;
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int gm = 0; gm < NG; ++gm) {
      const float ks = half_lo(T.kp[tt][gm]), km = half_hi(T.kp[tt][gm]);
      acc0 += ks * (sacc[gm][2 * tt] - Q.qsump[gm][0]) + km * Q.qsum[gm][0];
      acc1 += ks * (sacc[gm][2 * tt + 1] - Q.qsump[gm][1]) + km * Q.qsum[gm][1];
      // Padding slots of a partial page may hold anything (even NaN): zero
      // their value params so p = 0 cannot meet a NaN.
      vs[tt][gm] = ok ? half_lo(T.vp[tt][gm]) : 0.0f;
      vm[tt][gm] = ok ? half_hi(T.vp[tt][gm]) : 0.0f;
    }
    s[2 * tt] = ok ? acc0 * Q.f[0] : -INFINITY;
    s[2 * tt + 1] = ok ? acc1 * Q.f[1] : -INFINITY;
  }
}

// O^T += V^T (p s)^T per group for one tile (p in s[4]); sums of p s and p m
// for the fold.
template <int D, int G>
__device__ __forceinline__ void quant_pv(WarpState<D, D / G>& st, const QuantTile<D, G>& T,
                                         const float (&s)[4], const float (&vs)[2][D / G],
                                         const float (&vm)[2][D / G]) {
  constexpr int NG = D / G;
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) {
    const uint32_t h01 = pack_half2(s[0] * vs[0][gm], s[1] * vs[0][gm]);  // token g
    const uint32_t h23 = pack_half2(s[2] * vs[1][gm], s[3] * vs[1][gm]);  // token g+8
    st.pm[gm][0] += s[0] * vm[0][gm] + s[2] * vm[1][gm];
    st.pm[gm][1] += s[1] * vm[0][gm] + s[3] * vm[1][gm];
    const uint32_t b0 = transpose8x8(h01), b1 = transpose8x8(h23);
    // sum_t fp16(p s) per head on the tensor cores: an all-ones A operand.
    constexpr uint32_t kOnes = 0x3C003C00u;
    mma_f16(st.sp[gm], kOnes, kOnes, kOnes, kOnes, b0, b1);
    if constexpr (G == 128) {
#pragma unroll
      for (int xi = 0; xi < 2; ++xi) {
        const uint32_t sel = xi ? 0x7632u : 0x5410u;
        const CodeWord x0(prmt(T.vw[0][gm], T.vw[1][gm], sel)), x1(prmt(T.vw[2][gm], T.vw[3][gm], sel));
#pragma unroll
        for (int sh = 0; sh < 4; ++sh)
          mma_f16(st.o[gm * 8 + xi * 4 + sh], x0.lo(sh), x0.hi(sh), x1.lo(sh), x1.hi(sh), b0, b1);
      }
    } else if constexpr (G == 64) {
      const CodeWord x0(prmt(T.vw[0][gm], T.vw[1][gm], 0x5410u)), x1(prmt(T.vw[2][gm], T.vw[3][gm], 0x5410u));
#pragma unroll
      for (int i = 0; i < 4; ++i)
        mma_f16(st.o[gm * 4 + i], x0.lo(i), x0.hi(i), x1.lo(i), x1.hi(i), b0, b1);
    } else {
      // 1-byte loads: the upper bytes are zero, so 0x5410 gives [t0.b0, 0, t1.b0, 0].
      const CodeWord x0(prmt(T.vw[0][gm], T.vw[1][gm], 0x5410u)), x1(prmt(T.vw[2][gm], T.vw[3][gm], 0x5410u));
#pragma unroll
      for (int i = 0; i < 2; ++i)
        mma_f16(st.o[gm * 2 + i], x0.lo(2 * i), x0.lo(2 * i + 1), x1.lo(2 * i), x1.lo(2 * i + 1), b0, b1);
    }
  }
}

// N INT2 tiles with one softmax step.
template <int D, int G, int N>
__device__ __forceinline__ void compute_quant_tiles(WarpState<D, D / G>& st, const QuantTile<D, G> (&T)[N],
                                                    const QuantQuery<D, G>& Q, int g) {
  float s[N][4], vs[N][2][D / G], vm[N][2][D / G];
#pragma unroll
  for (int u = 0; u < N; ++u) quant_logits(T[u], Q, g, s[u], vs[u], vm[u]);
  softmax_step(st, s);
#pragma unroll
  for (int u = 0; u < N; ++u) quant_pv(st, T[u], s[u], vs[u], vm[u]);
}

// ---------------------------------------------------------------------------
// Int8-key loop (kernel variant 2, docs/history.md v10): head_dim 128,
// group 128, GQA <= 4. Keys go through m16n8k32 u8 x s8 tensor cores: a code
// word shifted by 2s and masked with 0x03030303 is one A register (four
// codes of consecutive virtual channels), so K needs no fp16 conversion. The
// query is rounded to a 16-bit integer qi (|qi| <= 127*256) and split into a
// high and a low signed byte (qi = 256 hi + lo); the N = 8 columns of the MMA
// are (head 0 hi, head 0 lo, head 1 hi, ..., head 3 lo), so the GQA-4 padding
// columns of the fp16 path now carry the low bytes and 4 MMAs cover the 16x128
// tile. 256 C[2r] + C[2r+1] = sum_j c_j qi_j exactly (int32), so the only
// new error is the rounding of q to 16 bits (|dq| <= amax / 65024 per channel).
// Each lane then owns ONE head (r) for tokens g and g+8: the softmax works on
// 2 values per lane instead of 4 (half of which were padding). For P.V the
// lane's (token g, token g+8) pair of head r is transposed with one movmatrix;
// after it lane (2h+e, r') holds tokens 2r'+8e, 2r'+8e+1 of head h, which is
// B column 2h+e restricted to token half e (the other half is zero): output
// columns 2h and 2h+1 are the two halves of head h, added at the end.
constexpr float kQ16 = 32512.0f;  // 127 * 256: hi in [-127, 127], lo in [-128, 127]

struct Int8Query {
  uint32_t qb[4][2];  // shift s: B fragments (4 x s8) of column g (head g/2, hi if g even else lo)
  float f;            // head r: sm_scale * log2(e) * amax / kQ16 / 64
  float qsum;         // head r: 64 sum_j qi_j (an integer, exact in fp32)
};

template <int D>
struct WarpState1 {
  float o[D / 16][4];  // O^T accumulators: rows (channels) g, g+8; cols 2r, 2r+1 = head r, token halves
  float sp[4];         // sum_t fp16(p s) (all-ones A operand), cols as o
  float pm;            // sum_t p m of head r (this lane's tokens)
  float m;             // running max of head r (log2 domain)
  float l;             // this lane's partial row sum of head r
};


template <int D>
struct WarpState2 {
  float o[D / 16][2];  // O^T of head r, MMA m: channels of rows g, g+8 (times 4^s)
  float pm;            // sum_t p m of head r (this lane's tokens)
  float m;             // running max of head r (log2 domain)
  float l;             // this lane's partial row sum of head r
};

// One head per lane (the int8 loops' states): every sum zero, the running
// max -inf.
template <class State>
__device__ __forceinline__ void state_init_lane(State& st) {
  st = State{};
  st.m = -INFINITY;
}
template <int D>
__device__ __forceinline__ void state_init(WarpState1<D>& st) { state_init_lane(st); }
template <int D>
__device__ __forceinline__ void state_init(WarpState2<D>& st) { state_init_lane(st); }

// The lane's 32 query values (channels 8r + i + 32s of the row at qhead;
// ok: that head exists, else zeros), fetched apart from their conversion so
// that the loads can go out before the middle's first copies (v50).
struct Int8QueryRaw {
  float4 x[4][2];
};
// v50: two 16-byte loads per 8 values (q is 16-byte aligned, check_decode)
// instead of 32 scalar loads with an address each: the kernel's prologue,
// which every warp of the launch runs at once, is ~100 instructions shorter.
__device__ __forceinline__ void fetch_int8_query(Int8QueryRaw& R, const float* qhead, bool ok, int r) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const float4* p = reinterpret_cast<const float4*>(qhead + 8 * r + 32 * s);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    R.x[s][0] = ok ? __ldg(p) : zero;
    R.x[s][1] = ok ? __ldg(p + 1) : zero;
  }
}
// qhead: the query row of head h*gqa + g/2 (ok: that head exists).
__device__ __forceinline__ void load_int8_query(Int8Query& Q, const Int8QueryRaw& R, float sm_scale_log2, int g,
                                                int r) {
  float v[4][8];
  float amax = 0.0f;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const float4 x0 = R.x[s][0], x1 = R.x[s][1];
    v[s][0] = x0.x, v[s][1] = x0.y, v[s][2] = x0.z, v[s][3] = x0.w;
    v[s][4] = x1.x, v[s][5] = x1.y, v[s][6] = x1.z, v[s][7] = x1.w;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmax_nan(amax, fabsf(v[s][i]));  // a NaN query gives NaN logits
  }
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  // (v50: the approximate reciprocal, as for v48's weight bound: |v * inv|
  // stays within 32512 (1 + 1e-6), which rounds to at most 32512; amax = inf
  // gives 0 as the division did.)
  const float inv = amax > 0.0f ? kQ16 * fast_rcp(amax) : 0.0f;
  int part = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int qi = __float2int_rn(v[s][4 * w + k] * inv);
        const int hi = (qi + 128) >> 8;  // floor((qi + 128) / 256)
        const int lo = qi - (hi << 8);
        word |= (static_cast<uint32_t>((g & 1) ? lo : hi) & 0xffu) << (8 * k);
        part += qi;
      }
      Q.qb[s][w] = word;
    }
  part += __shfl_xor_sync(0xffffffffu, part, 1);
  part += __shfl_xor_sync(0xffffffffu, part, 2);
  const float f = amax / kQ16 * sm_scale_log2 * (1.0f / 64.0f);  // 1/64: codes unpacked as 64 c
  // Lane (g, r) holds head g/2's values; it needs head r's: lane 4 * (2r).
  Q.qsum = 64.0f * static_cast<float>(__shfl_sync(0xffffffffu, part, 8 * r));  // x64 like the codes
  Q.f = __shfl_sync(0xffffffffu, f, 8 * r);
  // v48: the loops apply f inside the softmax's exp2 (and to the step max),
  // so masked logits (-inf) are multiplied by it: f must be > 0 there. A
  // zero query (f = 0, all its logits 0) gets the smallest normal float
  // instead; a NaN f stays NaN.
  if (Q.f == 0.0f) Q.f = FLT_MIN;
}

// Logits of one tile for head r, tokens g and g+8, masked -inf, and the
// value params of those tokens (zero for padding slots). kMasked = false: the
// caller knows every token of the tile is valid (no selects). v48: the logits
// are not yet multiplied by Q.f (> 0): softmax_step_lane folds it into its
// exp2 argument (one FFMA there instead of an FMUL per logit here).
template <bool kMasked>
__device__ __forceinline__ void int8k_logits(const QuantTile<128, 128>& T, const Int8Query& Q, int g,
                                             float (&s)[2], float (&vs)[2], float (&vm)[2]) {
  // Codes are taken at bits 6-7 of each byte: (w << (6 - 2 sh)) & 0xC0C0C0C0
  // is 64 c per byte, a left shift (IMAD.SHL, on the FMA pipe) and one LOP3 on
  // the integer pipe, which the V unpacking already keeps busy (ncu, v10).
  // The factor 64 is folded into Q.f. |acc| <= 64 * 3 * 128 * 128, so
  // 256 acc_hi + acc_lo < 2^30: exact in int32.
  int acc[4] = {0, 0, 0, 0};
#pragma unroll
  for (int sh = 0; sh < 4; ++sh) {
    constexpr uint32_t m = 0xC0C0C0C0u;
    const int l = 6 - 2 * sh;
    mma_u8s8(acc, (T.kw[0][0][0] << l) & m, (T.kw[1][0][0] << l) & m, (T.kw[0][0][1] << l) & m,
             (T.kw[1][0][1] << l) & m, Q.qb[sh][0], Q.qb[sh][1]);
  }
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const bool ok = !kMasked || g + 8 * tt < T.valid;
    const float dot = static_cast<float>(acc[2 * tt] * 256 + acc[2 * tt + 1]);
    const float ks = half_lo(T.kp[tt][0]), km = half_hi(T.kp[tt][0]);
    s[tt] = ok ? fmaf(ks, dot, km * Q.qsum) : -INFINITY;
    vs[tt] = ok ? half_lo(T.vp[tt][0]) : 0.0f;
    vm[tt] = ok ? half_hi(T.vp[tt][0]) : 0.0f;
  }
}

// Online-softmax rescale of the lane-per-head states' accumulators.
template <int D>
__device__ __forceinline__ void scale_accumulators(WarpState1<D>& st, float sc) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    st.o[i][0] *= sc;
    st.o[i][1] *= sc;
    st.o[i][2] *= sc;
    st.o[i][3] *= sc;
  }
  st.sp[0] *= sc;
  st.sp[1] *= sc;
  st.sp[2] *= sc;
  st.sp[3] *= sc;
}
template <int D>
__device__ __forceinline__ void scale_accumulators(WarpState2<D>& st, float sc) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    st.o[i][0] *= sc;
    st.o[i][1] *= sc;
  }
}

// Online softmax step for a lane that owns one head (int8 loops, WarpState1
// or WarpState2): f * s[u] = logits (log2 domain) of tokens g, g+8 of tile u
// (f > 0, so the maximum of s gives the logits'), p in place.
// Returns 2^(step max - base), the largest p of the step (0 if the step has
// no finite logit); the v13 loop scales its weights by it.
template <class State, int N>
__device__ __forceinline__ float softmax_step_lane(State& st, float (&s)[N][2], float f) {
  float mx = fmaxf(s[0][0], s[0][1]);
#pragma unroll
  for (int u = 1; u < N; ++u) mx = fmaxf(mx, fmaxf(s[u][0], s[u][1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
  mx *= f;
  const float mn = fmaxf(st.m, mx);
  if (__any_sync(0xffffffffu, mn > st.m)) {
    const float sc = mn > st.m ? fast_exp2(st.m - mn) : 1.0f;
    scale_accumulators(st, sc);
    st.pm *= sc;
    st.l *= sc;
    st.m = mn;
  }
  const float b = st.m == -INFINITY ? 0.0f : st.m;
#pragma unroll
  for (int u = 0; u < N; ++u) {
    s[u][0] = fast_exp2(fmaf(s[u][0], f, -b));
    s[u][1] = fast_exp2(fmaf(s[u][1], f, -b));
    st.l += s[u][0] + s[u][1];
  }
  return fast_exp2(mx - b);
}

__device__ __forceinline__ void int8k_pv(WarpState1<128>& st, const QuantTile<128, 128>& T,
                                         const float (&p)[2], const float (&vs)[2], const float (&vm)[2],
                                         int g) {
  st.pm += p[0] * vm[0] + p[1] * vm[1];
  const uint32_t y = transpose8x8(pack_half2(p[0] * vs[0], p[1] * vs[1]));
  const bool e = g & 1;
  const uint32_t b0 = e ? 0u : y, b1 = e ? y : 0u;
  constexpr uint32_t kOnes = 0x3C003C00u;
  mma_f16(st.sp, kOnes, kOnes, kOnes, kOnes, b0, b1);
#pragma unroll
  for (int xi = 0; xi < 2; ++xi) {
    const uint32_t sel = xi ? 0x7632u : 0x5410u;
    const CodeWord x0(prmt(T.vw[0][0], T.vw[1][0], sel)), x1(prmt(T.vw[2][0], T.vw[3][0], sel));
#pragma unroll
    for (int sh = 0; sh < 4; ++sh)
      mma_f16(st.o[xi * 4 + sh], x0.lo(sh), x0.hi(sh), x1.lo(sh), x1.hi(sh), b0, b1);
  }
}

#ifndef OSCAR_INT8K_FASTPATH
#define OSCAR_INT8K_FASTPATH 1  // unmasked code for steps of full tiles (build-time A/B knob)
#endif
template <int N, bool kMasked>
__device__ __forceinline__ void compute_int8k_tiles(WarpState1<128>& st, const QuantTile<128, 128> (&T)[N],
                                                    const Int8Query& Q, int g) {
  float s[N][2], vs[N][2], vm[N][2];
#pragma unroll
  for (int u = 0; u < N; ++u) int8k_logits<kMasked>(T[u], Q, g, s[u], vs[u], vm[u]);
  softmax_step_lane(st, s, Q.f);
#pragma unroll
  for (int u = 0; u < N; ++u) int8k_pv(st, T[u], s[u], vs[u], vm[u], g);
}

// ---------------------------------------------------------------------------
// Int8 K and V loop (kernel variant 3, docs/history.md v13): keys as in the
// int8-key loop above; values through m16n8k32 u8 x u8 tensor cores too:
//   O^T[channel][head hi|lo] += V^T[channel][32 tokens] . P'^T[32 tokens][head hi|lo]
// A (codes): the lane already holds the 4-byte words (16 codes each) of tokens
// 2r, 2r+1, 2r+8, 2r+9 at row byte 4g. Byte gathers (8 PRMT per tile) make
// word k = byte k of the four tokens, and word_k & (3 << 2s per byte) is one A
// register: those four tokens' codes of channel 4g + k + 32s (G = 128 packing),
// times 4^s, undone at the end. One MMA's K dimension is a PAIR of tiles: slots
// 4r..4r+3 are tokens 2r, 2r+1, 2r+8, 2r+9 of the first, slots 16+4r.. of the
// second.
// B (weights): P' = p s (s: the token's value scale) rounded to 16 bits
// against the step's bound S = (largest p of the step) * (largest s), as a
// high and a low byte in the N columns (head 0 hi, head 0 lo, ..., head 3 lo).
// The lane's (token g, token g+8) pair of head r goes through one movmatrix
// (lane (2h+e, r) then holds tokens 2r+8e, 2r+8e+1 of head h), one shuffle
// with the lane holding the other token half, and one PRMT that takes the hi
// (e = 0) or lo (e = 1) bytes in slot order.
// The int32 accumulators start each step at 2^23's float bit pattern: a sum
// 0 <= x < 2^23 (here <= 255 * 192 * 64 = 3.1e6) read back as a float is
// exactly 2^23 + x, so a step folds into the fp32 output with two FADD and two
// FFMA per value: o += S / 65280 * (256 hi + lo). The integer sums are exact;
// the only new error is rounding p s to 16 bits of the step's bound, and the
// min term sum p m stays in fp32 (no all-ones MMA: codes carry no offset).
constexpr float kPQ = 65280.0f;       // 255 * 256: hi and lo bytes both <= 255
constexpr int kAccBias = 0x4B000000;  // 2^23 as float bits
constexpr float kAccBiasF = 8388608.0f;

// x[k] = byte k of w[0..3] (tokens 2r, 2r+1, 2r+8, 2r+9), in token order.
__device__ __forceinline__ void gather_token_bytes(const QuantTile<128, 128>& T, uint32_t (&x)[4]) {
  const uint32_t a = prmt(T.vw[0][0], T.vw[1][0], 0x5140u), b = prmt(T.vw[2][0], T.vw[3][0], 0x5140u);
  const uint32_t c = prmt(T.vw[0][0], T.vw[1][0], 0x7362u), d = prmt(T.vw[2][0], T.vw[3][0], 0x7362u);
  x[0] = prmt(a, b, 0x5410u);
  x[1] = prmt(a, b, 0x7632u);
  x[2] = prmt(c, d, 0x5410u);
  x[3] = prmt(c, d, 0x7632u);
}

// Channel of output o[m][i] in lane row g (G = 128 packing: byte j, shift s
// holds channel j + 32 s), and its code factor 4^s.
__host__ __device__ constexpr int v8_shift(int m, int i) { return 2 * (m & 1) + i; }
__host__ __device__ constexpr int v8_channel(int g, int m, int i) { return 4 * g + (m >> 1) + 32 * v8_shift(m, i); }

template <int N, bool kMasked>
__device__ __forceinline__ void compute_int8kv_tiles(WarpState2<128>& st, const QuantTile<128, 128> (&T)[N],
                                                     const Int8Query& Q, int g) {
  static_assert(N % 2 == 0, "tiles pair up in the MMA's K dimension");
  float s[N][2], vs[N][2], vm[N][2];
#pragma unroll
  for (int u = 0; u < N; ++u) int8k_logits<kMasked>(T[u], Q, g, s[u], vs[u], vm[u]);
  const float pmax = softmax_step_lane(st, s, Q.f);
  // The value scales are the same for every head: the bound over the step's
  // tokens is a reduction over the 8 lanes of a column quad (padding slots: 0).
  // A NaN scale (a corrupt cache row) must reach the output as the reference's
  // does, so the maximum propagates NaN (fmaxf would drop it and turn the
  // step's weights into integers of garbage): S = NaN then makes every
  // output channel NaN below.
  float vmax = 0.0f;
#pragma unroll
  for (int u = 0; u < N; ++u) vmax = fmax_nan(vmax, fmax_nan(vs[u][0], vs[u][1]));
  vmax = fmax_nan(vmax, __shfl_xor_sync(0xffffffffu, vmax, 4));
  vmax = fmax_nan(vmax, __shfl_xor_sync(0xffffffffu, vmax, 8));
  vmax = fmax_nan(vmax, __shfl_xor_sync(0xffffffffu, vmax, 16));
  const float S = pmax * vmax;
  // kPQ / S by the approximate reciprocal (v48: no IEEE division and its
  // slow path): a relative error of ~1e-7 in inv only scales the rounded
  // weights, which stay far below 2^16. S below ~2^-112 gives inv = inf, as
  // the division did; the step's weights are then < 2^-112 of the largest so
  // far, and so is their share of the output whatever they round to.
  const float inv = S > 0.0f ? kPQ * fast_rcp(S) : 0.0f;
  const uint32_t bsel = (g & 1) ? 0x2064u : 0x7531u;  // lo bytes (e = 1) / hi bytes (e = 0)
  uint32_t bf[N];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    st.pm += s[u][0] * vm[u][0] + s[u][1] * vm[u][1];
    // Round to an integer by adding 2^23: the low 16 bits are the weight.
    const float f0 = fmaf(s[u][0] * vs[u][0], inv, kAccBiasF);
    const float f1 = fmaf(s[u][1] * vs[u][1], inv, kAccBiasF);
    const uint32_t y = transpose8x8(prmt(__float_as_uint(f0), __float_as_uint(f1), 0x5410u));
    bf[u] = prmt(y, __shfl_xor_sync(0xffffffffu, y, 4), bsel);
  }
  const int kBias[4] = {kAccBias, kAccBias, kAccBias, kAccBias};
  int acc[8][4];
#pragma unroll
  for (int v = 0; v < N / 2; ++v) {
    uint32_t x0[4], x1[4];
    gather_token_bytes(T[2 * v], x0);
    gather_token_bytes(T[2 * v + 1], x1);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int k = m >> 1;
      const uint32_t m0 = 0x03030303u << (2 * v8_shift(m, 0)), m1 = 0x03030303u << (2 * v8_shift(m, 1));
      if (v == 0)
        mma_u8u8(acc[m], x0[k] & m0, x0[k] & m1, x1[k] & m0, x1[k] & m1, bf[0], bf[1], kBias);
      else
        mma_u8u8(acc[m], x0[k] & m0, x0[k] & m1, x1[k] & m0, x1[k] & m1, bf[2 * v], bf[2 * v + 1], acc[m]);
    }
  }
  const float f1 = S * (1.0f / kPQ), f256 = 256.0f * f1;
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float hi = __int_as_float(acc[m][2 * i]) - kAccBiasF;
      const float lo = __int_as_float(acc[m][2 * i + 1]) - kAccBiasF;
      st.o[m][i] = fmaf(hi, f256, fmaf(lo, f1, st.o[m][i]));
    }
}

// ---------------------------------------------------------------------------
// BF16 tiles (sink and recent windows, and the BF16-only baseline).
template <int D>
struct Bf16Tile {
  uint4 k[2][D / 32];  // tokens g, g+8: channels 32k + 8r .. +7
  uint4 v[4][D / 64];  // tokens 2r, 2r+1, 2r+8, 2r+9: channels 64k + 8g .. +7
  int valid;
};

// A staged BF16 row's 16-byte chunk c (8 channels) lives at chunk
// window_chunk(row, c): the low three bits XOR-ed with a function of the row
// such that the K fragment loads (rows g, g+8 x chunks 4k + r) and the V
// fragment loads (rows 2r + j' x chunks 8k + g) of one 8-lane phase touch 8
// different 16-byte bank groups.
__device__ __forceinline__ int window_chunk(int row, int c) {
  return c ^ ((((row >> 1) & 3) << 1) ^ ((row & 1) << 2));
}

// Loads through L2 (ld.global.cg), not the read-only path (v40d): the tile
// holding a step write's new row was written by a launch running at the
// same time (v40b), and the read-only path is for data that does not change
// while the kernel runs; a branch that kept the read-only path for the
// other tiles measured 0.3 us slower at 8 x 4K (v40c), every tile through
// L2 the same as before.
template <int D>
__device__ __forceinline__ void load_bf16_tile(Bf16Tile<D>& T, const kv::PagedKvView& kv,
                                               const int32_t* pages, const FastDiv& tpp, int len,
                                               int h, int t, int g, int r) {
  auto load = [](const uint16_t* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); };
  const TileLoc loc =
      tile_loc(page_of(pages, tpp, t), tpp, len, kv.page_size, kv.num_kv_heads, h, t);
  T.valid = loc.valid;
  const uint16_t* kb = kv.bf16.k + size_t(loc.row0) * D;
  const uint16_t* vb = kv.bf16.v + size_t(loc.row0) * D;
#pragma unroll
  for (int tt = 0; tt < 2; ++tt)
#pragma unroll
    for (int k = 0; k < D / 32; ++k)
      T.k[tt][k] = load(kb + (g + 8 * tt) * D + 32 * k + 8 * r);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = 2 * r + (j & 1) + 8 * (j >> 1);
#pragma unroll
    for (int k = 0; k < D / 64; ++k) {
      const uint4 w = load(vb + tok * D + 64 * k + 8 * g);
      // Padding slots may hold NaN bits; p = 0 times NaN would poison O.
      T.v[j][k] = tok < loc.valid ? w : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

template <int D>
struct Bf16Query {
  uint32_t qf[D / 16][2];  // bf16x2 B fragments
  float f[2];
};

template <int D>
__device__ __forceinline__ void load_bf16_query(Bf16Query<D>& Q, const float* qrow, bool head_ok,
                                                float sm_scale_log2, int g, int r) {
  float v[D / 16][4];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int kpos = 2 * r + (k & 1) + 8 * (k >> 1);
      v[j][k] = head_ok ? __ldg(qrow + kb_channel(j, kpos)) : 0.0f;
      amax = fmax_nan(amax, fabsf(v[j][k]));  // a NaN query gives NaN logits
    }
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    Q.qf[j][0] = pack_bf162(v[j][0] * inv, v[j][1] * inv);
    Q.qf[j][1] = pack_bf162(v[j][2] * inv, v[j][3] * inv);
  }
  const float fh = amax * sm_scale_log2;
  Q.f[0] = __shfl_sync(0xffffffffu, fh, (2 * r) * 4);
  Q.f[1] = __shfl_sync(0xffffffffu, fh, (2 * r + 1) * 4);
}

template <int D, int NG>
__device__ __forceinline__ void compute_bf16_tile(WarpState<D, NG>& st, const Bf16Tile<D>& T,
                                                  const Bf16Query<D>& Q, int g) {
  float sacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int k = j / 2, mm = j % 2;
    const uint32_t* k0 = reinterpret_cast<const uint32_t*>(&T.k[0][k]);
    const uint32_t* k1 = reinterpret_cast<const uint32_t*>(&T.k[1][k]);
    mma_bf16(sacc, k0[2 * mm], k1[2 * mm], k0[2 * mm + 1], k1[2 * mm + 1], Q.qf[j][0], Q.qf[j][1]);
  }
  float s[1][4];
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const bool ok = g + 8 * tt < T.valid;
    s[0][2 * tt] = ok ? sacc[2 * tt] * Q.f[0] : -INFINITY;
    s[0][2 * tt + 1] = ok ? sacc[2 * tt + 1] * Q.f[1] : -INFINITY;
  }
  softmax_step(st, s);
  const uint32_t b0 = transpose8x8(pack_bf162(s[0][0], s[0][1]));
  const uint32_t b1 = transpose8x8(pack_bf162(s[0][2], s[0][3]));
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const int k = i / 4, w = i % 4;
    const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&T.v[0][k]);
    const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&T.v[1][k]);
    const uint32_t* v2 = reinterpret_cast<const uint32_t*>(&T.v[2][k]);
    const uint32_t* v3 = reinterpret_cast<const uint32_t*>(&T.v[3][k]);
    mma_bf16(st.o[i], prmt(v0[w], v1[w], 0x5410u), prmt(v0[w], v1[w], 0x7632u),
             prmt(v2[w], v3[w], 0x5410u), prmt(v2[w], v3[w], 0x7632u), b0, b1);
  }
}

// ---------------------------------------------------------------------------
// The split kernel. kQuant: this launch handles middle (INT2) chunks; else
// BF16 chunks (sink / recent).
// kVariant (INT2 loop shape; docs/kernels-cuda.md): 0 = four tiles per step
// staged through a per-warp two-stage cp.async ring in shared memory, fp16
// tensor cores for K and V; 1 = two tiles per step, the next step's tiles
// prefetched into registers (used for the other shapes); 2 = the ring of 0
// with int8 tensor cores for K (v10, head_dim 128, group 128, GQA <= 4);
// 3 = the ring with int8 tensor cores for K and V (v13: the default where
// it applies).
// Tiles per ring stage (v30 measured 2, 6 and 8: slower or within 1.2%).
constexpr int kRingTiles = 4;
// Stages of the per-warp ring (groups of kRingTiles tiles; stages - 1 groups
// in flight while one is computed). The int8 K/V loop (variant 3) can take
// OSCAR_INT8KV_STAGES (a build-time knob; 3 stages need 55 KB of dynamic
// shared memory per CTA, 4 CTAs still fit an H200 SM).
#ifndef OSCAR_INT8KV_STAGES
#define OSCAR_INT8KV_STAGES 2
#endif
template <int kVariant>
__host__ __device__ constexpr int ring_stages() { return kVariant == 3 ? OSCAR_INT8KV_STAGES : 2; }
// Shared memory of a split kernel: the warps' rings, then (reused) the
// per-warp outputs.
// The fused window CTA (v33) stages its BF16 window tiles (K and V, 16 rows
// each) through a per-warp cp.async ring of 8 KB (32 KB per CTA): 2 tiles at
// head_dim 64, 1 at 128, 1 at 256 (16 KB: the ring is one tile there). Deeper rings measured slower
// (v33): CTAs of 64 KB or more do not fit beside three middle CTAs and start
// later.
template <int D>
__host__ __device__ constexpr int window_ring_tiles() {
  constexpr int n = 8192 / (2 * kTileTokens * D * 2);
  return n > 0 ? n : 1;
}
template <int D, int G, bool kQuant, int kVariant, bool kFused = false>
__host__ __device__ constexpr int split_smem_bytes() {
  constexpr int so = kWarps * kMaxGqa * D * 4;
  constexpr int ring = kQuant && kVariant != 1 ? kWarps * ring_stages<kVariant>() * kRingTiles * quant_tile_bytes(D, G)
                       : kFused             ? kWarps * window_ring_tiles<D>() * 2 * kTileTokens * D * 2
                                            : 0;
  return so > ring ? so : ring;
}

// A tile's page id and (kSlot) first slot, looked up one step before its
// copies are issued: one division per tile.
struct TileRef {
  int32_t page;
  uint32_t slot0;
};
template <bool kSlot>
__device__ __forceinline__ TileRef tile_ref(const int32_t* pages, const FastDiv& tpp, int t) {
  const uint32_t q = tpp.div(static_cast<uint32_t>(t));
  return {__ldg(pages + q), kSlot ? (static_cast<uint32_t>(t) - q * tpp.d) * kTileTokens : 0u};
}
// The same for a tile whose page is known (v44: DecodePlan::first_pages).
__device__ __forceinline__ TileRef tile_ref_at(int32_t page, const FastDiv& tpp, int t) {
  const uint32_t tu = static_cast<uint32_t>(t);
  return {page, (tu - tpp.div(tu) * tpp.d) * kTileTokens};
}

// The lane's share of one tile image (head_dim 128: 32 chunks of 16 bytes
// per code array, one per lane; params: 4 chunks each for K and V), with the
// lane-dependent parts of the addresses computed once per kernel.
struct RingLane {
  const uint8_t* kc;  // K codes + the lane's chunk
  const uint8_t* vc;  // V codes + the lane's chunk
  const uint8_t* pp;  // K or V params + the lane's chunk (lanes < 8)
  uint32_t dv, dp;    // shared-memory offsets of the V chunk (swizzled rows) and params chunk
};
template <int D, int G>
__device__ __forceinline__ RingLane ring_lane(const kv::PagedKvView& kv, int lane) {
  static_assert(D == 128 && G == 128, "the cp.async ring serves head_dim 128, group 128");
  constexpr int RB = D / 4;
  RingLane L;
  L.kc = kv.quant.k_codes + 16 * lane;
  L.vc = kv.quant.v_codes + 16 * lane;
  const int row = 16 * lane / RB, col = 16 * lane % RB;
  L.dv = 16 * RB + ring_v_row(row) * RB + col;
  const bool v = lane >= 4;  // params: 64 bytes each for K (lanes 0-3) and V (4-7)
  const int c = v ? lane - 4 : lane;
  L.pp = reinterpret_cast<const uint8_t*>(v ? kv.quant.v_params : kv.quant.k_params) + 16 * c;
  L.dp = 32 * RB + (v ? 64 : 0) + 16 * c;
  return L;
}

// Issues the cp.async copies of TPI tiles tg.. (tiles past tlast: the last
// tile again). kSlot: ref[] carries the slots, else they are recomputed.
template <int D, int G, int TPI, bool kSlot>
__device__ __forceinline__ void issue_tile_copies(uint8_t* dst, const kv::PagedKvView& kv, const RingLane& L,
                                                  const TileRef (&ref)[TPI], const FastDiv& tpp, int tg,
                                                  int tlast, int h, int lane) {
  constexpr int RB = D / 4, TB = quant_tile_bytes(D, G);
#pragma unroll
  for (int u = 0; u < TPI; ++u) {
    uint32_t slot0 = ref[u].slot0;
    const RingLane& P = kSlot ? L : ring_lane<D, G>(kv, lane);
    if constexpr (!kSlot) {
      const uint32_t tu = static_cast<uint32_t>(min(tg + u, tlast));
      slot0 = (tu - tpp.div(tu) * tpp.d) * kTileTokens;
    }
    const uint32_t row0 = (static_cast<uint32_t>(ref[u].page) * kv.num_kv_heads + h) * kv.page_size + slot0;
    uint8_t* d = dst + u * TB;
    cp_async16(d + 16 * lane, P.kc + uint64_t(row0) * RB);
    cp_async16(d + P.dv, P.vc + uint64_t(row0) * RB);
    if (lane < 8) cp_async16(d + P.dp, P.pp + uint64_t(row0) * 4);
  }
}

// v34: one 4-tile group (64 consecutive rows of one page: page size a
// multiple of 64, the group starting at a multiple of 4 tiles) from one
// page id and one row index: per lane 4 K and 4 V chunks at immediate
// offsets from one address each, and one params chunk (lanes 0-15 K, 16-31
// V), instead of a page id, a slot and a row index per tile.
template <int D, int G>
__device__ __forceinline__ RingLane group_lane(const kv::PagedKvView& kv, int lane) {
  constexpr int RB = D / 4, TB = quant_tile_bytes(D, G);
  RingLane L = ring_lane<D, G>(kv, lane);
  const bool v = lane >= 16;
  const int c = lane & 15;  // the params chunk: tile c / 4, rows 4 (c % 4) ..
  L.pp = reinterpret_cast<const uint8_t*>(v ? kv.quant.v_params : kv.quant.k_params) + 16 * c;
  L.dp = (c >> 2) * TB + 32 * RB + (v ? 64 : 0) + 16 * (c & 3);
  return L;
}
// Tiles of the group past the chunk's last (u >= nt: masked in the loop)
// are not copied: their slots keep older bytes, which the masking ignores as
// it ignores a partial tile's padding rows (scores -inf, value scale and min
// 0).
template <int D, int G, int TPI>
__device__ __forceinline__ void issue_group_copies(uint8_t* dst, const kv::PagedKvView& kv, const RingLane& L,
                                                   const TileRef& ref, int nt, int h, int lane) {
  static_assert(TPI == 4, "a group is the 64 rows of 4 tiles");
  constexpr int RB = D / 4, TB = quant_tile_bytes(D, G);
  const uint32_t row0 = (static_cast<uint32_t>(ref.page) * kv.num_kv_heads + h) * kv.page_size + ref.slot0;
  const uint8_t* kc = L.kc + uint64_t(row0) * RB;
  const uint8_t* vc = L.vc + uint64_t(row0) * RB;
  if (nt >= TPI) {  // every group but a chunk's last: no per-copy predicates
#pragma unroll
    for (int u = 0; u < TPI; ++u) {
      cp_async16(dst + u * TB + 16 * lane, kc + u * kTileTokens * RB);
      cp_async16(dst + u * TB + L.dv, vc + u * kTileTokens * RB);
    }
    cp_async16(dst + L.dp, L.pp + uint64_t(row0) * 4);
  } else {
#pragma unroll
    for (int u = 0; u < TPI - 1; ++u)
      if (u < nt) {
        cp_async16(dst + u * TB + 16 * lane, kc + u * kTileTokens * RB);
        cp_async16(dst + u * TB + L.dv, vc + u * kTileTokens * RB);
      }
    if ((lane & 15) >> 2 < nt) cp_async16(dst + L.dp, L.pp + uint64_t(row0) * 4);
  }
}

// The fused window + merge epilogue (v27): warp w takes the q heads w,
// w + kWarps, ... of KV head h; per head the window's state (the 4 warps'
// states in shared memory) and the partials of middle chunks [c0, c1) (one
// lane per chunk for the log-sum-exp, every lane D/4/32 float4 channel slots
// of every chunk, all loads in flight at once) give the final output.
template <int D>
__device__ __forceinline__ void fused_merge(const KernelArgs& a, int b, int h, int c0, int c1,
                                            const float (*s_o)[kMaxGqa][D], const float (*s_m)[kMaxGqa],
                                            const float (*s_l)[kMaxGqa], int warp, int lane) {
  constexpr int S = (D / 4 + 31) / 32;  // float4 slots per lane
  constexpr int U = 8;                  // chunks whose outputs are loaded at once
  const int nc = c1 - c0;               // <= kFuseMaxChunks (upload_plan)
  pdl_wait();                           // the middle's partials (and a step write) are complete
  for (int hd = warp; hd < a.gqa; hd += kWarps) {
    const int hq = h * a.gqa + hd;
    auto chunk_o = [&](int c, int slot) {
      return c < nc && slot < D / 4
                 ? *reinterpret_cast<const float4*>(a.partial_o + (int64_t(c0 + c) * a.num_q_heads + hq) * D + 4 * slot)
                 : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    };
    // Every load of the first U chunks in flight before any arithmetic: the
    // log-sum-exps (one chunk per lane) and the outputs (the lane's slots).
    float4 x0[S][U];
#pragma unroll
    for (int si = 0; si < S; ++si)
#pragma unroll
      for (int u = 0; u < U; ++u) x0[si][u] = chunk_o(u, lane + 32 * si);
    const float lc = lane < nc ? a.partial_lse[int64_t(c0 + lane) * a.num_q_heads + hq] : -INFINITY;
    // The window's state: its 4 warps combined.
    float mw = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mw = fmaxf(mw, s_m[w][hd]);
    // NaN (a corrupt row) propagates as in the split kernel's epilogue: the
    // maximum over chunks keeps a NaN log-sum-exp, empty is L == 0 exactly.
    float sc[kWarps], lw = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      sc[w] = mw == -INFINITY ? 1.0f : exp2f(s_m[w][hd] - mw);
      lw += sc[w] * s_l[w][hd];
    }
    float M = fmax_nan(lw != 0.0f ? mw : -INFINITY, lc);
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) M = fmax_nan(M, __shfl_xor_sync(0xffffffffu, M, o));
    const float wc = M == -INFINITY ? 0.0f : exp2f(lc - M);  // lane c's chunk weight; -inf: 0
    float L = wc;
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    const float fw = lw != 0.0f ? exp2f(mw - M) : 0.0f;
    L += lw * fw;
    const float inv = L != 0.0f ? 1.0f / L : 0.0f;
    auto add = [](float4& acc, float f, const float4& x) {
      acc.x += f * x.x, acc.y += f * x.y, acc.z += f * x.z, acc.w += f * x.w;
    };
#pragma unroll
    for (int si = 0; si < S; ++si) {
      const int slot = lane + 32 * si;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (slot < D / 4)
#pragma unroll
        for (int w = 0; w < kWarps; ++w) add(acc, sc[w] * fw, *reinterpret_cast<const float4*>(&s_o[w][hd][4 * slot]));
#pragma unroll
      for (int u = 0; u < U; ++u) add(acc, __shfl_sync(0xffffffffu, wc, u), x0[si][u]);  // zeros past nc
      for (int cb = U; cb < nc; cb += U) {
        float4 x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) x[u] = chunk_o(cb + u, slot);
#pragma unroll
        for (int u = 0; u < U; ++u) add(acc, __shfl_sync(0xffffffffu, wc, (cb + u) & 31), x[u]);
      }
      if (slot < D / 4)
        *reinterpret_cast<float4*>(a.o + (int64_t(b) * a.num_q_heads + hq) * D + 4 * slot) =
            make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    }
    if (a.lse && lane == 0)
      a.lse[int64_t(b) * a.num_q_heads + hq] = L != 0.0f ? (M + log2f(L)) * 0.6931471805599453f : -INFINITY;
  }
}

// Resident CTAs per SM the int8-key loop is compiled for (register cap
// 65536 / (128 threads * N)); a build-time knob for tuning.
#ifndef OSCAR_INT8K_MIN_BLOCKS
#define OSCAR_INT8K_MIN_BLOCKS 4  // 5 spills 88 bytes; with lazy fragment loads (v11) it fits but ran slower
#endif
template <int D, int G, bool kQuant, int kVariant = 0, bool kFused = false, bool kGroup = false>
__global__ void __launch_bounds__(kThreads, kVariant >= 2                    ? OSCAR_INT8K_MIN_BLOCKS
                                            : (D <= 128 && G == 128) ? 4
                                                                     : 1)
    decode_split_kernel(const KernelArgs a) {
  static_assert(!kFused || !kQuant, "the fused window + merge kernel is a BF16 instance");
  constexpr int NG = kQuant ? D / G : 1;
  constexpr int kRingStages = ring_stages<kVariant>();
  // The warps' cp.async rings and, after the loop, the per-warp outputs.
  extern __shared__ __align__(16) uint8_t smem[];  // split_smem_bytes (dynamic: may exceed 48 KB)
  float(*s_o)[kMaxGqa][D] = reinterpret_cast<float(*)[kMaxGqa][D]>(smem);
  __shared__ float s_m[kWarps][kMaxGqa];
  __shared__ float s_l[kWarps][kMaxGqa];

  OSCAR_TRACE_BEGIN;
  // The next launch of the step (window chunks, then the merge) may start as
  // soon as every CTA of this one is running; it waits for us where it must.
  pdl_launch_dependents();
  // One 32-byte load gives the CTA its chunk and where its region's pages
  // are (launch-ordered table, upload_plan): no dependent load of the
  // region tables before the page ids (v25).
  // Grid: x = KV head, y = launch position (the heads of a chunk are
  // dispatched together; the planner's rounds count positions, v26).
  const int4 c = a.chunks[2 * (a.first + blockIdx.y)];
  const int4 c2 = a.chunks[2 * (a.first + blockIdx.y) + 1];
  // v44: the page of this warp's first tile group, from the plan (loaded
  // beside the chunk entry, not after it); -1: look it up.
  [[maybe_unused]] int first_page = -1;
  if constexpr (kGroup)
    if (a.first_pages) first_page = __ldg(a.first_pages + kWarps * (a.first + blockIdx.y) + (threadIdx.x >> 5));
  const int h = blockIdx.x;
  const int b = c.x & 0xffffff, region = c.x >> 24, t0 = c.y, t1 = c.z, chunk = c.w;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, r = lane & 3;
  const kv::PagedKvView& kv = a.kv;
  const int hq = h * a.gqa + g;  // the query head this lane gathers
  const float* qrow = a.q + (int64_t(b) * a.num_q_heads + hq) * D;
  const bool head_ok = g < a.gqa;

  static_assert(kVariant < 2 || (D == 128 && G == 128 && kQuant), "int8 loops: d 128, group 128 only");
  std::conditional_t<kVariant == 3, WarpState2<D>,
                     std::conditional_t<kVariant == 2, WarpState1<D>, WarpState<D, NG>>>
      st;
  state_init(st);

  if constexpr (kQuant) {
    const int32_t* pages = kv.mid.indices + c2.x;
    const int len = c2.y;
    [[maybe_unused]] QuantQuery<D, G> Q;
    [[maybe_unused]] Int8Query Q8;
    [[maybe_unused]] Int8QueryRaw Q8raw;
    if constexpr (kVariant >= 2) {
      // The query's loads before the first copies (v50): they are what the
      // first step waits for besides its tiles, and a load issued after a
      // warp's copies queues behind them; the conversion (load_query) still
      // runs while the copies are in flight.
      const int hb = g >> 1;  // the head whose B column this lane holds
      fetch_int8_query(Q8raw, a.q + (int64_t(b) * a.num_q_heads + h * a.gqa + hb) * D, hb < a.gqa, r);
    }
    auto load_query = [&] {
      if constexpr (kVariant >= 2) {
        load_int8_query(Q8, Q8raw, a.sm_scale_log2, g, r);
      } else {
        load_quant_query(Q, qrow, head_ok, a.sm_scale_log2, g, r);
      }
    };
    constexpr int TPI = kVariant == 1 ? kQuantTilesPerIter : kRingTiles, kStep = kWarps * TPI;
    const FastDiv& tpp = a.tiles_per_page;
    // Warp w takes tile groups w, w + kWarps, ... of TPI consecutive tiles.
    // Tiles past t1 are loaded as fully masked tiles (valid <= 0) of the
    // chunk's last page, so the step's softmax needs no per-tile branch.
    int t = t0 + warp * TPI;
    const int tlast = t1 - 1;
    QuantTile<D, G> cur[TPI];
    int32_t pg[TPI];
    if constexpr (kVariant == 1) {
      // Pipeline: page ids two groups ahead, tile data one group ahead.
      QuantTile<D, G> nxt[TPI];
      load_query();
#pragma unroll
      for (int u = 0; u < TPI; ++u) {
        const int tu = min(t + u, tlast);
        load_quant_tile(cur[u], kv, page_of(pages, tpp, tu), tpp, len, h, tu, g, r);
        if (t + u > tlast) cur[u].valid = 0;
      }
#pragma unroll
      for (int u = 0; u < TPI; ++u) pg[u] = page_of(pages, tpp, min(t + kStep + u, tlast));
      for (; t < t1; t += kStep) {
        const int tn = t + kStep;
        if (tn < t1) {
#pragma unroll
          for (int u = 0; u < TPI; ++u) {
            load_quant_tile(nxt[u], kv, pg[u], tpp, len, h, min(tn + u, tlast), g, r);
            if (tn + u > tlast) nxt[u].valid = 0;
          }
#pragma unroll
          for (int u = 0; u < TPI; ++u) pg[u] = page_of(pages, tpp, min(tn + kStep + u, tlast));
        }
        compute_quant_tiles(st, cur, Q, g);
#pragma unroll
        for (int u = 0; u < TPI; ++u) cur[u] = nxt[u];
      }
    } else {
      constexpr int TB = quant_tile_bytes(D, G), RB = D / 4;
      uint8_t* ring = smem + warp * (kRingStages * TPI * TB);
      const int ngroups = t < t1 ? (t1 - t + kStep - 1) / kStep : 0;
      // The int8 loops keep the lane's copy pointers and each tile's slot in
      // registers; the fp16 loop (variant 0) has none to spare (it would
      // spill) and recomputes them per tile.
      static_assert(!kGroup || kVariant >= 2, "group copies: the int8 rings");
      RingLane L{};
      if constexpr (kGroup)
        L = group_lane<D, G>(kv, lane);
      else if constexpr (kVariant != 0)
        L = ring_lane<D, G>(kv, lane);
      [[maybe_unused]] RingFrag frag{};
      if constexpr (kVariant == 3) frag = ring_frag<D, G>(g, r);
      constexpr int S = kRingStages;
      // kGroup (v34): one ref per group (its first tile's page and slot);
      // groups that are issued start at or before tlast. (The two ways are
      // spelled out at each of the three places: folding them into lambdas
      // changes the SASS of every ring instance, and this loop's speed moves
      // with its register allocation; the per-tile instances' code is
      // byte-identical to before v34 as written.)
      TileRef ref[TPI];
      // Prologue: groups 0 .. S-2 in flight (one commit group each, empty
      // past the end), then the page ids of group S-1.
#pragma unroll
      for (int sg = 0; sg < S - 1; ++sg) {
        if constexpr (kGroup) {
          if (sg == 0 && first_page >= 0) {  // v44: the plan's page; only the slot is computed
            ref[0] = tile_ref_at(first_page, tpp, t);
          } else {
            ref[0] = tile_ref<true>(pages, tpp, min(t + sg * kStep, tlast));
          }
          if (sg < ngroups)
            issue_group_copies<D, G, TPI>(ring + sg * TPI * TB, kv, L, ref[0], tlast + 1 - (t + sg * kStep), h, lane);
        } else {
#pragma unroll
        for (int u = 0; u < TPI; ++u) ref[u] = tile_ref<kVariant != 0>(pages, tpp, min(t + sg * kStep + u, tlast));
        if (sg < ngroups)
          issue_tile_copies<D, G, TPI, kVariant != 0>(ring + sg * TPI * TB, kv, L, ref, tpp, t + sg * kStep, tlast,
                                                      h, lane);
        }
        cp_async_commit();
      }
      if constexpr (kGroup) {
        ref[0] = tile_ref<true>(pages, tpp, min(t + (S - 1) * kStep, tlast));
      } else {
#pragma unroll
      for (int u = 0; u < TPI; ++u) ref[u] = tile_ref<kVariant != 0>(pages, tpp, min(t + (S - 1) * kStep + u, tlast));
      }
      // The query's conversion after the first copies are issued: it runs
      // while they are in flight instead of before them (v25).
      load_query();
      for (int j = 0; j < ngroups; ++j, t += kStep) {
        // Refill the stage freed one step ago with group j+S-1 (its page ids
        // were fetched one step ago), then fetch group j+S's page ids.
        if constexpr (kGroup) {
          if (j + S - 1 < ngroups)
            issue_group_copies<D, G, TPI>(ring + ((j + S - 1) % S) * TPI * TB, kv, L, ref[0],
                                          tlast + 1 - (t + (S - 1) * kStep), h, lane);
          cp_async_commit();
          ref[0] = tile_ref<true>(pages, tpp, min(t + S * kStep, tlast));
        } else {
        if (j + S - 1 < ngroups)
          issue_tile_copies<D, G, TPI, kVariant != 0>(ring + ((j + S - 1) % S) * TPI * TB, kv, L, ref, tpp,
                                                      t + (S - 1) * kStep, tlast, h, lane);
        cp_async_commit();
#pragma unroll
        for (int u = 0; u < TPI; ++u) ref[u] = tile_ref<kVariant != 0>(pages, tpp, min(t + S * kStep + u, tlast));
        }
        cp_async_wait<S - 1>();
        __syncwarp();
        OSCAR_TRACE_MARK(trace_t1);
        const uint8_t* img = ring + (j % kRingStages) * TPI * TB;
#if defined(OSCAR_DIAG_COPY_ONLY)
        // Diagnostic build (wrong results): the ring's copies without the
        // arithmetic, to time the loop's memory side alone.
        if (img[lane] == 0xA5 && img[lane + 32] == 0x5A) s_l[warp][0] = 1.0f;
        __syncwarp();
        if (a.step_write >= 0) continue;  // always (not provably: no unreachable-code warning)
#endif
        const auto tile_valid = [&](int u) {
          return t + u <= tlast ? min(kTileTokens, len - (t + u) * kTileTokens) : 0;
        };
#pragma unroll
        for (int u = 0; u < TPI; ++u) {
          const uint8_t* ti = img + u * TB;
          if constexpr (kVariant == 3)  // (the int8-key loop has no registers to spare for the offsets)
            load_ring_fragments(cur[u], ti, frag);
          else
            load_quant_fragments<true>(cur[u], ti, ti + 16 * RB, reinterpret_cast<const uint32_t*>(ti + 32 * RB),
                                       reinterpret_cast<const uint32_t*>(ti + 32 * RB + 64 * (D / G)), g, r);
          if constexpr (kVariant < 2) cur[u].valid = tile_valid(u);
        }
        if constexpr (kVariant >= 2) {
          // Steps whose tiles are all full (all but the last of a chunk) skip
          // the masking selects: every tile u < TPI has t + u <= tlast and
          // 16 (t + u + 1) <= len, i.e. the step's last one does. `valid`
          // (the same in every lane) is only needed by the masked code (v48:
          // computed there, not per step).
          const bool full = OSCAR_INT8K_FASTPATH != 0 && t + TPI - 1 <= tlast && (t + TPI) * kTileTokens <= len;
          if (!full) {
#pragma unroll
            for (int u = 0; u < TPI; ++u) cur[u].valid = tile_valid(u);
          }
          if constexpr (kVariant == 3) {
            if (full)
              compute_int8kv_tiles<TPI, false>(st, cur, Q8, g);
            else
              compute_int8kv_tiles<TPI, true>(st, cur, Q8, g);
          } else {
            if (full)
              compute_int8k_tiles<TPI, false>(st, cur, Q8, g);
            else
              compute_int8k_tiles<TPI, true>(st, cur, Q8, g);
          }
        } else
          compute_quant_tiles(st, cur, Q, g);
        __syncwarp();  // every lane has read this stage before it is refilled
      }
      cp_async_wait<0>();
    }
    OSCAR_TRACE_MARK(trace_t2);
  } else if constexpr (kFused) {
    // The whole window of (b, h): sink tiles then recent tiles in one index
    // space (c2 = sink offset and length, recent offset and length); the
    // merge with the middle's partials follows below.
    const int32_t* psink = kv.sink.indices + c2.x;
    const int32_t* prec = kv.recent.indices + c2.z;
    const int ns = (c2.y + kTileTokens - 1) / kTileTokens, nt = ns + (c2.w + kTileTokens - 1) / kTileTokens;
    // The warp's tiles u = warp, warp + kWarps, ... (i-th: slot i % WS of
    // its ring, WS tiles in flight: 1 at head_dim 128) are staged by
    // cp.async instead of 16 register loads per lane (v33). Page ids: lane i
    // holds the warp's i-th tile's page, all looked up at once, instead of
    // one dependent page-id load before each tile (this CTA starts in the
    // middle's tail, when every load is slow). Rows are stored with the 16-byte chunks of a
    // row XOR-swizzled (window_chunk) so that the fragment loads below are
    // free of bank conflicts; padding rows of V are zero-filled (their bits
    // may be NaN, and p = 0 times NaN would poison O).
    constexpr int WS = window_ring_tiles<D>(), RB = D * 2, TB = kTileTokens * RB, CPR = D / 8;
    uint8_t* ring = smem + warp * WS * 2 * TB;
    const int my_n = warp < nt ? (nt - 1 - warp) / kWarps + 1 : 0;  // <= kFuseMaxWindowTiles / kWarps = 16
    const FastDiv& tpp = a.tiles_per_page;
    auto tile_of = [&](int i, int& t, int& len) {
      const int u = warp + i * kWarps;
      const bool rec = u >= ns;
      t = rec ? u - ns : u;
      len = rec ? c2.w : c2.y;
      return rec;
    };
    int32_t my_page = 0;
    if (lane < my_n) {
      int t, len;
      const bool rec = tile_of(lane, t, len);
      my_page = page_of(rec ? prec : psink, tpp, t);
    }
    // The step's new row is the newest token: in the last window tile.
    const int wait_tile = a.step_write ? nt - 1 : -1;
    auto issue = [&](int i) {
      const int32_t page = __shfl_sync(0xffffffffu, my_page, i & 31);
      if (i < my_n) {
        if (warp + i * kWarps == wait_tile) wait_step_write(a, b, h, lane);
        int t, len;
        tile_of(i, t, len);
        const TileLoc loc = tile_loc(page, tpp, len, kv.page_size, kv.num_kv_heads, h, t);
        const uint8_t* kg = reinterpret_cast<const uint8_t*>(kv.bf16.k + size_t(loc.row0) * D);
        const uint8_t* vg = reinterpret_cast<const uint8_t*>(kv.bf16.v + size_t(loc.row0) * D);
        uint8_t* ks = ring + (i % WS) * 2 * TB;
#pragma unroll
        for (int c = lane; c < kTileTokens * CPR; c += 32) {
          const int row = c / CPR, off = row * RB + 16 * window_chunk(row, c % CPR);
          cp_async16(ks + off, kg + 16 * c);
          cp_async16_zfill(ks + TB + off, vg + 16 * c, row < loc.valid);
        }
      }
      cp_async_commit();
    };
#pragma unroll
    for (int i = 0; i < WS - 1; ++i) issue(i);
    Bf16Query<D> Q;
    load_bf16_query(Q, qrow, head_ok, a.sm_scale_log2, g, r);
    for (int i = 0; i < my_n; ++i) {
      // Refill the slot read one tile ago, then wait for tile i.
      issue(i + WS - 1);
      cp_async_wait<WS - 1>();
      __syncwarp();
      const uint8_t* ks = ring + (i % WS) * 2 * TB;
      const uint8_t* vs = ks + TB;
      Bf16Tile<D> T;
      {
        int t, len;
        tile_of(i, t, len);
        T.valid = min(kTileTokens, len - t * kTileTokens);
      }
#pragma unroll
      for (int tt = 0; tt < 2; ++tt)
#pragma unroll
        for (int k = 0; k < D / 32; ++k) {
          const int row = g + 8 * tt;
          T.k[tt][k] = *reinterpret_cast<const uint4*>(ks + row * RB + 16 * window_chunk(row, 4 * k + r));
        }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int tok = 2 * r + (j & 1) + 8 * (j >> 1);
#pragma unroll
        for (int k = 0; k < D / 64; ++k)
          T.v[j][k] = *reinterpret_cast<const uint4*>(vs + tok * RB + 16 * window_chunk(tok, 8 * k + g));
      }
      compute_bf16_tile(st, T, Q, g);
      __syncwarp();  // every lane has read the slot before it is refilled
      OSCAR_TRACE_MARK(trace_t1);
    }
    cp_async_wait<0>();
    OSCAR_TRACE_MARK(trace_t2);
  } else {
    const int32_t* pages = (region == 0 ? kv.sink : kv.recent).indices + c2.x;
    const int len = c2.y;
    Bf16Query<D> Q;
    load_bf16_query(Q, qrow, head_ok, a.sm_scale_log2, g, r);
    // With a step write (the launch before this one, still running), the
    // last tile of a region may hold a new row: wait for the write there
    // (its grid completes after the middle launch's).
    const int wait_tile = a.step_write && t1 * kTileTokens >= len ? t1 - 1 : -1;
    for (int t = t0 + warp; t < t1; t += kWarps) {
      Bf16Tile<D> T;
      if (t == wait_tile) wait_step_write(a, b, h, lane);
      load_bf16_tile(T, kv, pages, a.tiles_per_page, len, h, t, g, r);
      compute_bf16_tile(st, T, Q, g);
      OSCAR_TRACE_MARK(trace_t1);
    }
    OSCAR_TRACE_MARK(trace_t2);
  }

  // s_o overlaps the other warps' rings: wait until every warp is done.
  __syncthreads();
  if constexpr (kVariant == 3) {
    // One head (r) per lane, as variant 2.
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) {
      st.l += __shfl_xor_sync(0xffffffffu, st.l, o);
      st.pm += __shfl_xor_sync(0xffffffffu, st.pm, o);
    }
#pragma unroll
    for (int m = 0; m < D / 16; ++m)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        s_o[warp][r][v8_channel(g, m, i)] = st.o[m][i] * (1.0f / float(1 << (2 * v8_shift(m, i)))) + st.pm;
    if (g == 0) {
      s_m[warp][r] = st.m;
      s_l[warp][r] = st.l;
    }
  } else if constexpr (kVariant == 2) {
    // One head (r) per lane: reduce over the 8 lanes of each column quad.
#pragma unroll
    for (int o = 4; o <= 16; o <<= 1) {
      st.l += __shfl_xor_sync(0xffffffffu, st.l, o);
      st.pm += __shfl_xor_sync(0xffffffffu, st.pm, o);
    }
    const float sp0 = st.sp[0] + st.sp[1];  // both token halves (all rows of the ones-MMA agree)
#pragma unroll
    for (int i = 0; i < D / 16; ++i)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int rp = g + 8 * hf;
        const float ov = st.o[i][2 * hf] + st.o[i][2 * hf + 1];
        s_o[warp][r][vq_channel(G, 0, i, rp)] = (ov - sp0) * v_code_factor<G>(i, hf) + st.pm;
      }
    if (g == 0) {
      s_m[warp][r] = st.m;
      s_l[warp][r] = st.l;
    }
  } else {
  // --- finish this warp: reduce row sums (and min terms) over the 8 lanes of a column
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    st.l[k] += __shfl_xor_sync(0xffffffffu, st.l[k], 4);
    st.l[k] += __shfl_xor_sync(0xffffffffu, st.l[k], 8);
    st.l[k] += __shfl_xor_sync(0xffffffffu, st.l[k], 16);
#pragma unroll
    for (int gm = 0; gm < NG; ++gm)
#pragma unroll
      for (int o = 4; o <= 16; o <<= 1)  // (sp is already summed over tokens by its MMA)
        st.pm[gm][k] += __shfl_xor_sync(0xffffffffu, st.pm[gm][k], o);
  }
#pragma unroll
  for (int i = 0; i < D / 16; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int rp = g + 8 * (e >> 1), col = 2 * r + (e & 1);
      int ch;
      float val;
      if constexpr (kQuant) {
        constexpr int MTG = G / 16;
        const int gm = i / MTG;
        ch = vq_channel(G, gm, i % MTG, rp);
        val = (st.o[i][e] - st.sp[gm][e]) * v_code_factor<G>(i % MTG, rp >> 3) + st.pm[gm][e & 1];
      } else {
        ch = vb_channel(i, rp);
        val = st.o[i][e];
      }
      s_o[warp][col][ch] = val;
    }
  if (g == 0) {
    s_m[warp][2 * r] = st.m[0];
    s_m[warp][2 * r + 1] = st.m[1];
    s_l[warp][2 * r] = st.l[0];
    s_l[warp][2 * r + 1] = st.l[1];
  }
  }  // kVariant != 2
  __syncthreads();

  if constexpr (kFused) {
    // Middle chunks [t0, t1) of sequence b (ids; written by the launches
    // before this one): wait for them, then merge them with this CTA's window.
    fused_merge<D>(a, b, h, t0, t1, s_o, s_m, s_l, warp, lane);
    OSCAR_TRACE_END(1);
  } else {
  // --- merge the warps; write this chunk's partial (normalized o, log2 lse)
  for (int idx = threadIdx.x; idx < a.gqa * D; idx += kThreads) {
    const int hd = idx / D, ch = idx % D;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, s_m[w][hd]);
    // Empty is L == 0 exactly. NaN (a corrupt row: a NaN logit leaves the
    // running max alone but makes p, and so l, NaN) must survive to the
    // output as in the reference: no "L > 0" tests, and a warp whose max is
    // -inf still adds its sums (0, or NaN) when no warp has a finite max.
    float L = 0.0f, O = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float sc = M == -INFINITY ? 1.0f : exp2f(s_m[w][hd] - M);  // warps with no tokens: 0
      L += sc * s_l[w][hd];
      O += sc * s_o[w][hd][ch];
    }
    const int64_t row = int64_t(chunk) * a.num_q_heads + h * a.gqa + hd;
    a.partial_o[row * D + ch] = L != 0.0f ? O / L : 0.0f;
    if (ch == 0) a.partial_lse[row] = L != 0.0f ? M + log2f(L) : -INFINITY;
  }
  // A window launch that started early (programmatic dependent of the middle
  // launch or the step write) completes only after that launch has: the
  // merge, which waits for this grid, then sees all. A no-op for a plain
  // launch.
  OSCAR_TRACE_END(kQuant ? 0 : 1);
  if constexpr (!kQuant) pdl_wait();
  }  // !kFused
}

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
                                                                int num_q_heads, float* o, float* lse,
                                                                const float* chunk_bias) {
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
      wt[u] = cu < c1 ? partial_lse[row] + (chunk_bias ? chunk_bias[row] : 0.0f) : -INFINITY;
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

// Rotation of query rows: one block per row, D threads.
template <int D>
__global__ void __launch_bounds__(256) rotate_kernel(const float* q, int num_q_heads, const float* R,
                                                    int r_heads, float* out) {
  __shared__ float x[D];
  const int64_t row = blockIdx.x;
  const int head = static_cast<int>(row % num_q_heads);
  const float* Rh = R + int64_t(head / (num_q_heads / r_heads)) * D * D;
  x[threadIdx.x] = q[row * D + threadIdx.x];
  __syncthreads();
  float acc = 0.0f;
#pragma unroll 8
  for (int j = 0; j < D; ++j) acc = fmaf(x[j], __ldg(Rh + j * D + threadIdx.x), acc);
  __syncthreads();  // q == out allowed: every thread has read x before anyone writes
  out[row * D + threadIdx.x] = acc;
}

// ---------------------------------------------------------------------------
// Dispatch: the one place where runtime shapes become template arguments.
#if defined(OSCAR_CUDA_MIN_INSTANCES)
#define OSCAR_DISPATCH_HEAD_DIM(d, D, ...) \
  if ((d) == 128) {                        \
    constexpr int D = 128;                 \
    __VA_ARGS__                            \
  }
#define OSCAR_DISPATCH_GROUP(gs, D, G, ...) \
  if ((gs) == 128) {                        \
    constexpr int G = 128;                  \
    __VA_ARGS__                             \
  }
#else
#define OSCAR_DISPATCH_HEAD_DIM(d, D, ...) \
  if ((d) == 64) {                         \
    constexpr int D = 64;                  \
    __VA_ARGS__                            \
  } else if ((d) == 128) {                 \
    constexpr int D = 128;                 \
    __VA_ARGS__                            \
  } else if ((d) == 256) {                 \
    constexpr int D = 256;                 \
    __VA_ARGS__                            \
  }
#define OSCAR_DISPATCH_GROUP(gs, D, G, ...)   \
  if ((gs) == 32) {                           \
    constexpr int G = 32;                     \
    __VA_ARGS__                               \
  } else if ((gs) == 64) {                    \
    constexpr int G = 64;                     \
    __VA_ARGS__                               \
  } else if ((gs) == 128 && D >= 128) {       \
    constexpr int G = (D >= 128 ? 128 : 64);  \
    __VA_ARGS__                               \
  }
#endif

bool head_dim_supported(int d) {
#if defined(OSCAR_CUDA_MIN_INSTANCES)
  return d == 128;
#else
  return d == 64 || d == 128 || d == 256;
#endif
}
bool group_supported(int d, int gs) {
#if defined(OSCAR_CUDA_MIN_INSTANCES)
  return d == 128 && gs == 128;
#else
  return (gs == 32 || gs == 64 || gs == 128) && gs <= d;
#endif
}

// A split kernel with its dynamic shared memory (above 48 KB its limit is
// raised once per kernel instance, i.e. per template instance of this).
// (v33 measured the middle instances with the largest shared-memory
// carveout too, so that 64 KB fused window CTAs surely fit beside three
// middle CTAs: no faster at 8 x 32K, 7% slower at 8 x 4K.)
template <int D, int G, bool kQuant, int kVariant, bool kFused = false, bool kGroup = false>
cudaError_t launch_split(dim3 grid, bool pdl, cudaStream_t stream, const KernelArgs& a) {
  constexpr int smem = split_smem_bytes<D, G, kQuant, kVariant, kFused>();
  if constexpr (smem > 48 * 1024) {
    static const cudaError_t raised = [] {
      auto* k = decode_split_kernel<D, G, kQuant, kVariant, kFused, kGroup>;
      cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
      return e;
    }();
    if (raised != cudaSuccess) return raised;
  }
  return launch_pdl(decode_split_kernel<D, G, kQuant, kVariant, kFused, kGroup>, grid, dim3(kThreads), smem, pdl,
                    stream, a);
}

// Whole-group copies in the int8 K/V ring where they apply (v34); 0 keeps
// the per-tile copies (A/B builds).
#ifndef OSCAR_GROUP_COPIES
#define OSCAR_GROUP_COPIES 1
#endif
template <int D, int G>
cudaError_t launch_quant(dim3 grid, const KernelArgs& a, int variant, bool groups, cudaStream_t stream) {
  constexpr bool pdl = false;  // reads q: after whatever produced it
  // head_dim 128 / group 128 (the benchmark shape) has three loop shapes
  // (`variant` picks, docs/kernels-cuda.md); the others use the
  // register-prefetch loop. The default copies whole 4-tile groups where
  // the plan and the page size allow (`groups`, v34).
  if constexpr (D == 128 && G == 128) {
    if (variant == 0 && groups && a.gqa <= 4) return launch_split<D, G, true, 3, false, true>(grid, pdl, stream, a);
    if ((variant == 0 || variant == 4) && a.gqa <= 4)
      return launch_split<D, G, true, 3>(grid, pdl, stream, a);
    if (variant == 3 && a.gqa <= 4)
      return launch_split<D, G, true, 2>(grid, pdl, stream, a);
    if (variant != 1)
      return launch_split<D, G, true, 0>(grid, pdl, stream, a);
  }
  return launch_split<D, G, true, 1>(grid, pdl, stream, a);
}

// How the step write's blocks split its rows (v42; same-call A/Bs in
// docs/kernels-cuda.md). Its blocks run where the middle launch leaves room:
// at once where it does not fill the GPU, else in its tail, each in a slot
// that the window launch waits for (more blocks there delay the windows:
// 512 blocks at 8 x 32K cost ~1.5 us more than 128, 1024-2048 at 32 x 32K
// ~6.5 us more than 512). Where every row's d/32 parts fit in
// kStepWriteBlocks blocks with K and V rows in blocks of their own (batch
// <= 2 at 8 KV heads, d = 128), so: the parts of a row on as many SMs (1 x
// 4K: 3.7 -> 1.1 us in the step). Beyond, one block writes
// a (token, KV head)'s K and V, with as many parts per row as fit, and its
// parts one after the other (few registers: the tail's slots).
#ifndef OSCAR_STEP_WRITE_BLOCKS
#define OSCAR_STEP_WRITE_BLOCKS 128
#endif
constexpr int kStepWriteBlocks = OSCAR_STEP_WRITE_BLOCKS;
struct StepWriteSplit {
  int parts;  // blocks per row
  bool both;  // one block writes K and V
  int flags() const { return both ? parts : 2 * parts; }  // blocks per (token, KV head)
};
StepWriteSplit step_write_split(const DecodeParams& p) {
  const int64_t pairs = int64_t(p.write.n) * p.kv.num_kv_heads;
  const int all = p.kv.head_dim / 32;
  if (pairs * 2 * all <= kStepWriteBlocks) return {all, false};
  int parts = all;
  while (parts > 1 && pairs * parts > kStepWriteBlocks) parts /= 2;
  return {parts, true};
}

cudaError_t launch(const DecodeParams& p, const DecodePlan& plan, const DecodeWorkspace& ws,
                   cudaStream_t stream, bool force_bf16) {
  if (!check_decode(p, plan, ws).empty()) return cudaErrorInvalidValue;
  if (force_bf16 && plan.num_quant_chunks > 0) return cudaErrorInvalidValue;
  if (p.kv.batch == 0) return cudaSuccess;
  KernelArgs a;
  a.kv = p.kv;
  a.q = p.q;
  a.num_q_heads = p.num_q_heads;
  a.gqa = p.num_q_heads / p.kv.num_kv_heads;
  a.sm_scale_log2 = p.sm_scale * kLog2e;
  a.tiles_per_page = FastDiv(static_cast<uint32_t>(p.kv.page_size / kTileTokens));
  a.chunks = reinterpret_cast<const int4*>(ws.chunks);
  a.first_pages = plan.first_pages.empty() ? nullptr : ws.first_pages;
  a.partial_o = ws.partial_o;
  a.partial_lse = ws.partial_lse;
  a.step_write = p.write.n > 0;
  a.o = p.o;
  a.lse = p.lse;
  // v40: the step write publishes its rows to the window CTAs, under an
  // epoch of its own (never 0, the flag's initial value).
  static std::atomic<uint32_t> epochs{0};
  uint32_t epoch = 0;
  while (a.step_write && epoch == 0) epoch = ++epochs;
  uint32_t* const write_done = a.step_write ? ws.step_sync : nullptr;
  a.write_done = write_done;
  a.write_epoch = epoch;
  const StepWriteSplit split = step_write_split(p);
  a.write_flags = split.flags();
  const int nq = plan.num_quant_chunks, nb = plan.num_chunks - plan.num_quant_chunks;
  bool launched = false;
  const bool pdl = p.pdl != 0;
  const bool centered = p.kv.center.pairs > 0 && nq > 0;
  OSCAR_DISPATCH_HEAD_DIM(p.kv.head_dim, D, {
    if (centered) {
      // Page centering: each chunk's shift, before the middle launch (plain launches: the
      // merge, later in the stream, reads it after its dependency wait).
      center_coef_kernel<D><<<dim3(p.kv.batch, p.num_q_heads), 128, 0, stream>>>(p.q, p.num_q_heads, a.gqa,
                                                                                p.kv.center, ws.center_coef);
      chunk_bias_kernel<<<plan.num_chunks, 128, 0, stream>>>(a.chunks, p.kv.page_size / kTileTokens, p.num_q_heads,
                                                           p.kv.center.pairs, p.kv.center.angles, ws.center_coef,
                                                           a.sm_scale_log2, ws.chunk_bias);
      OSCAR_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    }
    if (nq > 0) {
      OSCAR_DISPATCH_GROUP(p.kv.group_size, D, G, {
        a.first = 0;
        const bool groups = OSCAR_GROUP_COPIES != 0 && plan.mid_groups_aligned &&
                            p.kv.page_size % (kRingTiles * kTileTokens) == 0;
        OSCAR_CUDA_RETURN_IF_ERROR((launch_quant<D, G>(dim3(p.kv.num_kv_heads, nq), a, p.variant, groups, stream)));
        launched = true;
      });
      if (!launched) return cudaErrorInvalidValue;
    }
    if (a.step_write) {
      // This step's new rows, between the middle launch (a programmatic
      // dependent of it: runs in its tail; touches nothing it reads) and the
      // window launch, whose tiles holding the rows wait for it.
      OSCAR_CUDA_RETURN_IF_ERROR(write_bf16_tokens_dependent(p.kv, p.write.n, p.write.pages, p.write.slots,
                                                             p.write.k, p.write.v, p.write.rot,
                                                             pdl && nq > 0, stream, write_done, epoch,
                                                             split.parts, split.both));
    }
    if (p.demote.n > 0) {
      // Likewise: reads BF16 pages, writes INT2 pages this step does not
      // read; its grid completes after the launches before it.
      OSCAR_CUDA_RETURN_IF_ERROR(demote_pages_dependent(p.kv, p.demote.n, p.demote.bf16_pages, p.demote.quant_pages,
                                                        p.demote.clip, p.demote.num_tokens,
                                                        pdl && (nq > 0 || a.step_write), stream));
    }
    if (plan.fused_windows) {
      // One CTA per (sequence, KV head): its window, then (after the
      // launches before it) the merge with the middle's partials (v27).
      a.first = nq;
      return launch_split<D, 128, false, 0, true>(dim3(p.kv.num_kv_heads, nb),
                                                  pdl && (nq > 0 || a.step_write || p.demote.n > 0), stream, a);
    }
    if (nb > 0) {
      a.first = nq;
      // The window chunks do not read the middle's results: with PDL they
      // run in the middle launch's tail instead of after it.
      OSCAR_CUDA_RETURN_IF_ERROR((launch_split<D, 128, false, 0>(
          dim3(p.kv.num_kv_heads, nb), pdl && (nq > 0 || a.step_write || p.demote.n > 0), stream, a)));
    }
    OSCAR_CUDA_RETURN_IF_ERROR((launch_pdl(merge_kernel<D>, dim3(p.kv.batch, p.num_q_heads), dim3(32 * kMergeWarps), 0, pdl,
                                              stream, static_cast<const int32_t*>(ws.seq_chunk_ptr),
                                              static_cast<const float*>(ws.partial_o),
                                              static_cast<const float*>(ws.partial_lse), p.num_q_heads,
                                              p.o, p.lse, static_cast<const float*>(centered ? ws.chunk_bias : nullptr))));
    return cudaGetLastError();
  });
  return cudaErrorInvalidValue;
}

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace

// ---------------------------------------------------------------------------
DecodePlan plan_decode(int batch, const HostRegions& regions, int num_kv_heads, int num_sms,
                       int tiles_per_chunk, int ctas_per_sm, float rank_skew, int fuse_windows) {
  if (batch < 0) throw Error("plan_decode: batch < 0");
  for (int k = 0; k < 3; ++k)
    if (!regions.len[k] || !regions.indptr[k])
      throw Error("plan_decode: HostRegions needs the lengths and indptr of all three regions");
  const int32_t* sink_len = regions.len[0];
  const int32_t* mid_len = regions.len[1];
  const int32_t* recent_len = regions.len[2];
  DecodePlan plan;
  plan.batch = batch;
  plan.regions.resize(size_t(batch) * 6);
  for (int b = 0; b < batch; ++b)
    for (int k = 0; k < 3; ++k) {
      plan.regions[6 * size_t(b) + 2 * k] = regions.indptr[k][b];
      plan.regions[6 * size_t(b) + 2 * k + 1] = regions.len[k][b];
    }
  const int qmin = kWarps * 4;  // whole steps of either INT2 loop variant
  int64_t quant_tiles = 0, bf16_tiles = 0;
  for (int b = 0; b < batch; ++b) {
    quant_tiles += ceil_div(mid_len[b], kTileTokens);
    bf16_tiles += ceil_div(sink_len[b], kTileTokens) + ceil_div(recent_len[b], kTileTokens);
  }
  int64_t per_cta = 0, target = 0;  // the automatic split's share of work per CTA, CTAs per wave
  if (tiles_per_chunk > 0) {
    plan.tiles_per_chunk_quant = plan.tiles_per_chunk_bf16 = tiles_per_chunk;
  } else {
    // Aim for ~ctas_per_sm CTAs per SM over the whole launch (default: the
    // resident CTAs of the default INT2 loop, OSCAR_INT8K_MIN_BLOCKS: one
    // wave of the 4 resident CTAs), in units of INT2-tile cost; never split
    // below one tile group per warp, so that small work is not drowned in
    // partials.
    const int64_t work = (quant_tiles + kBf16TileCost * bf16_tiles) * std::max(num_kv_heads, 1);
    if (ctas_per_sm <= 0) ctas_per_sm = OSCAR_INT8K_MIN_BLOCKS;
    target = int64_t(std::max(num_sms, 1)) * std::max(ctas_per_sm, 1);
    per_cta = std::max<int64_t>(1, (work + target - 1) / target);
    plan.tiles_per_chunk_quant =
        static_cast<int>(std::clamp<int64_t>((per_cta + qmin - 1) / qmin * qmin, qmin, 1 << 20));
    plan.tiles_per_chunk_bf16 = static_cast<int>(std::clamp<int64_t>(
        (per_cta / kBf16TileCost + kWarps - 1) / kWarps * kWarps, kWarps, 1 << 20));
  }
  std::vector<int32_t> quant_ids, bf16_ids;
  plan.seq_chunk_ptr.push_back(0);
  // A region of n tiles becomes ceil(n / per) chunks of equal size (rounded
  // up to whole steps of the INT2 loop), so that no chunk is a short
  // remainder: CTAs of one wave then end together (at 32 x 32K the split was
  // 1056 + 972 tiles; it is 1024 + 1004 now). Middle regions: if rounding the
  // chunk counts up would need more CTAs than one wave holds (8 x 128K: 9
  // chunks of 908 tiles per sequence = 576 CTAs for 528 slots, a second wave
  // of 48), they are rounded down instead (8 chunks, 512 CTAs).
  bool mid_round_down = false;
  // Chunk size of a region of n tiles (equal chunks).
  auto chunk_size = [&](int region, int ntiles, int per) {
    if (ntiles > 0 && tiles_per_chunk <= 0) {
      const int n = region == 1 && mid_round_down ? std::max<int>(1, static_cast<int>(ntiles / per_cta))
                                                  : ceil_div(ntiles, per);
      const int unit = region == 1 ? qmin : kWarps;
      per = ceil_div(ceil_div(ntiles, n), unit) * unit;
    }
    return per;
  };
  // Middle chunks are launched chunk index first (every sequence's first
  // chunk, then every sequence's second one, ...). With a rank skew (off by
  // default: v26 and v34c measured skews slower at batch 1 and 8) the
  // automatic split's sizes follow their dispatch round: the block
  // scheduler hands CTAs to the SMs round by round, and an SM's warp
  // scheduler favours its older CTAs, so that, with equal chunks, the CTAs of
  // the first round end first and those of the last round up to a third
  // later (git history: docs/cuda-logs/v26-rounds.md). A chunk at launch position `pos`
  // covers CTAs pos * Hkv .. (grid x = KV head), round (pos * Hkv + Hkv / 2) /
  // num_sms, and gets weight 1 - skew * round.
  const int hkv = std::max(num_kv_heads, 1);
  if (tiles_per_chunk <= 0) {
    int64_t ctas = 0;
    for (int b = 0; b < batch; ++b) ctas += ceil_div(ceil_div(mid_len[b], kTileTokens), per_cta);
    mid_round_down = ctas * hkv > target;
  }
  // Middle chunk boundaries (tiles), flat: sequence b's are
  // bounds[bptr[b] .. bptr[b + 1]) (count + 1 of them, none without a middle).
  // mid_per[b]: sequence b's middle chunk size in tiles (the last chunk shorter).
  std::vector<int> count(batch, 0), mid_per(batch, 0), bptr(size_t(batch) + 1, 0);
  std::vector<int32_t> bounds;
  {
    int max_count = 0;
    for (int b = 0; b < batch; ++b) {
      const int nt = ceil_div(mid_len[b], kTileTokens);
      mid_per[b] = chunk_size(1, nt, plan.tiles_per_chunk_quant);
      if (nt > 0) count[b] = ceil_div(nt, mid_per[b]);
      max_count = std::max(max_count, count[b]);
      bptr[b + 1] = bptr[b] + (count[b] > 0 ? count[b] + 1 : 0);
    }
    bounds.resize(size_t(bptr[batch]));
    // rank_skew < 0: the default, 0 (equal chunks; v26 measured skews slower at batch 1 and 8).
    const double skew = tiles_per_chunk > 0 || rank_skew < 0.0f ? 0.0 : double(rank_skew);
    // Weights by dispatch round (only with a skew), in bounds' layout.
    std::vector<double> weight;
    if (skew != 0.0) {
      weight.assign(bounds.size(), 1.0);
      const int rounds = std::max(1, ctas_per_sm);
      int pos = 0;
      for (int k = 0; k < max_count; ++k)
        for (int b = 0; b < batch; ++b) {
          if (k >= count[b]) continue;
          const int round = std::min<int>(rounds - 1, static_cast<int>((int64_t(pos) * hkv + hkv / 2) /
                                                                        std::max(num_sms, 1)));
          weight[size_t(bptr[b]) + k] = std::max(0.25, 1.0 - skew * round);
          ++pos;
        }
    }
    for (int b = 0; b < batch; ++b) {
      if (count[b] == 0) continue;
      const int nt = ceil_div(mid_len[b], kTileTokens);
      int32_t* t = &bounds[size_t(bptr[b])];
      const double* w = skew != 0.0 ? &weight[size_t(bptr[b])] : nullptr;
      double wsum = 0.0;
      for (int k = 0; w && k < count[b]; ++k) wsum += w[k];
      // Boundaries at the weights' cumulative shares, in whole tile groups
      // (4 tiles: the warps of a CTA then differ by at most one group), each
      // chunk at least one step; skew 0 gives the equal split (mid_per[b] tiles
      // each, the last one shorter).
      constexpr int unit = 4;
      double acc = 0.0;
      t[0] = 0;
      for (int k = 0; k + 1 < count[b]; ++k) {
        int64_t e = int64_t(k + 1) * mid_per[b];
        if (w) {
          acc += w[k];
          e = (static_cast<int64_t>(nt * acc / wsum + unit / 2) / unit) * unit;
        }
        const int64_t hi = nt - int64_t(count[b] - 1 - k);  // > t[k]: a tile left for each later chunk
        e = std::clamp<int64_t>(e, std::min<int64_t>(hi, int64_t(t[k]) + std::min(mid_per[b], qmin)), hi);
        t[k + 1] = static_cast<int32_t>(e);
      }
      t[count[b]] = nt;
    }
  }
  // Fused windows (v27): when every sequence's window is short and its
  // middle has few chunks, one CTA per (sequence, KV head) takes the whole
  // window and then merges the middle's partials with it: no separate merge
  // launch, and the merge does not wait for a window launch to complete.
  // A fused CTA's warps take its window tiles one after another, each a
  // chain of dependent loads that takes about as long as 4 pipelined middle
  // tiles: fuse only where that chain is no longer than a middle chunk's
  // share per warp (at 1 x 4K-16K it would be the call's longest path:
  // 12.3 -> 15.8 us at 1 x 4K in v27's first table), and a window alone (no
  // middle) only at one tile per warp.
  // fuse_windows 1: wherever the fused kernel can (windows <= 64 tiles,
  // middles <= 32 chunks); 0: never.
  bool fuse = fuse_windows < 0 ? OSCAR_FUSE_WINDOWS != 0 && tiles_per_chunk <= 0 : fuse_windows > 0;
  for (int b = 0; b < batch && fuse; ++b) {
    const int nwin = ceil_div(sink_len[b], kTileTokens) + ceil_div(recent_len[b], kTileTokens);
    const int first_chunk = count[b] > 0 ? bounds[size_t(bptr[b]) + 1] : kWarps;
    fuse = nwin <= kFuseMaxWindowTiles && count[b] <= kFuseMaxChunks &&
           (fuse_windows > 0 || (count[b] > 0 ? 4 * nwin <= first_chunk : nwin <= first_chunk));
  }
  plan.fused_windows = fuse;
  std::vector<int32_t> first_mid(batch, 0);  // chunk id of sequence b's first middle chunk
  plan.chunks.reserve(4 * (size_t(bptr[batch]) + 4 * size_t(batch)));
  auto add = [&](int b, int region, int ntiles, int per) {
    per = chunk_size(region, ntiles, per);
    for (int t = 0; t < ntiles; t += per) {
      const int id = static_cast<int>(plan.chunks.size() / 4);
      plan.chunks.insert(plan.chunks.end(), {b, region, t, std::min(ntiles, t + per)});
      bf16_ids.push_back(id);
    }
  };
  for (int b = 0; b < batch; ++b) {
    if (!fuse) add(b, 0, ceil_div(sink_len[b], kTileTokens), plan.tiles_per_chunk_bf16);
    first_mid[b] = static_cast<int32_t>(plan.chunks.size() / 4);
    const int32_t* t = count[b] > 0 ? &bounds[size_t(bptr[b])] : nullptr;
    for (int k = 0; k < count[b]; ++k) plan.chunks.insert(plan.chunks.end(), {b, 1, t[k], t[k + 1]});
    if (fuse) {
      // The window chunk of b: region 3, its "tiles" the ids of b's middle chunks.
      bf16_ids.push_back(static_cast<int32_t>(plan.chunks.size() / 4));
      plan.chunks.insert(plan.chunks.end(), {b, 3, first_mid[b], static_cast<int32_t>(plan.chunks.size() / 4)});
    } else {
      add(b, 2, ceil_div(recent_len[b], kTileTokens), plan.tiles_per_chunk_bf16);
    }
    plan.seq_chunk_ptr.push_back(static_cast<int32_t>(plan.chunks.size() / 4));
  }
  quant_ids.reserve(size_t(bptr[batch]));
  for (int k = 0;; ++k) {
    bool any = false;
    for (int b = 0; b < batch; ++b)
      if (k < count[b]) {
        quant_ids.push_back(first_mid[b] + k);
        any = true;
      }
    if (!any) break;
  }
  plan.num_chunks = static_cast<int>(plan.chunks.size() / 4);
  plan.num_quant_chunks = static_cast<int>(quant_ids.size());
  // The automatic split's middle chunks are whole steps (16 tiles) long, so
  // they start at multiples of 4 tiles; forced chunk sizes may not (v34).
  plan.mid_groups_aligned = true;
  for (int32_t id : quant_ids) plan.mid_groups_aligned &= plan.chunks[4 * size_t(id) + 2] % kRingTiles == 0;
  // v44: each middle warp's first group page, from the host page table.
  if (regions.mid_indices) {
    if (regions.page_size <= 0 || regions.page_size % kTileTokens != 0)
      throw Error("plan_decode: HostRegions::mid_indices needs page_size, a positive multiple of 16 (got " +
                  std::to_string(regions.page_size) + ")");
    static_assert(kWarps == 4, "DecodePlan::first_pages holds one page per warp, 4 per chunk");
    const int tpp = regions.page_size / kTileTokens;
    plan.first_pages_page_size = regions.page_size;
    plan.first_pages.assign(kWarps * size_t(plan.num_chunks), -1);
    for (int32_t id : quant_ids) {
      const int32_t* c = &plan.chunks[4 * size_t(id)];
      for (int w = 0; w < kWarps; ++w) {
        const int t = c[2] + kRingTiles * w;
        if (t < c[3])
          plan.first_pages[kWarps * size_t(id) + w] = regions.mid_indices[regions.indptr[1][c[0]] + t / tpp];
      }
    }
  }
  // Window chunks longest first: their CTAs start as middle CTAs leave, all
  // within a few microseconds, and a short chunk started last ends sooner
  // than a long one would (each tile a warp takes is a chain of dependent
  // loads; v24).
  auto window_tiles = [&](int32_t id) {
    const int32_t* c = &plan.chunks[4 * size_t(id)];
    return c[1] == 3 ? ceil_div(sink_len[c[0]], kTileTokens) + ceil_div(recent_len[c[0]], kTileTokens) : c[3] - c[2];
  };
  std::stable_sort(bf16_ids.begin(), bf16_ids.end(),
                   [&](int32_t x, int32_t y) { return window_tiles(x) > window_tiles(y); });
  plan.order = quant_ids;
  plan.order.insert(plan.order.end(), bf16_ids.begin(), bf16_ids.end());
  return plan;
}

DecodeWorkspace alloc_decode_workspace(int capacity, int max_batch, int max_q_heads, int head_dim) {
  if (capacity <= 0 || max_batch <= 0 || max_q_heads <= 0 || head_dim <= 0)
    throw Error("alloc_decode_workspace: sizes must be positive");
  DecodeWorkspace ws;
  ws.capacity = capacity;
  ws.max_batch = max_batch;
  ws.max_q_heads = max_q_heads;
  ws.head_dim = head_dim;
  try {  // a failed allocation frees the earlier ones
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.chunks, sizeof(int32_t) * 8 * size_t(capacity)));
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.seq_chunk_ptr, sizeof(int32_t) * (size_t(max_batch) + 1)));
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.first_pages, sizeof(int32_t) * kWarps * size_t(capacity)));
    OSCAR_CUDA_CHECK(
        cudaMalloc(&ws.partial_o, sizeof(float) * size_t(capacity) * max_q_heads * head_dim));
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.partial_lse, sizeof(float) * size_t(capacity) * max_q_heads));
    OSCAR_CUDA_CHECK(
        cudaMalloc(&ws.center_coef, sizeof(float) * size_t(max_batch) * max_q_heads * (head_dim + 1)));
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.chunk_bias, sizeof(float) * size_t(capacity) * max_q_heads));
    // The write's flags (one per block: KV head, K/V, 32 channels); the heads
    // are bounded by the q heads.
    const size_t flags = size_t(max_batch) * max_q_heads * 2 * std::max(head_dim / 32, 1);
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.step_sync, flags * sizeof(uint32_t)));
    OSCAR_CUDA_CHECK(cudaMemset(ws.step_sync, 0, flags * sizeof(uint32_t)));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());  // zero before any launch reads it
  } catch (...) {
    free_decode_workspace(ws);
    throw;
  }
  return ws;
}

#if defined(OSCAR_DECODE_TRACE)
cudaError_t set_decode_trace(unsigned long long* buf, int capacity) {
  cudaError_t e = cudaMemcpyToSymbol(g_decode_trace, &buf, sizeof(buf));
  if (e == cudaSuccess) e = cudaMemcpyToSymbol(g_decode_trace_cap, &capacity, sizeof(capacity));
  return e;
}
#endif

void free_decode_workspace(DecodeWorkspace& ws) {
  cudaFree(ws.chunks);
  cudaFree(ws.seq_chunk_ptr);
  cudaFree(ws.first_pages);
  cudaFree(ws.partial_o);
  cudaFree(ws.partial_lse);
  cudaFree(ws.center_coef);
  cudaFree(ws.chunk_bias);
  cudaFree(ws.step_sync);
  ws = DecodeWorkspace{};
}

cudaError_t upload_plan(const DecodePlan& plan, const DecodeWorkspace& ws, cudaStream_t stream) {
  if (plan.num_chunks < 0 || plan.num_chunks > ws.capacity || plan.batch < 0 || plan.batch > ws.max_batch ||
      plan.batch >= (1 << 24))
    return cudaErrorInvalidValue;
  // A plan not made by plan_decode (or edited) is checked before it is read.
  if (plan.chunks.size() != 4 * size_t(plan.num_chunks) || plan.order.size() != size_t(plan.num_chunks) ||
      plan.seq_chunk_ptr.size() != size_t(plan.batch) + 1 || plan.regions.size() != 6 * size_t(plan.batch))
    return cudaErrorInvalidValue;
  for (int i = 0; i < plan.batch * 3; ++i)
    if (plan.regions[2 * size_t(i)] < 0 || plan.regions[2 * size_t(i) + 1] < 0) return cudaErrorInvalidValue;
  if (!plan.first_pages.empty()) {
    if (plan.first_pages.size() != kWarps * size_t(plan.num_chunks) || !ws.first_pages) return cudaErrorInvalidValue;
    for (int32_t pg : plan.first_pages)
      if (pg < -1) return cudaErrorInvalidValue;
  }
  std::vector<bool> seen(size_t(plan.num_chunks), false);
  for (int i = 0; i < plan.num_chunks; ++i) {
    const int32_t id = plan.order[i];
    // Every chunk once: a repeated one would write its partial twice and
    // leave another's unwritten (the merge would read stale rows).
    if (id < 0 || id >= plan.num_chunks || seen[size_t(id)]) return cudaErrorInvalidValue;
    seen[size_t(id)] = true;
    const int32_t* c = &plan.chunks[4 * size_t(id)];
    if (c[0] < 0 || c[0] >= plan.batch || c[1] < 0 || c[1] > 3 || c[2] < 0 || c[3] < c[2])
      return cudaErrorInvalidValue;
    // Launch positions: the middle chunks first, then the window chunks
    // (fused ones exactly when the plan fuses).
    if ((c[1] == 1) != (i < plan.num_quant_chunks)) return cudaErrorInvalidValue;
    if ((c[1] == 3) != (plan.fused_windows && i >= plan.num_quant_chunks)) return cudaErrorInvalidValue;
    if (c[1] == 3) {
      // A fused window chunk: [c[2], c[3]) are middle chunks of its sequence.
      if (c[3] > plan.num_chunks || c[3] - c[2] > kFuseMaxChunks) return cudaErrorInvalidValue;
      for (int k = c[2]; k < c[3]; ++k)
        if (plan.chunks[4 * size_t(k)] != c[0] || plan.chunks[4 * size_t(k) + 1] != 1) return cudaErrorInvalidValue;
      continue;
    }
    // Tiles within the region's length: the kernels trust t1 and the length.
    if (c[3] > ceil_div(plan.regions[6 * size_t(c[0]) + 2 * c[1] + 1], kTileTokens)) return cudaErrorInvalidValue;
    // Whole-group copies read 64 rows from a group's first tile: only where
    // every middle chunk starts at a multiple of 4 tiles.
    if (c[1] == 1 && plan.mid_groups_aligned && c[2] % kRingTiles != 0) return cudaErrorInvalidValue;
  }
  // The kernels read 32 bytes per CTA: the plan's chunks in launch order
  // (plan.order), each with its id (the row of its partial result) and its
  // region's page-table offset and length.
  std::vector<int32_t> table(8 * size_t(plan.num_chunks), 0);
  for (int i = 0; i < plan.num_chunks; ++i) {
    const int id = plan.order[i];
    const int32_t* c = &plan.chunks[4 * size_t(id)];
    int32_t* e = &table[8 * size_t(i)];
    e[0] = c[0] | (c[1] << 24);
    e[1] = c[2];
    e[2] = c[3];
    e[3] = id;
    if (c[1] == 3) {  // fused window: sink and recent (page-table offset, length)
      for (int k = 0; k < 2; ++k) {
        e[4 + 2 * k] = plan.regions[6 * size_t(c[0]) + 4 * k];
        e[5 + 2 * k] = plan.regions[6 * size_t(c[0]) + 4 * k + 1];
      }
    } else {
      e[4] = plan.regions[6 * size_t(c[0]) + 2 * c[1]];
      e[5] = plan.regions[6 * size_t(c[0]) + 2 * c[1] + 1];
    }
  }
  if (plan.num_chunks > 0)
    OSCAR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ws.chunks, table.data(), sizeof(int32_t) * table.size(),
                                               cudaMemcpyHostToDevice, stream));
  std::vector<int32_t> first_pages;
  if (!plan.first_pages.empty() && plan.num_chunks > 0) {
    first_pages.resize(kWarps * size_t(plan.num_chunks));
    for (int i = 0; i < plan.num_chunks; ++i)
      std::copy_n(&plan.first_pages[kWarps * size_t(plan.order[i])], kWarps, &first_pages[kWarps * size_t(i)]);
    OSCAR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ws.first_pages, first_pages.data(),
                                               sizeof(int32_t) * first_pages.size(), cudaMemcpyHostToDevice,
                                               stream));
  }
  OSCAR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ws.seq_chunk_ptr, plan.seq_chunk_ptr.data(),
                                             sizeof(int32_t) * plan.seq_chunk_ptr.size(),
                                             cudaMemcpyHostToDevice, stream));
  return cudaStreamSynchronize(stream);
}

std::string check_decode(const DecodeParams& p, const DecodePlan& plan, const DecodeWorkspace& ws) {
  const kv::PagedKvView& kv = p.kv;
  const std::string who = "cuda decode_attention: ";
  if (!head_dim_supported(kv.head_dim))
    return who + "head_dim " + std::to_string(kv.head_dim) + " not compiled (64, 128, 256" +
           std::string(
#if defined(OSCAR_CUDA_MIN_INSTANCES)
               "; this build has OSCAR_CUDA_INSTANCES=min: 128 only"
#else
               ""
#endif
               ) +
           ")";
  if (kv.num_kv_heads <= 0 || p.num_q_heads <= 0 || p.num_q_heads % kv.num_kv_heads != 0)
    return who + "num_q_heads " + std::to_string(p.num_q_heads) + " is not a multiple of num_kv_heads " +
           std::to_string(kv.num_kv_heads);
  if (p.num_q_heads / kv.num_kv_heads > kMaxGqa)
    return who + "GQA ratio " + std::to_string(p.num_q_heads / kv.num_kv_heads) + " > 8 unsupported";
  if (kv.page_size <= 0 || kv.page_size % kTileTokens != 0)
    return who + "page_size " + std::to_string(kv.page_size) + " is not a positive multiple of 16";
  if (plan.num_quant_chunks > 0) {
    if (kv.bits != 2) return who + "only 2-bit codes are implemented (bits = " + std::to_string(kv.bits) + ")";
    if (!group_supported(kv.head_dim, kv.group_size))
      return who + "group_size " + std::to_string(kv.group_size) + " unsupported for head_dim " +
             std::to_string(kv.head_dim);
    if (!kv.quant.k_codes || !kv.quant.v_codes || !kv.quant.k_params || !kv.quant.v_params)
      return who + "middle pages present but quantized pool pointers are null";
    if (kv.key_axis != kv::KeyAxis::kToken)
      return who + "per-channel key params (kivi2's format) are not implemented on the GPU; "
                   "per-token keys only";
  }
  bool bf16_tokens = false;
  for (size_t b = 0; 6 * b + 5 < plan.regions.size(); ++b)
    bf16_tokens = bf16_tokens || plan.regions[6 * b + 1] > 0 || plan.regions[6 * b + 5] > 0;
  if (bf16_tokens && (!kv.bf16.k || !kv.bf16.v)) return who + "BF16 pages present but BF16 pool pointers are null";
  if (plan.batch != kv.batch) return who + "plan batch differs from view batch";
  if (!plan.first_pages.empty() && plan.first_pages_page_size != kv.page_size)
    return who + "plan's first pages were computed for page size " + std::to_string(plan.first_pages_page_size) +
           ", the view's is " + std::to_string(kv.page_size);
  if (plan.num_quant_chunks > 65535 || plan.num_chunks - plan.num_quant_chunks > 65535)
    return who + "plan has more than 65535 middle or window chunks (one grid dimension)";
  if (plan.num_chunks > ws.capacity)
    return who + "plan has " + std::to_string(plan.num_chunks) + " chunks, workspace holds " +
           std::to_string(ws.capacity);
  if (kv.batch > ws.max_batch || p.num_q_heads > ws.max_q_heads || kv.head_dim > ws.head_dim)
    return who + "workspace too small for batch/heads/head_dim";
  if (kv.batch > 0 && (!p.q || !p.o)) return who + "null q or o";
  if (reinterpret_cast<uintptr_t>(p.q) % 16 || reinterpret_cast<uintptr_t>(p.o) % 16)
    return who + "q and o must be 16-byte aligned";  // (read and written as float4)
  if (reinterpret_cast<uintptr_t>(kv.quant.k_codes) % 16 || reinterpret_cast<uintptr_t>(kv.bf16.k) % 16 ||
      reinterpret_cast<uintptr_t>(kv.bf16.v) % 16 || reinterpret_cast<uintptr_t>(kv.quant.v_codes) % 16)
    return who + "pools must be 16-byte aligned";
  if (kv.center.pairs > 0 && plan.num_quant_chunks > 0) {
    const int tpp = kv.page_size / kTileTokens;
    if (kv.center.pairs > kv.head_dim / 2 || !kv.center.u || !kv.center.w || !kv.center.angles)
      return who + "page centering without its vectors or angle table (or more pairs than head_dim / 2)";
    if (plan.fused_windows || plan.tiles_per_chunk_quant <= 0 || tpp % plan.tiles_per_chunk_quant != 0)
      return who + "page centering needs a plan whose middle chunks stay within one page and no fused "
                   "windows (plan_decode with tiles_per_chunk = page_size / 16, fuse_windows = 0)";
    if (!ws.center_coef || !ws.chunk_bias) return who + "workspace without the page-centering buffers";
    if (p.demote.n > 0)
      return who + "step demotions (DecodeParams::demote) do not take page centres; demote with "
                   "demote_pages(..., key_offset) instead";
  }
  if (p.write.n < 0) return who + "write.n < 0";
  if (p.demote.n < 0) return who + "demote.n < 0";
  if (p.demote.n > 0) {
    if (!p.demote.bf16_pages || !p.demote.quant_pages || kv.bits != 2 || kv.key_axis != kv::KeyAxis::kToken ||
        !kv.quant.k_codes || !kv.quant.v_codes || !kv.quant.k_params || !kv.quant.v_params || !kv.bf16.k ||
        !kv.bf16.v)
      return who + "demote: null page lists or pools, or a format demote_pages does not write";
    if (p.demote.num_tokens > kv.page_size) return who + "demote: num_tokens > page_size";
  }
  if (p.write.n > 0) {
    if (p.write.n != kv.batch)
      return who + "write.n " + std::to_string(p.write.n) + " != batch " + std::to_string(kv.batch) +
             " (one new row per sequence)";
    if (!p.write.pages || !p.write.slots || !p.write.k || !p.write.v || !kv.bf16.k || !kv.bf16.v)
      return who + "write: null pages, slots, k, v or BF16 pool";
    if (reinterpret_cast<uintptr_t>(p.write.rot.k) % 16 || reinterpret_cast<uintptr_t>(p.write.rot.v) % 16 ||
        ((p.write.rot.k || p.write.rot.v) && p.write.rot.r_heads != 1 && p.write.rot.r_heads != kv.num_kv_heads))
      return who + "write: rotation must be 16-byte aligned with r_heads 1 or num_kv_heads";
  }
  return "";
}

cudaError_t decode_attention(const DecodeParams& p, const DecodePlan& plan,
                             const DecodeWorkspace& ws, cudaStream_t stream) {
  return launch(p, plan, ws, stream, false);
}

cudaError_t decode_attention_bf16(const DecodeParams& p, const DecodePlan& plan,
                                  const DecodeWorkspace& ws, cudaStream_t stream) {
  return launch(p, plan, ws, stream, true);
}

cudaError_t rotate_queries(const float* q, int n, int num_q_heads, int d, const float* R,
                           int r_heads, float* q_rot, cudaStream_t stream) {
  if (n < 0 || num_q_heads <= 0 || r_heads <= 0 || num_q_heads % r_heads != 0 || !q || !R || !q_rot)
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  const unsigned rows = static_cast<unsigned>(int64_t(n) * num_q_heads);
  if (d == 64) {
    rotate_kernel<64><<<rows, 64, 0, stream>>>(q, num_q_heads, R, r_heads, q_rot);
  } else if (d == 128) {
    rotate_kernel<128><<<rows, 128, 0, stream>>>(q, num_q_heads, R, r_heads, q_rot);
  } else if (d == 256) {
    rotate_kernel<256><<<rows, 256, 0, stream>>>(q, num_q_heads, R, r_heads, q_rot);
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace oscar::kernels::cuda
