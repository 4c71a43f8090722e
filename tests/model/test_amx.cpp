// The AMX BF16 linear kernel (backend/cpu/ops_amx.h) against its specification (activations
// rounded to BF16, then the scalar fp32 loop) on fresh random inputs, and linear_bf16's routing
// to it. Skipped, saying why, on CPUs without AMX.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "backend/cpu/ops_amx.h"
#include "backend/cpu/ops_gemv.h"
#include "core/half.h"

namespace oscar::backend::cpu {
namespace {

// |y - ref| per output: both sum the same BF16 products in fp32 in different orders, so the bound
// is a few fp32 roundings of the sum of |products|.
double bound(const std::vector<uint16_t>& w, const std::vector<float>& x, int64_t in, int64_t r, int t) {
  double s = 0;
  for (int64_t k = 0; k < in; ++k)
    s += std::abs(double(bf16_to_f32(w[size_t(r * in + k)])) * bf16_to_f32(f32_to_bf16(x[size_t(t * in + k)])));
  return 4 * double(in) * 6e-8 * s + 1e-6;
}

TEST(Amx, LinearBf16MatchesItsReference) {
  if (!amx_available()) GTEST_SKIP() << "no AMX-BF16 on this CPU (or OSCAR_CPU_AMX=0, or the OS refused the tile state)";
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  int checked = 0;
  for (auto [out, in] : {std::pair<int64_t, int64_t>{16, 32}, {48, 96}, {64, 576}, {208, 160}}) {
    std::vector<uint16_t> w(size_t(out * in));
    for (auto& v : w) v = f32_to_bf16(nd(rng));
    std::vector<float> b(static_cast<size_t>(out));
    for (auto& v : b) v = nd(rng);
    for (int n : {1, 7, 16, 17, 33, 130}) {
      std::vector<float> x(size_t(n * in));
      for (auto& v : x) v = nd(rng) * (rng() % 4 == 0 ? 30.f : 1.f);  // some large activations
      for (bool with_bias : {false, true}) {
        std::vector<float> y(size_t(n * out), NAN), r(size_t(n * out));
        const float* bp = with_bias ? b.data() : nullptr;
        linear_bf16_amx(w.data(), out, in, bp, x.data(), n, y.data());
        linear_bf16_amx_ref(w.data(), out, in, bp, x.data(), n, r.data());
        for (int t = 0; t < n; ++t)
          for (int64_t o = 0; o < out; ++o) {
            const size_t i = size_t(t * out + o);
            ASSERT_TRUE(std::isfinite(y[i])) << out << "x" << in << " n " << n << " t " << t << " o " << o;
            ASSERT_NEAR(y[i], r[i], bound(w, x, in, o, t)) << out << "x" << in << " n " << n << " t " << t << " o " << o;
          }
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 4 * 6 * 2);
}

// The packed activations are f32_to_bf16's, bit for bit: ties, NaN (kept quiet), infinities,
// subnormals, signed zeros; padding tokens zero.
TEST(Amx, PackedActivationsAreExactlyTheRoundedOnes) {
  if (!amx_available()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  std::mt19937 rng(9);
  std::uniform_int_distribution<uint32_t> bits;
  for (auto [n, in] : {std::pair<int, int64_t>{1, 32}, {5, 64}, {16, 96}, {23, 160}}) {
    std::vector<float> x(size_t(n) * size_t(in));
    for (float& v : x) {
      uint32_t u = bits(rng);
      switch (rng() % 6) {
        case 0: u = (u & 0xffff0000u) | 0x8000u; break;  // a tie
        case 1: u = (u & 0x80000000u) | 0x7f800000u | (u & 0x7fffffu ? u & 0x3fffffu : 1u); break;  // NaN (signalling)
        case 2: u = (u & 0x80000000u) | 0x7f800000u; break;  // inf
        case 3: u &= 0x807fffffu; break;  // subnormal or zero
        default: break;
      }
      std::memcpy(&v, &u, 4);
    }
    const int n_pad = (n + 15) / 16 * 16;
    std::vector<uint16_t> xp(size_t(in) * size_t(n_pad), 0xdead);
    pack_activations_bf16(x.data(), n, in, xp.data());
    for (int64_t p = 0; p < in / 2; ++p)
      for (int t = 0; t < n_pad; ++t)
        for (int j = 0; j < 2; ++j) {
          const uint16_t want = t < n ? f32_to_bf16(x[size_t(t) * size_t(in) + size_t(2 * p + j)]) : 0;
          ASSERT_EQ(xp[(size_t(p) * size_t(n_pad) + size_t(t)) * 2 + size_t(j)], want)
              << "n " << n << " in " << in << " pair " << p << " token " << t << " half " << j;
        }
  }
}

// linear_bf16 takes the AMX kernel from amx_min_rows() rows on (the rounding of the activations
// shows), and keeps the GEMV (fp32 activations) below.
TEST(Amx, LinearBf16RoutesManyRowsToTiles) {
  if (!amx_available()) GTEST_SKIP() << "no AMX-BF16 on this CPU";
  const int64_t out = 64, in = 256;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<uint16_t> w(size_t(out * in));
  for (auto& v : w) v = f32_to_bf16(nd(rng));
  for (int n : {amx_min_rows() - 1, amx_min_rows()}) {
    std::vector<float> x(size_t(n * in));
    for (auto& v : x) v = nd(rng);
    std::vector<float> y(size_t(n * out)), amx(size_t(n * out)), exact(size_t(n * out));
    linear_bf16(w.data(), out, in, nullptr, x.data(), n, y.data());
    linear_bf16_amx_ref(w.data(), out, in, nullptr, x.data(), n, amx.data());
    linear_bf16_ref(w.data(), out, in, nullptr, x.data(), n, exact.data());
    double d_amx = 0, d_exact = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      d_amx = std::max(d_amx, double(std::abs(y[i] - amx[i])));
      d_exact = std::max(d_exact, double(std::abs(y[i] - exact[i])));
    }
    if (n >= amx_min_rows()) EXPECT_LT(d_amx, 1e-3) << "n " << n;
    else EXPECT_LT(d_exact, 1e-3) << "n " << n;
    EXPECT_GT(std::max(d_amx, d_exact), 1e-3) << "n " << n << ": the two specifications should differ here";
  }
}

}  // namespace
}  // namespace oscar::backend::cpu
