// GPU cache write / demotion vs the CPU references (kernels/cpu/cache_write.h).
//  * No rotation: clip -> quantize -> pack must be bit-exact (same fp32
//    arithmetic and IEEE division as core/quantizer.cpp), including rows with
//    NaN/inf entries; BF16 writes bit-exact.
//  * With rotation the GPU accumulates x R in fp32 (CPU: fp64), so rotated
//    values differ by rounding: dequantized rows must agree within one
//    quantization step, and fewer than 1% of codes may differ.
// Destination pools start from the same poison bytes on both sides, so writes
// to wrong slots show up as mismatches too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "core/quantizer.h"
#include "cuda_test_util.h"
#include "kernels/cpu/cache_write.h"
#include "kernels/cuda/cache_write.h"

namespace oscar::kernels::cuda {
namespace {

using test::DeviceBuffer;

struct Pools {
  int d, hkv, page, group, npages;
  std::vector<uint16_t> bk, bv, kp, vp;
  std::vector<uint8_t> kc, vc;
  Pools(int d_, int hkv_, int page_, int group_, int npages_)
      : d(d_), hkv(hkv_), page(page_), group(group_), npages(npages_) {
    const size_t rows = size_t(npages) * hkv * page;
    bk.assign(rows * d, 0xABCD);
    bv.assign(rows * d, 0xABCD);
    kc.assign(rows * d / 4, 0xA5);
    vc.assign(rows * d / 4, 0xA5);
    kp.assign(rows * (d / group) * 2, 0x1234);
    vp.assign(rows * (d / group) * 2, 0x1234);
  }
  kv::PagedKvView view(uint16_t* a, uint16_t* b, uint8_t* c, uint8_t* e, uint16_t* f, uint16_t* g) const {
    kv::PagedKvView v;
    v.batch = 0;
    v.num_kv_heads = hkv;
    v.head_dim = d;
    v.page_size = page;
    v.bits = 2;
    v.group_size = group;
    v.bf16 = {a, b};
    v.quant = {c, e, f, g};
    return v;
  }
  kv::PagedKvView host() { return view(bk.data(), bv.data(), kc.data(), vc.data(), kp.data(), vp.data()); }
};

struct DevPools {
  DeviceBuffer<uint16_t> bk, bv, kp, vp;
  DeviceBuffer<uint8_t> kc, vc;
  explicit DevPools(const Pools& p) : bk(p.bk), bv(p.bv), kp(p.kp), vp(p.vp), kc(p.kc), vc(p.vc) {}
  kv::PagedKvView view(const Pools& p) { return p.view(bk.ptr, bv.ptr, kc.ptr, vc.ptr, kp.ptr, vp.ptr); }
};

template <typename T>
size_t count_diff(const std::vector<T>& a, const std::vector<T>& b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size(); ++i) n += a[i] != b[i];
  return n;
}

// The quantized pools (codes and params of K and V) of the device equal the host's, byte for byte.
void expect_quant_pools_equal(const DevPools& dev, const Pools& host, const std::string& what) {
  EXPECT_EQ(count_diff(dev.kc.download(), host.kc), 0u) << what;
  EXPECT_EQ(count_diff(dev.kp.download(), host.kp), 0u) << what;
  EXPECT_EQ(count_diff(dev.vc.download(), host.vc), 0u) << what;
  EXPECT_EQ(count_diff(dev.vp.download(), host.vp), 0u) << what;
}

// Distinct random (page, slot) targets for n tokens.
void random_slots(int n, int npages, int page, std::mt19937& rng, std::vector<int32_t>& pages,
                  std::vector<int32_t>& slots) {
  std::vector<int32_t> all(size_t(npages) * page);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  pages.resize(n);
  slots.resize(n);
  for (int i = 0; i < n; ++i) {
    pages[i] = all[i] / page;
    slots[i] = all[i] % page;
  }
}

std::vector<float> random_rows(size_t n, std::mt19937& rng, bool specials) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng) * (1.0f + 3.0f * (nd(rng) > 2.0f));  // some outliers
  if (specials && n > 300) {
    x[5] = NAN;
    x[130] = INFINITY;
    x[260] = -INFINITY;
    x[261] = 1e35f;
  }
  return x;
}

