#include "engine/scheduler.h"

#include <fmt/format.h>

#include <algorithm>

namespace oscar::engine {

size_t utf8_complete_prefix(std::string_view s) {
  // Look back at most 3 bytes for the lead byte of an unfinished sequence.
  const size_t n = s.size();
  for (size_t back = 1; back <= std::min<size_t>(3, n); ++back) {
    const auto c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: keep looking
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? n - back : n;
  }
  return n;  // only continuation bytes (invalid anyway) or empty: pass through
}

struct Scheduler::Seq {
  RequestId id = 0;
  Request req;
  EventFn on_event;
  Sampler sampler;
  StopStringMatcher stop;
  std::string utf8_held;          // bytes of an unfinished UTF-8 character
  std::vector<int> history;       // prompt + generated
  int prompt_len = 0;
  int generated = 0;
  int fed = 0;                    // history tokens in the cache
  kv::SeqId cache_seq = -1;       // -1 while waiting
  bool finished = false;
  Clock::time_point arrival, first_token, last_token;
  bool queued_once = false;       // queue time observed (first admission only)

  Seq(RequestId i, Request r, EventFn f)
      : id(i), req(std::move(r)), on_event(std::move(f)), sampler(req.sampling),
        stop(req.stop_strings), history(req.prompt),
        prompt_len(static_cast<int>(req.prompt.size())), arrival(Clock::now()) {}
  int pending() const { return static_cast<int>(history.size()) - fed; }
};

Scheduler::Scheduler(model::Model& m, kv::KvCache& cache, TokenText token_text,
                     SchedulerConfig cfg)
    : m_(m), cache_(cache), token_text_(std::move(token_text)), cfg_(cfg) {
  if (cfg_.max_batch_tokens < 1) throw Error("scheduler: max_batch_tokens must be >= 1");
  if (cfg_.max_running < 1) throw Error("scheduler: max_running must be >= 1");
  if (cfg_.max_waiting < 0) throw Error("scheduler: max_waiting must be >= 0");
  if (cfg_.max_model_len <= 0) cfg_.max_model_len = m_.config().max_position;
  cache_total_ = cache_.usage().total;
  // The context is what one sequence can hold in the whole cache, so a request
  // that passes the context check can always run (alone, if need be).
  auto fits = [&](int64_t len) {
    return cache_.pages_to_hold(len, cfg_.max_batch_tokens).fits_in(cache_total_);
  };
  if (!fits(1)) throw Error("scheduler: the KV cache cannot hold even one token");
  if (!fits(cfg_.max_model_len)) {
    int64_t lo = 1, hi = cfg_.max_model_len;  // fits(lo), !fits(hi)
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      (fits(mid) ? lo : hi) = mid;
    }
    cfg_.max_model_len = static_cast<int>(lo);
  }
}

Scheduler::~Scheduler() {
  for (auto& s : running_)
    if (s->cache_seq >= 0) cache_.release(s->cache_seq);
}

void Scheduler::validate(Request& req) const {
  const int V = m_.config().vocab_size;
  if (req.prompt.empty()) throw Rejected(Rejected::kInvalid, "the prompt is empty");
  for (int t : req.prompt)
    if (t < 0 || t >= V)
      throw Rejected(Rejected::kInvalid,
                     fmt::format("prompt token {} is outside the vocabulary [0, {})", t, V));
  if (req.max_new_tokens < 0) throw Rejected(Rejected::kInvalid, "max_tokens must be >= 0");
  if (!req.stop_strings.empty() && !token_text_)
    throw Rejected(Rejected::kInvalid, "stop strings need a tokenizer");
  try {
    req.sampling.validate();
  } catch (const Error& e) {
    throw Rejected(Rejected::kInvalid, e.what());
  }
  const int64_t plen = static_cast<int64_t>(req.prompt.size());
  if (plen >= cfg_.max_model_len)
    throw Rejected(Rejected::kInvalid,
                   fmt::format("the prompt has {} tokens; the context is {} tokens (the model's, "
                               "or what the KV cache holds for one sequence)",
                               plen, cfg_.max_model_len));
  req.max_new_tokens =
      static_cast<int>(std::min<int64_t>(req.max_new_tokens, cfg_.max_model_len - plen));
  // Tokens it may hold: prompt + generated, the last sampled token never written.
  const int64_t most = plen + std::max(0, req.max_new_tokens - 1);
  const kv::PageCounts need = cache_.pages_to_hold(most, cfg_.max_batch_tokens);
  if (!need.fits_in(cache_total_))
    throw Rejected(Rejected::kInvalid,
                   fmt::format("the request needs up to {} tokens of KV cache ({} + {} pages); the "
                               "cache holds {} + {} pages (raise --max-kv-tokens or lower max_tokens)",
                               most, need.bf16, need.quant, cache_total_.bf16, cache_total_.quant));
}

