// Calibrator::add splits its work into (KV head, 512-token span) tasks and
// key-weighted targets into (head, add() block) tasks, each with its own fp64
// partial sums: long adds (several spans, an odd tail) must give the naive
// fp64 covariances. (Many add() blocks: Calibrator.ChunkedFeedingEqualsOneShot.)
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/calibrator.h"
#include "core/synthetic.h"

using namespace oscar;

namespace {

constexpr int kHq = 6, kH = 3, kD = 32, kT = 1300;  // 3 spans: 512 + 512 + 276

std::vector<double> naive_cov(const std::vector<float>& src, int heads, int per, int h) {
  std::vector<double> C(kD * kD, 0.0);
  for (int t = 0; t < kT; ++t)
    for (int j = 0; j < per; ++j) {
      const float* x = src.data() + (static_cast<size_t>(t) * heads + h * per + j) * kD;
      for (int a = 0; a < kD; ++a)
        for (int b = 0; b < kD; ++b) C[a * kD + b] += double(x[a]) * x[b];
    }
  for (auto& c : C) c /= double(kT) * per;
  return C;
}

SyntheticLayer layer() {
  SyntheticSpec s;
  s.n_layers = 1;
  s.n_q_heads = kHq;
  s.n_kv_heads = kH;
  s.head_dim = kD;
  s.tokens = kT;
  s.with_o = true;
  s.seed = 9;
  return synthetic_layer(s, 0);
}

}  // namespace

TEST(CalibratorTasks, LongAddsMatchNaiveCovariances) {
  const SyntheticLayer a = layer();
  CalibConfig cfg;
  cfg.key_target = KeyTarget::kRaw;
  cfg.value_target = ValueTarget::kAttnOutput;
  Calibrator cal(cfg, 1, kHq, kH, kD);
  cal.add(0, a.q.data(), a.k.data(), a.v.data(), a.o.data(), kT);
  const LayerTargets t = cal.targets(0);
  for (int h = 0; h < kH; ++h) {
    const std::vector<double> want[3] = {naive_cov(a.q, kHq, kHq / kH, h),
                                         naive_cov(a.k, kH, 1, h),
                                         naive_cov(a.o, kHq, kHq / kH, h)};
    const double* got[3] = {t.q(h), t.k(h), t.v(h)};
    for (int m = 0; m < 3; ++m) {
      double scale = 0;
      for (double x : want[m]) scale = std::max(scale, std::fabs(x));
      for (int i = 0; i < kD * kD; ++i)
        ASSERT_TRUE(std::fabs(got[m][i] - want[m][i]) <= 1e-12 * scale)
            << "head " << h << " target " << m << " @" << i;
    }
  }
}
