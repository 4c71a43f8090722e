// The CPU backend: host memory, OpenBLAS for large products, our threaded
// AVX-512/AVX2 GEMV for decode, attention from kernels/cpu.
#pragma once

#include <memory>

#include "backend/backend.h"

namespace oscar::model {

struct CpuBackendOptions {
  backend::WeightDtype weight_dtype = backend::WeightDtype::kBf16;  // matrices; norms stay f32
  int threads = 0;                                // 0 = OSCAR_NUM_THREADS or all cores
};

std::unique_ptr<backend::Backend> make_cpu_backend(const CpuBackendOptions& opts = {});

}  // namespace oscar::model
