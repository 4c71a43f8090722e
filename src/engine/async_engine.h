// The scheduler on its own thread, for callers on many threads (the HTTP
// server): submit() and abort() return at once; the loop thread feeds new
// requests and aborts into the Scheduler between steps and runs step() while
// there is work. Events are delivered on the loop thread (keep callbacks short:
// push into a queue).
#pragma once

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/scheduler.h"

namespace oscar::engine {

class AsyncEngine {
 public:
  explicit AsyncEngine(Scheduler& sched);
  ~AsyncEngine();  // shutdown(false)
  AsyncEngine(const AsyncEngine&) = delete;
  AsyncEngine& operator=(const AsyncEngine&) = delete;

  // Validates (throws Rejected: invalid, queue full, shutting down) and queues.
  RequestId submit(Request req, EventFn on_event);
  // Finishes the request with "abort" at the loop's next turn (frees its pages).
  void abort(RequestId id);
  // Stops accepting requests. drain: runs until every accepted request has
  // finished; otherwise aborts them. Then joins the loop. Idempotent.
  void shutdown(bool drain);

  // The scheduler's state after its latest step.
  struct Snapshot {
    SchedulerMetrics metrics;
    kv::KvUsage kv;
    int running = 0, waiting = 0;
  };
  Snapshot snapshot() const;

 private:
  void loop();
  void publish();

  Scheduler& sched_;
  mutable std::mutex mu_;  // inbox, aborts, flags
  std::condition_variable cv_;
  struct Pending {
    RequestId id;
    Request req;
    EventFn on_event;
  };
  std::vector<Pending> inbox_;
  std::vector<RequestId> aborts_;
  bool stop_ = false, drain_ = false;
  std::atomic<RequestId> next_id_{1};
  std::atomic<int> waiting_{0};  // inbox + scheduler queue, for the queue limit

  mutable std::mutex snap_mu_;
  Snapshot snap_;
  std::thread thread_;
};

}  // namespace oscar::engine
