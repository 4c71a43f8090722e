// engine::gpu_kv_budget: the KV page budget a GPU server takes from the device's memory when
// none is given (--gpu-memory-utilization).
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "engine/session.h"

namespace oscar::engine {
namespace {

constexpr int64_t kGiB = int64_t(1) << 30;

TEST(GpuKvBudget, TakesTheShareLeftAfterWhatIsInUse) {
  // An H200-like device: 141 GiB, 17 GiB in use by the weights and the runtime.
  const backend::Backend::MemoryInfo mem{141 * kGiB - 17 * kGiB, 141 * kGiB};
  EXPECT_EQ(gpu_kv_budget(mem, 0.9), int64_t(0.9 * double(141 * kGiB)) - 17 * kGiB);
  EXPECT_EQ(gpu_kv_budget(mem, 1.0), 124 * kGiB);
  // A lower share leaves more room outside the pages.
  EXPECT_LT(gpu_kv_budget(mem, 0.5), gpu_kv_budget(mem, 0.9));
}

TEST(GpuKvBudget, RefusesWithTheNumbersWhenNothingIsLeft) {
  const backend::Backend::MemoryInfo full{2 * kGiB, 80 * kGiB};  // 78 GiB in use
  try {
    gpu_kv_budget(full, 0.9);  // 72 GiB allowed < 78 in use
    FAIL() << "a budget was given for a full device";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("79872"), std::string::npos) << m;  // MiB in use
    EXPECT_NE(m.find("--kv-memory-mb"), std::string::npos) << m;
  }
  for (double u : {0.0, -0.5, 1.5})
    EXPECT_THROW(gpu_kv_budget({40 * kGiB, 80 * kGiB}, u), Error) << u;
  EXPECT_THROW(gpu_kv_budget({0, 0}, 0.9), Error);
  EXPECT_THROW(gpu_kv_budget({90 * kGiB, 80 * kGiB}, 0.9), Error);
}

}  // namespace
}  // namespace oscar::engine
