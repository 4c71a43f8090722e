// GPU decode attention vs the CPU reference (kernels/cpu/attention.h
// decode_attention_ref) on fresh random caches: the kernel error tier
// (attention on packed data vs the reference on the same dequantized data).
//
// Tolerances (relative L2 over all outputs; measured values are printed):
//  * INT2 middle only: the query is rounded to fp16 (int8-key loop: to a 16-bit
//    integer, |dq| <= max|q| / 65024) and p*scale to fp16 for the tensor
//    cores -> 3e-3.
//  * with BF16 windows: query and p are rounded to bf16 (as in FlashInfer) -> 1e-2.
//  * lse: absolute 2e-2 (natural log).
// Outputs are poisoned with NaN before every run; NaN or inf never passes.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/error.h"
#include "cuda_test_util.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cache_write.h"
#include "kernels/cuda/cache_write.h"
#include "kernels/cuda/decode_attention.h"

namespace oscar::kernels::cuda {
namespace {

using test::DeviceBuffer;
using test::HostCache;
using test::SeqLens;

struct Case {
  int d, group, gqa, hkv, page;
  std::vector<SeqLens> seqs;
  int tiles_per_chunk;  // 0 = planner's choice
  const char* name;
  int fuse = -1;        // plan_decode's fuse_windows (1: the fused window + merge kernel wherever it can run)
  bool host_pages = true;  // the plan gets the host page table (DecodePlan::first_pages, v44)
  int center_pairs = 0;    // page centering (HostCache::add_center)
  bool center_start = false;  // its angle rows through MidCenter::angle_start
};

int num_sms() {
  int dev = 0, n = 0;
  OSCAR_CUDA_CHECK(cudaGetDevice(&dev));
  OSCAR_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  return n;
}

struct Result {
  double err_o, err_lse;
  bool fused = false;  // the plan used the fused window + merge kernel
};

// The plan's host inputs: per region (sink, middle, recent) the lengths and
// the page-table offsets.
HostRegions host_regions(const std::vector<int32_t> (&len)[3], const std::vector<int32_t> (&indptr)[3]) {
  HostRegions hr;
  for (int k = 0; k < 3; ++k) {
    hr.len[k] = len[k].data();
    hr.indptr[k] = indptr[k].data();
  }
  return hr;
}

// ... of a test cache (its host region tables; host_pages: with the middle's
// page table and page size, so that the plan records first pages, v44).
HostRegions regions_of(const HostCache& cache, bool host_pages = true) {
  HostRegions hr = host_regions(cache.len, cache.indptr);
  if (host_pages) {
    hr.mid_indices = cache.indices[1].data();
    hr.page_size = cache.page;
  }
  return hr;
}

// Region lengths with page tables packed back to back (pages of 64 tokens),
// for tests of the plan alone.
struct PackedRegions {
  std::vector<int32_t> len[3], indptr[3];
  PackedRegions(const std::vector<int32_t>& s, const std::vector<int32_t>& m, const std::vector<int32_t>& r) {
    len[0] = s;
    len[1] = m;
    len[2] = r;
    for (int k = 0; k < 3; ++k) {
      indptr[k].push_back(0);
      for (int32_t n : len[k]) indptr[k].push_back(indptr[k].back() + (n + 63) / 64);
    }
  }
  HostRegions get() const { return host_regions(len, indptr); }
};

// Decode parameters over a test cache: q, o, lse device buffers.
DecodeParams params_for(const HostCache& cache, const float* q, int hq, float sm_scale, float* o, float* lse) {
  DecodeParams p;
  p.kv = cache.dev_view;
  p.q = q;
  p.num_q_heads = hq;
  p.sm_scale = sm_scale;
  p.o = o;
  p.lse = lse;
  return p;
}

// calls > 1: the same plan and workspace for several calls in a row (as for
// the layers of a step), each with a query of its own and its own output
// buffers, launched back to back with no synchronization between them (a
// merge that read another call's partial rows would fail); the result is the
// worst call's.
Result run_case(const Case& c, uint32_t seed, bool bf16_kernel = false, int variant = 0, int pdl = 1,
                int calls = 1) {
  const float k_scale = 1.5f;  // peaky softmax: logits with std ~1.5*|q|
  HostCache cache(c.seqs, c.hkv, c.d, c.page, c.group, seed, k_scale);
  if (c.center_pairs > 0) cache.add_center(c.center_pairs, seed + 17, 1.0f, c.center_start);
  const int hq = c.hkv * c.gqa, batch = cache.batch;
  std::mt19937 rng(seed ^ 0x9e3779b9u);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float sm_scale = 1.0f / std::sqrt(float(c.d));
  const size_t nq = size_t(batch) * hq * c.d;
  std::vector<std::vector<float>> q(calls), o_ref(calls), lse_ref(calls);
  for (int call = 0; call < calls; ++call) {
    q[call].resize(nq);
    for (auto& x : q[call]) x = nd(rng);
    o_ref[call].resize(nq);
    lse_ref[call].resize(size_t(batch) * hq);
    cpu::decode_attention_ref(cache.host_view, q[call].data(), hq, sm_scale, o_ref[call].data(),
                              lse_ref[call].data());
  }

  DecodePlan plan = plan_decode(batch, regions_of(cache, c.host_pages), c.hkv, num_sms(), c.tiles_per_chunk, 0,
                                -1.0f, c.fuse, c.center_pairs > 0 ? center_max_chunk_tiles(c.page) : 0);
  DecodeWorkspace ws = alloc_decode_workspace(std::max(plan.num_chunks, 1), batch, hq, c.d);
  std::vector<DeviceBuffer<float>> d_q, d_o, d_lse;
  for (int call = 0; call < calls; ++call) {
    d_q.emplace_back(q[call]);
    d_o.emplace_back(nq);
    d_lse.emplace_back(size_t(batch) * hq);
    d_o.back().poison();
    d_lse.back().poison();
  }
  OSCAR_CUDA_CHECK(upload_plan(plan, ws, nullptr));
  Result r{0.0, 0.0, plan.fused_windows};
  for (int call = 0; call < calls; ++call) {
    DecodeParams p = params_for(cache, d_q[call].ptr, hq, sm_scale, d_o[call].ptr, d_lse[call].ptr);
    p.variant = variant;
    p.pdl = pdl;
    if (call == 0) EXPECT_EQ(check_decode(p, plan, ws), "");
    OSCAR_CUDA_CHECK(bf16_kernel ? decode_attention_bf16(p, plan, ws, nullptr)
                                 : decode_attention(p, plan, ws, nullptr));
  }
  OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
  for (int call = 0; call < calls; ++call) {
    const std::vector<float> o = d_o[call].download(), lse = d_lse[call].download();
    r.err_o = std::max(r.err_o, test::rel_l2(o, o_ref[call]));  // inf if any output is not finite
    for (size_t i = 0; i < lse.size(); ++i) {
      if (std::isinf(lse_ref[call][i]) && lse_ref[call][i] < 0) {  // empty sequence
        if (!(std::isinf(lse[i]) && lse[i] < 0)) r.err_lse = INFINITY;
        continue;
      }
      const double e = std::isfinite(lse[i]) ? std::fabs(double(lse[i]) - lse_ref[call][i]) : INFINITY;
      r.err_lse = std::max(r.err_lse, e);
    }
  }
  free_decode_workspace(ws);
  std::printf("  [%s] d=%d G=%d gqa=%d hkv=%d page=%d variant=%d pdl=%d calls=%d chunks=%d (quant %d): "
              "rel_l2(o)=%.2e max|dlse|=%.2e\n",
              c.name, c.d, c.group, c.gqa, c.hkv, c.page, variant, pdl, calls, plan.num_chunks,
              plan.num_quant_chunks, r.err_o, r.err_lse);
  return r;
}

double tol_for(const Case& c) {
  bool any_bf16 = false;
  for (const auto& s : c.seqs) any_bf16 = any_bf16 || s.sink > 0 || s.recent > 0;
  return any_bf16 ? 1e-2 : 3e-3;
}

void expect_ok(const Case& c, uint32_t seed, bool bf16_kernel = false, int variant = 0, int pdl = 1,
               int calls = 1) {
  const Result r = run_case(c, seed, bf16_kernel, variant, pdl, calls);
  if (c.fuse > 0) EXPECT_TRUE(r.fused) << c.name << ": the plan does not fuse";
  EXPECT_LE(r.err_o, tol_for(c)) << c.name;  // NaN compares false -> fails
  EXPECT_LE(r.err_lse, 2e-2) << c.name;
}

// A mix of shapes that hits odd lengths, page boundaries, an empty middle,
// windows longer than the sequence, an empty sequence and a long middle.
std::vector<SeqLens> mixed_seqs(int page) {
  return {
      {64, 1000, 300},            // odd middle, recent not page aligned
      {17, 0, 0},                 // sequence shorter than the sink window
      {64, 0, 200},               // empty middle
      {64, 5 * page, 256},        // page-aligned middle
      {0, 0, 0},                  // empty sequence: o = 0, lse = -inf
      {64, 4096 + 33, 256 + 15},  // long middle, ragged ends
  };
}

TEST(CudaDecode, MixedRegionsDefaultShape) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  for (uint32_t seed : {1u, 2u})
    expect_ok({128, 128, 4, 8, 64, mixed_seqs(64), 0, "qwen3-8b shape"}, seed);
}

// The fused window + merge kernel (v27) on the same shapes, forced where the
// planner would not choose it: every head dim, GQA and loop variant, forced
// chunking (many middle chunks to merge), plain launches, repeated calls.
// Page centering: every middle page's logits shift by q̃·δ (kernels/paged_kv.h); each GPU middle
// CTA makes its pages' shifts from the query's coefficients (stage_page_bias) and adds them in
// its loop, the CPU reference adds δ to the rows (shifts of a few logits: a GPU path that dropped
// them, or took a neighbouring page's, would fail). Every loop the centred dispatch takes (the
// int8 ring with group copies, the fp16 ring, the register-prefetch loop), the planner's chunks
// and forced ones (steps and chunks that cross pages: pages of 16 and 32 tokens), fused windows,
// GQA 1 to 6, and chunks at the bound of the pages a CTA stages (240 pages of 16 tokens). A plan
// whose chunks may pass that bound, a workspace without the coefficient rows, or a view without
// its angle table, is refused. The angle rows either one per page-table slot or through
// MidCenter::angle_start (rows out of order, NaN rows between).
TEST(CudaDecode, PageCenteredMiddle) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  for (int d : {64, 128})
    for (int gqa : {1, 4, 6}) {
      Case c{d, d == 64 ? 64 : 128, gqa, 2, 64, mixed_seqs(64), 0, "page centering"};
      c.center_pairs = 3 + gqa;
      c.center_start = gqa != 4;
      for (int variant : {0, 1}) expect_ok(c, 71 + gqa, false, variant);
    }
  for (int page : {16, 32, 128})
    for (int tiles : {0, 4, 12}) {
      Case c{128, 128, 4, 2, page, mixed_seqs(page), tiles, "page centering, pages / chunks"};
      c.center_pairs = 7;
      c.center_start = tiles == 4;
      for (int variant : {0, 1}) expect_ok(c, 300 + page + tiles, false, variant);
    }
  {
    Case c{128, 128, 4, 8, 64, mixed_seqs(64), 0, "page centering, fused windows"};
    c.center_pairs = 11;
    c.center_start = true;
    c.fuse = 1;
    expect_ok(c, 77);
    c.gqa = 6;
    c.fuse = -1;
    c.tiles_per_chunk = 8;
    expect_ok(c, 78, false, 0, 1, 3);  // three calls on one plan and workspace
  }
  // Refusals.
  HostCache cache({{64, 1000, 300}}, 2, 128, 64, 128, 5);
  cache.add_center(4, 9);
  DeviceBuffer<float> q(8 * 128), o(8 * 128);
  DecodeParams p = params_for(cache, q.ptr, 8, 0.1f, o.ptr, nullptr);
  const DecodePlan plan = plan_decode(1, regions_of(cache), 2, num_sms());
  DecodeWorkspace ws = alloc_decode_workspace(64, 1, 8, 128);
  EXPECT_EQ(check_decode(p, plan, ws), "");
  // One chunk of the whole middle (1000 tokens in pages of 64: 16 pages, within the bound) is
  // accepted; a middle of 16,400 tokens in one chunk (257+ pages) is not, unless the plan is
  // cut at center_max_chunk_tiles.
  EXPECT_EQ(check_decode(p, plan_decode(1, regions_of(cache), 2, num_sms(), 1 << 16), ws), "");
  HostCache longer({{64, 16400, 300}}, 2, 128, 64, 128, 5);
  longer.add_center(4, 9);
  DecodeParams pl = params_for(longer, q.ptr, 8, 0.1f, o.ptr, nullptr);
  EXPECT_NE(check_decode(pl, plan_decode(1, regions_of(longer), 2, num_sms(), 1 << 16), ws).find("max_mid_chunk_tiles"),
            std::string::npos);
  const DecodePlan cut = plan_decode(1, regions_of(longer), 2, num_sms(), 1 << 16, 0, -1.0f, -1, center_max_chunk_tiles(64));
  EXPECT_LE(cut.max_mid_chunk_tiles, center_max_chunk_tiles(64));
  EXPECT_EQ(check_decode(pl, cut, ws), "");
  DecodeWorkspace none = ws;
  none.center_coef = nullptr;
  EXPECT_NE(check_decode(p, plan, none).find("coefficient rows"), std::string::npos);
  p.kv.center.angles = nullptr;
  EXPECT_NE(check_decode(p, plan, ws).find("angle table"), std::string::npos);
  free_decode_workspace(ws);
}