struct Shape {
  int d, group, hkv, page;
};
const Shape kShapes[] = {{128, 128, 8, 64}, {128, 32, 2, 16}, {64, 64, 4, 32}, {256, 128, 2, 16}, {256, 32, 1, 48}};

TEST(CudaCacheWrite, QuantTokensBitExactWithoutRotation) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(1);
  for (const Shape& s : kShapes) {
    const int n = 37, npages = 4;
    Pools host(s.d, s.hkv, s.page, s.group, npages);
    DevPools dev(host);
    std::vector<int32_t> pages, slots;
    random_slots(n, npages, s.page, rng, pages, slots);
    const auto k = random_rows(size_t(n) * s.hkv * s.d, rng, true);
    const auto v = random_rows(size_t(n) * s.hkv * s.d, rng, true);
    const cpu::ClipRatios clip{0.96f, 0.92f};
    cpu::write_quant_tokens_ref(host.host(), n, pages.data(), slots.data(), k.data(), v.data(), clip);
    DeviceBuffer<int32_t> dp(pages), ds(slots);
    DeviceBuffer<float> dk(k), dv(v);
    OSCAR_CUDA_CHECK(write_quant_tokens(dev.view(host), n, dp.ptr, ds.ptr, dk.ptr, dv.ptr, {}, clip, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(count_diff(dev.kc.download(), host.kc), 0u) << "d=" << s.d << " G=" << s.group;
    EXPECT_EQ(count_diff(dev.vc.download(), host.vc), 0u) << "d=" << s.d << " G=" << s.group;
    EXPECT_EQ(count_diff(dev.kp.download(), host.kp), 0u);
    EXPECT_EQ(count_diff(dev.vp.download(), host.vp), 0u);
    EXPECT_EQ(count_diff(dev.bk.download(), host.bk), 0u);  // BF16 pool untouched
  }
}

// Rotations: one R_K per layer, one per KV head, and R_K + R_V per KV head
// (at one KV head the per-head case is the per-layer one and is skipped).
// Rotated rows are compared dequantized, within one quantization step, with
// < 1% of codes differing (fp32 rotation here, fp64 in the reference); rows
// written unrotated are bit-exact.
TEST(CudaCacheWrite, QuantTokensWithRotationWithinOneStep) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(2);
  struct Rot {
    bool per_head, rot_v, mean;  // mean: the key transform's centering (WriteRotation::k_mean)
  };
  for (const Shape& s : kShapes)
    for (const Rot cfg : {Rot{false, false, false}, Rot{true, false, false}, Rot{true, true, false},
                          Rot{false, false, true}, Rot{true, true, true}}) {
      if (cfg.per_head && !cfg.rot_v && s.hkv == 1) continue;  // the same case as per layer
      const int n = 29, npages = 3, r_heads = cfg.per_head ? s.hkv : 1;
      Pools host(s.d, s.hkv, s.page, s.group, npages);
      DevPools dev(host);
      std::vector<int32_t> pages, slots;
      random_slots(n, npages, s.page, rng, pages, slots);
      const auto k = random_rows(size_t(n) * s.hkv * s.d, rng, false);
      const auto v = random_rows(size_t(n) * s.hkv * s.d, rng, false);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      std::vector<float> Rk(size_t(r_heads) * s.d * s.d), Rv(Rk.size());
      for (auto& x : Rk) x = nd(rng) / std::sqrt(float(s.d));
      for (auto& x : Rv) x = nd(rng) / std::sqrt(float(s.d));
      std::vector<float> kr(k.size()), vr(v), mean(size_t(s.hkv) * s.d, 0.0f), kc = k;
      if (cfg.mean) {  // a large per-head key offset, as Qwen2's k_proj bias makes
        for (auto& x : mean) x = 40.0f * nd(rng);
        for (int t = 0; t < n; ++t)
          for (int i = 0; i < s.hkv * s.d; ++i) kc[size_t(t) * s.hkv * s.d + i] -= mean[i];
      }
      cpu::rotate_heads_ref(kc.data(), n, s.hkv, s.d, Rk.data(), r_heads, kr.data());
      if (cfg.rot_v) cpu::rotate_heads_ref(v.data(), n, s.hkv, s.d, Rv.data(), r_heads, vr.data());
      const cpu::ClipRatios clip{0.96f, 0.92f};
      cpu::write_quant_tokens_ref(host.host(), n, pages.data(), slots.data(), kr.data(), vr.data(), clip);
      DeviceBuffer<int32_t> dp(pages), ds(slots);
      DeviceBuffer<float> dk(k), dv(v), dRk(Rk), dRv(Rv), dmean(mean);
      WriteRotation rot{dRk.ptr, cfg.rot_v ? dRv.ptr : nullptr, r_heads, cfg.mean ? dmean.ptr : nullptr};
      OSCAR_CUDA_CHECK(write_quant_tokens(dev.view(host), n, dp.ptr, ds.ptr, dk.ptr, dv.ptr, rot, clip, nullptr));
      OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
      const QuantSpec spec{2, s.group, ScaleDtype::kF16};
      const int rb = s.d / 4, np = 2 * (s.d / s.group);
      // Dequantized rows of every written slot against the reference's.
      auto within_a_step = [&](const std::vector<uint8_t>& codes, const std::vector<uint16_t>& params,
                               const std::vector<uint8_t>& ref_codes, const std::vector<uint16_t>& ref_params,
                               const char* what) {
        size_t code_diff = 0, total = 0;
        double worst = 0.0;
        std::vector<float> a(s.d), b(s.d);
        for (int t = 0; t < n; ++t)
          for (int h = 0; h < s.hkv; ++h) {
            const size_t row = (size_t(pages[t]) * s.hkv + h) * s.page + slots[t];
            dequantize_row(codes.data() + row * rb, params.data() + row * np, s.d, spec, a.data());
            dequantize_row(ref_codes.data() + row * rb, ref_params.data() + row * np, s.d, spec, b.data());
            for (int c = 0; c < s.d; ++c) {
              const float step = f16_to_f32(ref_params[row * np + 2 * (c / s.group)]);
              ASSERT_TRUE(std::isfinite(a[c])) << what;
              worst = std::max(worst, std::fabs(double(a[c]) - b[c]) / (step * 1.01 + 1e-3));
              code_diff += get_code(codes.data() + row * rb, c, s.group, 2) !=
                           get_code(ref_codes.data() + row * rb, c, s.group, 2);
              ++total;
            }
          }
        EXPECT_LE(worst, 1.0) << what << " d=" << s.d << " G=" << s.group << " r_heads=" << r_heads
                              << " mean=" << cfg.mean;
        EXPECT_LT(double(code_diff) / total, 0.01) << what << " d=" << s.d << " G=" << s.group;
      };
      within_a_step(dev.kc.download(), dev.kp.download(), host.kc, host.kp, "K");
      if (cfg.rot_v) {
        within_a_step(dev.vc.download(), dev.vp.download(), host.vc, host.vp, "V");
      } else {  // values not rotated: bit-exact
        EXPECT_EQ(count_diff(dev.vc.download(), host.vc), 0u);
        EXPECT_EQ(count_diff(dev.vp.download(), host.vp), 0u);
      }
    }
}

