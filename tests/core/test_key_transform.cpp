// The key transform (docs/core.md "Key transform", core/key_transform.h): exact up to a shift
// shared by every key of a query row; smoothing scales tied over RoPE pairs;
// the calibrator finds a planted key offset and never picks a transform with
// more error than no transform on its own sample; calibration files carry it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <vector>

#include "core/calibration.h"
#include "core/calibrator.h"
#include "core/error.h"
#include "core/key_transform.h"
#include "core/quant_error.h"
#include "core/rotation.h"
#include "core/synthetic.h"

using namespace oscar;

namespace {

std::vector<float> randn(size_t n, std::mt19937_64& rng, float scale = 1.0f) {
  std::normal_distribution<float> N(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = N(rng);
  return v;
}

LayerCalibration random_layer(int n_rot, int H, int d, bool center, bool scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  LayerCalibration L;
  L.n_rot = n_rot;
  for (int r = 0; r < n_rot; ++r) {
    const auto R = compose_rotation(Composition::kRandom, nullptr, d, seed + r);
    L.k_rotation.insert(L.k_rotation.end(), R.begin(), R.end());
  }
  L.v_rotation = L.k_rotation;
  L.k_clip.assign(n_rot, 0.96f);
  L.v_clip.assign(n_rot, 0.92f);
  if (center) L.k_mean = randn(size_t(H) * d, rng, 20.0f);
  if (scale) {
    std::uniform_real_distribution<float> U(-2.0f, 2.0f);
    L.k_scale.resize(size_t(H) * d);
    for (auto& s : L.k_scale) s = std::exp(U(rng));
  }
  return L;
}

}  // namespace

// q̃·k̃ = q·k − q·μ_h for every (query head, key) pair, per-layer and per-head
// rotations, with and without centering / scaling.
TEST(KeyTransform, ExactUpToAShiftPerQueryRow) {
  constexpr int Hq = 4, H = 2, d = 64, T = 5;
  for (int n_rot : {1, H})
    for (int mode = 0; mode < 4; ++mode) {
      const bool center = mode & 1, scale = mode & 2;
      const LayerCalibration L = random_layer(n_rot, H, d, center, scale, 17 + mode + 10 * n_rot);
      const KeyTransform t = prepare_key_transform(L, H, d);
      EXPECT_EQ(t.n, scale ? H : n_rot);
      EXPECT_EQ(t.mean.empty(), !center);
      std::mt19937_64 rng(5 + mode);
      std::vector<float> q = randn(size_t(T) * Hq * d, rng), k = randn(size_t(T) * H * d, rng, 3.0f);
      std::vector<float> qt = q, kt = k;
      apply_key_transform_ref(t, kt.data(), T, H);
      apply_query_transform_ref(t, qt.data(), T, Hq, H);
      for (int i = 0; i < T; ++i)
        for (int g = 0; g < Hq; ++g)
          for (int j = 0; j < T; ++j) {
            const int h = g / (Hq / H);
            const float* qa = q.data() + (size_t(i) * Hq + g) * d;
            const float* ka = k.data() + (size_t(j) * H + h) * d;
            const float* qb = qt.data() + (size_t(i) * Hq + g) * d;
            const float* kb = kt.data() + (size_t(j) * H + h) * d;
            double want = 0, got = 0, mag = 0;
            for (int c = 0; c < d; ++c) {
              const double mu = center ? L.k_mean[size_t(h) * d + c] : 0.0;
              want += double(qa[c]) * (ka[c] - mu);
              got += double(qb[c]) * kb[c];
              mag += std::fabs(double(qa[c]) * ka[c]) + std::fabs(double(qa[c]) * mu);
            }
            ASSERT_NEAR(got, want, 1e-5 * mag) << "n_rot " << n_rot << " mode " << mode;
          }
    }
}

TEST(KeyTransform, BadShapesAreClearErrors) {
  LayerCalibration L = random_layer(1, 2, 32, true, true, 3);
  L.k_mean.pop_back();
  EXPECT_THROW(prepare_key_transform(L, 2, 32), Error);
  L = random_layer(1, 2, 32, true, true, 3);
  EXPECT_THROW(prepare_key_transform(L, 3, 32), Error);  // k_scale sized for 2 heads
  L = random_layer(2, 2, 32, false, false, 3);
  EXPECT_THROW(prepare_key_transform(L, 4, 32), Error);  // 2 rotations for 4 heads
  CalibConfig bad;
  bad.key_offset_share = std::nanf("");
  EXPECT_THROW(Calibrator(bad, 1, 4, 2, 32), Error);
  bad.key_offset_share = -0.5f;
  EXPECT_THROW(Calibrator(bad, 1, 4, 2, 32), Error);
  EXPECT_THROW(parse_key_transform("sideways"), Error);
  EXPECT_EQ(parse_key_transform("center+scale"), KeyTransformMode::kCenterScale);
}

// s_c = (a_c / b_c)^(1/4) over RoPE pairs, geometric mean 1, clamped; silent channels 1.
TEST(KeyTransform, SmoothingScalesTiedOverRopePairs) {
  constexpr int d = 16;
  std::mt19937_64 rng(2);
  std::uniform_real_distribution<double> U(0.01, 100.0);
  std::vector<double> a(d), b(d);
  for (int c = 0; c < d; ++c) a[c] = U(rng), b[c] = U(rng);
  a[3] = a[3 + d / 2] = 0.0;  // a pair without key variance
  const std::vector<float> s = smoothing_scales(a.data(), b.data(), d);
  double logsum = 0;
  int n = 0;
  for (int c = 0; c < d / 2; ++c) {
    ASSERT_TRUE(std::isfinite(s[c]) && s[c] > 0);
    EXPECT_EQ(s[c], s[c + d / 2]);
    if (c == 3) {
      EXPECT_EQ(s[c], 1.0f);
      continue;
    }
    logsum += std::log(s[c]);
    ++n;
  }
  EXPECT_NEAR(logsum / n, 0.0, 1e-5);
  // Ratios follow the fourth root of the pair ratios.
  auto r = [&](int c) { return (a[c] + a[c + d / 2]) / (b[c] + b[c + d / 2]); };
  EXPECT_NEAR(std::log(s[0] / s[1]), 0.25 * std::log(r(0) / r(1)), 1e-5);
  EXPECT_NEAR(std::log(s[5] / s[2]), 0.25 * std::log(r(5) / r(2)), 1e-5);
  // Extreme ratios are clamped to [1/64, 64] around the mean.
  std::vector<double> a2(d, 1.0), b2(d, 1.0);
  a2[0] = a2[d / 2] = 1e30;
  const std::vector<float> s2 = smoothing_scales(a2.data(), b2.data(), d);
  for (float x : s2) EXPECT_TRUE(x <= 64.0f * 1.0001f && x >= 1.0f / 64 / 1.0001f) << x;
}

// A planted key offset (Qwen2's k_proj bias) in one KV head: offset-heads centers it (and
// only it), recovers the mean, and its sample error is below the untransformed one.
TEST(KeyTransform, CalibratorFindsAPlantedOffset) {
  const SyntheticSpec s{.n_layers = 1, .head_dim = 32, .tokens = 400, .seed = 4};  // 4 q / 2 KV heads
  SyntheticLayer a = synthetic_layer(s, 0);
  const int H = 2, d = 32;
  std::vector<double> planted(d, 0.0);
  for (int c = 0; c < 4; ++c) planted[c] = 40.0 * (c + 1);
  for (int t = 0; t < s.tokens; ++t)
    for (int c = 0; c < d; ++c) a.k[(size_t(t) * H + 1) * d + c] += float(planted[c]);
  auto run = [&](KeyTransformMode m) {
    CalibConfig cfg;
    cfg.key_transform = m;
    cfg.sample_tokens = 1000;  // every token: the error below is the calibrator's own
    Calibrator cal(cfg, 1, 4, H, d);
    cal.keep_targets(true);
    cal.add(0, a.q.data(), a.k.data(), a.v.data(), nullptr, s.tokens);
    Calibration c = cal.finish();
    return std::make_pair(c, cal.kept_targets(0));
  };
  // Named, not structured bindings: lambdas below capture them (clang 14, used by
  // scripts/sanitize.sh, cannot capture a structured binding).
  const auto r_off = run(KeyTransformMode::kOff), r_aut = run(KeyTransformMode::kOffsetHeads);
  const Calibration& off = r_off.first;
  const Calibration& aut = r_aut.first;
  const auto& t_off = r_off.second;
  EXPECT_FALSE(off.layers[0].has_key_transform());
  ASSERT_FALSE(aut.layers[0].k_mean.empty());
  ASSERT_FALSE(aut.layers[0].k_scale.empty());
  EXPECT_EQ(aut.key_transform, "offset-heads");
  // offset-heads' rule: a head is transformed iff its mean holds >= 0.85 of its key energy.
  ASSERT_EQ(aut.layers[0].key_offset_share.size(), 2u);
  for (int h = 0; h < H; ++h) {
    double m2 = 0, e2 = 0;
    for (int c = 0; c < d; ++c) {
      double m = 0, q = 0;
      for (int t = 0; t < s.tokens; ++t) {
        const double x = a.k[(size_t(t) * H + h) * d + c];
        m += x / s.tokens, q += x * x / s.tokens;
      }
      m2 += m * m, e2 += q;
    }
    EXPECT_NEAR(aut.layers[0].key_offset_share[h], m2 / e2, 1e-4);
    bool centered = false;
    for (int c = 0; c < d; ++c) centered = centered || aut.layers[0].k_mean[size_t(h) * d + c] != 0.0f;
    EXPECT_EQ(centered, m2 / e2 >= 0.85) << "head " << h << " share " << m2 / e2;
  }
  EXPECT_GT(aut.layers[0].key_offset_share[1], 0.95f);  // the planted offset dominates head 1
  // The mean of head 1 is the planted offset plus the data's own mean.
  for (int c = 0; c < d; ++c) {
    double m = 0;
    for (int t = 0; t < s.tokens; ++t) m += a.k[(size_t(t) * H + 1) * d + c];
    EXPECT_NEAR(aut.layers[0].k_mean[size_t(d) + c], m / s.tokens, 1e-3 * (1 + std::fabs(m / s.tokens)));
  }
  // Logit error (q-weighted, absolute) of the stored keys, with and without.
  auto err = [&](const Calibration& c) {
    const LayerCalibration& L = c.layers[0];
    double e = 0;
    for (int h = 0; h < H; ++h) {
      std::vector<float> rows(size_t(s.tokens) * d);
      std::vector<double> W(t_off.q(h), t_off.q(h) + size_t(d) * d), R(size_t(d) * d);
      for (int t = 0; t < s.tokens; ++t)
        for (int cc = 0; cc < d; ++cc) {
          const float mu = L.k_mean.empty() ? 0.0f : L.k_mean[size_t(h) * d + cc];
          const float sc = L.k_scale.empty() ? 1.0f : L.k_scale[size_t(h) * d + cc];
          rows[size_t(t) * d + cc] = (a.k[(size_t(t) * H + h) * d + cc] - mu) / sc;
        }
      if (!L.k_scale.empty())
        for (int i = 0; i < d; ++i)
          for (int j = 0; j < d; ++j) W[size_t(i) * d + j] *= double(L.k_scale[size_t(h) * d + i]) * L.k_scale[size_t(h) * d + j];
      for (size_t i = 0; i < R.size(); ++i) R[i] = L.k_rot(h, d)[i];
      e += quant_error_sums(rows.data(), s.tokens, d, d, R.data(), L.k_clip_of(h), {2, 32, ScaleDtype::kF16},
                            W.data()).err_w;
    }
    return e;
  };
  const double e_off = err(off), e_auto = err(aut);
  std::printf("planted offset: key logit error off %.4g, auto %.4g\n", e_off, e_auto);
  EXPECT_LT(e_auto, 0.5 * e_off);
}

// auto decides per model: a planted offset in one head of the last layer transforms every head
// of every layer (the first layer is finished before the offset's layer); without it, auto is
// bit-identical to off.
TEST(KeyTransform, AutoTransformsEveryHeadOfAModelWithAnOffset) {
  const SyntheticSpec s{.n_layers = 2, .head_dim = 32, .tokens = 300, .seed = 8};  // 4 q / 2 KV heads
  const int H = 2, d = 32;
  std::vector<SyntheticLayer> clean = {synthetic_layer(s, 0), synthetic_layer(s, 1)};
  for (SyntheticLayer& L : clean)  // keys without a mean of their own
    for (int i = 0; i < H * d; ++i) {
      double m = 0;
      for (int t = 0; t < s.tokens; ++t) m += L.k[size_t(t) * H * d + i];
      for (int t = 0; t < s.tokens; ++t) L.k[size_t(t) * H * d + i] -= float(m / s.tokens);
    }
  std::vector<SyntheticLayer> biased = clean;
  for (int t = 0; t < s.tokens; ++t)
    for (int c = 0; c < 4; ++c) biased[1].k[(size_t(t) * H + 1) * d + c] += 40.0f * (c + 1);
  auto run = [&](const std::vector<SyntheticLayer>& ls, KeyTransformMode m) {
    CalibConfig cfg;
    cfg.key_transform = m;
    Calibrator cal(cfg, 2, 4, H, d);
    for (int l = 0; l < 2; ++l) cal.add(l, ls[l].q.data(), ls[l].k.data(), ls[l].v.data(), nullptr, s.tokens);
    return cal.finish();
  };
  const Calibration a = run(biased, KeyTransformMode::kAuto);
  EXPECT_EQ(a.key_transform, "auto");
  EXPECT_GT(a.layers[1].key_offset_share[1], 0.85f);
  EXPECT_LT(a.layers[0].key_offset_share[0], 0.85f);
  for (int l = 0; l < 2; ++l) {
    ASSERT_EQ(a.layers[l].k_mean.size(), size_t(H) * d) << "layer " << l;
    ASSERT_EQ(a.layers[l].k_scale.size(), size_t(H) * d) << "layer " << l;
    for (int h = 0; h < H; ++h) {
      bool centred = false, scaled = false;
      for (int c = 0; c < d; ++c) {
        centred = centred || a.layers[l].k_mean[size_t(h) * d + c] != 0.0f;
        scaled = scaled || a.layers[l].k_scale[size_t(h) * d + c] != 1.0f;
      }
      EXPECT_TRUE(centred && scaled) << "layer " << l << " head " << h;
    }
  }
  // The same as center+scale forced on every head.
  const Calibration cs = run(biased, KeyTransformMode::kCenterScale);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(a.layers[l].k_mean, cs.layers[l].k_mean);
    EXPECT_EQ(a.layers[l].k_rotation, cs.layers[l].k_rotation);
  }
  // No offset: nothing transformed, the rotations those of off.
  const Calibration n = run(clean, KeyTransformMode::kAuto), off = run(clean, KeyTransformMode::kOff);
  for (int l = 0; l < 2; ++l) {
    EXPECT_FALSE(n.layers[l].has_key_transform()) << "layer " << l;
    EXPECT_EQ(n.layers[l].k_rotation, off.layers[l].k_rotation);
    EXPECT_EQ(n.layers[l].v_rotation, off.layers[l].v_rotation);
  }
}

