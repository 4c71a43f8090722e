// Cache-write kernels: rotation (fast vs fp64 reference), BF16 write -> read
// round trip, quantized write (fast bit-exact vs reference, and equal to
// core's clip_row + quantize_row), demotion equal to direct quantization of
// the same (BF16-rounded) rows, and the full write -> decode-attention path
// against dense attention on the fake-quantized rows.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/quantizer.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_impl.h"
#include "kernels/cpu/cache_write.h"
#include "test_cache.h"

namespace oscar::kernels::cpu {
namespace {

using test::random_vec;

// Pools for writes: nb BF16 pages and nq quantized pages, poisoned.
struct Pools {
  std::vector<uint16_t> bk, bv, kp, vp;
  std::vector<uint8_t> kc, vc;
  kv::PagedKvView view;
  Pools(int hkv, int d, int page, int bits, int group, int nb, int nq, bool key_channel = false) {
    bk.assign(size_t(nb) * hkv * page * d, test::kBf16NaN);
    bv = bk;
    kc.assign(size_t(nq) * hkv * page * d * bits / 8, 0xA5);
    vc = kc;
    vp.assign(size_t(nq) * hkv * page * (d / group) * 2, test::kF16NaN);
    kp.assign(key_channel ? size_t(nq) * hkv * (page / kv::kKeySpan) * d * 2 : vp.size(), test::kF16NaN);
    view.key_axis = key_channel ? kv::KeyAxis::kChannel : kv::KeyAxis::kToken;
    view.num_kv_heads = hkv;
    view.head_dim = d;
    view.page_size = page;
    view.bits = bits;
    view.group_size = group;
    view.bf16 = {bk.data(), bv.data()};
    view.quant = {kc.data(), vc.data(), kp.data(), vp.data()};
  }
};

TEST(Rotation, FastMatchesReferenceAndInPlace) {
  std::mt19937 rng(1);
  for (int d : {64, 128, 256}) {
    const int n = 5, H = 3;
    auto x = random_vec(rng, size_t(n) * H * d, 1.0f);
    auto R = random_vec(rng, size_t(H) * d * d, 1.0f / std::sqrt(float(d)));
    for (int r_heads : {1, H}) {
      std::vector<float> ref(x.size(), NAN), fast(x.size(), NAN);
      rotate_heads_ref(x.data(), n, H, d, R.data(), r_heads, ref.data());
      rotate_heads(x.data(), n, H, d, R.data(), r_heads, fast.data());
      // Independent check of one element: out[t][h][c] = sum_j x[t][h][j] R[h'][j][c].
      const int t = 2, h = 1, c = 7, hr = r_heads == 1 ? 0 : h;
      double s = 0;
      for (int j = 0; j < d; ++j) s += double(x[(size_t(t) * H + h) * d + j]) * R[(size_t(hr) * d + j) * d + c];
      EXPECT_NEAR(ref[(size_t(t) * H + h) * d + c], s, 1e-5);
      // fp32 vs fp64 accumulation over d terms of O(1/sqrt(d)): |diff| <= 1e-5.
      for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(fast[i], ref[i], 1e-5) << "d=" << d << " i=" << i;
      std::vector<float> inplace = x;
      rotate_heads(inplace.data(), n, H, d, R.data(), r_heads, inplace.data());
      for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(inplace[i], fast[i]);
    }
    std::vector<float> rows(size_t(n) * d, NAN), rows_ref(size_t(n) * d, NAN);
    rotate_rows(x.data(), n, d, R.data(), rows.data());
    rotate_rows_ref(x.data(), n, d, R.data(), rows_ref.data());
    for (size_t i = 0; i < rows.size(); ++i) ASSERT_NEAR(rows[i], rows_ref[i], 1e-5);
  }
  std::vector<float> x(8), R(64);
  EXPECT_THROW(rotate_heads(x.data(), 1, 2, 4, R.data(), 3, x.data()), Error);
}

TEST(WriteBf16, RoundTrip) {
  std::mt19937 rng(2);
  Pools p(2, 64, 16, 2, 64, 3, 1);
  const int n = 4;
  const int32_t pages[n] = {2, 0, 2, 1}, slots[n] = {0, 15, 7, 3};
  auto k = random_vec(rng, size_t(n) * 2 * 64, 3.0f);
  auto v = random_vec(rng, k.size(), 3.0f);
  write_bf16_tokens(p.view, n, pages, slots, k.data(), v.data());
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < 2; ++h)
      for (int c = 0; c < 64; ++c) {
        const size_t src = (size_t(t) * 2 + h) * 64 + c;
        const int64_t dst = p.view.bf16_row_offset(pages[t], h, slots[t]) + c;
        ASSERT_EQ(p.bk[dst], f32_to_bf16(k[src]));
        ASSERT_EQ(p.bv[dst], f32_to_bf16(v[src]));
        ASSERT_LE(std::fabs(bf16_to_f32(p.bk[dst]) - k[src]), std::fabs(k[src]) * (1.0f / 256));
      }
  // Untouched slot stays poisoned.
  EXPECT_EQ(p.bk[p.view.bf16_row_offset(0, 0, 0)], test::kBf16NaN);
  const int32_t bad_slot[1] = {16}, page0[1] = {0};
  EXPECT_THROW(write_bf16_tokens(p.view, 1, page0, bad_slot, k.data(), v.data()), Error);
}

TEST(WriteQuant, FastBitExactWithReferenceAndCoreQuantizer) {
  std::mt19937 rng(3);
  for (int d : {64, 128, 256})
    for (int group : {32, 64, 128})
      for (int bits : {2, 4}) {
        if (group > d) continue;
        const int H = 2, n = 6, page = 16;
        Pools a(H, d, page, bits, group, 1, 2), b(H, d, page, bits, group, 1, 2);
        std::vector<int32_t> pages(n), slots(n);
        for (int t = 0; t < n; ++t) {
          pages[t] = t % 2;
          slots[t] = (t * 5) % page;
        }
        std::vector<float> k(size_t(n) * H * d), v(k.size());
        for (size_t r = 0; r < size_t(n) * H; ++r) {
          test::random_row(rng, d, k.data() + r * d);
          test::random_row(rng, d, v.data() + r * d);
        }
        k[3] = NAN;  // non-finite input: both paths must agree on it
        v[d + 1] = INFINITY;
        const ClipRatios clip{0.96f, 0.92f};
        write_quant_tokens_ref(a.view, n, pages.data(), slots.data(), k.data(), v.data(), clip);
        write_quant_tokens(b.view, n, pages.data(), slots.data(), k.data(), v.data(), clip);
        ASSERT_EQ(a.kc, b.kc) << "d=" << d << " G=" << group << " bits=" << bits;
        ASSERT_EQ(a.vc, b.vc);
        ASSERT_EQ(a.kp, b.kp);
        ASSERT_EQ(a.vp, b.vp);
        // Read back one row and compare with core's clip_row + quantize_row + dequantize_row.
        const QuantSpec qs{bits, group, ScaleDtype::kF16};
        std::vector<float> row(v.begin() + d, v.begin() + 2 * d), want(d), got(d);
        clip_row(row.data(), d, clip.v);
        fake_quantize_rows(row.data(), 1, d, qs, want.data());
        const int64_t r = b.view.quant_row_index(pages[0], 1, slots[0]);
        dequantize_row(b.vc.data() + r * b.view.row_code_bytes(), b.vp.data() + r * b.view.row_groups() * 2, d, qs,
                       got.data());
        for (int c = 0; c < d; ++c) ASSERT_EQ(got[c], want[c]);
      }
}

// Rows whose group minimum is a zero: the reference's sequential min keeps the first zero with
// its sign, which reaches the fp16 bits of m; the fast kernel's lane-wise min must give the same.
// Also all-equal groups (zero range) and groups of one repeated zero of either sign.
TEST(WriteQuant, ZeroMinimumKeepsTheReferenceSign) {
  const int H = 1, d = 64, group = 32, page = 16;
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> ud(0.0f, 2.0f);
  for (int trial = 0; trial < 24; ++trial) {
    std::vector<float> k(static_cast<size_t>(d)), v(static_cast<size_t>(d));
    for (float& x : k) x = ud(rng);
    for (float& x : v) x = ud(rng);
    const int a = trial % group, b = (trial * 7 + 3) % group;
    k[size_t(a)] = trial % 2 ? -0.0f : 0.0f;  // the first zero's sign varies
    k[size_t(b)] = trial % 2 ? 0.0f : -0.0f;
    v[size_t(a + group)] = -0.0f;
    if (trial % 3 == 0) std::fill(v.begin(), v.begin() + group, trial % 2 ? -0.0f : 0.0f);  // zero range
    if (trial % 4 == 0) std::fill(k.begin() + group, k.end(), 1.25f);                       // equal values
    Pools x(H, d, page, 2, group, 1, 1), y(H, d, page, 2, group, 1, 1);
    const int32_t pg = 0, slot = trial % page;
    write_quant_tokens_ref(x.view, 1, &pg, &slot, k.data(), v.data(), {1.0f, 1.0f});
    write_quant_tokens(y.view, 1, &pg, &slot, k.data(), v.data(), {1.0f, 1.0f});
    ASSERT_EQ(x.kp, y.kp) << trial;
    ASSERT_EQ(x.vp, y.vp) << trial;
    ASSERT_EQ(x.kc, y.kc) << trial;
    ASSERT_EQ(x.vc, y.vc) << trial;
  }
}

// clip_threshold_select against core's clip_threshold (nth_element over |x|, NaN as +inf): the
// same float, bit for bit, on rows with ties, zeros of both signs, infinities, NaNs, subnormals
// and huge values, at every clip index of the row lengths the kernels take.
TEST(ClipThreshold, SelectionEqualsTheReference) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> pick(0, 9);
  const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-40f, -3e-39f, 3e38f, 1.0f};
  int cases = 0;
  for (int d : {1, 2, 3, 32, 64, 100, 128, 256})
    for (int trial = 0; trial < 40; ++trial) {
      std::vector<float> x(static_cast<size_t>(d));
      for (float& v : x) {
        switch (trial % 4) {
          case 0: v = nd(rng); break;                                              // plain
          case 1: v = std::round(nd(rng) * 2.0f) / 2.0f; break;                     // many ties
          case 2: v = pick(rng) < 3 ? specials[pick(rng)] : nd(rng); break;         // specials mixed in
          default: v = specials[pick(rng)]; break;                                 // specials only
        }
      }
      for (float ratio : {0.0f, 0.5f, 0.84f, 0.88f, 0.92f, 0.96f, 0.999f, 1.0f, 1.5f}) {
        const float want = clip_threshold(x.data(), d, ratio), got = clip_threshold_select(x.data(), d, ratio);
        uint32_t a, b;
        std::memcpy(&a, &want, 4);
        std::memcpy(&b, &got, 4);
        ASSERT_EQ(a, b) << "d=" << d << " trial=" << trial << " ratio=" << ratio << ": " << want << " vs " << got;
        ++cases;
      }
    }
  EXPECT_EQ(cases, 8 * 40 * 9);
  // Many rows at once (4 at a time, then the rest): 1 to 9 rows with a padded stride, each the
  // reference's value of its own row.
  for (int d : {64, 128, 100})
    for (int n = 1; n <= 9; ++n) {
      const int ld = d + 3;
      std::vector<float> rows(static_cast<size_t>(n) * ld, NAN), tau(static_cast<size_t>(n), -1.0f);
      for (int r = 0; r < n; ++r)
        for (int i = 0; i < d; ++i) rows[size_t(r) * ld + i] = r % 3 == 2 && i % 5 == 0 ? specials[pick(rng)] : nd(rng);
      clip_thresholds_select(rows.data(), ld, n, d, 0.88f, tau.data());
      for (int r = 0; r < n; ++r) {
        const float want = clip_threshold(rows.data() + size_t(r) * ld, d, 0.88f);
        ASSERT_EQ(std::memcmp(&want, &tau[size_t(r)], 4), 0) << "d=" << d << " n=" << n << " row " << r;
      }
    }
  float x[2] = {1.0f, 2.0f};
  EXPECT_THROW(clip_threshold_select(x, 0, 0.9f), Error);
  EXPECT_THROW(clip_threshold_select(x, 257, 0.9f), Error);
}

