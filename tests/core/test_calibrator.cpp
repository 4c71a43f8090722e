// Calibrator targets against naive fp64 reference formulas (DESIGN §3.1),
// chunked feeding == one-shot feeding, granularity, clip search, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/calibrator.h"
#include "core/error.h"
#include "core/quant_error.h"
#include "core/synthetic.h"

using namespace oscar;

namespace {

constexpr int kL = 2, kHq = 4, kH = 2, kD = 32, kT = 300;

SyntheticSpec small_spec(bool with_o = true) {
  SyntheticSpec s;
  s.n_layers = kL;
  s.n_q_heads = kHq;
  s.n_kv_heads = kH;
  s.head_dim = kD;
  s.tokens = kT;
  s.with_o = with_o;
  s.seed = 3;
  return s;
}

// mean over rows of x xᵀ for head h's rows: src [T][heads][d], head h owns
// source heads [h*per, (h+1)*per), each row weighted by w(t) (or 1).
std::vector<double> naive_cov(const std::vector<float>& src, int heads, int per, int h,
                              const std::vector<double>* w = nullptr) {
  std::vector<double> C(kD * kD, 0.0);
  double n = 0;
  for (int t = 0; t < kT; ++t)
    for (int j = 0; j < per; ++j) {
      const float* x = src.data() + (static_cast<size_t>(t) * heads + h * per + j) * kD;
      const double wt = w ? (*w)[t] : 1.0;
      n += wt;
      for (int a = 0; a < kD; ++a)
        for (int b = 0; b < kD; ++b) C[a * kD + b] += wt * double(x[a]) * x[b];
    }
  for (auto& c : C) c /= n;
  return C;
}

void expect_close(const double* a, const std::vector<double>& b, double rtol, const char* what) {
  double scale = 0;
  for (double x : b) scale = std::max(scale, std::fabs(x));
  for (size_t i = 0; i < b.size(); ++i) ASSERT_NEAR(a[i], b[i], rtol * scale) << what << " @" << i;
}

}  // namespace

TEST(Calibrator, TargetsMatchNaiveFormulas) {
  const auto s = small_spec();
  const SyntheticLayer a = synthetic_layer(s, 1);
  for (auto vt : {ValueTarget::kAttnOutput, ValueTarget::kKeyWeighted, ValueTarget::kRaw})
    for (auto kt : {KeyTarget::kQuery, KeyTarget::kRaw}) {
      CalibConfig cfg;
      cfg.value_target = vt;
      cfg.key_target = kt;
      Calibrator cal(cfg, kL, kHq, kH, kD);
      cal.add(1, a.q.data(), a.k.data(), a.v.data(), a.o.data(), kT);
      const LayerTargets t = cal.targets(1);
      EXPECT_EQ(t.tokens, kT);
      for (int h = 0; h < kH; ++h) {
        const auto Cq = naive_cov(a.q, kHq, kHq / kH, h);  // pooled over the GQA group
        expect_close(t.q(h), Cq, 1e-12, "query");
        expect_close(t.k(h), kt == KeyTarget::kQuery ? Cq : naive_cov(a.k, kH, 1, h), 1e-12, "key");
        std::vector<double> Cv;
        if (vt == ValueTarget::kAttnOutput) Cv = naive_cov(a.o, kHq, kHq / kH, h);
        if (vt == ValueTarget::kRaw) Cv = naive_cov(a.v, kH, 1, h);
        if (vt == ValueTarget::kKeyWeighted) {
          std::vector<double> w(kT);  // w_t = k_t C_Q k_tᵀ (normalization cancels)
          for (int t2 = 0; t2 < kT; ++t2) {
            const float* k = a.k.data() + (static_cast<size_t>(t2) * kH + h) * kD;
            double s2 = 0;
            for (int i = 0; i < kD; ++i)
              for (int j = 0; j < kD; ++j) s2 += k[i] * Cq[i * kD + j] * k[j];
            w[t2] = s2;
          }
          Cv = naive_cov(a.v, kH, 1, h, &w);
        }
        expect_close(t.v(h), Cv, 1e-10, value_target_name(vt));
      }
    }
}

