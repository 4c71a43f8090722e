// The reference quantizer: clip index rule, packing byte order, round-trip
// error bounds per bit width, constant groups, non-finite input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/quantizer.h"

using namespace oscar;

namespace {

std::vector<float> gaussian(int n, uint32_t seed, float sigma = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, sigma);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = nd(rng);
  return v;
}

struct Roundtrip {
  std::vector<uint8_t> codes;
  std::vector<uint8_t> params;
  std::vector<float> out;
};

Roundtrip roundtrip(const std::vector<float>& x, const QuantSpec& s) {
  const int d = static_cast<int>(x.size());
  Roundtrip r;
  r.codes.assign(static_cast<size_t>(row_code_bytes(d, s)), 0xAB);  // garbage: must be overwritten
  r.params.assign(static_cast<size_t>(row_param_bytes(d, s)), 0xCD);
  r.out.assign(x.size(), 0.0f);
  quantize_row(x.data(), d, s, r.codes.data(), r.params.data());
  dequantize_row(r.codes.data(), r.params.data(), d, s, r.out.data());
  return r;
}

float param(const Roundtrip& r, const QuantSpec& s, int i) {
  if (s.scale_dtype == ScaleDtype::kF16) {
    uint16_t h;
    std::memcpy(&h, r.params.data() + 2 * i, 2);
    return f16_to_f32(h);
  }
  float f;
  std::memcpy(&f, r.params.data() + 4 * i, 4);
  return f;
}

}  // namespace

TEST(Clip, IndexRuleMatchesDesign) {
  EXPECT_EQ(clip_index(128, 0.96f), 122);
  EXPECT_EQ(clip_index(128, 0.92f), 117);
  EXPECT_EQ(clip_index(128, 1.0f), 127);
  EXPECT_EQ(clip_index(128, 1.5f), 127);
  EXPECT_EQ(clip_index(128, 0.0f), 0);
  EXPECT_EQ(clip_index(64, 0.5f), 32);
  EXPECT_EQ(clip_index(64, -1.0f), 0);
}

TEST(Clip, ThresholdPicksSortedAbsIndex) {
  // |x| is a shuffled 1..128 with random signs: the k-th smallest |x| is k+1.
  std::vector<float> x(128);
  std::iota(x.begin(), x.end(), 1.0f);
  std::mt19937 rng(7);
  std::shuffle(x.begin(), x.end(), rng);
  for (auto& v : x)
    if (rng() & 1) v = -v;
  EXPECT_EQ(clip_threshold(x.data(), 128, 0.96f), 123.0f);
  EXPECT_EQ(clip_threshold(x.data(), 128, 0.92f), 118.0f);
  EXPECT_EQ(clip_threshold(x.data(), 128, 1.0f), 128.0f);
  std::vector<float> y = x;
  const float tau = clip_row(y.data(), 128, 0.92f);
  EXPECT_EQ(tau, 118.0f);
  int clamped = 0;
  for (int i = 0; i < 128; ++i) {
    EXPECT_LE(std::fabs(y[i]), 118.0f);
    if (std::fabs(x[i]) > 118.0f) {
      ++clamped;
      EXPECT_EQ(y[i], std::copysign(118.0f, x[i]));
    } else {
      EXPECT_EQ(y[i], x[i]);
    }
  }
  EXPECT_EQ(clamped, 10);
}