TEST(Demotion, EqualsDirectQuantizationOfTheSameRows) {
  std::mt19937 rng(4);
  for (int bits : {2, 4})
    for (int page : {16, 64}) {
      const int H = 3, d = 128, group = 64;
      Pools p(H, d, page, bits, group, 2, 3), direct(H, d, page, bits, group, 2, 3), ref(H, d, page, bits, group, 2, 3);
      // Fill BF16 page 1 through the write kernel, remember the BF16-rounded rows.
      std::vector<float> k(size_t(page) * H * d), v(k.size());
      for (size_t r = 0; r < size_t(page) * H; ++r) {
        test::random_row(rng, d, k.data() + r * d);
        test::random_row(rng, d, v.data() + r * d);
      }
      std::vector<int32_t> pages(page, 1), slots(page);
      for (int s = 0; s < page; ++s) slots[s] = s;
      write_bf16_tokens(p.view, page, pages.data(), slots.data(), k.data(), v.data());
      ref.bk = p.bk;
      ref.bv = p.bv;
      for (auto& x : k) x = bf16_to_f32(f32_to_bf16(x));
      for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
      const ClipRatios clip{0.96f, 0.92f};
      demote_page(p.view, 1, 2, clip);
      demote_page_ref(ref.view, 1, 2, clip);
      std::vector<int32_t> qpages(page, 2);
      write_quant_tokens_ref(direct.view, page, qpages.data(), slots.data(), k.data(), v.data(), clip);
      ASSERT_EQ(p.kc, direct.kc) << "bits=" << bits << " page=" << page;
      ASSERT_EQ(p.vc, direct.vc);
      ASSERT_EQ(p.kp, direct.kp);
      ASSERT_EQ(p.vp, direct.vp);
      ASSERT_EQ(ref.kc, direct.kc);
      ASSERT_EQ(ref.kp, direct.kp);
      ASSERT_EQ(ref.vc, direct.vc);
      ASSERT_EQ(ref.vp, direct.vp);
    }
}