TEST(Calibrator, ChunkedFeedingEqualsOneShot) {
  const auto s = small_spec(false);
  const SyntheticLayer a = synthetic_layer(s, 0);
  CalibConfig cfg;  // key-weighted: exact only because K/V are buffered
  Calibrator one(cfg, 1, kHq, kH, kD), chunked(cfg, 1, kHq, kH, kD);
  one.add(0, a.q.data(), a.k.data(), a.v.data(), nullptr, kT);
  for (int t0 = 0; t0 < kT; t0 += 70) {
    const int n = std::min(70, kT - t0);
    chunked.add(0, a.q.data() + t0 * kHq * kD, a.k.data() + t0 * kH * kD, a.v.data() + t0 * kH * kD,
                nullptr, n);
  }
  const auto t1 = one.targets(0), t2 = chunked.targets(0);
  expect_close(t2.value.data(), t1.value, 1e-12, "kw chunked");
  expect_close(t2.query.data(), t1.query, 1e-12, "query chunked");
  const Calibration c1 = one.finish(), c2 = chunked.finish();
  for (size_t i = 0; i < c1.layers[0].k_rotation.size(); ++i)
    ASSERT_NEAR(c1.layers[0].k_rotation[i], c2.layers[0].k_rotation[i], 1e-5);
  EXPECT_EQ(c1.calib_tokens, kT);
}

TEST(Calibrator, GranularityAndRotations) {
  const auto s = small_spec(false);
  for (auto gran : {Granularity::kLayer, Granularity::kHead}) {
    CalibConfig cfg;
    cfg.granularity = gran;
    cfg.key_transform = KeyTransformMode::kOff;  // eigenvalues of the untransformed target
    Calibrator cal(cfg, kL, kHq, kH, kD);
    cal.keep_targets(true);
    for (int l = 0; l < kL; ++l) {
      const auto a = synthetic_layer(s, l);
      cal.add(l, a.q.data(), a.k.data(), a.v.data(), nullptr, kT);
    }
    const Calibration c = cal.finish();
    ASSERT_EQ(c.layers.size(), static_cast<size_t>(kL));
    const int n_rot = gran == Granularity::kLayer ? 1 : kH;
    for (int l = 0; l < kL; ++l) {
      const auto& L = c.layers[l];
      ASSERT_EQ(L.n_rot, n_rot);
      ASSERT_EQ(L.k_rotation.size(), static_cast<size_t>(n_rot * kD * kD));
      const auto& t = cal.kept_targets(l);
      for (int r = 0; r < n_rot; ++r) {
        EXPECT_LT(orthogonality_error(L.k_rotation.data() + r * kD * kD, kD), 1e-5);
        EXPECT_LT(orthogonality_error(L.v_rotation.data() + r * kD * kD, kD), 1e-5);
        // Eigenvalues are those of the (pooled or per-head) key target.
        std::vector<double> C(kD * kD, 0.0);
        const int h0 = n_rot == 1 ? 0 : r, h1 = n_rot == 1 ? kH : r + 1;
        for (int h = h0; h < h1; ++h)
          for (int i = 0; i < kD * kD; ++i) C[i] += t.k(h)[i] / (h1 - h0);
        const SymEig e = sym_eig(C.data(), kD);
        for (int i = 0; i < kD; ++i)
          EXPECT_NEAR(L.k_eigenvalues[r * kD + i], e.values[i], 1e-5 * e.values[0]);
        EXPECT_EQ(L.k_clip[r], 0.96f);
        EXPECT_EQ(L.v_clip[r], 0.92f);
      }
    }
  }
}

TEST(Calibrator, ClipSearchNeverWorseThanDefaultOnItsSample) {
  auto s = small_spec(false);
  s.tokens = kT;
  const auto a = synthetic_layer(s, 0);
  CalibConfig cfg;
  cfg.clip_search = true;
  cfg.key_transform = KeyTransformMode::kOff;  // the errors below are of the untransformed rows
  cfg.sample_tokens = 1000;  // > T: the sample is every token, so we can recompute
  cfg.clip_grid = {0.80f, 0.88f, 0.92f, 0.96f, 1.0f};
  Calibrator cal(cfg, 1, kHq, kH, kD);
  cal.keep_targets(true);
  cal.add(0, a.q.data(), a.k.data(), a.v.data(), nullptr, kT);
  const Calibration c = cal.finish();
  const auto& t = cal.kept_targets(0);
  const std::vector<double> R(c.layers[0].k_rotation.begin(), c.layers[0].k_rotation.end());
  auto kerr = [&](float clip) {
    ErrorSums e;
    for (int h = 0; h < kH; ++h)
      e += quant_error_sums(a.k.data() + h * kD, kT, kH * kD, kD, R.data(), clip,
                            cal.config().quant, t.q(h));
    return e.err_w;
  };
  const float chosen = c.layers[0].k_clip[0];
  EXPECT_NE(std::find(cfg.clip_grid.begin(), cfg.clip_grid.end(), chosen), cfg.clip_grid.end());
  for (float g : cfg.clip_grid)
    EXPECT_LE(kerr(chosen), kerr(g) * (1 + 1e-9)) << chosen << " vs " << g;
}

