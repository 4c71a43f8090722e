// Attention kernels: the reference against a naive dense softmax on the
// dequantized cache, and every optimized ISA path against the reference
// (kernel error tier: the kernel on packed data vs the reference on the
// dequantized data). Outputs are NaN-poisoned before every run; a NaN never
// passes (every comparison is written so NaN fails it). The same for the
// per-channel key format of kivi2 (KeyAxis::kChannel, "PerChannelKeys" tests).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/quant_format.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_impl.h"
#include "test_cache.h"

namespace oscar::kernels::cpu {
namespace {

using test::CacheSpec;
using test::make_cache;
using test::random_vec;
using test::TestCache;

// Tolerances (stated): reference vs dense fp64: |diff| <= 1e-6 (both fp64,
// only the region split differs). Optimized (fp32 accumulation, polynomial
// exp2, fp32 log-sum-exp merge) vs reference: |diff| <= 2e-5 + 2e-5*|ref| on
// o and lse, with |o| = O(1) by construction.
constexpr double kRefTol = 1e-6;
constexpr double kOptAbs = 2e-5, kOptRel = 2e-5;

bool close(double a, double ref, double abs_tol, double rel_tol) {
  return std::fabs(a - ref) <= abs_tol + rel_tol * std::fabs(ref);  // false for NaN
}

std::vector<const detail::RowKernels*> kernel_sets() {
  std::vector<const detail::RowKernels*> out{&detail::scalar_kernels()};
  if (auto* k = detail::avx2_kernels(); k && detail::cpu_supports(*k)) out.push_back(k);
  if (auto* k = detail::avx512_kernels(); k && detail::cpu_supports(*k)) out.push_back(k);
  if (auto* k = detail::avx512_vnni_kernels(); k && detail::cpu_supports(*k)) out.push_back(k);
  return out;
}

// Approximate tier (kernels with exact == false: integer dot products on the
// INT2 middle, attention_vnni.cpp). Tolerances derived from the error bound of
// the method, per output, on top of the f32 tier:
//  keys:   the query of each group is rounded to multiples of max|q| / R_q
//          (R_q = RowKernels::query_range, 127*256 for two int8 digits), so
//          the logit of a middle row t moves by at most
//          D_t = sm * sum_g (max_{j in g}|q_j| / (2 R_q)) * sum_{j in g} s_g c_tj
//          (the min term uses the exact sum of q). With D = max_t D_t every
//          probability moves by a factor in [e^-2D, e^2D], so
//          |d lse| <= D and |d o_j| <= (e^{2D} - 1) * sum_t pi_t |v_tj - o_j|;
//  values: w_t = pi_t s_t (s of row t's group of channel j) is rounded to
//          multiples of sw = max_span w / R_w, one scale per span of at most
//          RowKernels::weight_span consecutive rows (R_w = weight_range),
//          so |d w_t| <= min(sw/2, w_t) and |d o_j| <= 3 sum_t min(sw/2, w_t)
//          (codes <= 3), evaluated with w_t * e^{2D} (the perturbed pi).
struct ApproxTol {
  std::vector<double> lse;  // [B][hq]
  std::vector<double> o;    // [B][hq][d]
};

ApproxTol approx_tolerance(const detail::RowKernels& k, const TestCache& tc, const std::vector<float>& q, int hq,
                           float sm) {
  const CacheSpec& s = tc.spec;
  const int B = tc.batch(), d = s.d, hkv = s.hkv, group = hq / hkv, G = s.group, P = s.page;
  const int ng = d / G, cb = d * s.bits / 8;
  ApproxTol tol;
  tol.lse.assign(size_t(B) * hq, 0.0);
  tol.o.assign(size_t(B) * hq * d, 0.0);
  for (int b = 0; b < B; ++b) {
    const int T = tc.total(b), s0 = s.sink[b], nm = s.mid[b];
    if (T == 0) continue;
    for (int qh = 0; qh < hq; ++qh) {
      const int h = qh / group;
      const float* qv = q.data() + (size_t(b) * hq + qh) * d;
      // Softmax of the exact logits and output.
      std::vector<double> z(T), pi(T), o(d, 0.0);
      double zmax = -INFINITY;
      for (int t = 0; t < T; ++t) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double(qv[c]) * tc.K[b][(size_t(t) * hkv + h) * d + c];
        z[t] = dot * sm;
        zmax = std::max(zmax, z[t]);
      }
      double L = 0;
      for (int t = 0; t < T; ++t) L += (pi[t] = std::exp(z[t] - zmax));
      for (int t = 0; t < T; ++t) {
        pi[t] /= L;
        for (int c = 0; c < d; ++c) o[c] += pi[t] * tc.V[b][(size_t(t) * hkv + h) * d + c];
      }
      // Key side.
      std::vector<double> qmax(ng, 0.0);
      for (int c = 0; c < d; ++c) qmax[c / G] = std::max(qmax[c / G], std::fabs(double(qv[c])));
      double D = 0;
      for (int i = 0; i < nm; ++i) {
        const int32_t page = tc.idx[1][tc.indptr[1][b] + i / P];
        const int64_t row = (int64_t(page) * hkv + h) * P + i % P;
        const uint8_t* codes = tc.kc.data() + row * cb;
        const uint16_t* par = tc.kp.data() + row * ng * 2;
        double Dt = 0;
        for (int c = 0; c < d; ++c)
          Dt += qmax[c / G] / (2.0 * k.query_range) * f16_to_f32(par[2 * (c / G)]) * get_code(codes, c, G, s.bits);
        D = std::max(D, Dt * sm * (1 + 1e-6));
      }
      tol.lse[size_t(b) * hq + qh] = D;
      const double grow = std::exp(2 * D);
      double* ot = tol.o.data() + (size_t(b) * hq + qh) * d;
      for (int c = 0; c < d; ++c) {
        double dev = 0;
        for (int t = 0; t < T; ++t) dev += pi[t] * std::fabs(tc.V[b][(size_t(t) * hkv + h) * d + c] - o[c]);
        ot[c] = (grow - 1) * dev;
      }
      // Value side. The kernel's spans (<= weight_span consecutive middle rows
      // of one work item) are not known here: the scale of row t's span is at
      // most the max of w over the rows within weight_span - 1 of t.
      const int W = k.weight_span;
      for (int g = 0; g < ng; ++g) {
        std::vector<double> w(nm);
        for (int i = 0; i < nm; ++i) {
          const int32_t page = tc.idx[1][tc.indptr[1][b] + i / P];
          const int64_t row = (int64_t(page) * hkv + h) * P + i % P;
          w[i] = pi[s0 + i] * grow * f16_to_f32(tc.vp[row * ng * 2 + 2 * g]);
        }
        double err = 0;
        for (int i = 0; i < nm; ++i) {
          double wmax = 0;
          for (int j = std::max(0, i - W + 1); j < std::min(nm, i + W); ++j) wmax = std::max(wmax, w[j]);
          err += std::min(wmax / (2.0 * k.weight_range), w[i]);
        }
        for (int c = g * G; c < (g + 1) * G; ++c) ot[c] += 3.0 * err * (1 + 1e-6);
      }
    }
  }
  return tol;
}

struct ForceKernels {
  explicit ForceKernels(const detail::RowKernels* k) { detail::force_kernels(k); }
  ~ForceKernels() { detail::force_kernels(nullptr); }
};

std::string describe(const CacheSpec& s, int hq) {
  std::string r = "d=" + std::to_string(s.d) + " G=" + std::to_string(s.group) + " bits=" +
                  std::to_string(s.bits) + " page=" + std::to_string(s.page) + " hkv=" +
                  std::to_string(s.hkv) + " hq=" + std::to_string(hq) + " lens:";
  for (size_t b = 0; b < s.sink.size(); ++b)
    r += " (" + std::to_string(s.sink[b]) + "," + std::to_string(s.mid[b]) + "," + std::to_string(s.recent[b]) + ")";
  return r;
}

// The reference's output o / lse (decode, queries q [batch][hq][d]) against the naive dense
// softmax over the cache's dense copy (tc.K, tc.V: what the kernels must see), kRefTol; an empty
// sequence must give o = 0 and lse = -inf.
void expect_ref_matches_dense(const TestCache& tc, const std::vector<float>& q, int hq, float sm,
                              const std::vector<float>& o, const std::vector<float>& lse) {
  const CacheSpec& s = tc.spec;
  const int d = s.d;
  std::vector<double> ref(d);
  for (int b = 0; b < tc.batch(); ++b)
    for (int g = 0; g < hq; ++g) {
      const int idx = b * hq + g;
      if (tc.total(b) == 0) {
        EXPECT_TRUE(std::isinf(lse[idx]) && lse[idx] < 0);
        for (int c = 0; c < d; ++c) EXPECT_EQ(o[size_t(idx) * d + c], 0.0f);
        continue;
      }
      const double l = test::dense_attention(q.data() + size_t(idx) * d, tc.K[b].data(), tc.V[b].data(),
                                             tc.total(b), s.hkv, g / (hq / s.hkv), d, sm, ref.data());
      EXPECT_TRUE(close(lse[idx], l, kRefTol, kRefTol)) << describe(s, hq) << " lse " << lse[idx] << " vs " << l;
      for (int c = 0; c < d; ++c)
        ASSERT_TRUE(close(o[size_t(idx) * d + c], ref[c], kRefTol, kRefTol))
            << describe(s, hq) << " b=" << b << " g=" << g << " c=" << c;
    }
}

TEST(DecodeAttentionRef, MatchesDenseSoftmaxOnDequantizedCache) {
  std::mt19937 rng(1);
  for (int d : {64, 128, 256})
    for (int bits : {2, 4}) {
      CacheSpec s;
      s.d = d;
      s.bits = bits;
      s.group = d == 64 ? 32 : 64;
      s.hkv = 2;
      s.page = 16;
      s.sink = {5, 0, 16};
      s.mid = {37, 20, 0};
      s.recent = {9, 0, 1};
      const int hq = 6;
      TestCache tc = make_cache(s, rng);
      const int B = tc.batch();
      auto q = random_vec(rng, size_t(B) * hq * d, 1.0f);
      std::vector<float> o(q.size(), NAN), lse(size_t(B) * hq, NAN);
      const float sm = 1.0f / std::sqrt(float(d));
      decode_attention_ref(tc.view, q.data(), hq, sm, o.data(), lse.data());
      expect_ref_matches_dense(tc, q, hq, sm, o, lse);
      if (HasFatalFailure()) return;
    }
}

// One sweep case: optimized (each ISA) vs reference.
// Two sequences whose (sink, middle, recent) lengths are patterns a and b.
void set_two_sequences(CacheSpec& s, const std::vector<int>& a, const std::vector<int>& b) {
  s.sink = {a[0], b[0]};
  s.mid = {a[1], b[1]};
  s.recent = {a[2], b[2]};
}

void check_decode_case(const CacheSpec& s, int hq, std::mt19937& rng) {
  TestCache tc = make_cache(s, rng);
  const int B = tc.batch(), d = s.d;
  auto q = random_vec(rng, size_t(B) * hq * d, 1.5f);
  const float sm = 1.0f / std::sqrt(float(d));
  std::vector<float> o_ref(q.size(), NAN), lse_ref(size_t(B) * hq, NAN);
  decode_attention_ref(tc.view, q.data(), hq, sm, o_ref.data(), lse_ref.data());
  ApproxTol tol;
  for (const detail::RowKernels* k0 : kernel_sets()) {
    // Per-channel keys always run the float kernels (the VNNI set hands them
    // to its exact AVX-512 kernel): the f32 tier, no approximate allowance.
    detail::RowKernels exact_view = *k0;
    if (s.key_channel) exact_view.exact = true;
    const detail::RowKernels* k = &exact_view;
    ForceKernels force(k0);
    if (!k->exact && tol.lse.empty()) tol = approx_tolerance(*k, tc, q, hq, sm);
    std::vector<float> o(q.size(), NAN), lse(size_t(B) * hq, NAN);
    decode_attention(tc.view, q.data(), hq, sm, o.data(), lse.data());
    for (size_t i = 0; i < lse.size(); ++i) {
      if (std::isinf(lse_ref[i])) {
        ASSERT_EQ(lse[i], lse_ref[i]) << k->name << " " << describe(s, hq);
        continue;
      }
      const double extra = k->exact ? 0.0 : tol.lse[i];
      ASSERT_TRUE(close(lse[i], lse_ref[i], kOptAbs + extra, kOptRel))
          << k->name << " " << describe(s, hq) << " lse[" << i << "] " << lse[i] << " vs " << lse_ref[i]
          << " (approx bound " << extra << ")";
    }
    if (!k->exact && std::getenv("OSCAR_TEST_VERBOSE")) {
      double emax = 0, bmax = 0, ratio = 0, omax = 0;
      for (size_t i = 0; i < o.size(); ++i) {
        const double e = std::fabs(o[i] - o_ref[i]);
        emax = std::max(emax, e);
        bmax = std::max(bmax, tol.o[i]);
        omax = std::max(omax, double(std::fabs(o_ref[i])));
        ratio = std::max(ratio, e / (tol.o[i] + 1e-30));
      }
      std::printf("%s: max err %.3g, max bound %.3g, max err/bound %.3g, max |o| %.3g\n", describe(s, hq).c_str(), emax, bmax, ratio, omax);
    }
    for (size_t i = 0; i < o.size(); ++i) {
      const double extra = k->exact ? 0.0 : tol.o[i];
      ASSERT_TRUE(close(o[i], o_ref[i], kOptAbs + extra, kOptRel))
          << k->name << " " << describe(s, hq) << " o[" << i << "] " << o[i] << " vs " << o_ref[i]
          << " (approx bound " << extra << ")";
    }
  }
}

TEST(DecodeAttention, MatchesReferenceAcrossShapesAndRegions) {
  std::mt19937 rng(7);
  // Region patterns (sink, mid, recent) per sequence: empty regions, odd
  // lengths, exact page multiples and lengths one past a page boundary.
  const std::vector<std::vector<int>> patterns = {
      {0, 0, 0}, {7, 0, 0}, {0, 33, 0}, {0, 0, 5}, {4, 49, 0}, {0, 17, 31}, {16, 64, 16}, {3, 65, 1}, {64, 129, 33}};
  int cases = 0;
  for (int d : {64, 128, 256})
    for (int group : {32, 64, 128}) {
      if (group > d) continue;
      for (int bits : {2, 4})
        for (int page : {16, 64})
          for (int gqa : {1, 2, 3, 4, 8}) {
            CacheSpec s;
            s.d = d;
            s.group = group;
            s.bits = bits;
            s.page = page;
            s.hkv = (gqa == 8 || d == 256) ? 1 : 2;
            // Two sequences per case with different region patterns.
            set_two_sequences(s, patterns[cases % patterns.size()], patterns[(cases * 5 + 3) % patterns.size()]);
            check_decode_case(s, s.hkv * gqa, rng);
            if (HasFatalFailure()) return;
            ++cases;
          }
    }
  EXPECT_GT(cases, 100);
}

// Page centering: every middle key is x̂ + δ_h(t) of its page. The reference against the dense
// softmax over those keys, then every optimized kernel (per-page partials) against the
// reference, across shapes, GQA, pages and splits.
TEST(DecodeAttentionRef, PageCenteredMiddleMatchesDense) {
  std::mt19937 rng(31);
  for (int d : {64, 128}) {
    CacheSpec s;
    s.center_start = d == 128;  // the angle rows through MidCenter::angle_start
    s.d = d;
    s.group = d == 64 ? 32 : 128;
    s.page = 16;
    s.hkv = 2;
    s.center_pairs = 5;
    s.sink = {5, 16, 0};
    s.mid = {37, 48, 0};
    s.recent = {9, 1, 3};
    const int hq = 4;
    TestCache tc = make_cache(s, rng);
    const int B = tc.batch();
    auto q = random_vec(rng, size_t(B) * hq * d, 1.0f);
    std::vector<float> o(q.size(), NAN), lse(size_t(B) * hq, NAN);
    const float sm = 1.0f / std::sqrt(float(d));
    decode_attention_ref(tc.view, q.data(), hq, sm, o.data(), lse.data());
    // Without the centre the result must differ (the test can fail).
    kv::PagedKvView plain = tc.view;
    plain.center = {};
    std::vector<float> o_plain(q.size(), NAN), lse_plain(size_t(B) * hq, NAN);
    decode_attention_ref(plain, q.data(), hq, sm, o_plain.data(), lse_plain.data());
    expect_ref_matches_dense(tc, q, hq, sm, o, lse);
    if (HasFatalFailure()) return;
    double moved = 0;
    for (int b = 0; b < B; ++b)
      for (int g = 0; g < hq; ++g)
        if (s.mid[b] > 0) moved = std::max(moved, double(std::fabs(lse[b * hq + g] - lse_plain[b * hq + g])));
    EXPECT_GT(moved, 0.5) << "the centre did not change the logits";
  }
}

TEST(DecodeAttention, PageCenteredMatchesReference) {
  std::mt19937 rng(37);
  const std::vector<std::vector<int>> patterns = {{0, 33, 0}, {4, 49, 7}, {16, 64, 16}, {3, 65, 1}, {64, 129, 33}, {2, 0, 3}};
  int cases = 0;
  for (int d : {64, 128, 256})
    for (int bits : {2, 4})
      for (int page : {16, 64})
        for (int gqa : {1, 3, 8, 12}) {
          CacheSpec s;
          s.d = d;
          s.group = d == 64 ? 32 : 64;
          s.bits = bits;
          s.page = page;
          s.hkv = gqa >= 8 || d == 256 ? 1 : 2;
          s.center_pairs = 1 + cases % 6;
          s.center_start = cases % 2 == 1;
          set_two_sequences(s, patterns[cases % patterns.size()], patterns[(cases * 5 + 3) % patterns.size()]);
          check_decode_case(s, s.hkv * gqa, rng);
          if (HasFatalFailure()) return;
          ++cases;
        }
  EXPECT_GE(cases, 48);
  // Long middle: many splits per KV head, each split several pages.
  CacheSpec s;
  s.page = 64;
  s.center_pairs = 8;
  s.center_start = true;
  s.sink = {64, 3};
  s.mid = {2880, 64};
  s.recent = {300, 0};
  for (int threads : {1, 3}) {
    set_num_threads(threads);
    check_decode_case(s, 12, rng);
  }
  set_num_threads(0);
}

TEST(DecodeAttention, LongContextAndManySplits) {
  // Long middle (many splits per KV head, several threads), batch 3 with
  // very different lengths, GQA 12 (two query sets per KV head).
  std::mt19937 rng(11);
  CacheSpec s;
  s.d = 128;
  s.group = 128;
  s.bits = 2;
  s.page = 64;
  s.hkv = 2;
  s.sink = {64, 64, 3};
  s.mid = {2880, 0, 64};
  s.recent = {300, 256, 0};
  for (int threads : {1, 3}) {
    set_num_threads(threads);
    check_decode_case(s, 24, rng);
  }
  set_num_threads(0);  // no-op: keep the last count
}

TEST(DecodeAttention, ValuesLargeLogitsStayFinite) {
  // Peaky softmax: logits in the hundreds must not overflow the base-2 state.
  std::mt19937 rng(5);
  CacheSpec s;
  s.d = 64;
  s.group = 64;
  s.sink = {10};
  s.mid = {100};
  s.recent = {20};
  TestCache tc = make_cache(s, rng);
  auto q = random_vec(rng, size_t(4) * 64, 40.0f);
  std::vector<float> o_ref(q.size(), NAN), lse_ref(4, NAN);
  decode_attention_ref(tc.view, q.data(), 4, 0.125f, o_ref.data(), lse_ref.data());
  for (const detail::RowKernels* k : kernel_sets()) {
    ForceKernels force(k);
    std::vector<float> o(q.size(), NAN), lse(4, NAN);
    decode_attention(tc.view, q.data(), 4, 0.125f, o.data(), lse.data());
    ApproxTol tol;
    if (!k->exact) tol = approx_tolerance(*k, tc, q, 4, 0.125f);
    for (int i = 0; i < 4; ++i)
      EXPECT_TRUE(close(lse[i], lse_ref[i], 1e-4 + (k->exact ? 0.0 : tol.lse[i]), 1e-5)) << k->name;
    for (size_t i = 0; i < o.size(); ++i)
      ASSERT_TRUE(close(o[i], o_ref[i], 1e-4 + (k->exact ? 0.0 : tol.o[i]), 1e-4)) << k->name << " " << i;
  }
}

// A corrupt cache row (a NaN key or value scale of a VALID middle token) or a
// NaN in one query reaches the output of every kernel set as it reaches the
// reference's: NaN exactly where the reference has NaN (a key scale or the
// query: every channel and the lse of the affected heads; a value scale: the
// channels of its group), every other output close (loose 1e-2 here, which
// covers the approximate tier: the point is the NaN pattern).
TEST(DecodeAttention, NanInputsReachTheOutput) {
  std::mt19937 rng(11);
  enum Kind { kValueScale, kKeyScale, kQuery };
  int runs = 0;
  for (int group : {128, 32})
    for (Kind kind : {kValueScale, kKeyScale, kQuery})
      for (int tok : {37, 199}) {  // a middle row inside a tile; the middle's last row
        CacheSpec s;
        s.hkv = 2;
        s.d = 128;
        s.group = group;
        s.page = 16;
        s.sink = {4, 0};
        s.mid = {200, 120};
        s.recent = {20, 0};
        TestCache tc = make_cache(s, rng);
        const int hq = 8, gqa = hq / s.hkv, h = 1, b = 0, ng = s.d / s.group, gm = ng - 1;
        auto q = random_vec(rng, size_t(2) * hq * s.d, 1.5f);
        if (kind == kQuery) {
          q[(size_t(b) * hq + h * gqa + 1) * s.d + 9] = NAN;
        } else {
          const int32_t page = tc.idx[1][size_t(tc.indptr[1][b] + tok / s.page)];
          const int64_t row = tc.view.quant_row_index(page, h, tok % s.page);
          (kind == kKeyScale ? tc.kp : tc.vp)[size_t((row * ng + gm) * 2)] = test::kF16NaN;
        }
        const float sm = 1.0f / std::sqrt(float(s.d));
        std::vector<float> o_ref(q.size(), NAN), lse_ref(size_t(2) * hq, NAN);
        decode_attention_ref(tc.view, q.data(), hq, sm, o_ref.data(), lse_ref.data());
        size_t nan_ref = 0;
        for (float x : o_ref) nan_ref += std::isnan(x);
        const size_t expect = kind == kQuery ? size_t(s.d) : kind == kKeyScale ? size_t(gqa) * s.d : size_t(gqa) * s.group;
        ASSERT_EQ(nan_ref, expect) << "the reference does not see the NaN";
        for (const detail::RowKernels* k : kernel_sets()) {
          ForceKernels force(k);
          std::vector<float> o(q.size(), 0.0f), lse(size_t(2) * hq, 0.0f);  // not NaN-poisoned: NaN must come from the kernel
          decode_attention(tc.view, q.data(), hq, sm, o.data(), lse.data());
          size_t mismatch = 0;
          for (size_t i = 0; i < o.size(); ++i)
            mismatch += std::isnan(o_ref[i]) ? !std::isnan(o[i]) : !close(o[i], o_ref[i], 1e-2, 1e-2);
          for (size_t i = 0; i < lse.size(); ++i)
            mismatch += std::isnan(lse_ref[i]) ? !std::isnan(lse[i]) : !close(lse[i], lse_ref[i], 1e-2, 1e-2);
          EXPECT_EQ(mismatch, 0u) << k->name << " G=" << group << " kind " << int(kind) << " token " << tok;
          ++runs;
        }
      }
  EXPECT_GE(runs, 12);
}

TEST(DecodeAttention, RejectsBadViews) {
  std::mt19937 rng(3);
  CacheSpec s;
  s.sink = {4};
  s.mid = {20};
  s.recent = {4};
  TestCache tc = make_cache(s, rng);
  std::vector<float> q(4 * 128), o(4 * 128);
  kv::PagedKvView bad = tc.view;
  EXPECT_THROW(decode_attention(bad, q.data(), 3, 1.0f, o.data(), nullptr), Error);  // 3 % 2 != 0
  bad.head_dim = 96;
  EXPECT_THROW(decode_attention(bad, q.data(), 4, 1.0f, o.data(), nullptr), Error);
  bad = tc.view;
  bad.page_size = 24;
  EXPECT_THROW(decode_attention_ref(bad, q.data(), 4, 1.0f, o.data(), nullptr), Error);
  bad = tc.view;
  bad.bits = 3;
  EXPECT_THROW(decode_attention(bad, q.data(), 4, 1.0f, o.data(), nullptr), Error);
  bad = tc.view;
  bad.group_size = 256;
  EXPECT_THROW(decode_attention(bad, q.data(), 4, 1.0f, o.data(), nullptr), Error);
  // Region length inconsistent with its page count.
  std::vector<int32_t> len = tc.len[1];
  len[0] = 40;  // 3 pages of 16 needed, 2 present
  bad = tc.view;
  bad.mid.len = len.data();
  EXPECT_THROW(decode_attention(bad, q.data(), 4, 1.0f, o.data(), nullptr), Error);
  bad = tc.view;
  bad.quant.k_codes = nullptr;
  EXPECT_THROW(decode_attention(bad, q.data(), 4, 1.0f, o.data(), nullptr), Error);
}

// ---- Per-channel keys (KIVI, KeyAxis::kChannel) ----------------------------

std::string describe_kchan(const CacheSpec& s, int hq) { return "per-channel keys " + describe(s, hq); }

TEST(DecodeAttentionRef, PerChannelKeysMatchDenseSoftmax) {
  // The reference on the per-channel key format against a dense softmax on
  // the rows dequantized by the fixture (quantize_row on each channel's span).
  std::mt19937 rng(41);
  for (int d : {64, 128})
    for (int page : {32, 64}) {
      CacheSpec s;
      s.d = d;
      s.group = 32;
      s.page = page;
      s.hkv = 2;
      s.key_channel = true;
      s.sink = {0, 5, 3};
      s.mid = {97, 0, 64};
      s.recent = {9, 7, 0};
      const int hq = 6;
      TestCache tc = make_cache(s, rng);
      const int B = tc.batch();
      auto q = random_vec(rng, size_t(B) * hq * d, 1.0f);
      std::vector<float> o(q.size(), NAN), lse(size_t(B) * hq, NAN);
      const float sm = 1.0f / std::sqrt(float(d));
      decode_attention_ref(tc.view, q.data(), hq, sm, o.data(), lse.data());
      std::vector<double> ref(d);
      for (int b = 0; b < B; ++b)
        for (int g = 0; g < hq; ++g) {
          const int idx = b * hq + g;
          const double l = test::dense_attention(q.data() + size_t(idx) * d, tc.K[b].data(), tc.V[b].data(),
                                                 tc.total(b), s.hkv, g / (hq / s.hkv), d, sm, ref.data());
          ASSERT_TRUE(close(lse[idx], l, kRefTol, kRefTol)) << describe_kchan(s, hq) << " lse " << lse[idx] << " vs " << l;
          for (int c = 0; c < d; ++c)
            ASSERT_TRUE(close(o[size_t(idx) * d + c], ref[c], kRefTol, kRefTol))
                << describe_kchan(s, hq) << " b=" << b << " g=" << g << " c=" << c;
        }
      // The per-channel params matter: read as per-token rows the same bytes
      // give other logits (guards against a reference that ignores key_axis).
      kv::PagedKvView as_rows = tc.view;
      as_rows.key_axis = kv::KeyAxis::kToken;
      std::vector<float> lse2(size_t(B) * hq, NAN), o2(q.size(), NAN);
      decode_attention_ref(as_rows, q.data(), hq, sm, o2.data(), lse2.data());
      EXPECT_FALSE(close(lse2[0], lse[0], 1e-3, 1e-3)) << describe_kchan(s, hq);
    }
}

TEST(DecodeAttention, PerChannelKeysMatchReferenceAcrossShapes) {
  // Optimized (every ISA) vs the reference on fresh random caches: head_dim
  // 64 and 128 (and 256), GQA 1..8, pages of 32/64/128, middles of odd length, ending
  // one past / one before a span or page boundary, empty middles.
  std::mt19937 rng(43);
  const std::vector<std::vector<int>> patterns = {
      {0, 0, 0},   {0, 33, 0},   {0, 31, 5},   {7, 0, 12}, {0, 64, 128}, {0, 65, 1},
      {3, 127, 9}, {0, 129, 33}, {16, 96, 0},  {0, 1, 0},  {5, 191, 130}, {0, 256, 64}};
  int cases = 0;
  for (int d : {64, 128, 256})
    for (int page : {32, 64, 128})
      for (int gqa : {1, 2, 3, 4, 5, 6, 7, 8}) {
        if (d == 256 && gqa % 3 != 1) continue;  // d = 256 (runtime plan): GQA 1, 4, 7
        CacheSpec s;
        s.d = d;
        s.group = 32;
        s.bits = 2;
        s.page = page;
        s.key_channel = true;
        s.hkv = gqa >= 5 || d == 256 ? 1 : 2;
        set_two_sequences(s, patterns[cases % patterns.size()], patterns[(cases * 7 + 5) % patterns.size()]);
        check_decode_case(s, s.hkv * gqa, rng);
        if (HasFatalFailure()) return;
        ++cases;
      }
  EXPECT_EQ(cases, 57);
}

TEST(DecodeAttention, PerChannelKeysLongContextManySplitsAndInt4) {
  std::mt19937 rng(47);
  CacheSpec s;
  s.d = 128;
  s.group = 32;
  s.page = 64;
  s.hkv = 2;
  s.key_channel = true;
  s.sink = {0, 0};
  s.mid = {2880, 64};
  s.recent = {150, 128};
  for (int threads : {1, 3}) {
    set_num_threads(threads);
    check_decode_case(s, 8, rng);
    if (HasFatalFailure()) return;
  }
  // 4-bit codes and group 64 (runtime plan, not the compile-time kivi2 ones).
  s.bits = 4;
  s.group = 64;
  s.mid = {320, 97};
  check_decode_case(s, 4, rng);
}

TEST(DecodeAttention, PerChannelKeysRejectPagesNotMultipleOf32) {
  std::mt19937 rng(3);
  CacheSpec s;
  s.d = 64;
  s.group = 32;
  s.page = 64;
  s.key_channel = true;
  s.sink = {0};
  s.mid = {64};
  s.recent = {4};
  TestCache tc = make_cache(s, rng);
  std::vector<float> q(4 * 64), o(4 * 64);
  EXPECT_NO_THROW(decode_attention(tc.view, q.data(), 4, 1.0f, o.data(), nullptr));
  kv::PagedKvView bad = tc.view;
  bad.page_size = 48;  // a multiple of 16, not of 32
  for (int ref = 0; ref < 2; ++ref) {
    try {
      if (ref)
        decode_attention_ref(bad, q.data(), 4, 1.0f, o.data(), nullptr);
      else
        decode_attention(bad, q.data(), 4, 1.0f, o.data(), nullptr);
      ADD_FAILURE() << "page 48 with per-channel keys accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("multiple of 32"), std::string::npos) << e.what();
    }
  }
  bad = tc.view;
  bad.key_axis = static_cast<kv::KeyAxis>(7);
  EXPECT_THROW(decode_attention(bad, q.data(), 4, 1.0f, o.data(), nullptr), Error);
}

// ---- Prefill ---------------------------------------------------------------

struct PrefillCase {
  CacheSpec spec;
  int hq, cached, n;
};

void check_prefill(const PrefillCase& pc, std::mt19937& rng, bool check_dense) {
  TestCache tc = make_cache(pc.spec, rng);
  const int d = pc.spec.d, hkv = pc.spec.hkv, hq = pc.hq, n = pc.n;
  auto q = random_vec(rng, size_t(n) * hq * d, 1.5f);
  auto kn = random_vec(rng, size_t(n) * hkv * d, 1.0f);
  auto vn = random_vec(rng, size_t(n) * hkv * d, 1.0f);
  const float sm = 1.0f / std::sqrt(float(d));
  std::vector<float> o_ref(q.size(), NAN);
  prefill_attention_ref(tc.view, 0, pc.cached, q.data(), kn.data(), vn.data(), n, hq, sm, o_ref.data());
  const std::string what = describe(pc.spec, hq) + " cached=" + std::to_string(pc.cached) + " n=" + std::to_string(n);
  if (check_dense) {
    // Dense keys: the first `cached` stored rows, then the chunk's own rows.
    const int T = pc.cached + n;
    std::vector<float> K(size_t(T) * hkv * d), V(K.size());
    std::copy_n(tc.K[0].data(), size_t(pc.cached) * hkv * d, K.data());
    std::copy_n(tc.V[0].data(), size_t(pc.cached) * hkv * d, V.data());
    std::copy(kn.begin(), kn.end(), K.begin() + size_t(pc.cached) * hkv * d);
    std::copy(vn.begin(), vn.end(), V.begin() + size_t(pc.cached) * hkv * d);
    std::vector<double> ref(d);
    for (int i = 0; i < n; ++i)
      for (int g = 0; g < hq; ++g) {
        test::dense_attention(q.data() + (size_t(i) * hq + g) * d, K.data(), V.data(), pc.cached + i + 1, hkv,
                              g / (hq / hkv), d, sm, ref.data());
        for (int c = 0; c < d; ++c)
          ASSERT_TRUE(close(o_ref[(size_t(i) * hq + g) * d + c], ref[c], kRefTol, kRefTol)) << what << " i=" << i;
      }
  }
  for (const detail::RowKernels* k : kernel_sets()) {
    ForceKernels force(k);
    std::vector<float> o(q.size(), NAN);
    prefill_attention(tc.view, 0, pc.cached, q.data(), kn.data(), vn.data(), n, hq, sm, o.data());
    for (size_t i = 0; i < o.size(); ++i)
      ASSERT_TRUE(close(o[i], o_ref[i], kOptAbs, kOptRel)) << k->name << " " << what << " o[" << i << "] " << o[i] << " vs " << o_ref[i];
  }
}

TEST(PrefillAttentionRef, MatchesDenseCausalSoftmax) {
  std::mt19937 rng(21);
  PrefillCase pc;
  pc.spec.d = 64;
  pc.spec.group = 32;
  pc.spec.hkv = 2;
  pc.spec.sink = {6};
  pc.spec.mid = {40};
  pc.spec.recent = {11};
  pc.hq = 6;
  for (int cached : {0, 4, 6, 30, 57}) {
    pc.cached = cached;
    pc.n = 13;
    check_prefill(pc, rng, /*check_dense=*/true);
  }
}

TEST(PrefillAttention, PageCenteredMiddleMatchesDenseAndReference) {
  // Cached middle pages with page centering: reference vs dense (keys x̂ + δ), then every
  // optimized kernel vs the reference, over several cached lengths and shapes.
  std::mt19937 rng(29);
  for (int d : {64, 128})
    for (int gqa : {1, 4}) {
      PrefillCase pc;
      pc.spec.d = d;
      pc.spec.group = d == 64 ? 32 : 128;
      pc.spec.hkv = 2;
      pc.spec.page = 16;
      pc.spec.center_pairs = 3;
      pc.spec.sink = {6};
      pc.spec.mid = {40};
      pc.spec.recent = {11};
      pc.hq = 2 * gqa;
      for (int cached : {6, 30, 57}) {
        pc.cached = cached;
        pc.n = 9;
        check_prefill(pc, rng, /*check_dense=*/true);
        if (HasFatalFailure()) return;
      }
    }
}

TEST(PrefillAttention, MatchesReferenceAcrossShapes) {
  std::mt19937 rng(23);
  for (int d : {64, 128, 256})
    for (int bits : {2, 4})
      for (int gqa : {1, 3, 4, 8, 12}) {
        PrefillCase pc;
        pc.spec.d = d;
        pc.spec.bits = bits;
        pc.spec.group = d == 64 ? 32 : 128;
        pc.spec.page = gqa % 2 ? 16 : 64;
        pc.spec.hkv = gqa >= 8 ? 1 : 2;
        pc.spec.sink = {5};
        pc.spec.mid = {gqa * 11};
        pc.spec.recent = {7};
        pc.hq = pc.spec.hkv * gqa;
        pc.cached = 5 + gqa * 11 + (gqa % 2 ? 7 : 3);  // all or part of the recent window
        pc.n = 1 + (gqa * 7) % 19;
        check_prefill(pc, rng, /*check_dense=*/false);
        if (HasFatalFailure()) return;
      }
}

TEST(PrefillAttention, LongChunkAcrossKeyBlocksAndTileBlocks) {
  // n and cached spanning several 256-row key chunks and several 16-tile
  // work items; GQA 3 (tiles of 2 tokens x 3 heads) and MHA (8 tokens).
  std::mt19937 rng(29);
  for (int gqa : {3, 1}) {
    PrefillCase pc;
    pc.spec.d = 64;
    pc.spec.group = 64;
    pc.spec.page = 64;
    pc.spec.hkv = 2;
    pc.spec.sink = {64};
    pc.spec.mid = {330};
    pc.spec.recent = {70};
    pc.hq = 2 * gqa;
    pc.cached = 64 + 330 + 50;
    pc.n = 531;
    check_prefill(pc, rng, /*check_dense=*/gqa == 3);
    if (HasFatalFailure()) return;
  }
}

TEST(PrefillAttention, PerChannelKeysMatchReference) {
  // Cached middle with per-channel keys, cut at arbitrary cached lengths
  // (inside a span, at a span boundary, the whole cache).
  std::mt19937 rng(53);
  for (int d : {64, 128})
    for (int gqa : {1, 3, 8}) {
      PrefillCase pc;
      pc.spec.d = d;
      pc.spec.group = 32;
      pc.spec.page = 64;
      pc.spec.key_channel = true;
      pc.spec.hkv = gqa == 8 ? 1 : 2;
      pc.spec.sink = {0};
      pc.spec.mid = {128 + gqa * 11};
      pc.spec.recent = {70};
      pc.hq = pc.spec.hkv * gqa;
      for (int cached : {0, 17, 64, 128 + gqa * 11 - 5, 128 + gqa * 11 + 70}) {
        pc.cached = cached;
        pc.n = 1 + (gqa * 5 + cached) % 23;
        check_prefill(pc, rng, /*check_dense=*/gqa == 3);
        if (HasFatalFailure()) return;
      }
    }
}

TEST(PrefillAttention, RejectsBadArguments) {
  std::mt19937 rng(2);
  CacheSpec s;
  s.sink = {4};
  s.mid = {0};
  s.recent = {4};
  TestCache tc = make_cache(s, rng);
  std::vector<float> q(4 * 128), kn(2 * 128), vn(2 * 128), o(4 * 128);
  EXPECT_THROW(prefill_attention(tc.view, 0, 9, q.data(), kn.data(), vn.data(), 1, 2, 1.0f, o.data()), Error);
  EXPECT_THROW(prefill_attention(tc.view, 1, 0, q.data(), kn.data(), vn.data(), 1, 2, 1.0f, o.data()), Error);
  EXPECT_THROW(prefill_attention_ref(tc.view, 0, -1, q.data(), kn.data(), vn.data(), 1, 2, 1.0f, o.data()), Error);
}

}  // namespace
}  // namespace oscar::kernels::cpu
