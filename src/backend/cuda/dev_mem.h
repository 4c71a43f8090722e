// Device memory owned by RAII and the CUDA error check that throws oscar::Error: shared by the
// CUDA backend's translation units (backend_cuda.cu, flashinfer/).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>

#include "core/error.h"

namespace oscar::backend::devmem {

// A failed call also leaves its error as the runtime's "last error", which the next launch
// check (cudaGetLastError) would report as its own: an allocation that did not fit would fail
// the next kernel of an unrelated request. The error is taken out of that state here (a sticky
// one, a dead context, stays whatever is done).
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    const std::string m = std::string("cuda backend: ") + what + ": " + cudaGetErrorString(e);
    if (e == cudaErrorMemoryAllocation) throw OutOfMemory(m);
    throw Error(m);
  }
}

struct DevMem {
  void* p = nullptr;
  size_t bytes = 0;
  DevMem() = default;
  explicit DevMem(size_t n) : bytes(n) {
    if (n) check(cudaMalloc(&p, n), ("cudaMalloc of " + std::to_string(n >> 20) + " MiB").c_str());
  }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
  DevMem(DevMem&& o) noexcept : p(o.p), bytes(o.bytes) { o.p = nullptr, o.bytes = 0; }
  DevMem& operator=(DevMem&& o) noexcept {
    std::swap(p, o.p);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DevMem() {
    if (p) cudaFree(p);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
  // Grows (contents lost) to at least n bytes.
  void ensure(size_t n) {
    if (n > bytes) *this = DevMem(std::max(n, bytes + bytes / 2));
  }
};

}  // namespace oscar::backend::devmem