RequestId Scheduler::add(Request req, EventFn on_event, RequestId id) {
  try {
    validate(req);
    if (static_cast<int>(waiting_.size()) >= cfg_.max_waiting)
      throw Rejected(Rejected::kBusy,
                     fmt::format("the queue is full ({} requests waiting)", waiting_.size()));
  } catch (const Rejected&) {
    ++metrics_.requests_rejected;
    throw;
  }
  if (id == 0) id = next_id_++;
  waiting_.push_back(std::make_unique<Seq>(id, std::move(req), std::move(on_event)));
  ++metrics_.requests_added;
  return id;
}

void Scheduler::abort(RequestId id) {
  for (auto it = waiting_.begin(); it != waiting_.end(); ++it)
    if ((*it)->id == id) {
      auto s = std::move(*it);
      waiting_.erase(it);
      finish(*s, "abort");
      return;
    }
  for (auto& s : running_)
    if (s->id == id) aborts_.push_back(id);
}

void Scheduler::abort_all() {
  while (!waiting_.empty()) abort(waiting_.front()->id);
  for (auto& s : running_) aborts_.push_back(s->id);
}

void Scheduler::emit(Seq& s, std::string text, std::vector<int> tokens) {
  RequestEvent ev;
  ev.id = s.id;
  // Hold back an unfinished UTF-8 character until its last byte arrives.
  s.utf8_held += text;
  const size_t cut = utf8_complete_prefix(s.utf8_held);
  ev.text = s.utf8_held.substr(0, cut);
  s.utf8_held.erase(0, cut);
  ev.tokens = std::move(tokens);
  ev.prompt_tokens = s.prompt_len;
  ev.completion_tokens = s.generated;
  if (ev.text.empty() && ev.tokens.empty()) return;
  if (s.on_event) {
    try {
      s.on_event(ev);
    } catch (...) {
      // A consumer's failure must not stop the loop; the request goes on.
    }
  }
}

void Scheduler::finish(Seq& s, const std::string& reason, const std::string& error) {
  if (s.finished) return;
  s.finished = true;
  if (s.cache_seq >= 0) {
    cache_.release(s.cache_seq);
    s.cache_seq = -1;
  }
  RequestEvent ev;
  ev.id = s.id;
  // What was held back: an unfinished character, text that could have begun a
  // stop string (empty once one completed).
  ev.text = s.utf8_held + s.stop.flush();
  s.utf8_held.clear();
  ev.finished = true;
  ev.finish_reason = reason;
  ev.error = error;
  ev.prompt_tokens = s.prompt_len;
  ev.completion_tokens = s.generated;
  const auto now = Clock::now();
  const double e2e = std::chrono::duration<double>(now - s.arrival).count();
  if (reason == "stop") ++metrics_.finished_stop;
  else if (reason == "length") ++metrics_.finished_length;
  else if (reason == "abort") ++metrics_.finished_abort;
  else ++metrics_.finished_error;
  metrics_.prompt_tokens += s.prompt_len;
  if (reason == "stop" || reason == "length") {
    metrics_.e2e.observe(e2e);
    if (s.generated > 1)
      metrics_.tpot.observe(std::chrono::duration<double>(s.last_token - s.first_token).count() /
                            (s.generated - 1));
  }
  if (s.on_event) {
    try {
      s.on_event(ev);
    } catch (...) {
    }
  }
}

void Scheduler::preempt(Seq& s) {
  cache_.release(s.cache_seq);
  s.cache_seq = -1;
  s.fed = 0;
  ++metrics_.preemptions;
}

void Scheduler::accept(Seq& s, int tok, Clock::time_point now) {
  s.history.push_back(tok);
  ++s.generated;
  ++metrics_.generation_tokens;
  if (s.generated == 1) {
    s.first_token = now;
    metrics_.ttft.observe(std::chrono::duration<double>(now - s.arrival).count());
  } else {
    metrics_.itl.observe(std::chrono::duration<double>(now - s.last_token).count());
  }
  s.last_token = now;
  const auto& st = s.req.stop_tokens;
  if (std::find(st.begin(), st.end(), tok) != st.end()) {
    emit(s, {}, {tok});
    finish(s, "stop");
    return;
  }
  std::string text = token_text_ ? s.stop.push(token_text_(tok)) : std::string();
  emit(s, std::move(text), {tok});
  if (s.stop.stopped()) finish(s, "stop");
  else if (s.generated >= s.req.max_new_tokens) finish(s, "length");
}

