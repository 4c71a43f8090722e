// engine::token_logprob against its definition written the plain way: every id sorted by
// (logit desc, id asc), the normalizer summed in long double.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/error.h"
#include "engine/logprobs.h"

namespace oscar::engine {
namespace {

struct Want {
  double logprob;
  std::vector<int> top;
  std::vector<double> top_lp;
};

Want reference(const std::vector<float>& x, int token, int k) {
  const int V = static_cast<int>(x.size());
  std::vector<int> ids(size_t(V), 0);
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) { return x[size_t(a)] > x[size_t(b)]; });
  long double sum = 0;
  const long double mx = x[size_t(ids[0])];
  for (float v : x) sum += std::exp(static_cast<long double>(v) - mx);
  const double lse = static_cast<double>(mx + std::log(sum));
  Want w{double(x[size_t(token)]) - lse, {}, {}};
  for (int i = 0; i < std::min(k, V); ++i) {
    w.top.push_back(ids[size_t(i)]);
    w.top_lp.push_back(double(x[size_t(ids[size_t(i)])]) - lse);
  }
  return w;
}

TEST(Logprobs, TokenLogprobEqualsTheDefinition) {
  std::mt19937 rng(5);
  int checked = 0;
  for (int V : {1, 2, 7, 64, 1000, 49152}) {
    for (int trial = 0; trial < 6; ++trial) {
      std::vector<float> x(static_cast<size_t>(V));
      std::normal_distribution<float> g(0.f, trial % 2 ? 8.f : 1.f);
      for (float& v : x) v = g(rng);
      if (trial >= 2)  // ties: values on a coarse grid, so equal logits must order by id
        for (float& v : x) v = std::round(v * 2) / 2;
      if (trial >= 4 && V > 2)  // masked ids
        for (int i = 0; i < V; i += 3) x[size_t(i)] = -INFINITY;
      if (trial == 5 && V > 2) x[1] = 40.f;  // one dominant id
      for (int k : {0, 1, 5, kMaxLogprobs}) {
        const int token = int(rng() % unsigned(V));
        const TokenLogprob got = token_logprob(x, token, k);
        const Want want = reference(x, token, k);
        EXPECT_EQ(got.token, token);
        if (std::isinf(want.logprob)) {
          EXPECT_TRUE(std::isinf(got.logprob) && got.logprob < 0) << "V " << V << " trial " << trial;
        } else {
          EXPECT_NEAR(got.logprob, want.logprob, 1e-5 * std::max(1.0, std::abs(want.logprob)))
              << "V " << V << " trial " << trial << " k " << k;
        }
        ASSERT_EQ(got.top.size(), want.top.size()) << "V " << V << " k " << k;
        for (size_t i = 0; i < want.top.size(); ++i) {
          EXPECT_EQ(got.top[i].token, want.top[i]) << "V " << V << " trial " << trial << " rank " << i;
          if (!std::isinf(want.top_lp[i])) {
            EXPECT_NEAR(got.top[i].logprob, want.top_lp[i], 1e-5 * std::max(1.0, std::abs(want.top_lp[i])));
          }
        }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 6 * 6 * 4);
}

TEST(Logprobs, NaNAndInfiniteRowsGiveNaNNeverANumber) {
  std::vector<float> x = {0.5f, NAN, 2.0f, -1.0f};
  TokenLogprob t = token_logprob(x, 0, 2);
  EXPECT_TRUE(std::isnan(t.logprob));
  ASSERT_EQ(t.top.size(), 2u);  // the best of the non-NaN logits
  EXPECT_EQ(t.top[0].token, 2);
  EXPECT_EQ(t.top[1].token, 0);
  EXPECT_TRUE(std::isnan(t.top[0].logprob));
  std::vector<float> ninf(5, -INFINITY);
  EXPECT_TRUE(std::isnan(token_logprob(ninf, 3, 1).logprob));
  std::vector<float> pinf = {0.f, INFINITY, 1.f};
  EXPECT_TRUE(std::isnan(token_logprob(pinf, 1, 0).logprob));
}

TEST(Logprobs, RefusesBadTokensAndCounts) {
  std::vector<float> x(10, 0.f);
  EXPECT_THROW(token_logprob(x, -1, 0), Error);
  EXPECT_THROW(token_logprob(x, 10, 0), Error);
  EXPECT_THROW(token_logprob(x, 0, -1), Error);
  EXPECT_THROW(token_logprob(x, 0, kMaxLogprobs + 1), Error);
  EXPECT_NEAR(token_logprob(x, 4, 3).logprob, -std::log(10.0), 1e-6);
}

}  // namespace
}  // namespace oscar::engine
