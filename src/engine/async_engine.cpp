#include "engine/async_engine.h"

#include <fmt/format.h>

namespace oscar::engine {

AsyncEngine::AsyncEngine(Scheduler& sched) : sched_(sched) {
  publish();
  thread_ = std::thread([this] { loop(); });
}

AsyncEngine::~AsyncEngine() { shutdown(false); }

RequestId AsyncEngine::submit(Request req, EventFn on_event) {
  sched_.validate(req);  // configuration only: safe beside a running step
  std::lock_guard lk(mu_);
  if (stop_) throw Rejected(Rejected::kBusy, "the server is shutting down");
  if (waiting_.load() >= sched_.config().max_waiting)
    throw Rejected(Rejected::kBusy,
                   fmt::format("the queue is full ({} requests waiting)", waiting_.load()));
  const RequestId id = next_id_++;
  inbox_.push_back({id, std::move(req), std::move(on_event)});
  ++waiting_;
  cv_.notify_one();
  return id;
}

void AsyncEngine::abort(RequestId id) {
  std::lock_guard lk(mu_);
  aborts_.push_back(id);
  cv_.notify_one();
}

void AsyncEngine::shutdown(bool drain) {
  {
    std::lock_guard lk(mu_);
    if (!stop_) {
      stop_ = true;
      drain_ = drain;
    }
    cv_.notify_one();
  }
  if (thread_.joinable()) thread_.join();
}

AsyncEngine::Snapshot AsyncEngine::snapshot() const {
  std::lock_guard lk(snap_mu_);
  return snap_;
}

void AsyncEngine::publish() {
  Snapshot s{sched_.metrics(), sched_.cache().usage(), sched_.num_running(), sched_.num_waiting()};
  std::lock_guard lk(snap_mu_);
  snap_ = std::move(s);
}

void AsyncEngine::loop() {
  for (;;) {
    std::vector<Pending> inbox;
    std::vector<RequestId> aborts;
    bool stop = false, drain = false;
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !inbox_.empty() || !aborts_.empty() || !sched_.idle(); });
      inbox.swap(inbox_);
      aborts.swap(aborts_);
      stop = stop_;
      drain = drain_;
    }
    for (auto& p : inbox) {
      try {
        sched_.add(std::move(p.req), p.on_event, p.id);
      } catch (const Rejected& e) {
        RequestEvent ev;
        ev.id = p.id;
        ev.finished = true;
        ev.finish_reason = "error";
        ev.error = e.what();
        try {
          if (p.on_event) p.on_event(ev);
        } catch (...) {
        }
      }
    }
    for (RequestId id : aborts) sched_.abort(id);
    if (stop && !drain) sched_.abort_all();
    sched_.step();
    waiting_ = sched_.num_waiting() + [&] {
      std::lock_guard lk(mu_);
      return static_cast<int>(inbox_.size());
    }();
    publish();
    if (stop && sched_.idle()) {
      std::lock_guard lk(mu_);
      if (inbox_.empty()) break;
    }
  }
  publish();
}

}  // namespace oscar::engine