TEST(KeyTransform, CalibrationFileRoundTripAndValidation) {
  namespace fs = std::filesystem;
  const std::string path =
      (fs::temp_directory_path() / ("oscar_test_kt_" + std::to_string(::getpid()) + ".safetensors")).string();
  Calibration c;
  c.model.n_layers = 2;
  c.model.n_q_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.head_dim = 32;
  c.group_size = 32;
  c.key_transform = "auto";
  c.layers = {random_layer(1, 2, 32, true, true, 1), random_layer(1, 2, 32, false, false, 2)};
  write_calibration(c, path);
  const Calibration r = read_calibration(path);
  EXPECT_EQ(r.key_transform, "auto");
  EXPECT_EQ(r.layers[0].k_mean, c.layers[0].k_mean);
  EXPECT_EQ(r.layers[0].k_scale, c.layers[0].k_scale);
  EXPECT_FALSE(r.layers[1].has_key_transform());
  // A zero scale is refused by name.
  c.layers[0].k_scale[7] = 0.0f;
  write_calibration(c, path);
  try {
    read_calibration(path);
    FAIL() << "a zero k_scale was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k_scale"), std::string::npos) << e.what();
  }
  // A NaN mean is refused.
  c.layers[0].k_scale[7] = 1.0f;
  c.layers[0].k_mean[3] = std::nanf("");
  write_calibration(c, path);
  EXPECT_THROW(read_calibration(path), Error);
  fs::remove(path);
}

