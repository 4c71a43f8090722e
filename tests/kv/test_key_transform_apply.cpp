// kernels::cpu::transform_keys / transform_queries (the CPU rotation kernel + offset) against
// the fp64 reference of core/key_transform.h, on fresh random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "core/key_transform.h"
#include "core/rotation.h"
#include "kernels/cpu/key_transform.h"

using namespace oscar;

TEST(KeyTransformApply, MatchesReference) {
  constexpr int Hq = 6, H = 2, T = 37;
  for (int d : {64, 128})
    for (int n_rot : {1, H})
      for (int mode = 0; mode < 4; ++mode) {
        std::mt19937_64 rng(d + 7 * n_rot + mode);
        std::normal_distribution<float> N(0.0f, 1.0f);
        LayerCalibration L;
        L.n_rot = n_rot;
        for (int r = 0; r < n_rot; ++r) {
          const auto R = compose_rotation(Composition::kRandom, nullptr, d, rng());
          L.k_rotation.insert(L.k_rotation.end(), R.begin(), R.end());
        }
        if (mode & 1)
          for (int i = 0; i < H * d; ++i) L.k_mean.push_back(50.0f * N(rng));
        if (mode & 2)
          for (int i = 0; i < H * d; ++i) L.k_scale.push_back(std::exp(N(rng)));
        const KeyTransform t = prepare_key_transform(L, H, d);
        std::vector<float> k(size_t(T) * H * d), q(size_t(T) * Hq * d);
        for (auto& x : k) x = 10.0f * N(rng);
        for (auto& x : q) x = N(rng);
        std::vector<float> k_ref = k, q_ref = q;
        apply_key_transform_ref(t, k_ref.data(), T, H);
        apply_query_transform_ref(t, q_ref.data(), T, Hq, H);
        kernels::cpu::transform_keys(t, k.data(), T, H);
        kernels::cpu::transform_queries(t, q.data(), T, Hq, H);
        double kmax = 0, qmax = 0;
        for (float x : k_ref) kmax = std::max(kmax, double(std::fabs(x)));
        for (float x : q_ref) qmax = std::max(qmax, double(std::fabs(x)));
        for (size_t i = 0; i < k.size(); ++i) {
          ASSERT_TRUE(std::isfinite(k[i]));
          ASSERT_NEAR(k[i], k_ref[i], 2e-5 * kmax) << "d " << d << " n_rot " << n_rot << " mode " << mode;
        }
        for (size_t i = 0; i < q.size(); ++i) {
          ASSERT_TRUE(std::isfinite(q[i]));
          ASSERT_NEAR(q[i], q_ref[i], 2e-5 * qmax) << "d " << d << " n_rot " << n_rot << " mode " << mode;
        }
      }
}

TEST(KeyTransformApply, QueryHeadsMustGroup) {
  LayerCalibration L;
  L.n_rot = 2;
  L.k_rotation.assign(2 * 32 * 32, 0.0f);
  for (int r = 0; r < 2; ++r)
    for (int i = 0; i < 32; ++i) L.k_rotation[size_t(r) * 1024 + i * 33] = 1.0f;
  const KeyTransform t = prepare_key_transform(L, 2, 32);
  std::vector<float> q(5 * 32, 1.0f);
  EXPECT_THROW(kernels::cpu::transform_queries(t, q.data(), 1, 5, 2), Error);
}