TEST(CudaDecode, FusedWindowsAndMerge) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  uint32_t seed = 900;
  for (uint32_t s : {1u, 2u}) {
    Case c{128, 128, 4, 8, 64, mixed_seqs(64), 0, "fused qwen3-8b shape"};
    c.fuse = 1;
    expect_ok(c, seed + s);
  }
  for (int variant : {1, 2, 3, 4}) {
    Case c{128, 128, 4, 2, 16, mixed_seqs(16), 0, "fused, loop variant"};
    c.fuse = 1;
    expect_ok(c, ++seed, false, variant);
  }
  {
    Case c{128, 128, 4, 2, 64, mixed_seqs(64), 8, "fused, 8-tile chunks"};  // middles of <= 32 chunks
    c.fuse = 1;
    c.seqs = {{64, 4000, 300}, {17, 0, 0}, {0, 0, 0}, {5, 33, 0}, {0, 2048, 1}};
    expect_ok(c, ++seed);
    expect_ok(c, ++seed, false, 0, /*pdl=*/0, /*calls=*/3);
  }
#if !defined(OSCAR_CUDA_MIN_INSTANCES)
  for (int d : {64, 256})
    for (int gqa : {1, 3, 8}) {
      Case c{d, 64, gqa, 2, 16, {{64, 777, 130}, {16, 48, 0}, {5, 0, 0}}, 0, "fused, other head dims"};
      c.fuse = 1;
      expect_ok(c, ++seed);
    }
#endif
}

TEST(CudaDecode, PrefetchLoopVariant) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  expect_ok({128, 128, 4, 8, 64, mixed_seqs(64), 0, "variant 1"}, 21, false, 1);
  expect_ok({128, 128, 4, 2, 16, mixed_seqs(16), 3, "variant 1 small chunks"}, 22, false, 1);
}

// The d128/G128 loop shapes side by side: 2 = fp16 tensor cores for K and V
// (v7), 3 = int8 tensor cores for K (v10, the default for GQA <= 4; GQA 8
// falls back to 2). Every GQA the int8 loop serves, middle-only (tight
// tolerance) and mixed; plain launches (pdl 0) as well as PDL.
TEST(CudaDecode, LoopVariantsD128) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  uint32_t seed = 300;
  for (int variant : {0, 2, 3, 4}) {
    for (int gqa : {1, 2, 3, 4, 8}) {
      const std::string name = "variant " + std::to_string(variant) + " gqa " + std::to_string(gqa);
      expect_ok({128, 128, gqa, 2, 64, {{0, 2001, 0}, {0, 16, 0}, {0, 1, 0}, {0, 64 * 9, 0}}, 0, name.c_str()},
                ++seed, false, variant);
      expect_ok({128, 128, gqa, 2, 16, mixed_seqs(16), 2, name.c_str()}, ++seed, false, variant);
    }
    expect_ok({128, 128, 4, 8, 64, mixed_seqs(64), 0, "no pdl"}, ++seed, false, variant, /*pdl=*/0);
    // Page 64 with chunks of 3 tiles (groups straddle pages: per-tile page
    // lookups) and of 8 tiles (page-aligned groups: one lookup per group).
    expect_ok({128, 128, 4, 2, 64, mixed_seqs(64), 3, "page 64, 3-tile chunks"}, ++seed, false, variant);
    expect_ok({128, 128, 4, 2, 64, mixed_seqs(64), 8, "page 64, 8-tile chunks"}, ++seed, false, variant);
  }
  // The default (0) copies whole 4-tile groups where the plan's middle
  // chunks start at multiples of 4 tiles and the page size is a multiple of
  // 64 (v34): page 128 (two groups per page), forced 4- and 12-tile chunks
  // (aligned) against 6 tiles (not: per-tile copies), middles ending inside
  // a group and a page.
  // Each with the plan's first pages (v44, the default) and without.
  for (int page : {64, 128})
    for (int per : {0, 4, 6, 12})
      for (bool host_pages : {true, false}) {
        const std::string name = "groups page " + std::to_string(page) + " chunks " + std::to_string(per) +
                                 (host_pages ? " first pages" : " looked up");
        expect_ok({128, 128, 4, 2, page, {{0, 2001, 0}, {0, 16, 0}, {0, 64 * 9 + 17, 0}, {0, 48, 0}}, per,
                   name.c_str(), -1, host_pages},
                  ++seed);
        expect_ok({128, 128, 3, 2, page, mixed_seqs(page), per, name.c_str(), -1, host_pages}, ++seed);
      }
}

