// CUDA error checking for host code. Compiles with a plain C++ compiler (only
// the CUDA runtime API header is needed), so public headers and tests can use it.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "core/error.h"

namespace oscar::kernels::cuda {

// Throws oscar::Error naming the statement, file and line of a failed CUDA call.
// The error is also taken out of the runtime's last-error state, so that a later launch check
// does not report it again as its own (an out-of-memory here is not the next kernel's failure).
inline void check_cuda(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    const std::string m = std::string(file) + ":" + std::to_string(line) + ": " + what + " failed: " +
                          cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
    if (e == cudaErrorMemoryAllocation) throw OutOfMemory(m);
    throw Error(m);
  }
}

}  // namespace oscar::kernels::cuda

// OSCAR_CUDA_CHECK(cudaMalloc(...)): throws oscar::Error with statement/file/line.
#define OSCAR_CUDA_CHECK(stmt) ::oscar::kernels::cuda::check_cuda((stmt), #stmt, __FILE__, __LINE__)

// Inside launchers (which return cudaError_t instead of throwing).
#define OSCAR_CUDA_RETURN_IF_ERROR(stmt)   \
  do {                                     \
    const cudaError_t _e = (stmt);         \
    if (_e != cudaSuccess) return _e;      \
  } while (0)
