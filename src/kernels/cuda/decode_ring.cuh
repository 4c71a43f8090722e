// The split kernel's cp.async staging: the per-warp rings of INT2 tile
// images (per-tile copies, and whole 4-tile groups from one page, v34) and
// of the fused window kernel's BF16 tiles, and the kernel's shared-memory
// size that follows from them.
#pragma once

#include "kernels/cuda/decode_tile_int2.cuh"

namespace oscar::kernels::cuda {

namespace {

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

}  // namespace

}  // namespace oscar::kernels::cuda