TEST(CudaCacheWrite, Bf16TokensExactAndRotated) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(3);
  for (const Shape& s : kShapes) {
    const int n = 21, npages = 2;
    Pools host(s.d, s.hkv, s.page, s.group, npages);
    DevPools dev(host);
    std::vector<int32_t> pages, slots;
    random_slots(n, npages, s.page, rng, pages, slots);
    const auto k = random_rows(size_t(n) * s.hkv * s.d, rng, false);
    const auto v = random_rows(size_t(n) * s.hkv * s.d, rng, false);
    cpu::write_bf16_tokens(host.host(), n, pages.data(), slots.data(), k.data(), v.data());
    DeviceBuffer<int32_t> dp(pages), ds(slots);
    DeviceBuffer<float> dk(k), dv(v);
    OSCAR_CUDA_CHECK(write_bf16_tokens(dev.view(host), n, dp.ptr, ds.ptr, dk.ptr, dv.ptr, {}, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(count_diff(dev.bk.download(), host.bk), 0u);
    EXPECT_EQ(count_diff(dev.bv.download(), host.bv), 0u);
    EXPECT_EQ(count_diff(dev.kc.download(), host.kc), 0u);  // quant pool untouched
    {  // Rows that are not 16-byte aligned (the copy kernel's float4 loads cannot take them): the
       // general kernel, the same bytes.
      std::vector<float> kpad(k.size() + 1, 0.0f), vpad(v.size() + 1, 0.0f);
      std::copy(k.begin(), k.end(), kpad.begin() + 1);
      std::copy(v.begin(), v.end(), vpad.begin() + 1);
      DeviceBuffer<float> dkp(kpad), dvp(vpad);
      Pools host4(s.d, s.hkv, s.page, s.group, npages);
      DevPools dev5(host4);
      OSCAR_CUDA_CHECK(write_bf16_tokens(dev5.view(host4), n, dp.ptr, ds.ptr, dkp.ptr + 1, dvp.ptr + 1, {}, nullptr));
      OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(count_diff(dev5.bk.download(), host.bk), 0u) << "unaligned rows, d=" << s.d;
      EXPECT_EQ(count_diff(dev5.bv.download(), host.bv), 0u) << "unaligned rows, d=" << s.d;
    }

    // Rotated rows: within one bf16 rounding of the reference. The device
    // pools start from the poison bytes (uploaded before the reference
    // write), so a row the kernel leaves unwritten fails. Two cases: one R_K
    // per layer (values unrotated), and per-KV-head R_K and R_V (at one KV
    // head, one R_K and one R_V).
    std::normal_distribution<float> nd(0.0f, 1.0f);
    {  // Unrotated keys with the key transform's mean: bf16(k − mean), bit-exact.
      std::vector<float> mean(size_t(s.hkv) * s.d), kc = k;
      for (auto& x : mean) x = 40.0f * nd(rng);
      for (int t = 0; t < n; ++t)
        for (int i = 0; i < s.hkv * s.d; ++i) kc[size_t(t) * s.hkv * s.d + i] -= mean[i];
      Pools host3(s.d, s.hkv, s.page, s.group, npages);
      DevPools dev3(host3);
      cpu::write_bf16_tokens(host3.host(), n, pages.data(), slots.data(), kc.data(), v.data());
      DeviceBuffer<float> dmean(mean);
      OSCAR_CUDA_CHECK(write_bf16_tokens(dev3.view(host3), n, dp.ptr, ds.ptr, dk.ptr, dv.ptr,
                                         {nullptr, nullptr, 1, dmean.ptr}, nullptr));
      OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(count_diff(dev3.bk.download(), host3.bk), 0u) << "centered keys, d=" << s.d;
      EXPECT_EQ(count_diff(dev3.bv.download(), host3.bv), 0u) << "values untouched by k_mean, d=" << s.d;
    }
    // With rot_v, keys are also centered (WriteRotation::k_mean, the key transform).
    for (const bool rot_v : {false, true}) {
      const int r_heads = rot_v ? s.hkv : 1;
      std::vector<float> Rk(size_t(r_heads) * s.d * s.d), Rv(Rk.size()), kr(k.size()), vr(v.size());
      for (auto& x : Rk) x = nd(rng) / std::sqrt(float(s.d));
      for (auto& x : Rv) x = nd(rng) / std::sqrt(float(s.d));
      std::vector<float> mean(size_t(s.hkv) * s.d, 0.0f), kc = k;
      if (rot_v) {
        for (auto& x : mean) x = 40.0f * nd(rng);
        for (int t = 0; t < n; ++t)
          for (int i = 0; i < s.hkv * s.d; ++i) kc[size_t(t) * s.hkv * s.d + i] -= mean[i];
      }
      cpu::rotate_heads_ref(kc.data(), n, s.hkv, s.d, Rk.data(), r_heads, kr.data());
      if (rot_v) cpu::rotate_heads_ref(v.data(), n, s.hkv, s.d, Rv.data(), r_heads, vr.data());
      DeviceBuffer<float> dRk(Rk), dRv(Rv), dmean(mean);
      // Every way the decode step may split the rows over blocks (parts per
      // row, K and V in one block or not), each block's flag checked too.
      for (int parts = s.d / 32; parts >= 1; parts /= 2)
        for (const bool both : {false, true}) {
          Pools host2(s.d, s.hkv, s.page, s.group, npages);
          DevPools dev2(host2);
          cpu::write_bf16_tokens(host2.host(), n, pages.data(), slots.data(), kr.data(), rot_v ? vr.data() : v.data());
          const size_t nflags = size_t(n) * s.hkv * parts * (both ? 1 : 2);
          DeviceBuffer<uint32_t> done(std::vector<uint32_t>(nflags + 1, 0u));
          const uint32_t epoch = 1000u + uint32_t(parts) * 2 + both;
          OSCAR_CUDA_CHECK(write_bf16_tokens_dependent(dev2.view(host2), n, dp.ptr, ds.ptr, dk.ptr, dv.ptr,
                                                       {dRk.ptr, rot_v ? dRv.ptr : nullptr, r_heads,
                                                        rot_v ? dmean.ptr : nullptr},
                                                       false, nullptr,
                                                       done.ptr, epoch, parts, both));
          OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
          const std::vector<uint32_t> flags = done.download();
          EXPECT_EQ(std::count(flags.begin(), flags.end(), epoch), std::ptrdiff_t(nflags))
              << "d=" << s.d << " parts=" << parts << " both=" << both;
          EXPECT_EQ(flags[nflags], 0u) << "a flag past the last block";
          for (int which = 0; which < 2; ++which) {
            const auto got = (which ? dev2.bv : dev2.bk).download();
            const auto& want = which ? host2.bv : host2.bk;
            size_t bad = 0, written = 0;
            for (size_t i = 0; i < got.size(); ++i) {
              written += want[i] != 0xABCD;
              if (got[i] == want[i]) continue;
              const float a = bf16_to_f32(got[i]), b = bf16_to_f32(want[i]);
              if (!std::isfinite(a) || std::fabs(a - b) > std::fabs(b) * (1.0f / 64) + 1e-6f) ++bad;
            }
            EXPECT_GT(written, size_t(n) * s.hkv * s.d / 2);
            EXPECT_EQ(bad, 0u) << "d=" << s.d << " r_heads=" << r_heads << " parts=" << parts << " both=" << both
                               << (which ? " V" : " K");
          }
        }
    }
  }
}

TEST(CudaCacheWrite, DemotionBitExact) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(4);
  for (const Shape& s : kShapes) {
    const int npages = 5;
    Pools host(s.d, s.hkv, s.page, s.group, npages);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : host.bk) x = f32_to_bf16(nd(rng));
    for (auto& x : host.bv) x = f32_to_bf16(nd(rng));
    host.bk[7] = 0x7fc0;  // a NaN in a row: mapped like the reference does
    DevPools dev(host);
    const std::vector<int32_t> src = {3, 0, 4}, dst = {1, 4, 2};
    const cpu::ClipRatios clip{0.96f, 0.92f};
    for (int num_tokens : {-1, 5}) {
      for (size_t i = 0; i < src.size(); ++i)
        cpu::demote_page_ref(host.host(), src[i], dst[i], clip, num_tokens);
      DeviceBuffer<int32_t> ds(src), dd(dst);
      OSCAR_CUDA_CHECK(demote_pages(dev.view(host), int(src.size()), ds.ptr, dd.ptr, clip, num_tokens, nullptr));
      OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
      expect_quant_pools_equal(dev, host, "d=" + std::to_string(s.d) + " G=" + std::to_string(s.group));
    }
  }
}

