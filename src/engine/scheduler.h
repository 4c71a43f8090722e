// Continuous batching (the serving loop's core; DESIGN §8).
//
// Requests wait in a FCFS queue and run in a set of at most `max_running`
// sequences. Every step() is one Model::forward over a batch assembled under a
// token budget (`max_batch_tokens`):
//   1. running sequences in admission order: one token each when decoding, a
//      chunk of their prompt when prefilling (chunked prefill mixed with decode);
//      when the KV pages they need are not free, the most recently admitted
//      running sequences are preempted (their pages freed; they go back to the
//      front of the queue and recompute prompt + generated tokens later);
//   2. only when nothing was preempted: waiting requests are admitted while the
//      budget lasts, the running set has room and kv::KvCache::pages_needed says
//      their first chunk fits. With prefix caching, a request starts from the
//      longest cached prefix of its tokens (kv::KvCache::attach_prefix), and the
//      full pages of every step are offered to the cache (publish_prefix). A
//      request whose first full pages a running sequence is still computing
//      waits for them (waits_for_prefix) and lets later requests pass.
// The pages of a step are checked before the forward runs, so a step never fails
// for lack of memory; a request that could not fit in the whole cache even alone
// is refused when it is added. Every request ends with exactly one finished
// event: "stop", "length", "abort" (abort() or shutdown) or "error".
//
// Single-threaded: the caller serializes add/abort/step (engine/async_engine.h
// runs it on its own thread for the server).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/generator.h"
#include "engine/logprobs.h"
#include "engine/metrics.h"
#include "engine/step_draw.h"
#include "kv/kv_cache.h"
#include "model/forward.h"

namespace oscar::engine {

using RequestId = int64_t;

// What a request produced since its previous event (delivered on the thread
// that runs step()).
struct RequestEvent {
  RequestId id = 0;
  std::string text;         // complete UTF-8 (held back otherwise), never part of a stop string
  std::vector<int> tokens;  // new token ids
  bool finished = false;
  std::string finish_reason;  // when finished: "stop" | "length" | "abort" | "error"
  std::string error;          // when finish_reason == "error"
  int prompt_tokens = 0, completion_tokens = 0;  // usage, on every event
  // With Request::logprobs: one per entry of `tokens`. With Request::prompt_logprobs: prompt
  // tokens 1, 2, ... in order, as their prefill computes them (events without tokens, before the
  // first generated token's).
  std::vector<TokenLogprob> logprobs;
  std::vector<TokenLogprob> prompt_logprobs;
};
using EventFn = std::function<void(const RequestEvent&)>;

// A request the scheduler refuses: the client's fault (kInvalid: HTTP 400) or
// the server's state (kBusy: queue full or shutting down, HTTP 503).
class Rejected : public Error {
 public:
  enum Kind { kInvalid, kBusy };
  Rejected(Kind k, const std::string& what) : Error(what), kind(k) {}
  Kind kind;
};

struct SchedulerConfig {
  int max_batch_tokens = 512;  // tokens per forward step (decode tokens + prefill chunks)
  int max_running = 32;        // sequences in the running set (max concurrency)
  int max_waiting = 1024;      // queued requests beyond which add() refuses
  int max_model_len = 0;       // prompt + generated tokens; 0 = the model's max_position.
                               // Lowered to what one sequence can hold in the whole cache.
};

// Counters and histograms for /metrics (times in seconds).
struct SchedulerMetrics {
  int64_t steps = 0;
  int64_t prompt_tokens = 0;      // prompt tokens of finished requests
  int64_t generation_tokens = 0;  // tokens sampled
  int64_t prefill_tokens = 0;     // tokens run as prefill (recomputation included)
  int64_t host_draws = 0;         // tokens whose logits were copied and drawn on the host
  int64_t preemptions = 0;
  int64_t prefix_queries = 0, prefix_hits = 0;  // prompt tokens looked up / found in the prefix cache
  int64_t prefix_waits = 0;       // admissions put off for a prefix a running sequence computes
  int64_t requests_added = 0, requests_rejected = 0;
  int64_t finished_stop = 0, finished_length = 0, finished_abort = 0, finished_error = 0;
  double busy_s = 0;  // time inside forward
  Histogram ttft{Histogram::latency_buckets()}, tpot{Histogram::latency_buckets()},
      itl{Histogram::latency_buckets()}, e2e{Histogram::e2e_buckets()},
      queue{Histogram::e2e_buckets()};
  // Forward steps by kind: every row a decode token, or with a prompt chunk in the step.
  Histogram decode_step{Histogram::latency_buckets()}, mixed_step{Histogram::latency_buckets()};
};

class Scheduler {
 public:
  // Prefill chunks of a request with prompt log probabilities yield the logits of every position
  // (vocab floats each, on the backend and copied to the host): at most this many tokens a step.
  static constexpr int kPromptLogprobChunk = 256;