// A corrupt quantized row (a NaN scale of a VALID middle token) or a NaN in
// a query reaches the output as it reaches the reference's: NaN exactly where
// the reference has NaN (a key scale: every output and the lse of the KV
// head's query heads in that sequence; a value scale: the channels of its
// group; a query: that head), every other output within the usual tolerance.
// Tokens in a full tile (unmasked code) and in a chunk's partial last tile, in
// a middle-only sequence and in one with BF16 windows (the fused window +
// merge). Before v43b a NaN key scale gave finite outputs in every loop
// variant (the chunk epilogues and merges took L > 0 for "not empty", and a
// NaN L is not) and a NaN value scale did in the int8 K+V loop (its value
// bound used fmaxf, which drops NaN).
TEST(CudaDecode, NanInputsReachTheOutput) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  struct Shape {
    int d, group, gqa, variant;
  };
  const Shape shapes[] = {{128, 128, 4, 0}, {128, 128, 4, 1}, {128, 128, 4, 2}, {128, 128, 4, 3},
                          {128, 128, 4, 4}, {128, 128, 8, 0}, {64, 64, 4, 0},   {128, 32, 2, 0}};
  const int hkv = 2, page = 64, h = 1;
  const std::vector<SeqLens> seqs = {{0, 64 * 9 + 17, 0}, {16, 700, 40}};
  enum Kind { kValueScale, kKeyScale, kQuery };
  uint32_t seed = 900;
  size_t runs = 0;
  for (const Shape& sh : shapes)
    for (Kind kind : {kValueScale, kKeyScale, kQuery})
      for (int b : {0, 1})
        for (bool last : {false, true}) {  // token 300 (a full tile) or the middle's last (a partial tile)
          if (kind == kQuery && last) continue;
          ++seed;
          HostCache cache(seqs, hkv, sh.d, page, sh.group, seed, 1.5f);
          const int hq = hkv * sh.gqa, batch = cache.batch;
          std::mt19937 rng(seed);
          std::normal_distribution<float> nd(0.0f, 1.0f);
          std::vector<float> q(size_t(batch) * hq * sh.d);
          for (auto& x : q) x = nd(rng);
          const int ng = sh.d / sh.group, gm = ng - 1;
          if (kind == kQuery) {
            q[(size_t(b) * hq + h * sh.gqa) * sh.d + 5] = NAN;
          } else {
            const int tok = last ? seqs[b].mid - 1 : 300;
            const int32_t id = cache.indices[1][cache.indptr[1][b] + tok / page];
            const size_t row = (size_t(id) * hkv + h) * page + tok % page;
            std::vector<uint16_t>& params = kind == kKeyScale ? cache.k_params : cache.v_params;
            params[(row * ng + gm) * 2] = 0x7e00;  // fp16 NaN scale
            (kind == kKeyScale ? cache.d_k_params : cache.d_v_params) = DeviceBuffer<uint16_t>(params);
            cache.dev_view.quant = {cache.d_k_codes.ptr, cache.d_v_codes.ptr, cache.d_k_params.ptr,
                                    cache.d_v_params.ptr};
          }
          const float sm_scale = 1.0f / std::sqrt(float(sh.d));
          std::vector<float> o_ref(q.size()), lse_ref(size_t(batch) * hq);
          cpu::decode_attention_ref(cache.host_view, q.data(), hq, sm_scale, o_ref.data(), lse_ref.data());

          DecodePlan plan = plan_decode(batch, regions_of(cache), hkv, num_sms(), 0, 0, -1.0f, -1);
          DecodeWorkspace ws = alloc_decode_workspace(std::max(plan.num_chunks, 1), batch, hq, sh.d);
          DeviceBuffer<float> d_q(q), d_o(q.size()), d_lse(lse_ref.size());
          DecodeParams p = params_for(cache, d_q.ptr, hq, sm_scale, d_o.ptr, d_lse.ptr);
          p.variant = sh.variant;
          ASSERT_EQ(check_decode(p, plan, ws), "");
          OSCAR_CUDA_CHECK(upload_plan(plan, ws, nullptr));
          d_o.poison();
          d_lse.poison();
          OSCAR_CUDA_CHECK(decode_attention(p, plan, ws, nullptr));
          OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
          free_decode_workspace(ws);
          const std::vector<float> o = d_o.download(), lse = d_lse.download();

          size_t nan_ref = 0, nan_out = 0, mismatch = 0, lse_mismatch = 0;
          double num = 0.0, den = 0.0;
          for (size_t i = 0; i < o.size(); ++i) {
            const bool rn = std::isnan(o_ref[i]);
            nan_ref += rn;
            nan_out += std::isnan(o[i]);
            if (rn != std::isnan(o[i]) || (!rn && !std::isfinite(o[i]))) {
              ++mismatch;
            } else if (!rn) {
              num += (double(o[i]) - o_ref[i]) * (double(o[i]) - o_ref[i]);
              den += double(o_ref[i]) * o_ref[i];
            }
          }
          for (size_t i = 0; i < lse.size(); ++i) {
            const bool rn = std::isnan(lse_ref[i]);
            if (rn != std::isnan(lse[i]) || (!rn && !(std::fabs(double(lse[i]) - lse_ref[i]) <= 2e-2)))
              ++lse_mismatch;
          }
          const size_t expect_nan = kind == kQuery      ? size_t(sh.d)
                                    : kind == kKeyScale ? size_t(sh.gqa) * sh.d
                                                        : size_t(sh.gqa) * sh.group;
          const double err = den > 0 ? std::sqrt(num / den) : INFINITY;
          const char* what = kind == kQuery ? "query" : kind == kKeyScale ? "K scale" : "V scale";
          std::printf("  [NaN %s] d=%d G=%d gqa=%d variant=%d seq %d%s: NaN outputs %zu (reference %zu), "
                      "mismatches %zu, lse mismatches %zu, rel_l2(rest)=%.2e\n",
                      what, sh.d, sh.group, sh.gqa, sh.variant, b, last ? " last token" : "", nan_out, nan_ref,
                      mismatch, lse_mismatch, err);
          EXPECT_EQ(nan_ref, expect_nan) << what << ": the reference does not see the NaN";
          EXPECT_EQ(mismatch, 0u) << what << ": NaN where the reference has none, or none where it has";
          EXPECT_EQ(lse_mismatch, 0u) << what;
          EXPECT_LE(err, 1e-2) << what;
          ++runs;
        }
  EXPECT_EQ(runs, std::size(shapes) * 10);
}

// One plan and workspace for several calls in a row, as for the layers of a
// step (outputs poisoned before each call), with and without PDL, and a plan
// whose small chunks give the merge many partials per sequence.
TEST(CudaDecode, RepeatedCallsOnePlan) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  uint32_t seed = 500;
  for (int pdl : {1, 0}) {
    expect_ok({128, 128, 4, 8, 64, mixed_seqs(64), 0, "6 calls"}, ++seed, false, 0, pdl, /*calls=*/6);
    expect_ok({128, 128, 2, 4, 16, {{0, 30000, 0}, {16, 20011, 48}}, 16, "long middles, 16-tile chunks"}, ++seed,
              false, 0, pdl, 3);
  }
}