// Page centering (core/key_transform.h PageCenter): keys whose offset ν turns with RoPE, fed at
// positions spread over 40K. The calibrator recovers ν on the slow pairs (zero elsewhere, ~0 on
// the head without an offset); the page centre RoPE_t(ν) removes the offset at every position,
// where the fixed mean μ leaves most of it; the file keeps ν and the frequencies.
TEST(PageCenter, CalibratorRecoversATurningOffsetAndFilesKeepIt) {
  const int H = 2, Hq = 4, d = 32, half = d / 2, T = 100, chunks = 4;
  std::vector<float> freq(half);
  for (int j = 0; j < half; ++j) freq[j] = float(std::pow(10000.0, -2.0 * j / d));
  // The offset on the slow pairs (those page centering follows) and a smaller one on two
  // fast pairs, which it must leave alone.
  std::vector<double> nu(d, 0.0);
  for (int j = 0; j < half; ++j)
    for (int c : {j, j + half}) nu[c] = freq[j] * 64.0 <= 1.0 ? 25.0 + 3.0 * (c % 7) : (j < 2 ? 5.0 : 0.0);
  auto rope = [&](const double* x, double pos, double* out) {
    for (int j = 0; j < half; ++j) {
      const double a = freq[j] * pos;
      out[j] = x[j] * std::cos(a) - x[j + half] * std::sin(a);
      out[j + half] = x[j + half] * std::cos(a) + x[j] * std::sin(a);
    }
  };
  std::mt19937_64 rng(5);
  std::normal_distribution<double> N(0.0, 1.0);
  CalibConfig cfg;
  cfg.rope_freq = freq;
  cfg.center_page = 64;
  // center: every head (auto's post-RoPE offset share is diluted by positions this spread).
  cfg.key_transform = KeyTransformMode::kCenter;
  Calibrator cal(cfg, 1, Hq, H, d);
  std::vector<std::vector<float>> kept;  // keys per chunk, for the residual check
  std::vector<int64_t> starts;
  for (int ch = 0; ch < chunks; ++ch) {
    const int64_t p0 = int64_t(ch) * 10000;
    std::vector<float> q(size_t(T) * Hq * d), k(size_t(T) * H * d), v(size_t(T) * H * d);
    for (auto& x : q) x = float(N(rng));
    for (auto& x : v) x = float(N(rng));
    std::vector<double> pre(d), post(d);
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h) {
        for (int c = 0; c < d; ++c) pre[c] = N(rng) + (h == 1 ? nu[c] : 0.0);
        rope(pre.data(), double(p0 + t), post.data());
        for (int c = 0; c < d; ++c) k[(size_t(t) * H + h) * d + c] = float(post[c]);
      }
    cal.add(0, q.data(), k.data(), v.data(), nullptr, T, p0);
    kept.push_back(k);
    starts.push_back(p0);
  }
  Calibration c = cal.finish();
  ASSERT_TRUE(c.has_page_center());
  EXPECT_EQ(c.rope_freq, freq);
  const LayerCalibration& L = c.layers[0];
  ASSERT_EQ(L.k_rope_mean.size(), size_t(H) * d);
  const std::vector<int> pairs = page_center_pairs(c);
  int slow = 0;
  for (int j = 0; j < half; ++j) {
    const bool is_slow = freq[j] * 64.0 <= 1.0;
    slow += is_slow;
    EXPECT_EQ(std::count(pairs.begin(), pairs.end(), j), is_slow ? 1 : 0) << "pair " << j;
    for (int cc : {j, j + half}) {
      EXPECT_NEAR(L.k_rope_mean[cc], 0.0, is_slow ? 0.3 : 0.0) << "head 0 has no offset";
      if (is_slow)
        EXPECT_NEAR(L.k_rope_mean[d + cc], nu[cc], 0.3) << "channel " << cc;
      else
        EXPECT_EQ(L.k_rope_mean[d + cc], 0.0f) << "channel " << cc;
    }
  }
  EXPECT_GT(slow, 4);
  EXPECT_LT(slow, half);
  // Residual offset of head 1's keys at every chunk: with the page centre (as the cache stores
  // them, (k − μ)M − δ) against the fixed mean only ((k − μ)M), on the slow pairs' energy.
  const KeyTransform xf = prepare_key_transform(L, H, d);
  const PageCenter pc = prepare_page_center(c, 0, xf, pairs, H, d);
  ASSERT_EQ(pc.pairs(), int(pairs.size()));
  std::vector<float> cs(2 * pairs.size()), delta(d);
  double e_fixed = 0, e_page = 0;
  for (int ch = 0; ch < chunks; ++ch)
    for (int t = 0; t < T; ++t) {
      const double pos = double(starts[ch] + t);
      for (int s = 0; s < pc.pairs(); ++s) {
        cs[2 * s] = float(std::cos(pc.freq[s] * pos));
        cs[2 * s + 1] = float(std::sin(pc.freq[s] * pos));
      }
      // Head 1's stored row (k − μ_1)·M_K.
      std::vector<float> row(d);
      for (int x = 0; x < d; ++x) {
        double acc = 0;
        for (int i = 0; i < d; ++i)
          acc += (double(kept[ch][(size_t(t) * H + 1) * d + i]) - xf.mean[d + i]) * xf.key_matrix(1)[size_t(i) * d + x];
        row[x] = float(acc);
      }
      for (int x = 0; x < d; ++x) {
        double dl = -pc.mu[d + x];
        for (int s = 0; s < pc.pairs(); ++s)
          dl += cs[2 * s] * pc.u[(size_t(1) * pc.pairs() + s) * d + x] + cs[2 * s + 1] * pc.w[(size_t(1) * pc.pairs() + s) * d + x];
        delta[x] = float(dl);
      }
      // M_K = R is orthogonal (center, no scale): energies compare in either basis.
      for (int x = 0; x < d; ++x) {
        e_fixed += double(row[x]) * row[x];
        e_page += double(row[x] - delta[x]) * (row[x] - delta[x]);
      }
    }
  std::printf("turning offset: residual energy fixed mean %.4g, page centre %.4g\n", e_fixed, e_page);
  EXPECT_LT(e_page, 0.25 * e_fixed);

  // The file keeps ν and the frequencies (format version 3); a model with other RoPE
  // frequencies is refused by name.
  namespace fs = std::filesystem;
  const std::string path =
      (fs::temp_directory_path() / ("oscar_test_pc_" + std::to_string(::getpid()) + ".safetensors")).string();
  c.model.n_layers = 1;
  c.model.n_q_heads = Hq;
  c.model.n_kv_heads = H;
  c.model.head_dim = d;
  c.group_size = 32;
  write_calibration(c, path);
  const Calibration r = read_calibration(path);
  EXPECT_EQ(r.layers[0].k_rope_mean, L.k_rope_mean);
  EXPECT_EQ(r.rope_freq, freq);
  EXPECT_NO_THROW(check_calibration_rope(r, freq, path));
  std::vector<float> other = freq;
  other[3] *= 1.5f;
  try {
    check_calibration_rope(r, other, path);
    FAIL() << "other RoPE frequencies accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("different RoPE"), std::string::npos) << e.what();
  }
  Calibration bad = c;
  bad.rope_freq.pop_back();
  EXPECT_THROW(write_calibration(bad, path), Error);
  fs::remove(path);
}