TEST(Clip, NonFiniteIsDefined) {
  std::vector<float> x = gaussian(128, 3);
  x[5] = std::numeric_limits<float>::quiet_NaN();
  x[6] = std::numeric_limits<float>::infinity();
  x[7] = -std::numeric_limits<float>::infinity();
  const float tau = clip_row(x.data(), 128, 0.96f);
  EXPECT_TRUE(std::isfinite(tau));
  EXPECT_EQ(x[5], 0.0f);
  EXPECT_EQ(x[6], tau);
  EXPECT_EQ(x[7], -tau);
  for (float v : x) EXPECT_TRUE(std::isfinite(v));
  // All-NaN row: threshold is +inf, never NaN; the row becomes zeros.
  std::vector<float> n(64, std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(clip_row(n.data(), 64, 0.9f), std::numeric_limits<float>::infinity());
  for (float v : n) EXPECT_EQ(v, 0.0f);
}

TEST(Quantizer, PackingByteOrderPinned) {
  // x_i in {0,1,2,3} with min 0, max 3: scale 1, codes == x exactly.
  const QuantSpec s{2, 32, ScaleDtype::kF16};
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = static_cast<float>((i % 32) / 8);  // quarter index
  auto r = roundtrip(x, s);
  // INT2, G=32: byte j of a group holds elements j, j+8, j+16, j+24 at shifts 0,2,4,6.
  ASSERT_EQ(r.codes.size(), 16u);
  for (uint8_t b : r.codes) EXPECT_EQ(b, 0xE4);  // 0 | 1<<2 | 2<<4 | 3<<6
  for (int i = 0; i < 64; ++i) x[i] = static_cast<float>(i % 4);
  r = roundtrip(x, s);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(r.codes[j], (j % 8 % 4) * 0x55) << j;
  EXPECT_EQ(param(r, s, 0), 1.0f);  // scale
  EXPECT_EQ(param(r, s, 1), 0.0f);  // min
  for (int i = 0; i < 64; ++i) EXPECT_EQ(r.out[i], x[i]);

  // INT4, G=32: byte j holds elements j and j+16 (low nibble first).
  const QuantSpec s4{4, 32, ScaleDtype::kF32};
  std::vector<float> y(32);
  for (int i = 0; i < 32; ++i) y[i] = static_cast<float>(i % 16);
  auto r4 = roundtrip(y, s4);
  ASSERT_EQ(r4.codes.size(), 16u);
  for (int j = 0; j < 16; ++j) EXPECT_EQ(r4.codes[j], j | (j << 4)) << j;
}

TEST(Quantizer, RoundTripErrorBoundsPerWidth) {
  for (int bits : {2, 4})
    for (int G : {32, 64, 128})
      for (ScaleDtype sd : {ScaleDtype::kF16, ScaleDtype::kF32}) {
        const QuantSpec s{bits, G, sd};
        const int qmax = (1 << bits) - 1;
        double err = 0, ref = 0;
        for (int row = 0; row < 50; ++row) {
          auto x = gaussian(128, 100 + row, 3.0f);
          auto r = roundtrip(x, s);
          for (int g = 0; g < 128 / G; ++g) {
            const float sc = param(r, s, 2 * g), mn = param(r, s, 2 * g + 1);
            // Every element lies within half a step of its reconstruction, up to
            // the rounding of (scale, min) to the storage dtype.
            const float slack =
                sd == ScaleDtype::kF16 ? 2e-3f * (std::fabs(mn) + qmax * sc) : 1e-5f;
            for (int i = g * G; i < (g + 1) * G; ++i) {
              ASSERT_LE(std::fabs(x[i] - r.out[i]), 0.5f * sc + slack)
                  << bits << " " << G << " " << i;
              ASSERT_GE(get_code(r.codes.data(), i, G, bits), 0);
            }
          }
          for (int i = 0; i < 128; ++i) {
            err += double(x[i] - r.out[i]) * (x[i] - r.out[i]);
            ref += double(x[i]) * x[i];
          }
        }
        const double rel = err / ref;
        // Uniform quantizer over the group range: step^2/12 over the value
        // variance. Gaussian G=128 range ~ 5.3 sigma -> INT2 ~0.26, INT4 ~0.01.
        const double bound = bits == 2 ? 0.35 : 0.02;
        EXPECT_LT(rel, bound) << bits << " " << G;
        EXPECT_GT(rel, bits == 2 ? 0.03 : 1e-4) << bits << " " << G;  // quantization did happen
      }
}

TEST(Quantizer, ConstantGroupIsExact) {
  for (ScaleDtype sd : {ScaleDtype::kF16, ScaleDtype::kF32}) {
    const QuantSpec s{2, 64, sd};
    std::vector<float> x(128, 5.0f);
    for (int i = 64; i < 128; ++i) x[i] = -0.25f;
    auto r = roundtrip(x, s);
    for (int i = 0; i < 128; ++i) EXPECT_EQ(r.out[i], x[i]);
    EXPECT_GT(param(r, s, 0), 0.0f);  // scale floored at kMinRange/3, never 0
  }
}

TEST(Quantizer, NonFiniteIsDefined) {
  const float inf = std::numeric_limits<float>::infinity();
  for (ScaleDtype sd : {ScaleDtype::kF16, ScaleDtype::kF32}) {
    const QuantSpec s{2, 32, sd};
    std::vector<float> x = gaussian(64, 9);
    x[0] = std::numeric_limits<float>::quiet_NaN();
    x[1] = inf;
    x[2] = -inf;
    x[40] = 1e38f;  // huge finite: params saturate, output stays finite
    auto r = roundtrip(x, s);
    for (float v : r.out) EXPECT_TRUE(std::isfinite(v));
    // Non-finite are coded like 0: same code as an explicit 0 in that group.
    std::vector<float> z = x;
    z[0] = z[1] = z[2] = 0.0f;
    auto rz = roundtrip(z, s);
    EXPECT_EQ(r.codes[0] & 3, rz.codes[0] & 3);
    for (int i = 0; i < 32; ++i) EXPECT_EQ(r.out[i], rz.out[i]);
  }
}

TEST(Quantizer, SpecValidation) {
  std::vector<float> x(128, 1.0f);
  std::vector<uint8_t> c(128), p(128);
  EXPECT_THROW(quantize_row(x.data(), 128, QuantSpec{3, 128}, c.data(), p.data()), Error);
  EXPECT_THROW(quantize_row(x.data(), 128, QuantSpec{2, 16}, c.data(), p.data()), Error);
  EXPECT_THROW(quantize_row(x.data(), 64, QuantSpec{2, 128}, c.data(), p.data()), Error);
  EXPECT_THROW(quantize_row(x.data(), 96, QuantSpec{2, 64}, c.data(), p.data()), Error);
  EXPECT_NO_THROW(quantize_row(x.data(), 96, QuantSpec{2, 32}, c.data(), p.data()));
}

TEST(Quantizer, BitsPerElement) {
  EXPECT_DOUBLE_EQ(row_bits_per_element(2, 128, ScaleDtype::kF16), 2.25);
  EXPECT_DOUBLE_EQ(row_bits_per_element(2, 128, ScaleDtype::kF32), 2.5);
  EXPECT_DOUBLE_EQ(row_bits_per_element(4, 32, ScaleDtype::kF16), 5.0);
  // DESIGN §5.4 with S0 = 64, W = 256.
  EXPECT_DOUBLE_EQ(cache_bits_per_element(100, 64, 256, 2, 128), 16.0);
  EXPECT_DOUBLE_EQ(cache_bits_per_element(4096, 64, 256, 2, 128),
                   (320 * 16.0 + 3776 * 2.25) / 4096);
  EXPECT_DOUBLE_EQ(cache_bits_per_element(32768, 64, 256, 2, 32, ScaleDtype::kF16),
                   (320 * 16.0 + 32448 * 3.0) / 32768);
  EXPECT_DOUBLE_EQ(cache_bits_per_element(0, 64, 256, 2, 128), 16.0);
}

// A line-by-line transcription of quant_format.h's rule (code_byte/code_shift,
// no shortcuts): the optimized reference must produce identical bytes.
TEST(Quantizer, MatchesNaiveTranscriptionOfTheFormat) {
  for (int bits : {2, 4})
    for (int G : {32, 64, 128})
      for (ScaleDtype sd : {ScaleDtype::kF16, ScaleDtype::kF32}) {
        const QuantSpec s{bits, G, sd};
        const int d = 256, qmax = (1 << bits) - 1;
        for (int row = 0; row < 20; ++row) {
          auto x = gaussian(d, 500 + row, row % 2 ? 0.01f : 40.0f);
          if (row == 3) x[7] = x[8];  // ties and constant runs
          auto r = roundtrip(x, s);
          std::vector<uint8_t> codes(static_cast<size_t>(row_code_bytes(d, s)), 0);
          for (int g = 0; g < d / G; ++g) {
            float lo = x[g * G], hi = x[g * G];
            for (int i = 0; i < G; ++i)
              lo = std::min(lo, x[g * G + i]), hi = std::max(hi, x[g * G + i]);
            float sc = std::max(hi - lo, kMinRange) / qmax, mn = lo;
            if (sd == ScaleDtype::kF16)
              sc = f16_to_f32(f32_to_f16(sc)), mn = f16_to_f32(f32_to_f16(mn));
            ASSERT_EQ(param(r, s, 2 * g), sc);
            ASSERT_EQ(param(r, s, 2 * g + 1), mn);
            for (int i = 0; i < G; ++i) {
              const int c = static_cast<int>(
                  std::clamp(std::floor((x[g * G + i] - mn) / sc + 0.5f), 0.0f, float(qmax)));
              const int ch = g * G + i;
              codes[code_byte(ch, G, bits)] |= static_cast<uint8_t>(c << code_shift(ch, G, bits));
              ASSERT_EQ(r.out[ch], mn + static_cast<float>(c) * sc);
            }
          }
          ASSERT_EQ(r.codes, codes) << bits << " " << G;
        }
      }
}