// A plan that does not match its workspace or is inconsistent is refused
// before anything is read or copied. With a GPU the workspace is real and the
// unedited plan must upload (so the refusals are the checks, not a failing
// copy); without one only the host checks run.
TEST(CudaDecode, UploadPlanRejectsBadPlans) {
  std::vector<int32_t> s(2, 64), m(2, 40000), r(2, 256);
  const PackedRegions packed(s, m, r);
  const DecodePlan good = plan_decode(2, packed.get(), 8, 132, 0);
  ASSERT_GT(good.num_chunks, 2);
  const bool gpu = test::have_gpu();
  DecodeWorkspace ws;
  if (gpu) {
    ws = alloc_decode_workspace(good.num_chunks, 2, 32, 128);
    EXPECT_EQ(upload_plan(good, ws, nullptr), cudaSuccess);
  } else {
    ws.capacity = good.num_chunks;
    ws.max_batch = 2;
  }
  auto bad = [&](auto edit) {
    DecodePlan p = good;
    edit(p);
    return upload_plan(p, ws, nullptr);
  };
  EXPECT_EQ(bad([](DecodePlan& p) { p.order.pop_back(); }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([](DecodePlan& p) { p.order[0] = p.num_chunks; }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([](DecodePlan& p) { p.order[1] = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([](DecodePlan& p) { p.chunks[1] = 3; }), cudaErrorInvalidValue);       // region
  EXPECT_EQ(bad([](DecodePlan& p) { p.chunks[0] = 2; }), cudaErrorInvalidValue);       // sequence
  EXPECT_EQ(bad([](DecodePlan& p) { p.chunks[3] = p.chunks[2] - 1; }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([](DecodePlan& p) { p.chunks.resize(p.chunks.size() - 1); }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([](DecodePlan& p) { p.seq_chunk_ptr.pop_back(); }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([](DecodePlan& p) { p.regions.pop_back(); }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([](DecodePlan& p) { p.regions[2] = -1; }), cudaErrorInvalidValue);   // page-table offset
  EXPECT_EQ(bad([](DecodePlan& p) { p.regions[3] -= 17; }), cudaErrorInvalidValue);  // middle shorter than its chunks
  // The fused window chunk of sequence 0 (the plan fuses: short windows).
  ASSERT_TRUE(good.fused_windows);
  const int w0 = good.seq_chunk_ptr[1] - 1;
  ASSERT_EQ(good.chunks[4 * w0 + 1], 3);
  EXPECT_EQ(bad([&](DecodePlan& p) { p.chunks[4 * w0 + 3] += 1; }), cudaErrorInvalidValue);  // a chunk of sequence 1
  EXPECT_EQ(bad([&](DecodePlan& p) { p.chunks[4 * w0 + 2] = -1; }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([&](DecodePlan& p) { p.fused_windows = false; }), cudaErrorInvalidValue);
  EXPECT_EQ(bad([&](DecodePlan& p) { ++p.num_quant_chunks; }), cudaErrorInvalidValue);  // a window chunk in the middle launch
  EXPECT_EQ(bad([&](DecodePlan& p) { p.chunks[4 * w0 + 1] = 2; }), cudaErrorInvalidValue);  // recent: its tiles run past the window
  EXPECT_EQ(bad([&](DecodePlan& p) { p.batch = 3; }), cudaErrorInvalidValue);          // > max_batch
  EXPECT_EQ(bad([&](DecodePlan& p) { p.order[1] = p.order[0]; }), cudaErrorInvalidValue);  // not a permutation
  // Whole-group copies (v34) read 64 rows from each group's first tile: a
  // plan that claims aligned middle chunks must have them.
  ASSERT_TRUE(good.mid_groups_aligned);
  int m1 = -1;
  for (int k = 0; k < good.num_chunks && m1 < 0; ++k)
    if (good.chunks[4 * k + 1] == 1 && good.chunks[4 * k + 2] > 0) m1 = k;
  ASSERT_GE(m1, 0);
  EXPECT_EQ(bad([&](DecodePlan& p) { p.chunks[4 * m1 + 2] += 2; }), cudaErrorInvalidValue);
  if (gpu)
    EXPECT_EQ(bad([&](DecodePlan& p) {
                p.chunks[4 * m1 + 2] += 2;
                p.mid_groups_aligned = false;
              }),
              cudaSuccess);
  // First pages (v44): one per warp and chunk, none below -1, and a
  // workspace to hold them.
  {
    std::vector<int32_t> ids(size_t(packed.indptr[1].back()));
    std::iota(ids.begin(), ids.end(), 0);
    HostRegions hp = packed.get();
    hp.mid_indices = ids.data();
    hp.page_size = 64;
    const DecodePlan with = plan_decode(2, hp, 8, 132, 0);
    ASSERT_EQ(with.first_pages.size(), 4 * size_t(with.num_chunks));
    DecodePlan p = with;
    p.first_pages.pop_back();
    EXPECT_EQ(upload_plan(p, ws, nullptr), cudaErrorInvalidValue);
    p = with;
    p.first_pages[1] = -2;
    EXPECT_EQ(upload_plan(p, ws, nullptr), cudaErrorInvalidValue);
    DecodeWorkspace no_pages = ws;
    no_pages.first_pages = nullptr;
    EXPECT_EQ(upload_plan(with, no_pages, nullptr), cudaErrorInvalidValue);
    if (gpu) EXPECT_EQ(upload_plan(with, ws, nullptr), cudaSuccess);
  }
  // A plan needs every region's lengths and page-table offsets.
  HostRegions missing = packed.get();
  missing.indptr[1] = nullptr;
  EXPECT_THROW(plan_decode(2, missing, 8, 132, 0), Error);
  ws.capacity = good.num_chunks - 1;
  EXPECT_EQ(upload_plan(good, ws, nullptr), cudaErrorInvalidValue);
  ws.capacity = good.num_chunks;
  if (gpu) free_decode_workspace(ws);
}

TEST(CudaDecode, MiddleOnly) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  expect_ok({128, 128, 4, 2, 64, {{0, 3001, 0}, {0, 16, 0}, {0, 1, 0}}, 0, "int2 only"}, 3);
}

TEST(CudaDecode, SplitMergeSmallChunks) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  for (int tpc : {1, 3, 8})
    expect_ok({128, 128, 4, 2, 32, mixed_seqs(32), tpc, "forced chunking"}, 10 + tpc);
}

TEST(CudaDecode, AllHeadDimsGroupsGqa) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
#if defined(OSCAR_CUDA_MIN_INSTANCES)
  GTEST_SKIP() << "OSCAR_CUDA_INSTANCES=min";
#else
  const std::vector<SeqLens> seqs = {{64, 777, 130}, {16, 48, 0}, {5, 0, 0}};
  uint32_t seed = 100;
  for (int d : {64, 128, 256})
    for (int group : {32, 64, 128}) {
      if (group > d) continue;
      for (int gqa : {1, 3, 8}) {
        for (int page : {16, 64}) {
          const std::string name = "d" + std::to_string(d) + " G" + std::to_string(group);
          expect_ok({d, group, gqa, 2, page, seqs, 0, name.c_str()}, ++seed);
        }
      }
    }
#endif
}

TEST(CudaDecode, Bf16OnlyBaseline) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  expect_ok({128, 128, 4, 8, 64, {{2048 + 7, 0, 0}, {100, 0, 0}, {0, 0, 0}}, 0, "bf16 baseline"}, 7,
            /*bf16_kernel=*/true);
  expect_ok({128, 128, 8, 1, 16, {{333, 0, 0}}, 2, "bf16 baseline gqa8"}, 8, true);
}

// The split schedule (host code): every region covered once, in order, by
// chunks of its own sequence; the middle of a sequence in chunks of one size
// (whole 16-tile steps) with a last chunk short by less than 16 tiles per
// chunk (not a remainder of arbitrary size), so that a wave's CTAs end together.
// Windows of at most 64 tiles: one fused window chunk per sequence (region 3)
// after its middle chunks, naming exactly them; longer ones: sink and recent
// chunks.
TEST(CudaDecode, PlanSplitsRegionsEvenly) {
  std::mt19937 rng(11);
  int fused_plans = 0;
  for (int fuse : {-1, 1})  // the planner's choice; fused wherever the kernel can
  for (int recent : {256, 1100})
  for (int batch : {1, 8, 32, 64}) {
    std::vector<int32_t> s(batch), m(batch), r(batch);
    for (int b = 0; b < batch; ++b) {
      s[b] = std::min<int>(64, rng() % 100);
      m[b] = b % 5 == 0 ? 0 : int(rng() % 40000);
      r[b] = recent + int(rng() % 64);
    }
    const PackedRegions packed(s, m, r);
    const DecodePlan plan = plan_decode(batch, packed.get(), 8, 132, 0, 0, -1.0f, fuse);
    ASSERT_EQ(int(plan.seq_chunk_ptr.size()), batch + 1);
    // Whole 16-tile steps: every middle chunk starts at a multiple of 4 tiles
    // (the INT2 ring's whole-group copies, v34).
    EXPECT_TRUE(plan.mid_groups_aligned);
    if (recent != 256) EXPECT_FALSE(plan.fused_windows);  // windows over 64 tiles
    fused_plans += plan.fused_windows;
    auto window_tiles = [&](int id) {
      const int* ch = &plan.chunks[4 * id];
      return ch[1] == 3 ? (s[ch[0]] + 15) / 16 + (r[ch[0]] + 15) / 16 : ch[3] - ch[2];
    };
    // The launch order: every chunk once, the middle ones first, the window
    // ones longest first.
    ASSERT_EQ(int(plan.order.size()), plan.num_chunks);
    std::vector<int> seen(plan.num_chunks, 0);
    for (int i = 0; i < plan.num_chunks; ++i) {
      const int id = plan.order[i];
      ASSERT_TRUE(id >= 0 && id < plan.num_chunks);
      ++seen[id];
      EXPECT_EQ(plan.chunks[4 * id + 1] == 1, i < plan.num_quant_chunks);
      if (i > plan.num_quant_chunks) EXPECT_GE(window_tiles(plan.order[i - 1]), window_tiles(id));
    }
    for (int c = 0; c < plan.num_chunks; ++c) EXPECT_EQ(seen[c], 1);
    // Each sequence's page-table offset and length per region, as given.
    ASSERT_EQ(plan.regions.size(), size_t(batch) * 6);
    for (int b = 0; b < batch; ++b)
      for (int k = 0; k < 3; ++k) {
        EXPECT_EQ(plan.regions[6 * b + 2 * k], packed.indptr[k][b]);
        EXPECT_EQ(plan.regions[6 * b + 2 * k + 1], packed.len[k][b]);
      }
    for (int b = 0; b < batch; ++b) {
      int next[3] = {0, 0, 0};
      std::vector<int> mid_sizes;
      int fused = 0;
      for (int c = plan.seq_chunk_ptr[b]; c < plan.seq_chunk_ptr[b + 1]; ++c) {
        const int* ch = &plan.chunks[4 * c];
        ASSERT_EQ(ch[0], b);
        const int reg = ch[1];
        if (reg == 3) {
          // The last chunk of b; its range: all of b's middle chunks.
          EXPECT_EQ(c, plan.seq_chunk_ptr[b + 1] - 1);
          EXPECT_EQ(ch[2], plan.seq_chunk_ptr[b]);
          EXPECT_EQ(ch[3], c);
          next[0] = (s[b] + 15) / 16;
          next[2] = (r[b] + 15) / 16;
          ++fused;
          continue;
        }
        EXPECT_EQ(ch[2], next[reg]) << "batch " << batch << " seq " << b << " region " << reg;
        EXPECT_GT(ch[3], ch[2]);
        next[reg] = ch[3];
        if (reg == 1) mid_sizes.push_back(ch[3] - ch[2]);
      }
      EXPECT_EQ(fused, plan.fused_windows ? 1 : 0);
      const int len[3] = {s[b], m[b], r[b]};
      for (int reg = 0; reg < 3; ++reg) EXPECT_EQ(next[reg], (len[reg] + 15) / 16);
      const int n = int(mid_sizes.size());
      for (int i = 0; i + 1 < n; ++i) {
        EXPECT_EQ(mid_sizes[i], mid_sizes[0]) << "batch " << batch << " seq " << b;
        EXPECT_EQ(mid_sizes[i] % 16, 0);
      }
      if (n > 1) EXPECT_GT(mid_sizes[n - 1], mid_sizes[0] - 16 * n) << "batch " << batch << " seq " << b;
    }
  }
  EXPECT_GE(fused_plans, 3);  // the fused layout was walked above
  // Equal sequences: the middle fills one wave of 4 CTAs per SM (132 SMs,
  // 8 KV heads) without spilling into a second one, and at least 90% of it
  // (batch >= 8; at batch 1 x 32K chunks of one 16-tile step per warp are the
  // floor: 43 chunks, 344 CTAs).
  for (int batch : {8, 32, 64})
    for (int ctx : {32768, 131072}) {
      std::vector<int32_t> s(batch, 64), m(batch, ctx - 320), r(batch, 256);
      const PackedRegions packed(s, m, r);
      const DecodePlan plan = plan_decode(batch, packed.get(), 8, 132, 0);
      const int ctas = plan.num_quant_chunks * 8;
      if (batch * 8 <= 528) {
        EXPECT_LE(ctas, 528) << batch << " x " << ctx;
        EXPECT_GE(ctas, 475) << batch << " x " << ctx;
      }
      // Middle chunks launched chunk index first: position p holds chunk
      // p / batch of sequence p % batch (equal sequences).
      for (int p = 0; p < plan.num_quant_chunks; ++p) {
        const int* ch = &plan.chunks[4 * plan.order[p]];
        EXPECT_EQ(ch[0], p % batch) << batch << " x " << ctx << " position " << p;
        EXPECT_EQ(plan.order[p] - plan.seq_chunk_ptr[ch[0]], p / batch);
      }
    }
}

// Whole-group copies (v34) are chosen from DecodePlan::mid_groups_aligned:
// set exactly when every middle chunk starts at a multiple of 4 tiles (the
// GPU cases of LoopVariantsD128 take the group path for chunks of 4 and 12
// tiles and the automatic split, the per-tile path for 6).
TEST(CudaDecode, PlanMarksGroupAlignedMiddles) {
  std::vector<int32_t> s = {0, 0, 0, 0}, m = {2001, 16, 64 * 9 + 17, 48}, r = {0, 0, 0, 0};
  const PackedRegions packed(s, m, r);
  for (int per : {0, 4, 6, 8, 12, 16, 3}) {
    const DecodePlan plan = plan_decode(4, packed.get(), 2, 132, per);
    bool aligned = true;
    for (int i = 0; i < plan.num_quant_chunks; ++i) aligned &= plan.chunks[4 * plan.order[i] + 2] % 4 == 0;
    EXPECT_EQ(plan.mid_groups_aligned, aligned) << "chunks of " << per;
    EXPECT_EQ(plan.mid_groups_aligned, per % 4 == 0) << "chunks of " << per;
  }
}

// v44: with the host page table the plan records the page of each middle
// warp's first 4-tile group (tile t0 + 4 w), -1 past the chunk's end and for
// window chunks; without it, nothing; a page size that is not a positive
// multiple of 16 is refused.
TEST(CudaDecode, PlanRecordsFirstPages) {
  const std::vector<int32_t> s = {64, 0, 0, 16}, m = {2001, 16, 64 * 9 + 17, 300}, r = {256, 0, 40, 3};
  std::mt19937 rng(7);
  for (int page : {16, 64, 128}) {
    std::vector<int32_t> len[3] = {s, m, r}, indptr[3];
    for (int k = 0; k < 3; ++k) {
      indptr[k].push_back(0);
      for (int32_t n : len[k]) indptr[k].push_back(indptr[k].back() + (n + page - 1) / page);
    }
    std::vector<int32_t> ids(size_t(indptr[1].back()));
    std::iota(ids.begin(), ids.end(), 100);
    std::shuffle(ids.begin(), ids.end(), rng);
    HostRegions hr = host_regions(len, indptr);
    EXPECT_TRUE(plan_decode(4, hr, 2, 132, 0).first_pages.empty());
    hr.mid_indices = ids.data();
    hr.page_size = page;
    for (int per : {0, 3, 6, 12}) {
      const DecodePlan plan = plan_decode(4, hr, 2, 132, per);
      ASSERT_EQ(plan.first_pages.size(), 4 * size_t(plan.num_chunks));
      EXPECT_EQ(plan.first_pages_page_size, page);
      int set = 0, unset_mid = 0;
      for (int id = 0; id < plan.num_chunks; ++id) {
        const int32_t* c = &plan.chunks[4 * id];
        for (int w = 0; w < 4; ++w) {
          const int t = c[2] + 4 * w;
          const int32_t want = c[1] == 1 && t < c[3] ? ids[size_t(indptr[1][c[0]] + t / (page / 16))] : -1;
          EXPECT_EQ(plan.first_pages[4 * id + w], want) << "page " << page << " chunks " << per << " id " << id;
          set += want >= 0;
          unset_mid += c[1] == 1 && want < 0;
        }
      }
      EXPECT_GT(set, 0);
      if (per == 3 || per == 6) EXPECT_GT(unset_mid, 0);  // chunks shorter than 4 warps' groups
    }
    for (int bad_page : {0, 24, -16}) {
      hr.page_size = bad_page;
      EXPECT_THROW(plan_decode(4, hr, 2, 132, 0), Error) << bad_page;
    }
  }
}

// Fused windows (v27) where a window's tiles, one after another per warp, do
// not outlast the middle: 8 x 16K and up at these windows (20 tiles), not at
// batch 1 (short chunks, or more than 32 of them), not for a sequence
// without a middle, not with forced chunking.
TEST(CudaDecode, PlanFusesShortWindows) {
  auto fused = [](int batch, int ctx, int sink, int recent, int tiles_per_chunk = 0) {
    std::vector<int32_t> s(batch, sink), m(batch, std::max(0, ctx - sink - recent)), r(batch, recent);
    const PackedRegions packed(s, m, r);
    return plan_decode(batch, packed.get(), 8, 132, tiles_per_chunk).fused_windows;
  };
  EXPECT_TRUE(fused(8, 32768, 64, 256));
  EXPECT_TRUE(fused(8, 16384, 64, 256));
  EXPECT_TRUE(fused(32, 4096, 64, 256));
  EXPECT_TRUE(fused(64, 131072, 64, 256));
  EXPECT_FALSE(fused(1, 4096, 64, 256));
  EXPECT_FALSE(fused(1, 131072, 64, 256));  // 64 middle chunks
  EXPECT_FALSE(fused(8, 32768, 64, 1024));  // 68 window tiles
  EXPECT_FALSE(fused(8, 300, 64, 256));     // windows only
  EXPECT_FALSE(fused(8, 32768, 64, 256, 16));
}

// rank_skew > 0 (v26, off by default): within a sequence, middle chunks
// launched in later dispatch rounds are no larger (beyond one 4-tile group of
// rounding) than earlier ones, all but the last end on a 4-tile group, and the
// sizes differ when the chunks span several rounds; the regions are still
// covered exactly (checked with the same walk as above).
TEST(CudaDecode, PlanRankSkew) {
  for (int batch : {1, 8, 32}) {
    std::vector<int32_t> s(batch, 64), m(batch, 32768 - 320), r(batch, 256);
    const PackedRegions packed(s, m, r);
    const DecodePlan flat = plan_decode(batch, packed.get(), 8, 132, 0, 0, 0.0f);
    const DecodePlan plan = plan_decode(batch, packed.get(), 8, 132, 0, 0, 0.1f);
    ASSERT_EQ(plan.num_quant_chunks, flat.num_quant_chunks);
    for (int b = 0; b < batch; ++b) {
      std::vector<int> sizes;
      int next = 0;
      for (int c = plan.seq_chunk_ptr[b]; c < plan.seq_chunk_ptr[b + 1]; ++c) {
        const int* ch = &plan.chunks[4 * c];
        if (ch[1] != 1) continue;  // windows
        EXPECT_EQ(ch[2], next);
        next = ch[3];
        sizes.push_back(ch[3] - ch[2]);
      }
      EXPECT_EQ(next, (m[b] + 15) / 16);
      const int n = int(sizes.size());
      for (int i = 0; i + 1 < n; ++i) {
        EXPECT_EQ(sizes[i] % 4, 0);
        EXPECT_LE(sizes[i + 1], sizes[i] + 4) << "batch " << batch << " seq " << b << " chunk " << i;
      }
      if (n >= 8) EXPECT_LT(sizes[n - 2], sizes[0]) << "batch " << batch << ": no skew";
    }
  }
}

// The step as served: decode with this step's write and demotions in its
// launch sequence (DecodeParams::write / demote: they run in the middle
// launch's tail, the window tiles holding the new rows wait for the write). The new rows are NaN on the
// device until the write lands, so reading one early cannot pass; the
// reference sees the written values.
TEST(CudaDecode, StepWriteSeesTheNewRows) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  const int hkv = 2, d = 128, page = 64, gqa = 4, hq = hkv * gqa;
  for (uint32_t seed : {61u, 62u, 63u}) {
    std::vector<SeqLens> seqs;
    // Seeds 61 and 62: batch 25 x 2 KV heads, past the write's small-batch
    // split, whose blocks write K and V together; seed 63: batch 5, K and V
    // rows in blocks of their own.
    const int nseq = seed == 63 ? 4 : 24;
    for (int b = 0; b < nseq; ++b) seqs.push_back({64, 1500 + 97 * b, 1 + (37 * b) % 300});
    seqs.push_back({17, 0, 0});  // the new token is the sink's last
    HostCache cache(seqs, hkv, d, page, 128, seed, 1.5f);
    const int batch = cache.batch;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<int32_t> pages(batch), slots(batch);
    std::vector<float> k(size_t(batch) * hkv * d), v(k.size()), q(size_t(batch) * hq * d);
    for (auto& x : k) x = 1.5f * nd(rng);
    for (auto& x : v) x = nd(rng);
    for (auto& x : q) x = nd(rng);
    // Seed 61: no rotation; 62: one R_K per layer; 63: R_K and R_V per KV
    // head. The reference holds the rows rotated on the CPU (the GPU's fp32
    // sums may round a few of them to the neighbouring bf16).
    const int r_heads = seed == 61 ? 0 : seed == 62 ? 1 : hkv;
    std::vector<float> Rk(size_t(std::max(r_heads, 1)) * d * d), Rv(Rk.size()), kr = k, vr = v;
    for (auto& x : Rk) x = nd(rng) / std::sqrt(float(d));
    for (auto& x : Rv) x = nd(rng) / std::sqrt(float(d));
    if (r_heads > 0) cpu::rotate_heads_ref(k.data(), batch, hkv, d, Rk.data(), r_heads, kr.data());
    if (r_heads > 1) cpu::rotate_heads_ref(v.data(), batch, hkv, d, Rv.data(), r_heads, vr.data());
    std::vector<uint16_t> dev_k = cache.bf16_k, dev_v = cache.bf16_v;
    for (int b = 0; b < batch; ++b) {
      const int reg = cache.len[2][b] > 0 ? 2 : 0, n = cache.len[reg][b];
      pages[b] = cache.indices[reg][cache.indptr[reg][b] + (n - 1) / page];
      slots[b] = (n - 1) % page;
      for (int h = 0; h < hkv; ++h) {
        const size_t row = (size_t(pages[b]) * hkv + h) * page + slots[b];
        for (int c = 0; c < d; ++c) {
          cache.bf16_k[row * d + c] = f32_to_bf16(kr[(size_t(b) * hkv + h) * d + c]);
          cache.bf16_v[row * d + c] = f32_to_bf16(vr[(size_t(b) * hkv + h) * d + c]);
          dev_k[row * d + c] = dev_v[row * d + c] = 0x7fc0;  // NaN until written
        }
      }
    }
    cache.d_bf16_k.upload(dev_k);
    cache.d_bf16_v.upload(dev_v);
    const float sm_scale = 1.0f / std::sqrt(float(d));
    std::vector<float> o_ref(q.size()), lse_ref(size_t(batch) * hq);
    cpu::decode_attention_ref(cache.host_view, q.data(), hq, sm_scale, o_ref.data(), lse_ref.data());

    // Seeds 61 and 63: separate window and merge launches; 62: the fused
    // window + merge kernel.
    DecodePlan plan = plan_decode(batch, regions_of(cache), hkv, num_sms(), 0, 0, -1.0f, seed == 62 ? 1 : 0);
    EXPECT_EQ(plan.fused_windows, seed == 62);
    DecodeWorkspace ws = alloc_decode_workspace(std::max(plan.num_chunks, 1), batch, hq, d);
    DeviceBuffer<float> d_q(q), d_k(k), d_v(v), d_o(q.size()), d_lse(lse_ref.size());
    DeviceBuffer<int32_t> d_pages(pages), d_slots(slots);
    DeviceBuffer<float> d_rk(Rk), d_rv(Rv);
    d_o.poison();
    DecodeParams p = params_for(cache, d_q.ptr, hq, sm_scale, d_o.ptr, d_lse.ptr);
    WriteRotation rot;
    if (r_heads > 0) rot = {d_rk.ptr, r_heads > 1 ? d_rv.ptr : nullptr, r_heads};
    p.write = StepWrite{batch, d_pages.ptr, d_slots.ptr, d_k.ptr, d_v.ptr, rot};
    // One new row per sequence, row b for sequence b: other counts are refused.
    p.write.n = batch - 1;
    EXPECT_NE(check_decode(p, plan, ws).find("one new row per sequence"), std::string::npos);
    EXPECT_EQ(decode_attention(p, plan, ws, nullptr), cudaErrorInvalidValue);
    p.write.n = batch;
    // And two page demotions in the same step (StepDemote): the sink pages
    // of sequences 0 and 1 (full, not written this step) into INT2 pages no
    // region uses; checked below against a standalone demote_pages.
    std::vector<char> used(cache.k_codes.size() / (size_t(hkv) * page * d / 4), 0);
    for (int32_t id : cache.indices[1]) used[id] = 1;
    std::vector<int32_t> spare;
    for (size_t id = 0; id < used.size(); ++id)
      if (!used[id]) spare.push_back(int32_t(id));
    ASSERT_GE(spare.size(), 3u);
    const std::vector<int32_t> dem_src = {cache.indices[0][cache.indptr[0][0]], cache.indices[0][cache.indptr[0][1]]};
    const std::vector<int32_t> dem_dst = {spare[0], spare[1]}, ref_dst = {spare[2]};
    DeviceBuffer<int32_t> d_dem_src(dem_src), d_dem_dst(dem_dst), d_ref_dst(ref_dst);
    p.demote = StepDemote{2, d_dem_src.ptr, d_dem_dst.ptr, {0.9f, 0.85f}, -1};
    EXPECT_EQ(check_decode(p, plan, ws), "");
    OSCAR_CUDA_CHECK(upload_plan(plan, ws, nullptr));
    // The window tiles wait for the write's published epoch (v40), not for
    // its grid: two calls, the new rows NaN again before each, so that a
    // tile read before its row is written (a missing wait, or an epoch left
    // from the first call) gives NaN. Such a race need not lose every time:
    // a pass is evidence, not proof.
    for (int call = 0; call < 2; ++call) {
      if (call > 0) {
        cache.d_bf16_k.upload(dev_k);
        cache.d_bf16_v.upload(dev_v);
        d_o.poison();
      }
      OSCAR_CUDA_CHECK(decode_attention(p, plan, ws, nullptr));
      OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
      const double err = test::rel_l2(d_o.download(), o_ref);  // +inf if any NaN
      std::printf("  [step write seed %u call %d] chunks=%d (quant %d): rel_l2(o)=%.2e\n", seed, call,
                  plan.num_chunks, plan.num_quant_chunks, err);
      EXPECT_LE(err, 1e-2);
    }
    // The demotion inside the step wrote what a standalone one writes.
    OSCAR_CUDA_CHECK(demote_pages(cache.dev_view, 1, d_dem_src.ptr, d_ref_dst.ptr, {0.9f, 0.85f}, -1, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> kc = cache.d_k_codes.download(), vc = cache.d_v_codes.download();
    const std::vector<uint16_t> kp = cache.d_k_params.download(), vp = cache.d_v_params.download();
    const size_t cpage = size_t(hkv) * page * d / 4, ppage = size_t(hkv) * page * 2;  // G = d: one group
    auto same = [&](const auto& buf, size_t per, int32_t a, int32_t b2) {
      return std::equal(buf.begin() + a * per, buf.begin() + (a + 1) * per, buf.begin() + b2 * per);
    };
    EXPECT_TRUE(same(kc, cpage, spare[0], spare[2]) && same(vc, cpage, spare[0], spare[2]));
    EXPECT_TRUE(same(kp, ppage, spare[0], spare[2]) && same(vp, ppage, spare[0], spare[2]));
    free_decode_workspace(ws);
  }
}

TEST(CudaDecode, RejectsUnsupportedShapes) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  HostCache cache({{16, 32, 16}}, 1, 128, 16, 128, 5);
  DecodePlan plan = plan_decode(1, regions_of(cache), 1, 1, 0);
  DecodeWorkspace ws = alloc_decode_workspace(plan.num_chunks, 1, 16, 128);
  DeviceBuffer<float> q(16 * 128), o(16 * 128);
  DecodeParams p;
  p.kv = cache.dev_view;
  p.q = q.ptr;
  p.o = o.ptr;
  p.sm_scale = 0.1f;
  p.num_q_heads = 9;  // GQA 9 > 8
  EXPECT_NE(check_decode(p, plan, ws).find("GQA"), std::string::npos);
  EXPECT_EQ(decode_attention(p, plan, ws, nullptr), cudaErrorInvalidValue);
  p.num_q_heads = 4;
  p.kv.head_dim = 96;
  EXPECT_NE(check_decode(p, plan, ws).find("head_dim"), std::string::npos);
  p.kv.head_dim = 128;
  p.kv.page_size = 24;
  EXPECT_NE(check_decode(p, plan, ws).find("page_size"), std::string::npos);
  p.kv.page_size = 16;
  p.kv.bits = 4;
  EXPECT_NE(check_decode(p, plan, ws).find("2-bit"), std::string::npos);
  p.kv.bits = 2;
  p.kv.key_axis = kv::KeyAxis::kChannel;  // kivi2's per-channel keys: CPU only
  EXPECT_NE(check_decode(p, plan, ws).find("per-channel"), std::string::npos);
  EXPECT_EQ(decode_attention(p, plan, ws, nullptr), cudaErrorInvalidValue);
  p.kv.key_axis = kv::KeyAxis::kToken;
  ASSERT_FALSE(plan.first_pages.empty());
  p.kv.page_size = 32;  // the plan's first pages (v44) are pages of 16 tokens
  EXPECT_NE(check_decode(p, plan, ws).find("first pages"), std::string::npos);
  p.kv.page_size = 16;
  EXPECT_EQ(check_decode(p, plan, ws), "");
  p.q = q.ptr + 1;  // q and o are read and written 16 bytes at a time
  EXPECT_NE(check_decode(p, plan, ws).find("16-byte aligned"), std::string::npos);
  EXPECT_EQ(decode_attention(p, plan, ws, nullptr), cudaErrorInvalidValue);
  p.q = q.ptr;
  p.o = o.ptr + 2;
  EXPECT_NE(check_decode(p, plan, ws).find("16-byte aligned"), std::string::npos);
  p.o = o.ptr;
  EXPECT_EQ(check_decode(p, plan, ws), "");
  free_decode_workspace(ws);
}

// n = 3 and 64 run the per-row kernel; from 128 on the tiled one at d <= 128
// (set_rotate_tiled_min_tokens' default) with tiles of 16 (200: a partial last tile), 32 (600) and
// 64 tokens (2100: 8 heads x 33 tiles fill 132 SMs); 64 and 200 also with the tiled kernel from
// 16 tokens on, and 200 with it turned off. The fp32 kernels only (the tensor-core one, which
// kAuto would take for 2100 tokens at d = 128, has its own test below).
TEST(CudaDecode, RotateQueriesMatchesReference) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  const int hq = 8;
  ASSERT_EQ(rotate_tiled_min_tokens(), 128);
  set_rotate_mma(RotateMma::kOff);
  std::mt19937 rng(42);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int tiled_min : {128, 16, 0})
  for (int n : {3, 64, 200, 600, 2100})
  for (int d : {64, 128, 256})
  for (int r_heads : {1, hq}) {
    if ((tiled_min == 16 && n != 64 && n != 200) || (tiled_min == 0 && n != 200)) continue;
    set_rotate_tiled_min_tokens(tiled_min);
    SCOPED_TRACE("n " + std::to_string(n) + ", tiled from " + std::to_string(tiled_min) + ", d " +
                 std::to_string(d) + ", r_heads " + std::to_string(r_heads));
    std::vector<float> q(size_t(n) * hq * d), R(size_t(r_heads) * d * d), ref(q.size());
    for (auto& x : q) x = nd(rng);
    for (auto& x : R) x = nd(rng) / std::sqrt(float(d));
    cpu::rotate_heads_ref(q.data(), n, hq, d, R.data(), r_heads, ref.data());
    DeviceBuffer<float> dq(q), dR(R), dout(q.size());
    dout.poison();
    OSCAR_CUDA_CHECK(rotate_queries(dq.ptr, n, hq, d, dR.ptr, r_heads, dout.ptr, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LE(test::rel_l2(dout.download(), ref), 1e-6);
    if (n == 200 && tiled_min == 128) {
      // An output 4 bytes off 16-byte alignment: the per-row kernel takes it (the tiled one
      // writes float4).
      DeviceBuffer<float> dodd(q.size() + 1);
      OSCAR_CUDA_CHECK(rotate_queries(dq.ptr, n, hq, d, dR.ptr, r_heads, dodd.ptr + 1, nullptr));
      OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
      const std::vector<float> all = dodd.download();
      EXPECT_LE(test::rel_l2(std::vector<float>(all.begin() + 1, all.end()), ref), 1e-6) << "unaligned output";
      // An input 4 bytes off 16-byte alignment (the tiled kernel reads its tiles element by
      // element, so it takes it): the same rows.
      std::vector<float> qodd(q.size() + 1, 0.0f);
      std::copy(q.begin(), q.end(), qodd.begin() + 1);
      DeviceBuffer<float> dqodd(qodd);
      dout.poison();
      OSCAR_CUDA_CHECK(rotate_queries(dqodd.ptr + 1, n, hq, d, dR.ptr, r_heads, dout.ptr, nullptr));
      OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_LE(test::rel_l2(dout.download(), ref), 1e-6) << "unaligned input";
    }
  }
  set_rotate_tiled_min_tokens(128);
  set_rotate_mma(RotateMma::kAuto);
}

// The step's queries and keys in one launch (in place), the keys centred first: against the
// reference rotation of q and of (k - mean), and against two rotate_queries calls.
TEST(CudaDecode, RotateQueriesKeysMatchesReference) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  const int hq = 8, hkv = 2;
  set_rotate_mma(RotateMma::kOff);  // the fp32 kernels (1e-6); the tensor-core one is tested below
  std::mt19937 rng(43);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int n : {3, 130, 1500})  // the per-row kernel; the tiled one (tiles of 16, the last partial; of 64)
  // (the tiled kernel's default threshold is 128 tokens)
  for (int d : {64, 128, 256})
  for (int r_heads : {1, hkv})
  for (bool centred : {false, true}) {
    SCOPED_TRACE("n " + std::to_string(n) + ", d " + std::to_string(d) + ", r_heads " + std::to_string(r_heads) +
                 (centred ? ", mean" : ""));
    std::vector<float> q(size_t(n) * hq * d), k(size_t(n) * hkv * d), Rq(size_t(r_heads) * d * d),
        Rk(Rq.size()), mean(size_t(hkv) * d, 0.0f);
    for (auto& x : q) x = nd(rng);
    for (auto& x : k) x = 10.0f + nd(rng);  // an offset the mean takes out
    for (auto& x : Rq) x = nd(rng) / std::sqrt(float(d));
    for (auto& x : Rk) x = nd(rng) / std::sqrt(float(d));
    if (centred)
      for (auto& x : mean) x = 10.0f + 0.1f * nd(rng);
    std::vector<float> kc = k, qref(q.size()), kref(k.size());
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < hkv; ++h)
        for (int c = 0; c < d; ++c) kc[(size_t(i) * hkv + h) * d + c] -= mean[size_t(h) * d + c];
    // out[i][h] = x[i][h] R[h / (heads / r_heads)] (the GQA grouping of the queries).
    auto rotate = [&](const std::vector<float>& x, int heads, const std::vector<float>& R, std::vector<float>& out) {
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < heads; ++h) {
          const float* Rh = R.data() + size_t(h / (heads / r_heads)) * d * d;
          const float* xr = x.data() + (size_t(i) * heads + h) * d;
          for (int c = 0; c < d; ++c) {
            double acc = 0;
            for (int j = 0; j < d; ++j) acc += double(xr[j]) * Rh[size_t(j) * d + c];
            out[(size_t(i) * heads + h) * d + c] = float(acc);
          }
        }
    };
    rotate(q, hq, Rq, qref);
    rotate(kc, hkv, Rk, kref);
    DeviceBuffer<float> dq(q), dk(k), dRq(Rq), dRk(Rk), dm(mean);
    OSCAR_CUDA_CHECK(rotate_queries_keys(dq.ptr, hq, dRq.ptr, dk.ptr, hkv, dRk.ptr, centred ? dm.ptr : nullptr, n, d,
                                         r_heads, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LE(test::rel_l2(dq.download(), qref), 1e-6) << "queries";
    EXPECT_LE(test::rel_l2(dk.download(), kref), 1e-6) << "keys";
    // The keys alone, through rotate_queries with the same centering (the store's transform_keys).
    DeviceBuffer<float> dk1(k);
    OSCAR_CUDA_CHECK(rotate_queries(dk1.ptr, n, hkv, d, dRk.ptr, r_heads, dk1.ptr, nullptr, false,
                                    centred ? dm.ptr : nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_LE(test::rel_l2(dk1.download(), kref), 1e-6) << "keys alone";
  }
  // Bad arguments are refused, not launched.
  DeviceBuffer<float> b(std::vector<float>(64 * 64, 0.0f));
  EXPECT_EQ(rotate_queries_keys(b.ptr, 3, b.ptr, b.ptr, 2, b.ptr, nullptr, 1, 64, 2, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(rotate_queries_keys(b.ptr, 4, b.ptr, b.ptr, 2, b.ptr, nullptr, 1, 96, 1, nullptr), cudaErrorInvalidValue);
  set_rotate_mma(RotateMma::kAuto);
}

// The tiled rotation on the tensor cores (set_rotate_mma: 3xTF32): queries and keys (centred),
// one matrix per layer or per KV head, tiles of 128 tokens with a partial last one (130, 700,
// 2100), blocks that take several tiles and change heads between them (9000: 710 items for a
// wave of blocks), in place, an unaligned input (the 4-byte copies); every output written
// (poisoned first), within 4e-6 of the fp64 reference (the fp32 kernels: 1e-6; the split drops
// the lo x lo term, ~2^-22 of each product, the tensor cores truncate lo to tf32, ~2^-21, and
// their accumulation is not IEEE fp32).
// d = 256 stays on the per-row kernel.
TEST(CudaDecode, RotateMmaMatchesReference) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  const int hq = 8, hkv = 2;
  ASSERT_EQ(rotate_mma(), RotateMma::kAuto);
  set_rotate_mma(RotateMma::kOn);
  std::mt19937 rng(44);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int n : {130, 700, 2100, 9000})
  for (int d : {64, 128, 256})
  for (int r_heads : {1, hkv}) {
    SCOPED_TRACE("n " + std::to_string(n) + ", d " + std::to_string(d) + ", r_heads " + std::to_string(r_heads));
    std::vector<float> q(size_t(n) * hq * d), k(size_t(n) * hkv * d), Rq(size_t(r_heads) * d * d), Rk(Rq.size()),
        mean(size_t(hkv) * d), qref(q.size()), kref(k.size());
    for (auto& x : q) x = nd(rng);
    for (auto& x : k) x = 10.0f + nd(rng);
    for (auto& x : Rq) x = nd(rng) / std::sqrt(float(d));
    for (auto& x : Rk) x = nd(rng) / std::sqrt(float(d));
    for (auto& x : mean) x = 10.0f + 0.1f * nd(rng);
    std::vector<float> kc = k;
    for (int i = 0; i < n; ++i)
      for (int h = 0; h < hkv; ++h)
        for (int c = 0; c < d; ++c) kc[(size_t(i) * hkv + h) * d + c] -= mean[size_t(h) * d + c];
    // rotate_heads_ref takes one matrix per head (or one): expand the per-KV-head queries' matrices.
    std::vector<float> Rq_heads(size_t(r_heads == 1 ? 1 : hq) * d * d);
    for (int h = 0; h < (r_heads == 1 ? 1 : hq); ++h)
      std::copy_n(Rq.begin() + size_t(r_heads == 1 ? 0 : h / (hq / hkv)) * d * d, size_t(d) * d,
                  Rq_heads.begin() + size_t(h) * d * d);
    cpu::rotate_heads_ref(q.data(), n, hq, d, Rq_heads.data(), r_heads == 1 ? 1 : hq, qref.data());
    cpu::rotate_heads_ref(kc.data(), n, hkv, d, Rk.data(), r_heads, kref.data());
    DeviceBuffer<float> dq(q), dk(k), dRq(Rq), dRk(Rk), dm(mean);
    OSCAR_CUDA_CHECK(rotate_queries_keys(dq.ptr, hq, dRq.ptr, dk.ptr, hkv, dRk.ptr, dm.ptr, n, d, r_heads, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> qo = dq.download(), ko = dk.download();
    EXPECT_LE(test::rel_l2(qo, qref), 4e-6) << "queries, in place";
    EXPECT_LE(test::rel_l2(ko, kref), 4e-6) << "keys, in place";
    // Out of place into a poisoned buffer, from an input 4 bytes off 16-byte alignment.
    std::vector<float> qodd(q.size() + 1, 0.0f);
    std::copy(q.begin(), q.end(), qodd.begin() + 1);
    DeviceBuffer<float> dqodd(qodd), dout(q.size());
    dout.poison();
    OSCAR_CUDA_CHECK(rotate_queries(dqodd.ptr + 1, n, hq, d, dRq.ptr, r_heads, dout.ptr, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> qo2 = dout.download();
    for (float x : qo2) ASSERT_TRUE(std::isfinite(x)) << "an output left unwritten";
    EXPECT_LE(test::rel_l2(qo2, qref), 4e-6) << "queries, out of place, unaligned input";
  }
  set_rotate_mma(RotateMma::kAuto);
}

}  // namespace
}  // namespace oscar::kernels::cuda
