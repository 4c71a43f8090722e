// The host planner of the CUDA decode (decode_plan.h). Plain C++: the CPU tests
// check its plans (tests/kernels/test_decode_plan.cpp).
#include "kernels/cuda/decode_plan.h"

#include <algorithm>
#include <string>

#include "core/error.h"

// Fused window + merge launch where the plan allows it (v27); 0 = never.
#ifndef OSCAR_FUSE_WINDOWS
#define OSCAR_FUSE_WINDOWS 1
#endif

namespace oscar::kernels::cuda {

using namespace decode_impl;

DecodePlan plan_decode(int batch, const HostRegions& regions, int num_kv_heads, int num_sms,
                       int tiles_per_chunk, int ctas_per_sm, float rank_skew, int fuse_windows,
                       int max_mid_chunk_tiles) {
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
  // Window regions likewise (the BF16 cache's decode, all of whose pages are window pages:
  // 8 x 32K on Qwen3-8B shapes made 9 chunks of 228 tiles per sequence and KV head, 576 CTAs
  // for 528 slots, and took 16.6 ms a step against 14.4 ms with 512 CTAs; H200, 2026-12-04).
  bool mid_round_down = false, win_round_down = false;
  // Chunk size of a region of n tiles (equal chunks), the count rounded down or up.
  // max_mid_chunk_tiles (page centering's bound) raises a middle region's chunk count, so that
  // its chunks stay equal (whole steps, the cap rounded down to them) instead of ending in a short
  // remainder; forced sizes are cut to it.
  const int mid_cap = max_mid_chunk_tiles > 0 ? std::max(qmin, max_mid_chunk_tiles / qmin * qmin) : 0;
  auto chunk_size_rounded = [&](int region, int ntiles, int per, bool down) {
    if (ntiles > 0 && tiles_per_chunk <= 0) {
      const int64_t cost = region == 1 ? 1 : kBf16TileCost;
      int n = down ? std::max<int>(1, static_cast<int>(int64_t(ntiles) * cost / per_cta)) : ceil_div(ntiles, per);
      if (region == 1 && mid_cap > 0) n = std::max(n, ceil_div(ntiles, mid_cap));
      const int unit = region == 1 ? qmin : kWarps;
      per = ceil_div(ceil_div(ntiles, n), unit) * unit;
    } else if (region == 1 && max_mid_chunk_tiles > 0) {
      per = std::min(per, max_mid_chunk_tiles);
    }
    return per;
  };
  auto chunk_size = [&](int region, int ntiles, int per) {
    return chunk_size_rounded(region, ntiles, per, region == 1 ? mid_round_down : win_round_down);
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
    // The windows' chunks rounded up and rounded down, beside the middle's (as rounded): down
    // only where that makes the launch one wave (where it does not, longer window chunks
    // would only lengthen the tail).
    int64_t mid = 0, win_up = 0, win_down = 0;
    for (int b = 0; b < batch; ++b) {
      const int nt = ceil_div(mid_len[b], kTileTokens);
      if (nt > 0) mid += ceil_div(nt, chunk_size(1, nt, plan.tiles_per_chunk_quant));
      for (int len : {sink_len[b], recent_len[b]}) {
        const int wt = ceil_div(len, kTileTokens);
        if (wt == 0) continue;
        win_up += ceil_div(wt, chunk_size_rounded(0, wt, plan.tiles_per_chunk_bf16, false));
        win_down += ceil_div(wt, chunk_size_rounded(0, wt, plan.tiles_per_chunk_bf16, true));
      }
    }
    win_round_down = (mid + win_up) * hkv > target && (mid + win_down) * hkv <= target;
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
  for (int32_t id : quant_ids) {
    plan.mid_groups_aligned &= plan.chunks[4 * size_t(id) + 2] % kRingTiles == 0;
    plan.max_mid_chunk_tiles = std::max(plan.max_mid_chunk_tiles, plan.chunks[4 * size_t(id) + 3] - plan.chunks[4 * size_t(id) + 2]);
  }
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

}  // namespace oscar::kernels::cuda
