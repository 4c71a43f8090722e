// The CPU backend: host memory, OpenBLAS for large products, our threaded
// AVX-512/AVX2 GEMV for decode, attention from kernels/cpu.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace oscar::backend {

struct CpuBackendOptions {
  WeightDtype weight_dtype = WeightDtype::kBf16;  // matrices; norms stay f32
  int threads = 0;                                // 0 = OSCAR_NUM_THREADS or all cores
};

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendOptions& opts = {});

}  // namespace oscar::backend
