// The split kernel of the decode (one CTA = one chunk of 16-token tiles x one
// KV head) with its four INT2 loop shapes, the BF16 window loop and the
// fused window + merge epilogue, and launch_split, its launcher. Included
// by the instance files (decode_split_d*.cu), which instantiate the
// launcher (OSCAR_DECODE_SPLIT_INSTANCE) for the shapes that
// decode_dispatch.cu launches.
#pragma once

#include <type_traits>

#include "kernels/cuda/decode_dispatch.h"
#include "kernels/cuda/decode_ring.cuh"
#include "kernels/cuda/decode_tile_bf16.cuh"
#include "kernels/cuda/decode_tile_int8.cuh"
#include "kernels/cuda/decode_trace.cuh"
#include "kernels/cuda/launch.cuh"

namespace oscar::kernels::cuda {

namespace {

// Tiles a warp works on per loop iteration in the INT2 path; the next
// iteration's tiles are loaded before this one's are computed, so up to
// 2*kQuantTilesPerIter tiles per warp are in flight.
constexpr int kQuantTilesPerIter = 2;

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

// Page centering (kCenter): the log2-domain logit shifts of the pages of a middle chunk, staged
// once per CTA in shared memory (no launch of their own before the middle's). Page p of the
// sequence's middle (p0 <= p < p0 + np; np <= kCenterMaxPages, check_decode) gets, for query
// head j of KV head h's group,
//   s_pb[(p % kCenterMaxPages) * kMaxGqa + j] = (sum_k coef[j][k] * angles[row(p)][k] - coef[j][2S]) * scale_log2,
// coef being center_coef_kernel's rows ((A_s, B_s) pairs, C) and angles the page's (cos, sin)
// pairs (kv::MidCenter::angle_row). The group's coefficient rows (contiguous: its heads are
// consecutive) go to shared memory first; then warp w takes pages p0 + w, + kWarps, ... (the
// next page's angles loaded before this one's sums), lane l the terms k = l, l + 32, ... of all
// kMaxGqa sums at once, which one transposing reduction (9 shuffles, not 5 per head) leaves
// with lane 4j. Called by every thread, after the wait for the coefficients and with the CTA's
// first copies in flight; the caller syncs before the loop reads s_pb.
template <int D>
__device__ __forceinline__ void stage_page_bias(const KernelArgs& a, int b, int h, int mid_off, int p0, int np,
                                                float* s_pb, float* s_cf) {
  const int S2 = 2 * a.kv.center.pairs, ld = a.center_ld, n4 = a.gqa * ld / 4;  // ld % 4 == 0
  const float4* cf = reinterpret_cast<const float4*>(a.center_coef + (int64_t(b) * a.num_q_heads + h * a.gqa) * ld);
  for (int i = threadIdx.x; i < kMaxGqa * ld / 4; i += kThreads)  // rows past the group: zeros
    reinterpret_cast<float4*>(s_cf)[i] = i < n4 ? __ldcg(cf + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);  // (the previous launch's)
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const kv::MidCenter& c = a.kv.center;
  const float* ang0 = c.angles + ((c.angle_start ? int64_t(__ldg(c.angle_start + b)) : int64_t(mid_off)) + p0) * S2;
  constexpr int KI = D / 32;  // 2S <= D terms: at most KI per lane
  auto load = [&](int p, float (&x)[KI]) {
#pragma unroll
    for (int i = 0; i < KI; ++i) x[i] = p < np && lane + 32 * i < S2 ? __ldg(ang0 + int64_t(p) * S2 + lane + 32 * i) : 0.0f;
  };
  float x[KI];
  load(warp, x);
  for (int p = warp; p < np; p += kWarps) {
    float xn[KI];
    load(p + kWarps, xn);
    float v[kMaxGqa];
#pragma unroll
    for (int j = 0; j < kMaxGqa; ++j) {
      v[j] = 0.0f;
#pragma unroll
      for (int i = 0; i < KI; ++i)
        if (lane + 32 * i < S2) v[j] = fmaf(s_cf[j * ld + lane + 32 * i], x[i], v[j]);
    }
    // Transposing reduction: at each step a lane keeps half its sums and adds its partner's
    // share of them; then lanes 4j .. 4j + 3 hold head j's four partial sums.
    const bool b16 = lane & 16, b8 = lane & 8, b4 = lane & 4;
    float w[4], y[2];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      w[i] = (b16 ? v[4 + i] : v[i]) + __shfl_xor_sync(0xffffffffu, b16 ? v[i] : v[4 + i], 16);
#pragma unroll
    for (int i = 0; i < 2; ++i)
      y[i] = (b8 ? w[2 + i] : w[i]) + __shfl_xor_sync(0xffffffffu, b8 ? w[i] : w[2 + i], 8);
    float z = (b4 ? y[1] : y[0]) + __shfl_xor_sync(0xffffffffu, b4 ? y[0] : y[1], 4);
    z += __shfl_xor_sync(0xffffffffu, z, 2);
    z += __shfl_xor_sync(0xffffffffu, z, 1);
    const int j = lane >> 2;
    if ((lane & 3) == 0 && j < a.gqa)
      s_pb[((p0 + p) % kCenterMaxPages) * kMaxGqa + j] = (z - s_cf[j * ld + S2]) * a.sm_scale_log2;
#pragma unroll
    for (int i = 0; i < KI; ++i) x[i] = xn[i];
  }
}

// The staged shifts of tiles t .. t + N - 1 (clamped to tlast) for the lane's head columns:
// NH = 2 (columns 2r, 2r + 1: the fp16 loops) or 1 (head r: the int8 loop). Columns past the KV
// head's group read 0. (Rows by page modulo kCenterMaxPages: the chunk's pages are that many
// consecutive ones at most, and no register holds the first.)
template <int N, int NH>
__device__ __forceinline__ void load_page_bias(const KernelArgs& a, const float* s_pb, int t, int tlast, int r,
                                               float (&pb)[N][NH]) {
  static_assert((kCenterMaxPages & (kCenterMaxPages - 1)) == 0, "a power of two: the modulo is a mask");
#pragma unroll
  for (int u = 0; u < N; ++u) {
    const int row = (int(a.tiles_per_page.div(uint32_t(min(t + u, tlast)))) % kCenterMaxPages) * kMaxGqa;
#pragma unroll
    for (int e = 0; e < NH; ++e) {
      const int hd = NH == 2 ? 2 * r + e : r;
      pb[u][e] = hd < a.gqa ? s_pb[row + hd] : 0.0f;
    }
  }
}

// The split kernel. kQuant: this launch handles middle (INT2) chunks; else
// BF16 chunks (sink / recent).
// kVariant (INT2 loop shape; docs/kernels-cuda.md): 0 = four tiles per step
// staged through a per-warp two-stage cp.async ring in shared memory, fp16
// tensor cores for K and V; 1 = two tiles per step, the next step's tiles
// prefetched into registers (used for the other shapes); 2 = the ring of 0
// with int8 tensor cores for K (v10, head_dim 128, group 128, GQA <= 4);
// 3 = the ring with int8 tensor cores for K and V (v13: the default where
// it applies). kCenter (middle only, variants 0, 1 and 3): page centering, each
// middle page's logits shifted inside the loop by its shift, which the CTA computes first
// (stage_page_bias).
template <int D, int G, bool kQuant, int kVariant = 0, bool kFused = false, bool kGroup = false,
          bool kCenter = false>
__global__ void __launch_bounds__(kThreads, kVariant >= 2                    ? OSCAR_INT8K_MIN_BLOCKS
                                            : (D <= 128 && G == 128) ? 4
                                                                     : 1)
    decode_split_kernel(const KernelArgs a) {
  static_assert(!kFused || !kQuant, "the fused window + merge kernel is a BF16 instance");
  static_assert(!kCenter || (kQuant && kVariant != 2), "page centering: middle chunks, variants 0, 1 and 3");
  constexpr int NG = kQuant ? D / G : 1;
  constexpr int kRingStages = ring_stages<kVariant>();
  // The warps' cp.async rings and, after the loop, the per-warp outputs.
  extern __shared__ __align__(16) uint8_t smem[];  // split_smem_bytes (dynamic: may exceed 48 KB)
  float(*s_o)[kMaxGqa][D] = reinterpret_cast<float(*)[kMaxGqa][D]>(smem);
  __shared__ float s_m[kWarps][kMaxGqa];
  __shared__ float s_l[kWarps][kMaxGqa];
  // Page centering: the chunk's page shifts, and the coefficient rows they are made from.
  [[maybe_unused]] __shared__ float s_pb[kCenter ? kCenterMaxPages * kMaxGqa : 1];
  [[maybe_unused]] __shared__ __align__(16) float s_cf[kCenter ? kMaxGqa * coef_row_floats(D / 2) : 4];

  OSCAR_TRACE_BEGIN;
  // Page centering: launched as a programmatic dependent of center_coef_kernel (PDL: the CTAs are
  // resident when the coefficients are ready, no launch gap); nothing is read, and no dependent is
  // released, before every earlier launch is complete.
  if constexpr (kCenter) pdl_wait();
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
      if constexpr (kCenter) {  // with the first tiles' loads in flight
        const int p0 = int(tpp.div(uint32_t(t0)));
        stage_page_bias<D>(a, b, h, c2.x, p0, int(tpp.div(uint32_t(t1 - 1))) - p0 + 1, s_pb, s_cf);
        __syncthreads();
      }
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
        if constexpr (kCenter) {
          float pb[TPI][2];
          load_page_bias(a, s_pb, t, tlast, r, pb);
          compute_quant_tiles(st, cur, Q, g, pb);
        } else {
          compute_quant_tiles(st, cur, Q, g);
        }
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
      // Page centering: the chunk's page shifts, while the first copies are in flight.
      if constexpr (kCenter) {
        const int p0 = int(tpp.div(uint32_t(t0)));
        stage_page_bias<D>(a, b, h, c2.x, p0, int(tpp.div(uint32_t(t1 - 1))) - p0 + 1, s_pb, s_cf);
        __syncthreads();
      }
      // The query's conversion after the first copies are issued: it runs
      // while they are in flight instead of before them (v25).
      load_query();
      [[maybe_unused]] float inv_f = 0.0f;  // page centering in the int8 loop: its logits are not yet times Q8.f
      if constexpr (kCenter && kVariant >= 2) inv_f = Q8.f > 0.0f ? 1.0f / Q8.f : 0.0f;
      for (int j = 0; j < ngroups; ++j, t += kStep) {
        // Page centering: this step's shifts, loaded before the refill and the wait.
        [[maybe_unused]] float pb[TPI][kVariant >= 2 ? 1 : 2];
        if constexpr (kCenter) load_page_bias(a, s_pb, t, tlast, r, pb);
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
          if constexpr (kVariant == 3 && kCenter) {
            float pbf[TPI];
#pragma unroll
            for (int u = 0; u < TPI; ++u) pbf[u] = pb[u][0] * inv_f;
            if (full)
              compute_int8kv_tiles<TPI, false, true>(st, cur, Q8, g, pbf);
            else
              compute_int8kv_tiles<TPI, true, true>(st, cur, Q8, g, pbf);
          } else if constexpr (kVariant == 3) {
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
        } else if constexpr (kCenter) {
          compute_quant_tiles(st, cur, Q, g, pb);
        } else {
          compute_quant_tiles(st, cur, Q, g);
        }
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

}  // namespace

namespace decode_impl {

// A split kernel with its dynamic shared memory (above 48 KB its limit is
// raised once per kernel instance, i.e. per template instance of this).
// (v33 measured the middle instances with the largest shared-memory
// carveout too, so that 64 KB fused window CTAs surely fit beside three
// middle CTAs: no faster at 8 x 32K, 7% slower at 8 x 4K.)
template <int D, int G, bool kQuant, int kVariant, bool kFused, bool kGroup, bool kCenter>
cudaError_t launch_split(dim3 grid, bool pdl, cudaStream_t stream, const KernelArgs& a) {
  constexpr int smem = split_smem_bytes<D, G, kQuant, kVariant, kFused>();
  // (Static and dynamic shared memory together past 48 KB need the raised limit too: the
  // kCenter instances' staged page shifts are static.)
  if constexpr (smem > 48 * 1024 || kCenter) {
    static const cudaError_t raised = [] {
      auto* k = decode_split_kernel<D, G, kQuant, kVariant, kFused, kGroup, kCenter>;
      cudaError_t e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e == cudaSuccess)
        e = cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared);
      return e;
    }();
    if (raised != cudaSuccess) return raised;
  }
  return launch_pdl(decode_split_kernel<D, G, kQuant, kVariant, kFused, kGroup, kCenter>, grid, dim3(kThreads), smem, pdl,
                    stream, a);
}

// One instance of the launcher (and so of its kernel), for the instance files:
//   OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 3, false, true, false)
#define OSCAR_DECODE_SPLIT_INSTANCE(...) \
  template cudaError_t launch_split<__VA_ARGS__>(dim3, bool, cudaStream_t, const KernelArgs&);

}  // namespace decode_impl

}  // namespace oscar::kernels::cuda
