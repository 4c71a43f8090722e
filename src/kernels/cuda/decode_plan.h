// The host planner of the CUDA decode (decode_attention.h): which chunks of
// 16-token tiles the split kernels take, in which launch order. Plain C++:
// no CUDA header, compiled by the host compiler (decode_plan.cpp), so that
// the CPU tests check it (tests/kernels/test_decode_plan.cpp).
//
// The plan splits every sequence into chunks of 16-token tiles that never
// cross a region boundary; one CTA handles one (chunk, KV head). Chunk size is
// chosen from the total work and the SM count so that small batches still
// fill the GPU (split-KV) and large ones do not pay for many partials.
#pragma once

#include <cstdint>
#include <vector>

namespace oscar::kernels::cuda {

// Tokens per tile: the M dimension of one m16n8k16 tensor-core product.
inline constexpr int kTileTokens = 16;

// The kernels' shape that the planner cuts its chunks for; the split kernels
// (decode_common.cuh) are built from the same numbers.
namespace decode_impl {
// Warps per split CTA (DecodePlan::first_pages: one page per warp).
inline constexpr int kWarps = 4;
// Tiles per group of the INT2 ring, a warp's step (v30 measured 2, 6 and 8:
// slower or within 1.2%).
inline constexpr int kRingTiles = 4;
// A BF16 tile moves ~7x the bytes of an INT2 tile (16 vs 2.25 bits).
inline constexpr int kBf16TileCost = 7;
// A fused window chunk merges at most this many middle chunks (one lane each).
inline constexpr int kFuseMaxChunks = 32;
// ... and covers at most this many window tiles per (sequence, KV head).
inline constexpr int kFuseMaxWindowTiles = 64;
// Page centering: a middle CTA stages the shifts of its chunk's pages in shared memory, for at
// most this many pages (DecodePlan::max_mid_chunk_tiles, center_max_chunk_tiles).
inline constexpr int kCenterMaxPages = 256;

inline int ceil_div(int64_t a, int64_t b) {
  return static_cast<int>((a + b - 1) / b);
}
}  // namespace decode_impl

// Resident CTAs per SM the int8-key loop is compiled for (register cap
// 65536 / (128 threads * N)); a build-time knob for tuning, also the plan's
// default CTAs per SM. (Both builds, CMakeLists.txt and tests/cuda/gpu_build,
// give decode_plan.cpp the -D flags of CMAKE_CUDA_FLAGS: one flag sets both.)
#ifndef OSCAR_INT8K_MIN_BLOCKS
// (5 spills 88 bytes; with lazy fragment loads, v11, it fits but ran slower.)
#define OSCAR_INT8K_MIN_BLOCKS 4
#endif

// Host copies of what a plan needs from the view's region tables, per region
// (0 sink, 1 middle, 2 recent): the lengths [batch] and the page-table
// offsets (kv::RegionTable::indptr, [batch + 1]); the page ids themselves
// stay on the device. An engine builds its page tables on the host, so it
// has both; FlashInfer's plan takes its indptr from the host the same way.
struct HostRegions {
  const int32_t* len[3] = {nullptr, nullptr, nullptr};
  const int32_t* indptr[3] = {nullptr, nullptr, nullptr};
  // Optional (v44): the host copy of the middle's page table (the same ids as
  // kv::RegionTable::indices of the view the plan runs on) and the page size.
  // With both, the plan records the page of each middle CTA warp's first tile
  // group (DecodePlan::first_pages), so that the CTA's first copies do not
  // wait for a page-id load behind its chunk entry. Ids that differ from the
  // device table make the kernels read the wrong pages.
  const int32_t* mid_indices = nullptr;
  int page_size = 0;
};

// Host-side split-KV schedule. chunks[i] = {b, region, first tile, end tile}
// with region 0 sink, 1 middle, 2 recent (tiles relative to the region) or
// 3 (fused windows, below),
// ordered by sequence so that the partials of sequence b are contiguous.
// `order` lists the chunk ids of the middle (quantized) chunks first, then the
// BF16 ones: the two kinds run as two launches with separate register budgets.
// `regions` keeps each sequence's page-table offset and length per region, so
// that a CTA finds its pages with the one load of its chunk entry instead of
// a chain of two (v25). The plan must describe the view it runs on: a plan
// from other lengths or page tables reads the wrong pages.
struct DecodePlan {
  int batch = 0;
  int num_chunks = 0;
  int num_quant_chunks = 0;            // order[0 .. num_quant_chunks) are middle chunks
  int max_mid_chunk_tiles = 0;         // the longest middle chunk (tiles; page centering's bound)
  int tiles_per_chunk_bf16 = 0;
  int tiles_per_chunk_quant = 0;
  std::vector<int32_t> chunks;         // [num_chunks][4]
  std::vector<int32_t> order;          // [num_chunks]
  std::vector<int32_t> seq_chunk_ptr;  // [batch+1]: chunks of sequence b are [ptr[b], ptr[b+1])
  std::vector<int32_t> regions;        // [batch][3][2]: {indptr[b], len[b]} of sink, middle, recent
  // Fused windows (v27): instead of sink and recent chunks, one chunk per
  // sequence {b, 3, first, end} (after its middle chunks; first..end are the
  // ids of its middle chunks) whose CTAs take the whole window and then
  // merge: no merge launch. Chosen when every window has at most 64 tiles and
  // at most a quarter as many as its sequence's first middle chunk (4 tiles
  // without a middle), and every middle at most 32 chunks.
  bool fused_windows = false;
  // Every middle chunk starts at a multiple of 4 tiles (64 tokens), so that
  // each 4-tile group of the INT2 ring is 64 consecutive rows of one page
  // when the page size is a multiple of 64: the ring then copies whole
  // groups from one address per array (v34). upload_plan checks it.
  bool mid_groups_aligned = false;
  // v44, with HostRegions::mid_indices: [num_chunks][4] by chunk id: for a
  // middle chunk, the page of tile t0 + 4 w (the first group of warp w), -1
  // past the chunk's end; -1 for window chunks. Empty: the kernels look the
  // pages up. upload_plan copies it in launch order.
  std::vector<int32_t> first_pages;
  int first_pages_page_size = 0;  // the page size they were computed for (check_decode compares)
};

// Builds the plan from HOST copies of the region tables (HostRegions; every
// pointer non-null, else oscar::Error). num_sms: the device's multiprocessor
// count. tiles_per_chunk > 0 forces a chunk size (tests use it to exercise
// the merge); 0 picks one so that the whole step makes about ctas_per_sm CTAs
// per SM (0: as many as the default INT2 loop keeps resident, one wave).
// rank_skew: the middle chunks' weight lost per dispatch round (v26; < 0:
// the default, which is 0: equal chunks). fuse_windows: -1 the planner's
// choice (DecodePlan::fused_windows), 1 wherever the fused kernel can run
// (tests), 0 never. max_mid_chunk_tiles > 0: no middle chunk longer than that (page centering's
// bound, center_max_chunk_tiles; with rank_skew 0, and at least 16 tiles in the automatic split): a
// middle region gets as many more equal chunks as that takes.
DecodePlan plan_decode(int batch, const HostRegions& regions, int num_kv_heads, int num_sms,
                       int tiles_per_chunk = 0, int ctas_per_sm = 0, float rank_skew = -1.0f,
                       int fuse_windows = -1, int max_mid_chunk_tiles = 0);

// The pages a middle chunk of `tiles` tiles may span (its start anywhere) at tiles_per_page.
inline int chunk_pages_bound(int tiles, int tiles_per_page) {
  return tiles <= 0 ? 0 : (tiles - 1 + tiles_per_page - 1) / tiles_per_page + 1;
}
// The longest middle chunk whose pages' shifts a page-centred CTA can stage (kCenterMaxPages),
// in whole steps of the INT2 loops (16 tiles), at page_size (a multiple of 16).
inline int center_max_chunk_tiles(int page_size) {
  const int tpp = page_size / kTileTokens > 0 ? page_size / kTileTokens : 1, step = decode_impl::kWarps * 4;
  return (decode_impl::kCenterMaxPages - 2) * tpp / step * step;
}

}  // namespace oscar::kernels::cuda