bool Scheduler::step() {
  // Aborts of running requests.
  if (!aborts_.empty()) {
    for (RequestId id : aborts_)
      for (auto& s : running_)
        if (s->id == id) finish(*s, "abort");
    aborts_.clear();
    std::erase_if(running_, [](const auto& s) { return s->finished; });
  }

  // 1. Running sequences, with preemption from the back when pages run out.
  struct Planned {
    Seq* seq;
    int n;
  };
  std::vector<Planned> plan;
  int budget = cfg_.max_batch_tokens;
  kv::PageCounts need;  // pages the plan's reservations will take
  kv::PageCounts free = cache_.pages_free();
  bool preempted = false;
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Seq& s = *running_[i];
    const int n = std::min(s.pending(), budget);
    kv::PageCounts total = need;
    total += cache_.pages_needed(s.cache_seq, n);
    if (total.fits_in(free) || n == 0) {
      if (n > 0) {
        plan.push_back({&s, n});
        need = total;
        budget -= n;
      }
      ++i;
      continue;
    }
    // Free pages by preempting the most recently admitted sequence (maybe this one).
    Seq& victim = *running_.back();
    preempt(victim);
    preempted = true;
    waiting_.push_front(std::move(running_.back()));
    running_.pop_back();
    free = cache_.pages_free();  // grew; the plan's needs are not taken yet
  }

  // 2. Admission (FCFS), when nothing had to be preempted.
  if (!preempted) {
    while (!waiting_.empty() && budget > 0 &&
           static_cast<int>(running_.size()) < cfg_.max_running) {
      Seq& s = *waiting_.front();
      s.cache_seq = cache_.create();
      // Prefix cache: pages of the longest cached prefix join the sequence.
      const int hit = cache_.attach_prefix(s.cache_seq, s.history);
      s.fed = hit;
      const int n = std::min(s.pending(), budget);
      kv::PageCounts total = need;
      total += cache_.pages_needed(s.cache_seq, n);
      free = cache_.pages_free();  // attaching took cached pages out of the free count
      if (!total.fits_in(free)) {
        cache_.release(s.cache_seq);
        s.cache_seq = -1;
        s.fed = 0;
        break;
      }
      if (cache_.prefix_caching()) {
        metrics_.prefix_queries += static_cast<int64_t>(s.history.size());
        metrics_.prefix_hits += hit;
      }
      if (!s.queued_once) {
        s.queued_once = true;
        metrics_.queue.observe(std::chrono::duration<double>(Clock::now() - s.arrival).count());
      }
      plan.push_back({&s, n});
      need = total;
      budget -= n;
      running_.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
    }
  }
  if (plan.empty()) return false;

  // 3. The forward.
  std::vector<model::SeqStep> steps;
  steps.reserve(plan.size());
  for (const Planned& p : plan)
    steps.push_back({p.seq->cache_seq,
                     std::span<const int32_t>(p.seq->history.data() + p.seq->fed, size_t(p.n)),
                     false});
  // The rows that yield a token: sequences whose every token is in the cache after this step
  // (a last prefill chunk, or a decode token), unless no new token is wanted.
  jobs_.clear();
  job_of_.assign(plan.size(), -1);
  for (size_t r = 0; r < plan.size(); ++r) {
    Seq& s = *plan[r].seq;
    if (s.pending() == plan[r].n && s.req.max_new_tokens != 0) {
      job_of_[r] = static_cast<int>(jobs_.size());
      jobs_.push_back({&s.sampler, {}, s.history, -1, {}, static_cast<int>(r)});
    }
  }
  const auto t0 = Clock::now();
  try {
    drawer_.run(m_, steps, cache_, jobs_);
  } catch (const std::exception& e) {
    // Not expected (pages were checked): fail the step's requests, keep serving.
    for (const Planned& p : plan) finish(*p.seq, "error", std::string("forward failed: ") + e.what());
    std::erase_if(running_, [](const auto& s) { return s->finished; });
    return true;
  }
  const auto now = Clock::now();
  metrics_.busy_s += std::chrono::duration<double>(now - t0).count();
  ++metrics_.steps;
  metrics_.host_draws += drawer_.host_rows();

  // 4. Each row's token accepted in plan order. A row whose logits could not be drawn from
  // (NaN) fails its own request only.
  for (size_t r = 0; r < plan.size(); ++r) {
    Seq& s = *plan[r].seq;
    const bool decode = plan[r].n == 1 && s.generated > 0 && s.pending() == 1;
    if (!decode) metrics_.prefill_tokens += plan[r].n;
    s.fed += plan[r].n;
    cache_.publish_prefix(s.cache_seq, s.history);
    if (s.pending() > 0) continue;
    if (s.req.max_new_tokens == 0) {
      finish(s, "length");
      continue;
    }
    const SampleJob& j = jobs_[size_t(job_of_[r])];
    if (j.token < 0)
      finish(s, "error", "sampling failed: " + j.error);
    else
      accept(s, j.token, now);
  }
  std::erase_if(running_, [](const auto& s) { return s->finished; });
  return true;
}

}  // namespace oscar::engine