// Page centering only where the offset dominates (--page-center offset): with the key transform
// on every head, the head whose mean holds most of its key energy gets ν, the other one keeps
// its fixed mean only; with page centering on every centred head both get ν.
TEST(PageCenter, OffsetOnlyKeepsTheCentresOfOffsetDominatedHeads) {
  const int H = 2, Hq = 4, d = 32, half = d / 2, T = 200;
  std::vector<float> freq(half);
  for (int j = 0; j < half; ++j) freq[j] = float(std::pow(10000.0, -2.0 * j / d));
  auto run = [&](bool offset_only) {
    CalibConfig cfg;
    cfg.rope_freq = freq;
    cfg.key_transform = KeyTransformMode::kCenterScale;
    cfg.page_center_offset_only = offset_only;
    Calibrator cal(cfg, 1, Hq, H, d);
    std::mt19937_64 rng(9);
    std::normal_distribution<double> N(0.0, 1.0);
    std::vector<float> q(size_t(T) * Hq * d), k(size_t(T) * H * d), v(size_t(T) * H * d);
    for (auto& x : q) x = float(N(rng));
    for (auto& x : v) x = float(N(rng));
    // Head 1: a large constant offset on every channel (positions 0..T: it barely turns on the
    // slow pairs); head 0: a small one (share well below 0.85), so centering it still does something.
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < d; ++c) k[(size_t(t) * H + h) * d + c] = float(N(rng) + (h == 1 ? 40.0 : 0.5));
    cal.add(0, q.data(), k.data(), v.data(), nullptr, T, 0);
    return cal.finish();
  };
  auto head_has = [&](const std::vector<float>& x, int h) {
    for (int c = 0; c < d; ++c)
      if (x[size_t(h) * d + c] != 0.0f) return true;
    return false;
  };
  const Calibration all = run(false), only = run(true);
  for (const Calibration* c : {&all, &only}) {
    const LayerCalibration& L = c->layers[0];
    ASSERT_EQ(L.k_mean.size(), size_t(H) * d);
    EXPECT_TRUE(head_has(L.k_mean, 0) && head_has(L.k_mean, 1)) << "the key transform centres both heads";
    ASSERT_EQ(L.key_offset_share.size(), size_t(H));
    EXPECT_LT(L.key_offset_share[0], 0.85f);
    EXPECT_GT(L.key_offset_share[1], 0.85f);
    ASSERT_EQ(L.k_rope_mean.size(), size_t(H) * d);
    EXPECT_TRUE(head_has(L.k_rope_mean, 1));
  }
  EXPECT_TRUE(head_has(all.layers[0].k_rope_mean, 0));
  EXPECT_FALSE(head_has(only.layers[0].k_rope_mean, 0)) << "offset only: head 0 keeps the fixed mean";
  EXPECT_EQ(only.layers[0].page_center_heads(d), 1);
  EXPECT_EQ(all.layers[0].page_center_heads(d), 2);
}