// Per-head clip ratios (head_clips): each head's rows clipped with its own ratios, the kernel
// bit-exact with the reference, and a head given the layer's ratios equal to the uniform call;
// with a partial page (num_tokens) and a key offset (page centering) too.
TEST(Demotion, PerHeadClipsMatchTheReference) {
  std::mt19937 rng(12);
  const int H = 3, d = 64, page = 64, group = 64;
  for (int tokens : {64, 37}) {
    Pools p(H, d, page, 2, group, 2, 3), ref(H, d, page, 2, group, 2, 3), uni(H, d, page, 2, group, 2, 3);
    std::vector<float> k(size_t(page) * H * d), v(k.size()), off(size_t(H) * d);
    for (size_t r = 0; r < size_t(page) * H; ++r) {
      test::random_row(rng, d, k.data() + r * d);
      test::random_row(rng, d, v.data() + r * d);
    }
    for (float& x : off) x = 0.3f;
    std::vector<int32_t> pages(page, 1), slots(page);
    for (int s = 0; s < page; ++s) slots[s] = s;
    write_bf16_tokens(p.view, page, pages.data(), slots.data(), k.data(), v.data());
    ref.bk = uni.bk = p.bk;
    ref.bv = uni.bv = p.bv;
    const ClipRatios heads[H] = {{0.88f, 0.84f}, {0.96f, 0.92f}, {1.0f, 0.75f}};
    demote_page(p.view, 1, 2, {0.5f, 0.5f}, tokens, off.data(), heads);
    demote_page_ref(ref.view, 1, 2, {0.5f, 0.5f}, tokens, off.data(), heads);
    ASSERT_EQ(p.kc, ref.kc) << tokens;
    ASSERT_EQ(p.vc, ref.vc);
    ASSERT_EQ(p.kp, ref.kp);
    ASSERT_EQ(p.vp, ref.vp);
    // Head 1 has the uniform call's ratios: its rows equal that call's; head 0's differ.
    demote_page(uni.view, 1, 2, heads[1], tokens, off.data());
    auto head_bytes = [&](const std::vector<uint8_t>& c, int h) {
      std::vector<uint8_t> out;
      for (int s = 0; s < tokens; ++s) {
        const int64_t r = p.view.quant_row_index(2, h, s);
        out.insert(out.end(), c.begin() + r * p.view.row_code_bytes(), c.begin() + (r + 1) * p.view.row_code_bytes());
      }
      return out;
    };
    EXPECT_EQ(head_bytes(p.vc, 1), head_bytes(uni.vc, 1));
    EXPECT_EQ(head_bytes(p.kc, 1), head_bytes(uni.kc, 1));
    EXPECT_NE(head_bytes(p.vc, 0), head_bytes(uni.vc, 0));
  }
}