// Page centering: each demoted page's keys quantized around its centre δ_h (key_offset), as
// the CPU reference does; bit-exact. Without the offset the key bytes differ (the test can fail).
TEST(CudaCacheWrite, DemotionWithPageCentreBitExact) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(6);
  for (const Shape& s : kShapes) {
    const int npages = 5;
    Pools host(s.d, s.hkv, s.page, s.group, npages);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : host.bk) x = f32_to_bf16(nd(rng) + 6.0f);  // an offset the centre removes
    for (auto& x : host.bv) x = f32_to_bf16(nd(rng));
    DevPools dev(host);
    const std::vector<int32_t> src = {3, 0, 4}, dst = {1, 4, 2};
    const cpu::ClipRatios clip{0.96f, 0.92f};
    std::vector<float> off(src.size() * s.hkv * s.d);
    for (auto& x : off) x = 6.0f + 0.5f * nd(rng);
    for (size_t i = 0; i < src.size(); ++i)
      cpu::demote_page_ref(host.host(), src[i], dst[i], clip, -1, off.data() + i * s.hkv * s.d);
    DeviceBuffer<int32_t> ds(src), dd(dst);
    DeviceBuffer<float> doff(off);
    OSCAR_CUDA_CHECK(demote_pages(dev.view(host), int(src.size()), ds.ptr, dd.ptr, clip, -1, nullptr, doff.ptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    expect_quant_pools_equal(dev, host, "d=" + std::to_string(s.d) + " G=" + std::to_string(s.group));
    OSCAR_CUDA_CHECK(demote_pages(dev.view(host), int(src.size()), ds.ptr, dd.ptr, clip, -1, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_GT(count_diff(dev.kp.download(), host.kp), 0u) << "the offset changed nothing";
  }
}

// Per-head clip ratios (calibrations searched per head): every head's rows clipped with its own
// ratio, bit-exact with the CPU reference's head_clips; with the layer's one ratio instead, the
// bytes of the heads whose ratio differs must change (the test can fail).
TEST(CudaCacheWrite, DemotionWithPerHeadClipsBitExact) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(8);
  for (const Shape& s : kShapes) {
    if (s.hkv < 2) continue;
    const int npages = 5;
    Pools host(s.d, s.hkv, s.page, s.group, npages);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : host.bk) x = f32_to_bf16(nd(rng) * (1.0f + 3.0f * (rng() % 8 == 0)));  // outliers to clip
    for (auto& x : host.bv) x = f32_to_bf16(nd(rng) * (1.0f + 3.0f * (rng() % 8 == 0)));
    DevPools dev(host);
    const std::vector<int32_t> src = {3, 0, 4}, dst = {1, 4, 2};
    const cpu::ClipRatios clip{0.96f, 0.92f};
    std::vector<cpu::ClipRatios> heads(s.hkv);
    heads[0] = clip;  // one head as the layer's ratio, the others each their own
    for (int h = 1; h < s.hkv; ++h) heads[h] = {0.70f + 0.04f * h, 0.80f - 0.03f * h};
    for (size_t i = 0; i < src.size(); ++i)
      cpu::demote_page_ref(host.host(), src[i], dst[i], clip, -1, nullptr, heads.data());
    DeviceBuffer<int32_t> ds(src), dd(dst);
    OSCAR_CUDA_CHECK(demote_pages(dev.view(host), int(src.size()), ds.ptr, dd.ptr, clip, -1, nullptr, nullptr,
                                  heads.data()));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    expect_quant_pools_equal(dev, host, "d=" + std::to_string(s.d) + " Hkv=" + std::to_string(s.hkv));
    OSCAR_CUDA_CHECK(demote_pages(dev.view(host), int(src.size()), ds.ptr, dd.ptr, clip, -1, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_GT(count_diff(dev.kp.download(), host.kp), 0u) << "the per-head clips changed nothing";
    EXPECT_GT(count_diff(dev.vp.download(), host.vp), 0u) << "the per-head clips changed nothing";
  }
}

// The demotions' page centres on the device (page_centres) against the host specification
// (kv::center_angles + kv::center_offset) on random centres: every layer with a centre within
// 1e-6 relative (both sum in fp64, the device with its own cos / sin and FMA contraction), the
// rows of a layer without one left as they were. Positions up to ~1M, so the angles wrap.
TEST(CudaCacheWrite, PageCentresMatchHost) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  struct Case { int d, hkv, S, layers, pages, page_size; };
  for (const Case c : {Case{64, 1, 3, 2, 5, 16}, Case{128, 2, 44, 4, 37, 64}, Case{256, 3, 128, 3, 9, 32}}) {
    std::vector<float> freq(c.S);
    for (int s = 0; s < c.S; ++s) freq[s] = std::pow(10000.0f, -2.0f * float(s) / float(c.d));
    std::vector<std::vector<float>> u(c.layers), w(c.layers), mu(c.layers);
    std::vector<DeviceBuffer<float>> du, dw, dmu;
    std::vector<PageCentreLayer> layers(c.layers);
    for (int l = 0; l < c.layers; ++l) {
      u[l].resize(size_t(c.hkv) * c.S * c.d);
      w[l].resize(u[l].size());
      mu[l].resize(size_t(c.hkv) * c.d);
      for (auto* v : {&u[l], &w[l], &mu[l]})
        for (auto& x : *v) x = 3.0f * nd(rng);
      du.emplace_back(u[l]);
      dw.emplace_back(w[l]);
      dmu.emplace_back(mu[l]);
      // Layer 1 has no centre; the last one has no mean.
      if (l != 1) layers[l] = {du[l].ptr, dw[l].ptr, l + 1 == c.layers ? nullptr : dmu[l].ptr};
    }
    std::vector<int64_t> pos(c.pages);
    std::uniform_int_distribution<int64_t> pd(0, 1 << 20);
    for (auto& p : pos) p = pd(rng) / c.page_size * c.page_size;
    pos[0] = 0;
    DeviceBuffer<PageCentreLayer> dl(layers);
    DeviceBuffer<float> dfreq(freq);
    DeviceBuffer<int64_t> dpos(pos);
    const size_t per_layer = size_t(c.pages) * c.hkv * c.d;
    std::vector<float> out(per_layer * c.layers, 1234.5f);
    DeviceBuffer<float> dout(out);
    OSCAR_CUDA_CHECK(page_centres(dl.ptr, c.layers, dfreq.ptr, c.S, c.hkv, c.d, c.pages, dpos.ptr, c.page_size,
                                  dout.ptr, nullptr));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = dout.download();
    std::vector<float> cs(2 * size_t(c.S)), ref(c.d);
    size_t bad = 0;
    double worst = 0.0;
    for (int l = 0; l < c.layers; ++l)
      for (int i = 0; i < c.pages; ++i)
        for (int h = 0; h < c.hkv; ++h) {
          const float* g = got.data() + l * per_layer + (size_t(i) * c.hkv + h) * c.d;
          if (l == 1) {
            for (int k = 0; k < c.d; ++k) bad += g[k] != 1234.5f;
            continue;
          }
          kv::MidCenter mc;
          mc.pairs = c.S;
          mc.u = u[l].data();
          mc.w = w[l].data();
          mc.mu = l + 1 == c.layers ? nullptr : mu[l].data();
          kv::center_angles(freq.data(), c.S, double(pos[i]) + 0.5 * (c.page_size - 1), cs.data());
          kv::center_offset(mc, c.d, h, cs.data(), ref.data());
          for (int k = 0; k < c.d; ++k) {
            const double e = std::fabs(double(g[k]) - ref[k]);
            worst = std::max(worst, e);
            bad += !(e <= 1e-6 * std::max(1.0, std::fabs(double(ref[k]))));  // NaN fails
          }
        }
    EXPECT_EQ(bad, 0u) << "d=" << c.d << " S=" << c.S << " worst |diff| " << worst;
  }
  DeviceBuffer<PageCentreLayer> dl(std::vector<PageCentreLayer>(1));
  DeviceBuffer<float> f(64);
  DeviceBuffer<int64_t> p(std::vector<int64_t>{0});
  EXPECT_EQ(page_centres(dl.ptr, 1, f.ptr, 33, 1, 64, 1, p.ptr, 16, f.ptr, nullptr), cudaErrorInvalidValue)
      << "S > d / 2";
  EXPECT_EQ(page_centres(dl.ptr, 1, f.ptr, 4, 1, 96, 1, p.ptr, 16, f.ptr, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(page_centres(dl.ptr, 1, f.ptr, 4, 1, 64, 1, nullptr, 16, f.ptr, nullptr), cudaErrorInvalidValue);
}

TEST(CudaCacheWrite, RejectsBadArguments) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  Pools host(96, 1, 16, 32, 1);  // head_dim 96 unsupported
  DevPools dev(host);
  DeviceBuffer<int32_t> p(std::vector<int32_t>{0}), s(std::vector<int32_t>{0});
  DeviceBuffer<float> x(96);
  EXPECT_EQ(write_quant_tokens(dev.view(host), 1, p.ptr, s.ptr, x.ptr, x.ptr, {}, {}, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(demote_pages(dev.view(host), 1, p.ptr, s.ptr, {}, -1, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace oscar::kernels::cuda
