// A small persistent thread pool for the CPU kernels: parallel_for over an
// index range with dynamic scheduling (an atomic counter), the calling thread
// taking part. One pool per process, sized by num_threads() (attention.h).
#pragma once

#include <cstdint>
#include <functional>

namespace oscar::kernels::cpu {

// Calls fn(i) for every i in [0, n), spread over the pool's threads; returns
// when all calls are done. The first exception thrown by fn is rethrown here.
// Nested calls from inside fn run serially on the calling thread.
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn);

}  // namespace oscar::kernels::cpu
