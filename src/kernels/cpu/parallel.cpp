#include "kernels/cpu/parallel.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/cpu/attention.h"

namespace oscar::kernels::cpu {

namespace {

thread_local bool t_inside = false;  // set on pool threads and during a parallel_for

class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    return pool;
  }

  int threads() const { return threads_; }

  void set_threads(int n) {
    std::lock_guard<std::mutex> run(run_mu_);
    stop_workers();
    threads_ = n;
    start_workers();
  }

  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    if (n <= 0) return;
    if (t_inside || threads_ <= 1 || n == 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    std::lock_guard<std::mutex> run(run_mu_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      pending_.store(static_cast<int>(workers_.size()));
      error_ = nullptr;
      generation_.fetch_add(1);
    }
    cv_.notify_all();
    t_inside = true;
    work();
    t_inside = false;
    spin_until([&] { return pending_.load() == 0; });
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return pending_.load() == 0; });
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  ~Pool() { stop_workers(); }

 private:
  Pool() {
    int n = 0;
    if (const char* env = std::getenv("OSCAR_NUM_THREADS")) n = std::atoi(env);
    if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
    threads_ = n > 0 ? n : 1;
    start_workers();
  }

  // Poll pred() for up to kSpinMicros, yielding the core between polls (as the
  // CPU backend's op pool in backend/cpu/ops_threads.cpp does), then the caller
  // blocks on its condition variable.
  template <class Pred>
  static void spin_until(const Pred& pred) {
    constexpr int kSpinMicros = 30;
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      if (pred()) return;
      std::this_thread::yield();
      if ((i & 7) == 7 && std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(kSpinMicros)) return;
    }
  }

  void work() {
    for (;;) {
      const int64_t i = next_.fetch_add(1);
      if (i >= n_) break;
      try {
        (*fn_)(i);
      } catch (...) {
        std::lock_guard<std::mutex> lk(mu_);
        if (!error_) error_ = std::current_exception();
        next_.store(n_);  // stop handing out work
      }
    }
  }

  void worker() {
    t_inside = true;
    uint64_t seen = 0;
    for (;;) {
      // Back-to-back regions (one per layer in a decode step): spin briefly
      // before sleeping, a futex wake-up costs tens of µs on a VM.
      spin_until([&] { return generation_.load() != seen; });
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return stop_ || generation_.load() != seen; });
        if (stop_) return;
        seen = generation_.load();
      }
      work();
      if (pending_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_one();
      }
    }
  }

  void start_workers() {
    stop_ = false;
    for (int i = 1; i < threads_; ++i) workers_.emplace_back([this] { worker(); });
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  int threads_ = 1;
  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> pending_{0};
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;
  std::exception_ptr error_;
};

}  // namespace

void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) { Pool::get().run(n, fn); }

void set_num_threads(int n) {
  if (n > 0 && n != Pool::get().threads()) Pool::get().set_threads(n);
}

int num_threads() { return Pool::get().threads(); }

}  // namespace oscar::kernels::cpu
