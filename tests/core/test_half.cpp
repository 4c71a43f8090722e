// fp16/bf16 conversions: exhaustive round trip and round-to-nearest-even at
// every midpoint between consecutive fp16 values (subnormals included).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/half.h"

using namespace oscar;

TEST(Half, F16ExhaustiveRoundTrip) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f)))) << h;
      continue;
    }
    ASSERT_EQ(f32_to_f16(f), h) << "h=" << h << " f=" << f;
  }
}

TEST(Half, F16MidpointsRoundToEven) {
  // Positive finite fp16 values a < b adjacent: the fp32 midpoint rounds to the
  // one with an even mantissa; just above/below rounds to the nearer one.
  for (uint32_t h = 0; h < 0x7bff; ++h) {
    const float a = f16_to_f32(static_cast<uint16_t>(h));
    const float b = f16_to_f32(static_cast<uint16_t>(h + 1));
    const float mid = 0.5f * (a + b);  // exact in fp32
    const uint16_t even = (h & 1) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h);
    ASSERT_EQ(f32_to_f16(mid), even) << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 0.0f)), h) << h;
    ASSERT_EQ(f32_to_f16(std::nextafter(mid, 1e9f)), h + 1) << h;
    ASSERT_EQ(f32_to_f16(-mid), 0x8000u | even) << h;
  }
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00u);  // rounds up to inf
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bffu);
  EXPECT_EQ(f32_to_f16(1e-9f), 0u);
}

TEST(Half, Bf16) {
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f)), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80u);  // tie -> even (down)
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82u);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
}

#include <vector>

#include "core/safetensors.h"

TEST(Half, BulkF16ConversionMatchesScalar) {
  // convert_to_f32 may take a SIMD path (run-time dispatch): it must agree
  // with f16_to_f32 on every one of the 65536 values (NaN: any NaN).
  std::vector<uint16_t> h(65536 + 5);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i);
  std::vector<float> out(h.size());
  oscar::st::convert_to_f32(oscar::st::Dtype::F16, reinterpret_cast<const std::byte*>(h.data()),
                            static_cast<int64_t>(h.size()), out.data());
  for (size_t i = 0; i < h.size(); ++i) {
    const float want = f16_to_f32(h[i]);
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(out[i])) << i;
    } else {
      ASSERT_EQ(f32_bits(out[i]), f32_bits(want)) << i;
    }
  }
}