TEST(Demotion, PerChannelKeysEqualQuantizingEachSpanDirectly) {
  // KIVI keys (KeyAxis::kChannel): demoting a BF16 page must give, for each
  // KV head, 32-slot span and channel, exactly the codes and fp16 (scale,
  // min) of the reference quantizer run on that channel's 32 BF16 values
  // (what the evaluation's simulation does with fake_quantize_rows), packed
  // into the rows in the usual format; values stay per-token rows. The fast
  // kernel must be bit-exact with the reference, non-finite inputs included.
  std::mt19937 rng(14);
  int checked = 0;
  for (int bits : {2, 4})
    for (int page : {32, 64, 128})
      for (int d : {64, 128}) {
        const int H = 3, group = (d == 128 && bits == 4) ? 64 : 32;
        Pools p(H, d, page, bits, group, 2, 3, true), ref(H, d, page, bits, group, 2, 3, true),
            rows(H, d, page, bits, group, 2, 3, false);
        std::vector<float> k(size_t(page) * H * d), v(k.size());
        for (size_t r = 0; r < size_t(page) * H; ++r) {
          test::random_row(rng, d, k.data() + r * d);
          test::random_row(rng, d, v.data() + r * d);
        }
        // A few non-finite keys (quantized as 0, like quantize_row does).
        k[5] = NAN;
        k[size_t(3) * d + 7] = INFINITY;
        k[size_t(page) * d + 1] = -INFINITY;
        std::vector<int32_t> pages(page, 1), slots(page);
        for (int s = 0; s < page; ++s) slots[s] = s;
        write_bf16_tokens(p.view, page, pages.data(), slots.data(), k.data(), v.data());
        ref.bk = p.bk;
        ref.bv = p.bv;
        const ClipRatios clip{1.0f, 0.92f};
        demote_page(p.view, 1, 2, clip);
        demote_page_ref(ref.view, 1, 2, clip);
        ASSERT_EQ(p.kc, ref.kc) << "bits=" << bits << " page=" << page << " d=" << d;
        ASSERT_EQ(p.kp, ref.kp);
        ASSERT_EQ(p.vc, ref.vc);
        ASSERT_EQ(p.vp, ref.vp);
        // Values: the per-token rows of write_quant_tokens on the BF16-rounded rows.
        for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
        std::vector<int32_t> qpages(page, 2);
        write_quant_tokens_ref(rows.view, page, qpages.data(), slots.data(), k.data(), v.data(), clip);
        ASSERT_EQ(p.vc, rows.vc);
        ASSERT_EQ(p.vp, rows.vp);
        // Keys: span by span, channel by channel.
        const QuantSpec cs{bits, kv::kKeySpan, ScaleDtype::kF16};
        std::vector<float> col(kv::kKeySpan), want(kv::kKeySpan);
        std::vector<uint8_t> cc(kv::kKeySpan);
        uint16_t par[2];
        for (int h = 0; h < H; ++h)
          for (int s0 = 0; s0 < page; s0 += kv::kKeySpan) {
            const uint16_t* sp = p.kp.data() + p.view.key_span_params_offset(2, h, s0);
            for (int c = 0; c < d; ++c) {
              for (int i = 0; i < kv::kKeySpan; ++i)
                col[i] = bf16_to_f32(p.bk[size_t(p.view.bf16_row_offset(1, h, s0 + i)) + c]);
              quantize_row(col.data(), kv::kKeySpan, cs, cc.data(), par);
              fake_quantize_rows(col.data(), 1, kv::kKeySpan, cs, want.data());
              ASSERT_EQ(sp[2 * c], par[0]) << "h=" << h << " s0=" << s0 << " c=" << c;
              ASSERT_EQ(sp[2 * c + 1], par[1]);
              for (int i = 0; i < kv::kKeySpan; ++i) {
                const uint8_t* rc = p.kc.data() + p.view.quant_row_index(2, h, s0 + i) * p.view.row_code_bytes();
                const int code = get_code(rc, c, group, bits);
                ASSERT_EQ(code, get_code(cc.data(), i, kv::kKeySpan, bits)) << "h=" << h << " slot=" << s0 + i << " c=" << c;
                // The simulation's dequantized value, bit for bit.
                ASSERT_EQ(f16_to_f32(sp[2 * c + 1]) + float(code) * f16_to_f32(sp[2 * c]), want[i]);
                ++checked;
              }
            }
          }
      }
  EXPECT_GT(checked, 100000);
}

