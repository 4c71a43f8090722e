// The CUDA decode's host planner (kernels/cuda/decode_plan.h), plain C++, on
// random shapes: every plan covers each token of each region of each
// sequence exactly once with chunks inside that region, lays its tables out
// as upload_plan and the kernels read them (order, seq_chunk_ptr, regions,
// first_pages), and keeps the promises the kernels rely on (launch order,
// aligned tile groups, chunk sizes, the fused-window limits).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/decode_plan.h"

namespace oscar::kernels::cuda {
namespace {

using namespace decode_impl;

// One call of plan_decode: the host region tables and the planner's options.
struct Shape {
  int batch = 0;
  std::vector<int32_t> len[3], indptr[3];
  std::vector<int32_t> mid_indices;  // the middle's page table (empty: not given)
  int page_size = 16;
  int hkv = 1, num_sms = 132, tiles_per_chunk = 0, ctas_per_sm = 0, fuse_windows = -1;
  float rank_skew = -1.0f;
  int max_mid_chunk_tiles = 0;

  HostRegions regions() const {
    static const int32_t kNone =
        0;  // an empty batch's lengths: not null (plan_decode refuses null)
    HostRegions hr;
    for (int k = 0; k < 3; ++k) {
      hr.len[k] = len[k].empty() ? &kNone : len[k].data();
      hr.indptr[k] = indptr[k].data();
    }
    if (!mid_indices.empty()) {
      hr.mid_indices = mid_indices.data();
      hr.page_size = page_size;
    }
    return hr;
  }
  DecodePlan plan() const {
    return plan_decode(batch, regions(), hkv, num_sms, tiles_per_chunk, ctas_per_sm, rank_skew,
                       fuse_windows, max_mid_chunk_tiles);
  }
  std::string describe() const {
    std::string s = "batch " + std::to_string(batch) + " page " + std::to_string(page_size) +
                    " hkv " + std::to_string(hkv) + " sms " + std::to_string(num_sms) +
                    " tiles_per_chunk " + std::to_string(tiles_per_chunk) + " ctas_per_sm " +
                    std::to_string(ctas_per_sm) + " rank_skew " + std::to_string(rank_skew) +
                    " fuse " + std::to_string(fuse_windows) + " max_mid_chunk_tiles " +
                    std::to_string(max_mid_chunk_tiles) +
                    (mid_indices.empty() ? "" : " host pages") + "; (sink, middle, recent):";
    for (int b = 0; b < batch && b < 16; ++b)
      s += " (" + std::to_string(len[0][b]) + ", " + std::to_string(len[1][b]) + ", " +
           std::to_string(len[2][b]) + ")";
    return s + (batch > 16 ? " ..." : "");
  }
};

int tiles(int64_t tokens) {
  return ceil_div(tokens, kTileTokens);
}

// Fills the page tables: region k of sequence b gets ceil(len / page_size)
// pages from a running offset (after a random gap), the middle's ids random.
void make_tables(Shape& s, std::mt19937& rng, bool host_pages) {
  for (int k = 0; k < 3; ++k) {
    s.indptr[k].assign(size_t(s.batch) + 1, 0);
    int32_t at = int32_t(rng() % 5);
    for (int b = 0; b < s.batch; ++b) {
      s.indptr[k][b] = at;
      at += ceil_div(s.len[k][b], s.page_size);
    }
    s.indptr[k][s.batch] = at;
  }
  s.mid_indices.clear();
  if (host_pages) {
    s.mid_indices.resize(size_t(s.indptr[1][s.batch]));
    for (int32_t& id : s.mid_indices) id = int32_t(rng() % 100000);
  }
}

// A random call: mostly engine-like sequences (a short sink, a long middle,
// a recent window of up to a few pages), some anything-goes ones (empty
// regions, one-token regions, empty batches), and every option.
Shape random_shape(std::mt19937& rng) {
  auto u = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Shape s;
  const int kind = u(0, 9);  // 0-5 engine-like, 6-8 anything, 9 large middles
  s.batch = kind == 9 ? u(1, 4) : u(0, 3) == 0 ? u(0, 3) : u(1, 48);
  s.page_size = 16 * (u(0, 2) == 0 ? u(1, 16) : (1 << u(0, 4)));
  for (int k = 0; k < 3; ++k) s.len[k].assign(size_t(s.batch), 0);
  for (int b = 0; b < s.batch; ++b) {
    if (kind <= 5) {
      s.len[0][b] = u(0, 4) == 0 ? 0 : u(1, 64);
      s.len[1][b] = u(0, 5) == 0 ? 0 : s.page_size * u(1, 512);
      s.len[2][b] = u(1, 4 * s.page_size);
    } else if (kind <= 8) {
      for (int k = 0; k < 3; ++k) {
        const int pick = u(0, 4);
        s.len[k][b] = pick == 0 ? 0 : pick == 1 ? u(1, 17) : pick == 2 ? u(1, 300) : u(1, 20000);
      }
    } else {
      s.len[0][b] = u(0, 64);
      s.len[1][b] = u(1, 140000);
      s.len[2][b] = u(0, 2000);
    }
  }
  s.hkv = 1 << u(0, 3);
  const int sms[] = {1, 8, 78, 114, 132};
  s.num_sms = sms[u(0, 4)];
  s.tiles_per_chunk = u(0, 2) == 0 ? u(1, 64) : 0;
  s.ctas_per_sm = u(0, 3) == 0 ? u(1, 8) : 0;
  const float skews[] = {-1.0f, -1.0f, -1.0f, 0.0f, 0.05f, 0.2f, 0.4f};
  s.rank_skew = skews[u(0, 6)];
  s.fuse_windows = u(-1, 1);
  // Page centering's bound on middle chunks, or a small one that cuts often.
  const int cap = u(0, 3);
  s.max_mid_chunk_tiles = cap == 0 ? center_max_chunk_tiles(s.page_size) : cap == 1 ? 16 * u(1, 8) : 0;
  make_tables(s, rng, u(0, 1) == 1);
  return s;
}

// What the plan must be; "" when it is, else the first thing that is not.
std::string check_plan(const Shape& s, const DecodePlan& p) {
  const int B = s.batch, n = p.num_chunks, nq = p.num_quant_chunks;
  // --- sizes and the copies of the region tables
  if (p.batch != B) return "plan.batch != batch";
  if (n < 0 || nq < 0 || nq > n) return "chunk counts out of range";
  if (p.chunks.size() != 4 * size_t(n) || p.order.size() != size_t(n))
    return "chunks / order sizes";
  if (p.seq_chunk_ptr.size() != size_t(B) + 1 || p.regions.size() != 6 * size_t(B))
    return "seq_chunk_ptr / regions sizes";
  for (int b = 0; b < B; ++b)
    for (int k = 0; k < 3; ++k)
      if (p.regions[6 * b + 2 * k] != s.indptr[k][b] || p.regions[6 * b + 2 * k + 1] != s.len[k][b])
        return "regions of sequence " + std::to_string(b) + " differ from the host tables";
  auto chunk = [&](int id) { return &p.chunks[4 * size_t(id)]; };
  // --- chunks grouped by sequence, in id order
  if (p.seq_chunk_ptr[0] != 0 || p.seq_chunk_ptr[B] != n)
    return "seq_chunk_ptr does not span the chunks";
  for (int b = 0; b < B; ++b) {
    if (p.seq_chunk_ptr[b + 1] < p.seq_chunk_ptr[b]) return "seq_chunk_ptr decreases";
    for (int id = p.seq_chunk_ptr[b]; id < p.seq_chunk_ptr[b + 1]; ++id)
      if (chunk(id)[0] != b)
        return "chunk " + std::to_string(id) + " is not of sequence " + std::to_string(b);
  }
  // --- order: a permutation, the middle chunks first, then the windows
  std::vector<int> seen(size_t(n), 0);
  int mid_count = 0;
  for (int id = 0; id < n; ++id) {
    const int32_t* c = chunk(id);
    if (c[1] < 0 || c[1] > 3)
      return "chunk " + std::to_string(id) + " has region " + std::to_string(c[1]);
    if (c[1] == 3 && !p.fused_windows)
      return "a fused window chunk in a plan without fused windows";
    if ((c[1] == 0 || c[1] == 2) && p.fused_windows)
      return "a sink or recent chunk in a plan with fused windows";
    mid_count += c[1] == 1;
  }
  if (mid_count != nq) return "num_quant_chunks != the number of middle chunks";
  for (int i = 0; i < n; ++i) {
    const int id = p.order[i];
    if (id < 0 || id >= n || seen[size_t(id)]++)
      return "order is not a permutation of the chunk ids";
    if ((chunk(id)[1] == 1) != (i < nq)) return "order does not list the middle chunks first";
  }
  // --- every token of every region covered exactly once, chunks inside their region
  for (int b = 0; b < B; ++b)
    for (int k = 0; k < 3; ++k) {
      if (p.fused_windows && k != 1) continue;  // the fused chunk, below
      std::vector<std::pair<int, int>> r;       // token ranges of the region's chunks
      for (int id = p.seq_chunk_ptr[b]; id < p.seq_chunk_ptr[b + 1]; ++id) {
        const int32_t* c = chunk(id);
        if (c[1] != k) continue;
        if (c[2] < 0 || c[3] <= c[2])
          return "chunk " + std::to_string(id) + " is empty or reversed";
        const int64_t t0 = int64_t(c[2]) * kTileTokens,
                      t1 = std::min<int64_t>(int64_t(c[3]) * kTileTokens, s.len[k][b]);
        if (t0 >= t1) return "chunk " + std::to_string(id) + " starts past its region's last token";
        r.emplace_back(int(t0), int(t1));
      }
      std::sort(r.begin(), r.end());
      int at = 0;
      for (const auto& [t0, t1] : r) {
        if (t0 != at)
          return "sequence " + std::to_string(b) + " region " + std::to_string(k) + ": token " +
                 std::to_string(at) + (t0 > at ? " is in no chunk" : " is in two chunks");
        at = t1;
      }
      if (at != s.len[k][b])
        return "sequence " + std::to_string(b) + " region " + std::to_string(k) + ": tokens " +
               std::to_string(at) + ".. are in no chunk";
    }
  // --- fused windows: one chunk per sequence after its middle chunks, naming exactly them
  bool can_fuse = true;
  for (int b = 0; b < B; ++b) {
    const int nwin = tiles(s.len[0][b]) + tiles(s.len[2][b]);
    int mids = 0, first_mid = -1, fused = -1, nfused = 0;
    for (int id = p.seq_chunk_ptr[b]; id < p.seq_chunk_ptr[b + 1]; ++id) {
      if (chunk(id)[1] == 1) {
        if (first_mid < 0) first_mid = id;
        ++mids;
      }
      if (chunk(id)[1] == 3) fused = id, ++nfused;
    }
    if (first_mid >= 0)
      for (int id = first_mid; id < first_mid + mids; ++id)
        if (chunk(id)[1] != 1)
          return "the middle chunks of sequence " + std::to_string(b) + " are not contiguous";
    can_fuse = can_fuse && nwin <= kFuseMaxWindowTiles && mids <= kFuseMaxChunks;
    if (!p.fused_windows) continue;
    if (nfused != 1)
      return "sequence " + std::to_string(b) + " has " + std::to_string(nfused) + " fused chunks";
    const int32_t* c = chunk(fused);
    if (c[2] != (mids ? first_mid : fused) || c[3] != c[2] + mids ||
        (mids && fused != first_mid + mids))
      return "the fused chunk of sequence " + std::to_string(b) +
             " does not follow and name its middle chunks";
    if (nwin > kFuseMaxWindowTiles || mids > kFuseMaxChunks)
      return "sequence " + std::to_string(b) + " fused beyond the fused kernel's limits";
    if (s.fuse_windows < 0) {  // the planner's own choice: short windows only
      const int first_len = mids ? chunk(first_mid)[3] - chunk(first_mid)[2] : kWarps;
      if (mids ? 4 * nwin > first_len : nwin > first_len)
        return "sequence " + std::to_string(b) +
               " fused a window longer than its middle's chunks allow";
    }
  }
  if (s.fuse_windows == 0 && p.fused_windows) return "fused although fuse_windows = 0";
  if (s.fuse_windows == 1 && p.fused_windows != can_fuse)
    return std::string("fuse_windows = 1: ") +
           (can_fuse ? "not fused where the kernel can" : "fused where it cannot");
  if (s.fuse_windows < 0 && s.tiles_per_chunk > 0 && p.fused_windows)
    return "fused with a forced chunk size";
  // --- launch order: the middle chunk index first, then the sequence; windows longest first
  std::vector<int> rank(size_t(n), 0);  // k of the k-th middle chunk of its sequence
  for (int b = 0; b < B; ++b)
    for (int id = p.seq_chunk_ptr[b], k = 0; id < p.seq_chunk_ptr[b + 1]; ++id)
      if (chunk(id)[1] == 1) rank[size_t(id)] = k++;
  for (int i = 1; i < nq; ++i) {
    const int a = p.order[i - 1], c = p.order[i];
    const int ra = rank[size_t(a)], rc = rank[size_t(c)];
    if (ra > rc || (ra == rc && chunk(a)[0] >= chunk(c)[0]))
      return "middle chunks are not launched chunk index first, then by sequence";
  }
  auto window_tiles = [&](int id) {
    const int32_t* c = chunk(id);
    return c[1] == 3 ? tiles(s.len[0][c[0]]) + tiles(s.len[2][c[0]]) : c[3] - c[2];
  };
  for (int i = nq + 1; i < n; ++i)
    if (window_tiles(p.order[i]) > window_tiles(p.order[i - 1]))
      return "window chunks are not longest first";
  // --- aligned groups and chunk sizes
  bool aligned = true;
  for (int id = 0; id < n; ++id)
    if (chunk(id)[1] == 1) aligned = aligned && chunk(id)[2] % kRingTiles == 0;
  if (p.mid_groups_aligned != aligned)
    return "mid_groups_aligned does not say whether the middle chunks are aligned";
  const bool equal_split = s.rank_skew <= 0.0f;
  if (s.tiles_per_chunk <= 0 && equal_split && !aligned)
    return "the automatic split's middle chunks are not aligned";
  if (s.tiles_per_chunk > 0
          ? p.tiles_per_chunk_quant != s.tiles_per_chunk ||
                p.tiles_per_chunk_bf16 != s.tiles_per_chunk
          : p.tiles_per_chunk_quant % (kWarps * kRingTiles) || p.tiles_per_chunk_bf16 % kWarps)
    return "tiles_per_chunk_quant / _bf16 are not the forced size or whole steps";
  for (int b = 0; b < B; ++b)
    for (int k = 0; k < 3; ++k) {
      if (k == 1 && !equal_split && s.tiles_per_chunk <= 0) continue;  // sizes follow the skew
      std::vector<int> sizes;  // in tile order (ids are in tile order within a region)
      for (int id = p.seq_chunk_ptr[b]; id < p.seq_chunk_ptr[b + 1]; ++id)
        if (chunk(id)[1] == k) sizes.push_back(chunk(id)[3] - chunk(id)[2]);
      if (sizes.empty()) continue;
      const int full = sizes[0];
      const int unit = s.tiles_per_chunk > 0 ? 1 : k == 1 ? kWarps * kRingTiles : kWarps;
      const int forced = k == 1 && s.max_mid_chunk_tiles > 0 && s.tiles_per_chunk > 0
                             ? std::min(s.tiles_per_chunk, s.max_mid_chunk_tiles)
                             : s.tiles_per_chunk;
      if (s.tiles_per_chunk > 0 && sizes.size() > 1 && full != forced)
        return "a chunk of sequence " + std::to_string(b) + " is not of the forced size";
      if (sizes.size() > 1 && full % unit)
        return "chunks of sequence " + std::to_string(b) + " are not whole steps";
      for (size_t i = 1; i < sizes.size(); ++i)
        if (sizes[i] != full && (i + 1 < sizes.size() || sizes[i] > full))
          return "the chunks of sequence " + std::to_string(b) + " region " + std::to_string(k) +
                 " are not equal with a shorter last one";
    }
  // --- the longest middle chunk, and the bound on it (equal splits)
  int longest = 0;
  for (int id = 0; id < n; ++id)
    if (chunk(id)[1] == 1) longest = std::max(longest, chunk(id)[3] - chunk(id)[2]);
  if (p.max_mid_chunk_tiles != longest) return "max_mid_chunk_tiles is not the longest middle chunk";
  if (s.max_mid_chunk_tiles > 0 && equal_split && longest > s.max_mid_chunk_tiles)
    return "a middle chunk of " + std::to_string(longest) + " tiles, above max_mid_chunk_tiles";
  // --- first pages: the page of each middle warp's first tile group
  if (s.mid_indices.empty()) {
    if (!p.first_pages.empty()) return "first_pages without the host page table";
  } else {
    if (p.first_pages.size() != size_t(kWarps) * n || p.first_pages_page_size != s.page_size)
      return "first_pages sizes";
    const int tpp = s.page_size / kTileTokens;
    for (int id = 0; id < n; ++id) {
      const int32_t* c = chunk(id);
      for (int w = 0; w < kWarps; ++w) {
        const int t = c[2] + kRingTiles * w;
        const int32_t want =
            c[1] == 1 && t < c[3] ? s.mid_indices[size_t(s.indptr[1][c[0]]) + t / tpp] : -1;
        if (p.first_pages[size_t(kWarps) * id + w] != want)
          return "first_pages of chunk " + std::to_string(id) + " warp " + std::to_string(w);
      }
    }
  }
  return "";
}

// Page centering's bound: a chunk of center_max_chunk_tiles(page) tiles spans at most
// kCenterMaxPages pages wherever it starts, in whole steps of the INT2 loops; chunk_pages_bound
// is the most pages a chunk spans (counted here for every start within a page).
TEST(DecodePlan, CenterChunkBoundFitsTheStagedPages) {
  for (int tpp : {1, 2, 3, 4, 8, 16, 64, 256}) {
    for (int tiles = 1; tiles <= 3 * tpp + 5; ++tiles) {
      int most = 0;
      for (int t0 = 0; t0 < tpp; ++t0) most = std::max(most, (t0 + tiles - 1) / tpp - t0 / tpp + 1);
      EXPECT_EQ(chunk_pages_bound(tiles, tpp), most) << tiles << " tiles, " << tpp << " a page";
    }
    const int cap = center_max_chunk_tiles(tpp * kTileTokens);
    EXPECT_GT(cap, 0);
    EXPECT_EQ(cap % (kWarps * kRingTiles), 0);
    EXPECT_LE(chunk_pages_bound(cap, tpp), kCenterMaxPages) << tpp;
    EXPECT_GT(chunk_pages_bound(cap + tpp * kWarps * kRingTiles + tpp, tpp), kCenterMaxPages - 1) << tpp;
  }
}

// The cap raises a middle's chunk count and keeps its chunks equal: 32 sequences of a 2028-tile
// middle at 8 KV heads make one 1024-tile chunk and a 1004-tile one each uncapped; with the cap at
// pages of 64 (1008 tiles) three chunks of 688 / 688 / 652, not 1008 / 1008 / 12.
TEST(DecodePlan, CenterCapKeepsMiddleChunksEqual) {
  Shape s;
  s.batch = 32;
  s.page_size = 64;
  s.hkv = 8;
  for (int k = 0; k < 3; ++k) s.len[k].assign(size_t(s.batch), 0);
  for (int b = 0; b < s.batch; ++b) s.len[0][b] = 64, s.len[1][b] = 2028 * kTileTokens, s.len[2][b] = 256;
  std::mt19937 rng(3);
  make_tables(s, rng, false);
  const DecodePlan free_plan = s.plan();
  EXPECT_EQ(free_plan.max_mid_chunk_tiles, 1024);
  s.max_mid_chunk_tiles = center_max_chunk_tiles(s.page_size);
  ASSERT_EQ(s.max_mid_chunk_tiles, 1008);
  const DecodePlan p = s.plan();
  ASSERT_EQ(check_plan(s, p), "");
  for (int b = 0; b < s.batch; ++b) {
    std::vector<int> sizes;
    for (int id = p.seq_chunk_ptr[b]; id < p.seq_chunk_ptr[b + 1]; ++id)
      if (p.chunks[4 * size_t(id) + 1] == 1) sizes.push_back(p.chunks[4 * size_t(id) + 3] - p.chunks[4 * size_t(id) + 2]);
    ASSERT_EQ(sizes, (std::vector<int>{688, 688, 652})) << "sequence " << b;
  }
}

TEST(DecodePlan, RandomShapesCoverEveryTokenOnceAndKeepTheKernelsPromises) {
  std::mt19937 rng(20240518);
  int fused = 0, chosen = 0, unfused = 0, with_pages = 0, unaligned = 0, chunks = 0;
  for (int i = 0; i < 3000; ++i) {
    const Shape s = random_shape(rng);
    const DecodePlan p = s.plan();
    ASSERT_EQ(check_plan(s, p), "") << "shape " << i << ": " << s.describe();
    (p.fused_windows ? fused : unfused) += s.batch > 0;
    chosen += p.fused_windows && s.batch > 0 && s.fuse_windows < 0;
    with_pages += !p.first_pages.empty();
    unaligned += !p.mid_groups_aligned && p.num_quant_chunks > 0;
    chunks += p.num_chunks;
  }
  // The random shapes reach every kind of plan.
  EXPECT_GT(fused, 100);
  EXPECT_GT(chosen, 20);  // fused by the planner's own rule, not forced
  EXPECT_GT(unfused, 100);
  EXPECT_GT(with_pages, 100);
  EXPECT_GT(unaligned, 10);
  EXPECT_GT(chunks, 100000);
}

// The planner splits small work finely and large work coarsely: a lone
// 128K sequence fills the GPU with middle chunks (split-KV), while 64 of
// them do not make more CTAs than about one wave.
TEST(DecodePlan, ChunkCountFollowsTheWork) {
  for (int batch : {1, 64}) {
    Shape s;
    s.batch = batch;
    s.page_size = 64;
    s.hkv = 8;
    s.len[0].assign(size_t(batch), 64);
    s.len[1].assign(size_t(batch), 131072 - 64 - 1024);
    s.len[2].assign(size_t(batch), 1024);
    std::mt19937 rng(1);
    make_tables(s, rng, false);
    const DecodePlan p = s.plan();
    ASSERT_EQ(check_plan(s, p), "") << s.describe();
    const int64_t ctas = int64_t(p.num_quant_chunks) * s.hkv,
                  wave = int64_t(s.num_sms) * OSCAR_INT8K_MIN_BLOCKS;
    if (batch == 1) {
      EXPECT_GE(ctas, wave / 2) << "a lone long sequence leaves most SMs idle";
    } else {
      EXPECT_LE(ctas, wave) << "more middle CTAs than one wave";
      EXPECT_GE(ctas, wave / 2);
    }
  }
}

// A BF16 cache's step (every page a window page) is one wave where one wave can hold it:
// rounding the chunk counts up must not leave a short second wave (8 x 32K, 8 KV heads made
// 576 CTAs for 528 slots, 17 % slower on the H200).
TEST(DecodePlan, WindowOnlyStepsFitOneWave) {
  const int64_t wave = int64_t(132) * OSCAR_INT8K_MIN_BLOCKS;
  for (int batch : {1, 2, 3, 4, 5, 6, 8, 12, 16, 22, 24, 32, 48, 64})
    for (int ctx : {4096, 8192, 32768, 65536, 131072}) {
      Shape s;
      s.batch = batch;
      s.page_size = 16;
      s.hkv = 8;
      s.len[0].assign(size_t(batch), 0);
      s.len[1].assign(size_t(batch), 0);
      s.len[2].assign(size_t(batch), ctx);
      std::mt19937 rng(3);
      make_tables(s, rng, false);
      const DecodePlan p = s.plan();
      ASSERT_EQ(check_plan(s, p), "") << s.describe();
      const int64_t ctas = int64_t(p.num_chunks) * s.hkv;
      // At least one chunk per sequence and head; beyond that, one wave.
      EXPECT_LE(ctas, std::max<int64_t>(wave, int64_t(batch) * s.hkv)) << s.describe();
      // Not coarser than needed: more than half a wave whenever the work could fill one.
      if (int64_t(batch) * s.hkv * ceil_div(ctx, kTileTokens) >= 2 * wave) {
        EXPECT_GT(ctas, wave / 2) << s.describe();
      }
    }
}

TEST(DecodePlan, EmptyBatchAndBadInputs) {
  Shape s;
  std::mt19937 rng(2);
  make_tables(s, rng, false);
  const DecodePlan empty = s.plan();
  EXPECT_EQ(check_plan(s, empty), "");
  EXPECT_EQ(empty.num_chunks, 0);

  EXPECT_THROW(plan_decode(-1, s.regions(), 1, 132), Error);
  s.batch = 2;
  for (int k = 0; k < 3; ++k) s.len[k] = {100, 20};
  make_tables(s, rng, true);
  HostRegions missing = s.regions();
  missing.indptr[2] = nullptr;
  EXPECT_THROW(plan_decode(2, missing, 1, 132), Error);
  HostRegions bad_page = s.regions();
  bad_page.page_size = 24;  // page ids need a page size that is a multiple of 16
  EXPECT_THROW(plan_decode(2, bad_page, 1, 132), Error);
  bad_page.page_size = 0;
  EXPECT_THROW(plan_decode(2, bad_page, 1, 132), Error);
}

}  // namespace
}  // namespace oscar::kernels::cuda