// The named settings of `oscar calibrate --preset`: "paper" is the struct's defaults without
// the key transform; "recommended" changes exactly the knobs docs/accuracy.md measured.
TEST(Calibrator, Presets) {
  const CalibConfig def, paper = calib_preset("paper"), rec = calib_preset("recommended");
  EXPECT_EQ(paper.composition, def.composition);
  EXPECT_EQ(paper.granularity, Granularity::kLayer);
  EXPECT_EQ(paper.key_target, KeyTarget::kQuery);
  EXPECT_EQ(paper.value_target, ValueTarget::kKeyWeighted);
  EXPECT_EQ(paper.k_clip, 0.96f);
  EXPECT_EQ(paper.v_clip, 0.92f);
  EXPECT_EQ(paper.key_transform, KeyTransformMode::kOff);
  EXPECT_EQ(rec.composition, Composition::kUHP);
  EXPECT_EQ(rec.granularity, Granularity::kHead);
  EXPECT_EQ(rec.key_target, KeyTarget::kRaw);
  EXPECT_EQ(rec.value_target, ValueTarget::kRaw);
  EXPECT_EQ(rec.k_clip, 0.88f);
  EXPECT_EQ(rec.v_clip, 0.84f);
  EXPECT_EQ(rec.key_transform, KeyTransformMode::kAuto);
  EXPECT_EQ(rec.quant.bits, def.quant.bits);
  EXPECT_EQ(rec.quant.group_size, def.quant.group_size);
  EXPECT_THROW(calib_preset("best"), Error);
  EXPECT_THROW(calib_preset(""), Error);
  // At 4 bits both presets stop clipping (their clips are 2-bit settings); nothing else changes.
  for (const char* name : {"recommended", "paper"}) {
    const CalibConfig two = calib_preset(name), four = calib_preset(name, 4);
    EXPECT_EQ(two.quant.bits, 2) << name;
    EXPECT_EQ(four.quant.bits, 4) << name;
    EXPECT_EQ(four.k_clip, 1.0f) << name;
    EXPECT_EQ(four.v_clip, 1.0f) << name;
    EXPECT_EQ(four.composition, two.composition) << name;
    EXPECT_EQ(four.granularity, two.granularity) << name;
    EXPECT_EQ(four.key_target, two.key_target) << name;
    EXPECT_EQ(four.value_target, two.value_target) << name;
    EXPECT_EQ(four.key_transform, two.key_transform) << name;
    EXPECT_THROW(calib_preset(name, 3), Error) << name;
  }
}

TEST(Calibrator, ErrorsAreClear) {
  EXPECT_THROW(Calibrator(CalibConfig{}, 1, 3, 2, 32), Error);  // GQA mismatch
  EXPECT_THROW(Calibrator(CalibConfig{}, 1, 4, 2, 48), Error);  // not pow2 / group
  CalibConfig bad;
  bad.k_clip = 1.5f;
  EXPECT_THROW(Calibrator(bad, 1, 4, 2, 32), Error);
  const auto s = small_spec(false);
  const auto a = synthetic_layer(s, 0);
  CalibConfig cfg;
  cfg.value_target = ValueTarget::kAttnOutput;
  Calibrator cal(cfg, 2, kHq, kH, kD);
  EXPECT_THROW(cal.add(0, a.q.data(), a.k.data(), a.v.data(), nullptr, kT), Error);  // o missing
  EXPECT_THROW(cal.add(5, a.q.data(), a.k.data(), a.v.data(), a.q.data(), kT), Error);
  Calibrator cal2(CalibConfig{}, 2, kHq, kH, kD);
  cal2.add(0, a.q.data(), a.k.data(), a.v.data(), nullptr, kT);
  EXPECT_THROW(cal2.finish(), Error);  // layer 1 saw nothing
  // NaN activations: a clear error at finish, not a crash or a NaN rotation.
  std::vector<float> q = a.q;
  q[5] = NAN;
  Calibrator cal3(CalibConfig{}, 1, kHq, kH, kD);
  cal3.add(0, q.data(), a.k.data(), a.v.data(), nullptr, kT);
  EXPECT_THROW(cal3.finish(), Error);
  // Finished layers refuse more data.
  Calibrator cal4(CalibConfig{}, 1, kHq, kH, kD);
  cal4.add(0, a.q.data(), a.k.data(), a.v.data(), nullptr, kT);
  cal4.finish_layer(0);
  EXPECT_THROW(cal4.add(0, a.q.data(), a.k.data(), a.v.data(), nullptr, kT), Error);
  ModelFingerprint fp;
  fp.n_layers = 7;
  EXPECT_THROW(cal4.finish(fp), Error);
}