TEST(Demotion, PerChannelKeysRejectBadInput) {
  Pools p(2, 64, 64, 2, 32, 2, 2, true);
  std::vector<float> k(size_t(64) * 2 * 64, 0.5f), v(k.size(), 0.25f);
  std::vector<int32_t> pages(64, 1), slots(64);
  for (int s = 0; s < 64; ++s) slots[s] = s;
  write_bf16_tokens(p.view, 64, pages.data(), slots.data(), k.data(), v.data());
  EXPECT_NO_THROW(demote_page(p.view, 1, 0, {1.0f, 0.92f}));
  EXPECT_NO_THROW(demote_page_ref(p.view, 1, 0, {1.0f, 1.0f}, 32));
  // Partial span, key clipping, token-wise quantized writes, page not a multiple of 32.
  EXPECT_THROW(demote_page(p.view, 1, 1, {1.0f, 1.0f}, 48), Error);
  EXPECT_THROW(demote_page_ref(p.view, 1, 1, {1.0f, 1.0f}, 40), Error);
  EXPECT_THROW(demote_page(p.view, 1, 1, {0.96f, 1.0f}), Error);
  EXPECT_THROW(demote_page_ref(p.view, 1, 1, {0.96f, 1.0f}), Error);
  EXPECT_THROW(write_quant_tokens(p.view, 1, pages.data(), slots.data(), k.data(), v.data(), {}), Error);
  EXPECT_THROW(write_quant_tokens_ref(p.view, 1, pages.data(), slots.data(), k.data(), v.data(), {}), Error);
  kv::PagedKvView bad = p.view;
  bad.page_size = 48;
  EXPECT_THROW(demote_page(bad, 1, 1, {1.0f, 1.0f}, 32), Error);
  EXPECT_THROW(demote_page_ref(bad, 1, 1, {1.0f, 1.0f}, 32), Error);
}

