#include "backend/cpu/ops_threads.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace oscar::backend::cpu {

namespace {

int default_threads() {
  if (const char* e = std::getenv("OSCAR_NUM_THREADS")) {
    int n = std::atoi(e);
    if (n > 0) return n;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

thread_local bool t_in_worker = false;

class Pool {
 public:
  explicit Pool(int n) : n_(n) {
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i] { loop(i); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int size() const { return n_; }

  void run(const std::function<void(int)>& task) {
    std::lock_guard<std::mutex> run_lock(run_mu_);  // one parallel region at a time
    task_ = &task;
    pending_.store(n_ - 1);
    {
      std::lock_guard<std::mutex> lk(mu_);
      gen_.fetch_add(1);
    }
    cv_.notify_all();
    t_in_worker = true;
    task(0);
    t_in_worker = false;
    while (pending_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
    task_ = nullptr;
  }

 private:
  void loop(int idx) {
    t_in_worker = true;
    uint64_t seen = 0;
    for (;;) {
      // Spin a little first: the next op of a decode step usually follows within microseconds.
      uint64_t g = gen_.load(std::memory_order_acquire);
      for (int spin = 0; g == seen && spin < 20000; ++spin) {
        std::this_thread::yield();
        g = gen_.load(std::memory_order_acquire);
      }
      if (g == seen) {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return gen_.load() != seen; });
        g = gen_.load();
      }
      seen = g;
      if (stop_) return;
      (*task_)(idx);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  int n_;
  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> gen_{0};
  std::atomic<int> pending_{0};
  const std::function<void(int)>* task_ = nullptr;
  bool stop_ = false;
};

int g_requested = 0;
std::unique_ptr<Pool> g_pool;
std::mutex g_pool_mu;

Pool& pool() {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  const int want = g_requested > 0 ? g_requested : default_threads();
  if (!g_pool || g_pool->size() != want) {
    g_pool.reset();
    g_pool = std::make_unique<Pool>(want);
  }
  return *g_pool;
}

}  // namespace

void set_op_threads(int n) {
  std::lock_guard<std::mutex> lk(g_pool_mu);
  g_requested = n;
}

int op_threads() { return pool().size(); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t units = (n + grain - 1) / grain;
  if (t_in_worker || units == 1) {
    fn(0, n);
    return;
  }
  Pool& p = pool();
  const int nt = static_cast<int>(std::min<int64_t>(p.size(), units));
  if (nt <= 1) {
    fn(0, n);
    return;
  }
  p.run([&](int idx) {
    if (idx >= nt) return;
    const int64_t u0 = units * idx / nt, u1 = units * (idx + 1) / nt;
    const int64_t b = u0 * grain, e = std::min(n, u1 * grain);
    if (b < e) fn(b, e);
  });
}

}  // namespace oscar::backend::cpu
