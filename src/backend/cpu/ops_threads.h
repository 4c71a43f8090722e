// A small persistent thread pool for the CPU ops (GEMV, norms, RoPE).
//
// Why our own: a decode step issues a few hundred tiny ops; waking threads
// through a condition variable each time costs tens of microseconds, so the
// workers spin briefly on an atomic generation counter before sleeping.
// OpenBLAS keeps its own threads for the large matrix products (prefill); the
// two never run at the same time.
#pragma once

#include <cstdint>
#include <functional>

namespace oscar::backend::cpu {

// Threads used by the CPU ops: set_op_threads(n > 0), else OSCAR_NUM_THREADS, else
// std::thread::hardware_concurrency().
void set_op_threads(int n);
int op_threads();

// Runs fn(begin, end) over [0, n) split into op_threads() contiguous chunks whose
// boundaries are multiples of `grain` (except the last). Blocks until all finish.
// Calls from inside a worker run serially (no nested parallelism).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace oscar::backend::cpu
