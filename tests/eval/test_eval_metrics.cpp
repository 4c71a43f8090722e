// The evaluation's local error views (eval/eval.h), checked against a direct
// computation: the attention-output error before o_proj (o_err) and after it
// (proj_err, W_o·o_quant vs W_o·o_bf16), on a one-layer random model where the
// layer's inputs are known exactly (they do not depend on any earlier
// quantized layer).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/cpu/backend_cpu.h"
#include "core/calibration.h"
#include "core/half.h"
#include "core/quantizer.h"
#include "eval/eval.h"
#include "kv/quant_methods.h"
#include "model/calib_forward.h"
#include "model/fold_rotation.h"
#include "model/forward_random.h"

namespace oscar {
namespace {

constexpr int kSink = 16, kRecent = 32, kPage = 16, kT = 160;
constexpr int kScoreFrom = kSink + kRecent + kPage;

std::vector<int32_t> random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = int32_t(rng() % vocab);
  return t;
}

kv::KvMethod naive_method(const model::ModelWeights& w, int sink, int recent) {
  kv::KvMethod m;
  m.label = "int2-naive";
  m.kind = kv::KvMethod::Kind::kRow;
  m.calib = std::make_shared<Calibration>(
      data_free_calibration(Composition::kNone, model::model_fingerprint(w), 1.0f, 1.0f, 2, 64));
  m.bits = 2;
  m.group_size = 64;
  m.sink = sink;
  m.recent = recent;
  return m;
}

struct CaptureQkv : model::DenseHooks {
  std::vector<float> q, k, v;
  int Hq = 0, Hkv = 0, d = 0;
  void on_qkv(int layer, float* q_, float* k_, float* v_, int T) override {
    if (layer != 0) return;
    q.assign(q_, q_ + size_t(T) * Hq * d);
    k.assign(k_, k_ + size_t(T) * Hkv * d);
    v.assign(v_, v_ + size_t(T) * Hkv * d);
  }
};

float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

TEST(EvalMetrics, ProjErrMatchesDirectComputation) {
  model::ModelConfig cfg = model::tiny_config(model::Arch::kLlama);
  cfg.n_layers = 1;
  const auto w = model::random_weights(cfg, 21);
  const int Hq = cfg.n_heads, Hkv = cfg.n_kv_heads, d = cfg.head_dim, H = cfg.hidden,
            group = Hq / Hkv;
  ASSERT_NE(H, Hq * d);  // W_o is not square: proj_err is not o_err in disguise
  const auto tokens = random_tokens(kT, cfg.vocab_size, 5);
  auto be = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  model::DenseForward fwd(w, *be);

  CaptureQkv cap;
  cap.Hq = Hq, cap.Hkv = Hkv, cap.d = d;
  fwd.run(tokens, &cap, nullptr);
  ASSERT_EQ(cap.q.size(), size_t(kT) * Hq * d);

  const kv::KvMethod m = naive_method(w, kSink, kRecent);
  std::vector<float> hidden;
  eval::LocalErrorSums sums;
  eval::simulate(fwd, m, tokens, kPage, kScoreFrom, hidden, &sums);

  // Direct: BF16-rounded rows, and their 2-bit (group 64, no clip) copies.
  const size_t nkv = size_t(kT) * Hkv * d;
  std::vector<float> khi(nkv), vhi(nkv), klo(nkv), vlo(nkv);
  for (size_t i = 0; i < nkv; ++i) khi[i] = bf16_round(cap.k[i]), vhi[i] = bf16_round(cap.v[i]);
  const QuantSpec spec{2, 64, ScaleDtype::kF16};
  fake_quantize_rows(khi.data(), int64_t(kT) * Hkv, d, spec, klo.data());
  fake_quantize_rows(vhi.data(), int64_t(kT) * Hkv, d, spec, vlo.data());
  const std::vector<float>& Wo = w.layers[0].wo.data;  // [H][Hq*d]
  ASSERT_EQ(Wo.size(), size_t(H) * Hq * d);

  double o_num = 0, o_den = 0, p_num = 0, p_den = 0, l_num = 0, l_den = 0, akl = 0;
  int64_t arows = 0;
  int quantized_rows_seen = 0;
  std::vector<double> oq(size_t(Hq) * d), orf(size_t(Hq) * d);
  for (int t = kScoreFrom; t < kT; ++t) {
    const int mid = std::max(0, (t - kSink - kRecent) / kPage) * kPage;
    const int b = kSink, e = kSink + mid;  // quantized positions [b, e) seen by query t
    quantized_rows_seen = std::max(quantized_rows_seen, e - b);
    for (int g = 0; g < Hq; ++g) {
      const int h = g / group;
      const float* qt = cap.q.data() + (size_t(t) * Hq + g) * d;
      std::vector<double> sq(t + 1), sr(t + 1);
      for (int j = 0; j <= t; ++j) {
        const bool lo = j >= b && j < e;
        const float* kr = khi.data() + (size_t(j) * Hkv + h) * d;
        const float* kq = (lo ? klo.data() : khi.data()) + (size_t(j) * Hkv + h) * d;
        double a = 0, c = 0;
        for (int x = 0; x < d; ++x) a += double(qt[x]) * kq[x], c += double(qt[x]) * kr[x];
        sq[j] = a / std::sqrt(double(d));
        sr[j] = c / std::sqrt(double(d));
      }
      const double mq = *std::max_element(sq.begin(), sq.end()),
                   mr = *std::max_element(sr.begin(), sr.end());
      double zq = 0, zr = 0;
      for (int j = 0; j <= t; ++j) zq += std::exp(sq[j] - mq), zr += std::exp(sr[j] - mr);
      double kl = 0;
      for (int j = 0; j <= t; ++j) {
        l_num += (sq[j] - sr[j]) * (sq[j] - sr[j]);
        l_den += sr[j] * sr[j];
        const double lp = sr[j] - mr - std::log(zr), lq = sq[j] - mq - std::log(zq);
        kl += std::exp(lp) * (lp - lq);
      }
      akl += kl;
      ++arows;
      for (int x = 0; x < d; ++x) oq[size_t(g) * d + x] = orf[size_t(g) * d + x] = 0;
      for (int j = 0; j <= t; ++j) {
        const bool lo = j >= b && j < e;
        const double pq = std::exp(sq[j] - mq) / zq, pr = std::exp(sr[j] - mr) / zr;
        const float* vq = (lo ? vlo.data() : vhi.data()) + (size_t(j) * Hkv + h) * d;
        const float* vr = vhi.data() + (size_t(j) * Hkv + h) * d;
        for (int x = 0; x < d; ++x) {
          oq[size_t(g) * d + x] += pq * vq[x];
          orf[size_t(g) * d + x] += pr * vr[x];
        }
      }
    }
    for (size_t i = 0; i < oq.size(); ++i) {
      o_num += (oq[i] - orf[i]) * (oq[i] - orf[i]);
      o_den += orf[i] * orf[i];
    }
    for (int r = 0; r < H; ++r) {
      const float* wr = Wo.data() + size_t(r) * Hq * d;
      double yq = 0, yr = 0;
      for (int c = 0; c < Hq * d; ++c) yq += wr[c] * oq[c], yr += wr[c] * orf[c];
      p_num += (yq - yr) * (yq - yr);
      p_den += yr * yr;
    }
  }
  ASSERT_GT(quantized_rows_seen, 0);
  const double o_direct = o_num / o_den, p_direct = p_num / p_den;
  const double o_sim = sums.o_num / sums.o_den, p_sim = sums.proj_num / sums.proj_den;
  std::printf("o_err direct %.6g sim %.6g; proj_err direct %.6g sim %.6g; attn KL direct %.6g sim %.6g\n",
              o_direct, o_sim, p_direct, p_sim, akl / arows, sums.attn_kl / sums.attn_rows);
  ASSERT_TRUE(std::isfinite(p_sim) && std::isfinite(o_sim));
  EXPECT_GT(p_direct, 1e-4);  // 2-bit rows really perturb the output
  EXPECT_NEAR(o_sim, o_direct, 1e-3 * o_direct);
  // The other local views on the same rows: logits and attention KL.
  ASSERT_EQ(sums.attn_rows, arows);
  EXPECT_NEAR(sums.logit_num / sums.logit_den, l_num / l_den, 1e-3 * l_num / l_den);
  EXPECT_GT(akl / arows, 1e-5);
  EXPECT_NEAR(sums.attn_kl / sums.attn_rows, akl / arows, 2e-3 * akl / arows);
  EXPECT_NEAR(p_sim, p_direct, 1e-3 * p_direct);
  // The two views differ (W_o weights the heads' errors unevenly).
  EXPECT_GT(std::fabs(p_direct - o_direct), 1e-3 * o_direct);
}

TEST(EvalMetrics, ProjErrZeroForExactCacheAndPositiveWhenQuantized) {
  const auto w = model::random_weights(model::tiny_config(model::Arch::kLlama), 22);
  const auto tokens = random_tokens(kT, w.cfg.vocab_size, 6);
  auto be = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  model::DenseForward fwd(w, *be);
  std::vector<float> hidden;

  // Windows that cover the whole sequence: nothing is ever quantized, so the
  // method is exact and every local error is exactly 0 (with a nonzero
  // reference: the metric is defined).
  eval::LocalErrorSums exact;
  eval::simulate(fwd, naive_method(w, kSink, kT), tokens, kPage, kScoreFrom, hidden, &exact);
  EXPECT_GT(exact.proj_den, 0.0);
  EXPECT_EQ(exact.proj_num, 0.0);
  EXPECT_EQ(exact.o_num, 0.0);

  eval::LocalErrorSums lossy;
  eval::simulate(fwd, naive_method(w, kSink, kRecent), tokens, kPage, kScoreFrom, hidden, &lossy);
  ASSERT_TRUE(std::isfinite(lossy.proj_num) && std::isfinite(lossy.proj_den));
  EXPECT_GT(lossy.proj_num / lossy.proj_den, 1e-4);
  EXPECT_LT(lossy.proj_num / lossy.proj_den, 10.0);

}

// +bf16L (kv/quant_methods.h): a layer kept in BF16 has no cache error, and keeping every layer
// makes the quantized method's simulation the BF16 one, bit for bit.
TEST(EvalMetrics, Bf16LayersAreExact) {
  const auto w = model::random_weights(model::tiny_config(model::Arch::kLlama), 23);
  const auto tokens = random_tokens(kT, w.cfg.vocab_size, 7);
  auto be = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  model::DenseForward fwd(w, *be);
  const int L = w.cfg.n_layers;
  ASSERT_GE(L, 2);
  kv::KvMethod bf16;
  std::vector<float> h_ref, h_q, h_all, h_some;
  eval::simulate(fwd, bf16, tokens, kPage, kScoreFrom, h_ref, nullptr);
  kv::KvMethod q = naive_method(w, kSink, kRecent);
  eval::simulate(fwd, q, tokens, kPage, kScoreFrom, h_q, nullptr);
  kv::KvMethod all = q;
  for (int l = 0; l < L; ++l) all.bf16_layers.push_back(l);
  eval::simulate(fwd, all, tokens, kPage, kScoreFrom, h_all, nullptr);
  ASSERT_EQ(h_all.size(), h_ref.size());
  EXPECT_EQ(h_all, h_ref);
  kv::KvMethod some = q;
  some.bf16_layers = {0};
  eval::LocalErrorSums sums;
  eval::simulate(fwd, some, tokens, kPage, kScoreFrom, h_some, &sums);
  double d_q = 0, d_some = 0;
  for (size_t i = 0; i < h_ref.size(); ++i) {
    d_q += std::fabs(double(h_q[i]) - h_ref[i]);
    d_some += std::fabs(double(h_some[i]) - h_ref[i]);
  }
  EXPECT_GT(d_some, 0.0);        // the other layers are still quantized
  EXPECT_NE(d_some, d_q);        // and layer 0 no longer is
  EXPECT_GT(sums.k_den, 0.0);    // the cache error counts the quantized layers only
}

// --first-position: the BF16 reference is the same at any first RoPE position (attention is
// relative), while a quantized cache sees other key phases, so its errors change.
TEST(EvalMetrics, FirstPositionMovesOnlyTheCachedPhases) {
  const auto w = model::random_weights(model::tiny_config(model::Arch::kQwen2), 24);
  const auto tokens = random_tokens(kT, w.cfg.vocab_size, 8);
  auto be = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  model::DenseForward fwd(w, *be);
  std::vector<float> h0, h1;
  eval::simulate(fwd, naive_method(w, kSink, kT), tokens, kPage, kScoreFrom, h0, nullptr, 0);
  eval::simulate(fwd, naive_method(w, kSink, kT), tokens, kPage, kScoreFrom, h1, nullptr, 5000);
  ASSERT_EQ(h0.size(), h1.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < h0.size(); ++i) {
    ASSERT_TRUE(std::isfinite(h1[i]));
    num += double(h0[i] - h1[i]) * (h0[i] - h1[i]);
    den += double(h0[i]) * h0[i];
  }
  // Equal up to the BF16 rounding of the stored rows, which depends on the phases (8e-4 here).
  EXPECT_LT(std::sqrt(num / den), 5e-3);
  eval::LocalErrorSums a, b;
  eval::simulate(fwd, naive_method(w, kSink, kRecent), tokens, kPage, kScoreFrom, h0, &a, 0);
  eval::simulate(fwd, naive_method(w, kSink, kRecent), tokens, kPage, kScoreFrom, h1, &b, 5000);
  ASSERT_GT(a.k_den, 0.0);
  ASSERT_GT(b.k_den, 0.0);
  EXPECT_NE(a.k_num / a.k_den, b.k_num / b.k_den);
}

TEST(EvalMetrics, ProjErrIsBasisFree) {
  // A Hadamard value rotation folded into W_v / W_o: o lives in the rotated
  // basis, W_o·o in the model's. On one layer (same inputs for both methods)
  // the BF16 reference after o_proj is the unrotated one up to BF16 rounding
  // of the rotated rows, and the quantized error is positive and finite.
  model::ModelConfig cfg = model::tiny_config(model::Arch::kLlama);
  cfg.n_layers = 1;
  const auto w = model::random_weights(cfg, 23);
  const auto tokens = random_tokens(kT, cfg.vocab_size, 7);
  std::vector<float> hidden;
  auto be = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  model::DenseForward fwd(w, *be);
  eval::LocalErrorSums plain;
  eval::simulate(fwd, naive_method(w, kSink, kRecent), tokens, kPage, kScoreFrom, hidden, &plain);

  kv::KvMethod had = naive_method(w, kSink, kRecent);
  had.calib = std::make_shared<Calibration>(data_free_calibration(
      Composition::kHadamard, model::model_fingerprint(w), 1.0f, 1.0f, 2, 64));
  ASSERT_TRUE(had.folds_values());
  model::ModelWeights fw = w;
  model::fold_value_rotation(fw, *had.calib);
  auto be2 = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  model::DenseForward ffwd(fw, *be2);
  eval::LocalErrorSums rot;
  eval::simulate(ffwd, had, tokens, kPage, kScoreFrom, hidden, &rot);
  ASSERT_TRUE(std::isfinite(rot.proj_num) && std::isfinite(rot.proj_den));
  EXPECT_GT(rot.proj_num / rot.proj_den, 1e-4);
  EXPECT_NEAR(rot.proj_den, plain.proj_den, 1e-2 * plain.proj_den);
  EXPECT_NEAR(rot.o_den, plain.o_den, 1e-2 * plain.o_den);  // |o| is rotation-invariant too
}

}  // namespace
}  // namespace oscar