  Scheduler(model::Model& m, kv::KvCache& cache, TokenText token_text, SchedulerConfig cfg = {});
  ~Scheduler();

  // Throws Rejected when the request is invalid or could never fit in the
  // cache; caps max_new_tokens to what max_model_len leaves. Reads only the
  // configuration, so another thread may call it while step() runs.
  void validate(Request& req) const;
  // Validates and queues a request (takes effect at the next step). Throws
  // Rejected. `id` 0 = assign the next id; a caller that assigns its own ids
  // (engine/async_engine.h) must keep them unique and non-zero.
  RequestId add(Request req, EventFn on_event, RequestId id = 0);
  // Finishes a request with "abort" (now when it waits, at the next step when it
  // runs) and frees its pages. Unknown or finished ids are ignored.
  void abort(RequestId id);
  void abort_all();
  // One forward step; false when there was nothing to run.
  bool step();

  int num_running() const { return static_cast<int>(running_.size()); }
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  bool idle() const { return running_.empty() && waiting_.empty(); }
  const SchedulerMetrics& metrics() const { return metrics_; }
  const SchedulerConfig& config() const { return cfg_; }
  const kv::KvCache& cache() const { return cache_; }

 private:
  struct Seq;
  using Clock = std::chrono::steady_clock;
  void finish(Seq& s, const std::string& reason, const std::string& error = {});
  void preempt(Seq& s);
  void accept(Seq& s, int token, Clock::time_point now, TokenLogprob* logprob);
  void emit(Seq& s, std::string text, std::vector<int> tokens, std::vector<TokenLogprob> logprobs = {},
            std::vector<TokenLogprob> prompt_logprobs = {});
  // In-batch prefix sharing (with prefix caching): true while a running sequence is still
  // computing full pages that begin `w`'s tokens too, or has not settled them
  // (KvCache::prefix_unsettled). `w` then waits and attaches them when they are done, instead of
  // computing them a second time beside it (SGLang defers such requests the same way; `n`
  // choices of one prompt are the common case).
  bool waits_for_prefix(const Seq& w) const;
  // Tokens a running sequence may feed this step within `budget`.
  int chunk(const Seq& s, int budget) const;
  // The log probabilities the step's requests asked for, from its output rows.
  struct LogprobItem {
    Seq* seq;
    int row, token, k;
    int pos;  // a prompt token's index in the prompt; -1 for a drawn token
    TokenLogprob out;
  };
  void compute_logprobs(std::vector<LogprobItem>& items);

  model::Model& m_;
  kv::KvCache& cache_;
  TokenText token_text_;
  SchedulerConfig cfg_;
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::vector<std::unique_ptr<Seq>> running_;  // admission order
  std::vector<RequestId> aborts_;
  RequestId next_id_ = 1;
  kv::PageCounts cache_total_;
  SchedulerMetrics metrics_;
  StepDrawer drawer_;             // the step and its tokens
  std::vector<SampleJob> jobs_;   // the step's draws, in plan order
  std::vector<int> job_of_;       // per planned row: its index in jobs_, or -1 (no token)
  std::vector<float> lp_rows_;    // compute_logprobs: output rows copied to the host
};

// Length of the longest prefix of `s` that does not end inside a UTF-8 sequence.
size_t utf8_complete_prefix(std::string_view s);

}  // namespace oscar::engine