TEST(WriteThenAttend, DecodeMatchesDenseAttentionOnFakeQuantizedRows) {
  // The serving path end to end on one sequence: rows written through the
  // kernels into sink (BF16), middle (clip+quantize) and recent (BF16)
  // pages; decode attention must equal dense attention over the rows as the
  // simulation would produce them (BF16-rounded windows, clip + fake-quant middle).
  std::mt19937 rng(5);
  const int H = 2, d = 128, page = 16, hq = 8, sink = 16, mid = 48, recent = 21;
  const int T = sink + mid + recent;
  Pools p(H, d, page, 2, 128, 4, 3);
  std::vector<float> k(size_t(T) * H * d), v(k.size());
  for (size_t r = 0; r < size_t(T) * H; ++r) {
    test::random_row(rng, d, k.data() + r * d);
    test::random_row(rng, d, v.data() + r * d);
  }
  const ClipRatios clip{0.96f, 0.92f};
  std::vector<float> Kd(k.size()), Vd(v.size());
  const QuantSpec qs{2, 128, ScaleDtype::kF16};
  // Sink: BF16 page 3; middle: quant pages 2,0,1; recent: BF16 pages 0,2.
  const int32_t sink_pages[1] = {3}, mid_pages[3] = {2, 0, 1}, rec_pages[2] = {0, 2};
  for (int t = 0; t < T; ++t) {
    const float* kt = k.data() + size_t(t) * H * d;
    const float* vt = v.data() + size_t(t) * H * d;
    if (t < sink || t >= sink + mid) {
      const int i = t < sink ? t : t - sink - mid;
      const int32_t pg = t < sink ? sink_pages[i / page] : rec_pages[i / page];
      const int32_t sl = i % page;
      write_bf16_tokens(p.view, 1, &pg, &sl, kt, vt);
      for (size_t c = 0; c < size_t(H) * d; ++c) {
        Kd[size_t(t) * H * d + c] = bf16_to_f32(f32_to_bf16(kt[c]));
        Vd[size_t(t) * H * d + c] = bf16_to_f32(f32_to_bf16(vt[c]));
      }
    } else {
      const int i = t - sink;
      const int32_t pg = mid_pages[i / page], sl = i % page;
      write_quant_tokens(p.view, 1, &pg, &sl, kt, vt, clip);
      for (int h = 0; h < H; ++h) {
        std::vector<float> rk(kt + h * d, kt + (h + 1) * d), rv(vt + h * d, vt + (h + 1) * d);
        clip_row(rk.data(), d, clip.k);
        clip_row(rv.data(), d, clip.v);
        fake_quantize_rows(rk.data(), 1, d, qs, Kd.data() + (size_t(t) * H + h) * d);
        fake_quantize_rows(rv.data(), 1, d, qs, Vd.data() + (size_t(t) * H + h) * d);
      }
    }
  }
  std::vector<int32_t> ip_s{0, 1}, ip_m{0, 3}, ip_r{0, 2}, ix_s{3}, ix_m{2, 0, 1}, ix_r{0, 2};
  std::vector<int32_t> l_s{sink}, l_m{mid}, l_r{recent};
  p.view.batch = 1;
  p.view.sink = {ip_s.data(), ix_s.data(), l_s.data()};
  p.view.mid = {ip_m.data(), ix_m.data(), l_m.data()};
  p.view.recent = {ip_r.data(), ix_r.data(), l_r.data()};
  auto q = random_vec(rng, size_t(hq) * d, 1.5f);
  std::vector<float> o(q.size(), NAN), lse(hq, NAN);
  const float sm = 1.0f / std::sqrt(float(d));
  // Exact (float) kernel tier: the default avx512vnni kernel has its own,
  // bounded tier, tested in test_attention.cpp.
  if (!detail::active_kernels().exact) detail::force_kernels(detail::avx512_kernels());
  decode_attention(p.view, q.data(), hq, sm, o.data(), lse.data());
  detail::force_kernels(nullptr);
  std::vector<double> ref(d);
  for (int g = 0; g < hq; ++g) {
    const double l = test::dense_attention(q.data() + size_t(g) * d, Kd.data(), Vd.data(), T, H, g / (hq / H), d, sm,
                                           ref.data());
    EXPECT_NEAR(lse[g], l, 1e-4);
    for (int c = 0; c < d; ++c) ASSERT_NEAR(o[size_t(g) * d + c], ref[c], 2e-5 + 2e-5 * std::fabs(ref[c]));
  }
}

}  // namespace
}  // namespace oscar::kernels::cpu
