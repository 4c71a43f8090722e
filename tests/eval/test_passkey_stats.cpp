// Passkey statistics (eval/passkey.h): the Wilson interval and the paired
// "of BF16's solved" view of format_passkey.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "eval/passkey.h"

namespace oscar::eval {
namespace {

TEST(PasskeyStats, WilsonIntervalKnownValues) {
  // Closed form at z = 1.96, checked by hand: 10/20 -> [0.2993, 0.7007],
  // 0/20 -> [0, 0.1611], 20/20 -> [0.8389, 1].
  Interval a = wilson_interval(10, 20);
  EXPECT_NEAR(a.lo, 0.29929, 1e-4);
  EXPECT_NEAR(a.hi, 0.70071, 1e-4);
  Interval b = wilson_interval(0, 20);
  EXPECT_NEAR(b.lo, 0.0, 1e-12);
  EXPECT_NEAR(b.hi, 0.16113, 1e-4);
  Interval c = wilson_interval(20, 20);
  EXPECT_NEAR(c.lo, 0.83887, 1e-4);
  EXPECT_NEAR(c.hi, 1.0, 1e-12);
  // Narrower with more trials at the same proportion; contains the estimate.
  Interval d = wilson_interval(30, 60);
  EXPECT_LT(d.hi - d.lo, a.hi - a.lo);
  for (int k = 0; k <= 7; ++k) {
    Interval e = wilson_interval(k, 7);
    EXPECT_LE(e.lo, double(k) / 7 + 1e-12);
    EXPECT_GE(e.hi, double(k) / 7 - 1e-12);
  }
  Interval n0 = wilson_interval(0, 0);
  EXPECT_EQ(n0.lo, 0.0);
  EXPECT_EQ(n0.hi, 1.0);
}

TEST(PasskeyStats, WilsonIntervalRejectsBadInput) {
  EXPECT_THROW(wilson_interval(3, 2), Error);
  EXPECT_THROW(wilson_interval(-1, 2), Error);
  EXPECT_THROW(wilson_interval(1, 2, 0.0), Error);
  EXPECT_THROW(wilson_interval(1, 2, std::nan("")), Error);
}

TEST(PasskeyStats, FormatShowsPairedCountsAgainstBf16) {
  std::vector<PasskeyResult> rs;
  rs.push_back({"bf16", 1024, 0.25, 4, 3, {1, 1, 0, 1}});
  rs.push_back({"bf16", 1024, 0.75, 2, 1, {0, 1}});
  rs.push_back({"oscar", 1024, 0.25, 4, 2, {1, 0, 1, 0}});
  rs.push_back({"oscar", 1024, 0.75, 2, 2, {1, 1}});
  const std::string s = format_passkey(rs);
  // bf16 solves prompts 0,1,3,5 (4 of 6); oscar solves 0,2,4,5: both on 0 and 5.
  EXPECT_NE(s.find("4/6"), std::string::npos) << s;
  EXPECT_NE(s.find("2/4"), std::string::npos) << s;  // of bf16's solved
  EXPECT_NE(s.find("+2"), std::string::npos) << s;   // solved where bf16 failed
  EXPECT_NE(s.find("bf16"), std::string::npos) << s;
}

}  // namespace
}  // namespace oscar::eval
