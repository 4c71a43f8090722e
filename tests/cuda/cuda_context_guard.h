// A gtest listener for the GPU test binaries. A test that leaves the CUDA context in a sticky
// error (an illegal address, a kernel fault) makes every later CUDA call of the process fail, so
// the tests after it fail for a reason that is not theirs, and the first cause is easy to miss in
// the list. After each test this checks the context once (cudaDeviceSynchronize) and, the first
// time it finds it broken, prints which test broke it and the error, and says that the failures
// after it follow from it. Including the header registers it (once per binary).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace oscar::test {

class CudaContextGuard : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& t) override {
    if (!broken_.empty()) {
      if (t.result()->Failed())
        std::fprintf(stderr, "[ CUDA     ] %s.%s ran after the CUDA context broke in %s\n", t.test_suite_name(),
                     t.name(), broken_.c_str());
      return;
    }
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return;  // no GPU: the tests skip
    const cudaError_t e = cudaDeviceSynchronize();
    if (e == cudaSuccess) return;
    broken_ = std::string(t.test_suite_name()) + "." + t.name();
    std::fprintf(stderr,
                 "[ CUDA     ] the CUDA context broke in %s: %s (%s); every later test's CUDA calls fail "
                 "because of it\n",
                 broken_.c_str(), cudaGetErrorName(e), cudaGetErrorString(e));
  }

 private:
  std::string broken_;
};

inline const bool kCudaContextGuardRegistered =
    (::testing::UnitTest::GetInstance()->listeners().Append(new CudaContextGuard), true);

}  // namespace oscar::test
