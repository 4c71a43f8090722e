// Minimal fork-join helper for the calibration hot loops (per-head work).
// Threads: $OSCAR_NUM_THREADS if set, else std::thread::hardware_concurrency().
#pragma once

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace oscar {

int default_threads();

// Runs f(i, worker) for i in [0, n) on up to default_threads() workers
// (worker in [0, workers)); the first exception is rethrown after joining.
template <typename F>
void parallel_for(int n, F&& f) {
  const int workers = std::max(1, std::min(n, default_threads()));
  if (workers <= 1) {
    for (int i = 0; i < n; ++i) f(i, 0);
    return;
  }
  std::atomic<int> next{0};
  std::exception_ptr err;
  std::mutex mu;
  auto run = [&](int w) {
    try {
      for (int i = next++; i < n; i = next++) f(i, w);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!err) err = std::current_exception();
    }
  };
  std::vector<std::thread> ts;
  for (int w = 1; w < workers; ++w) ts.emplace_back(run, w);
  run(0);
  for (auto& t : ts) t.join();
  if (err) std::rethrow_exception(err);
}

}  // namespace oscar
