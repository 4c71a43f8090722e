#include "engine/scheduler.h"

#include <fmt/format.h>

#include <algorithm>

#include "backend/cpu/ops_threads.h"

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
  int prompt_lp_next = 1;         // the next prompt token whose log probability is due

  Seq(RequestId i, Request r, EventFn f)
      : id(i), req(std::move(r)), on_event(std::move(f)), sampler(req.sampling, static_cast<int>(req.prompt.size())),
        stop(req.stop_strings), history(req.prompt),
        prompt_len(static_cast<int>(req.prompt.size())), arrival(Clock::now()) {}
  int pending() const { return static_cast<int>(history.size()) - fed; }
  bool wants_prompt_logprobs() const { return req.prompt_logprobs >= 0 && prompt_lp_next < prompt_len; }
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
  for (int k : {req.logprobs, req.prompt_logprobs})
    if (k < -1 || k > kMaxLogprobs)
      throw Rejected(Rejected::kInvalid,
                     fmt::format("logprobs must be in [0, {}] alternatives (got {})", kMaxLogprobs, k));
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

bool Scheduler::waits_for_prefix(const Seq& w) const {
  if (!cache_.prefix_caching() || w.wants_prompt_logprobs()) return false;
  const size_t P = static_cast<size_t>(cache_.shape().page_size);
  const size_t most = (w.history.size() - 1) / P * P;  // attach_prefix leaves the last token
  if (most == 0) return false;
  for (const auto& rp : running_) {
    const Seq& r = *rp;
    if (r.finished || r.cache_seq < 0) continue;
    const bool unsettled = cache_.prefix_unsettled(r.cache_seq);
    if (size_t(r.fed) >= most && !unsettled) continue;  // what it could share is attachable now
    if (r.history.size() < P || !std::equal(w.history.begin(), w.history.begin() + std::ptrdiff_t(P), r.history.begin()))
      continue;
    const size_t lim = std::min(most, r.history.size());
    size_t c = P;
    while (c < lim && w.history[c] == r.history[c]) ++c;
    const size_t shared = c / P * P;  // full pages both begin with
    if (size_t(r.fed) < shared || unsettled) return true;
  }
  return false;
}

int Scheduler::chunk(const Seq& s, int budget) const {
  const int n = std::min(s.pending(), budget);
  return s.wants_prompt_logprobs() ? std::min(n, kPromptLogprobChunk) : n;
}

void Scheduler::emit(Seq& s, std::string text, std::vector<int> tokens, std::vector<TokenLogprob> logprobs,
                     std::vector<TokenLogprob> prompt_logprobs) {
  RequestEvent ev;
  ev.id = s.id;
  // Hold back an unfinished UTF-8 character until its last byte arrives.
  s.utf8_held += text;
  const size_t cut = utf8_complete_prefix(s.utf8_held);
  ev.text = s.utf8_held.substr(0, cut);
  s.utf8_held.erase(0, cut);
  ev.tokens = std::move(tokens);
  ev.logprobs = std::move(logprobs);
  ev.prompt_logprobs = std::move(prompt_logprobs);
  ev.prompt_tokens = s.prompt_len;
  ev.completion_tokens = s.generated;
  if (ev.text.empty() && ev.tokens.empty() && ev.prompt_logprobs.empty()) return;
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

void Scheduler::accept(Seq& s, int tok, Clock::time_point now, TokenLogprob* lp) {
  std::vector<TokenLogprob> lps;
  if (lp) lps.push_back(std::move(*lp));
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
    emit(s, {}, {tok}, std::move(lps));
    finish(s, "stop");
    return;
  }
  std::string text = token_text_ ? s.stop.push(token_text_(tok)) : std::string();
  emit(s, std::move(text), {tok}, std::move(lps));
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
    const int n = chunk(s, budget);
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

  // 2. Admission (FCFS), when nothing had to be preempted. A request that waits for a shared
  // prefix (waits_for_prefix) lets the ones behind it pass; one that does not fit stops admission.
  if (!preempted) {
    for (auto it = waiting_.begin(); it != waiting_.end() && budget > 0 &&
                                     static_cast<int>(running_.size()) < cfg_.max_running;) {
      Seq& s = **it;
      if (waits_for_prefix(s)) {
        ++metrics_.prefix_waits;
        ++it;
        continue;
      }
      s.cache_seq = cache_.create();
      // Prefix cache: pages of the longest cached prefix join the sequence.
      // (Not for prompt log probabilities: they need the logits of every prompt position.)
      const int hit = s.wants_prompt_logprobs() ? 0 : cache_.attach_prefix(s.cache_seq, s.history);
      s.fed = hit;
      const int n = chunk(s, budget);
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
      running_.push_back(std::move(*it));
      it = waiting_.erase(it);
    }
  }
  if (plan.empty()) return false;

  // 3. The forward.
  // A sequence with prompt log probabilities due yields every position's logits (all_logits);
  // the others their last. first_row[r]: the step's first output row.
  std::vector<model::SeqStep> steps;
  std::vector<int> first_row(plan.size());
  steps.reserve(plan.size());
  int rows = 0;
  for (size_t r = 0; r < plan.size(); ++r) {
    const Planned& p = plan[r];
    const bool all = p.seq->wants_prompt_logprobs();
    steps.push_back({p.seq->cache_seq,
                     std::span<const int32_t>(p.seq->history.data() + p.seq->fed, size_t(p.n)), all});
    first_row[r] = rows;
    rows += all ? p.n : 1;
  }
  // The rows that yield a token: sequences whose every token is in the cache after this step
  // (a last prefill chunk, or a decode token), unless no new token is wanted.
  jobs_.clear();
  job_of_.assign(plan.size(), -1);
  for (size_t r = 0; r < plan.size(); ++r) {
    Seq& s = *plan[r].seq;
    if (s.pending() == plan[r].n && s.req.max_new_tokens != 0) {
      job_of_[r] = static_cast<int>(jobs_.size());
      const int last = first_row[r] + (steps[r].all_logits ? plan[r].n : 1) - 1;
      jobs_.push_back({&s.sampler, {}, s.history, -1, {}, last});
      jobs_.back().appends = true;  // a request's history only grows
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
  const double step_s = std::chrono::duration<double>(now - t0).count();
  metrics_.busy_s += step_s;
  const bool decode_only = std::all_of(steps.begin(), steps.end(), [](const model::SeqStep& st) {
    return st.tokens.size() == 1;
  });
  (decode_only ? metrics_.decode_step : metrics_.mixed_step).observe(step_s);
  ++metrics_.steps;
  metrics_.host_draws += drawer_.host_rows();

  // Log probabilities: of the prompt tokens whose predicting position ran in this step (row i of
  // an all_logits chunk predicts history[fed + i + 1]), and of the drawn tokens.
  std::vector<LogprobItem> lp_items;
  std::vector<int> lp_first(plan.size(), -1), lp_end(plan.size(), -1), lp_job(plan.size(), -1);
  for (size_t r = 0; r < plan.size(); ++r) {
    Seq& s = *plan[r].seq;
    if (steps[r].all_logits) {
      lp_first[r] = static_cast<int>(lp_items.size());
      for (int i = 0; i < plan[r].n; ++i) {
        const int target = s.fed + i + 1;
        if (target >= s.prompt_lp_next && target < s.prompt_len)
          lp_items.push_back({&s, first_row[r] + i, s.history[size_t(target)], s.req.prompt_logprobs, target, {}});
      }
      lp_end[r] = static_cast<int>(lp_items.size());
    }
    if (job_of_[r] >= 0 && s.req.logprobs >= 0 && jobs_[size_t(job_of_[r])].token >= 0) {
      const SampleJob& j = jobs_[size_t(job_of_[r])];
      lp_job[r] = static_cast<int>(lp_items.size());
      lp_items.push_back({&s, j.row, j.token, s.req.logprobs, -1, {}});
    }
  }
  if (!lp_items.empty()) {
    try {
      compute_logprobs(lp_items);
    } catch (const std::exception& e) {
      // Not expected (rows and tokens are in range): fail those requests only.
      for (const LogprobItem& it : lp_items) finish(*it.seq, "error", std::string("logprobs failed: ") + e.what());
    }
  }

  // 4. Each row's token accepted in plan order. A row whose logits could not be drawn from
  // (NaN) fails its own request only.
  for (size_t r = 0; r < plan.size(); ++r) {
    Seq& s = *plan[r].seq;
    const bool decode = plan[r].n == 1 && s.generated > 0 && s.pending() == 1;
    if (!decode) metrics_.prefill_tokens += plan[r].n;
    s.fed += plan[r].n;
    if (s.finished) continue;  // (a failed log probability)
    cache_.publish_prefix(s.cache_seq, s.history);
    if (lp_first[r] >= 0 && lp_end[r] > lp_first[r]) {
      std::vector<TokenLogprob> plp;
      for (int i = lp_first[r]; i < lp_end[r]; ++i) plp.push_back(std::move(lp_items[size_t(i)].out));
      s.prompt_lp_next = lp_items[size_t(lp_end[r] - 1)].pos + 1;
      emit(s, {}, {}, {}, std::move(plp));
    }
    if (s.pending() > 0) continue;
    if (s.req.max_new_tokens == 0) {
      finish(s, "length");
      continue;
    }
    const SampleJob& j = jobs_[size_t(job_of_[r])];
    if (j.token < 0)
      finish(s, "error", "sampling failed: " + j.error);
    else
      accept(s, j.token, now, lp_job[r] >= 0 ? &lp_items[size_t(lp_job[r])].out : nullptr);
  }
  std::erase_if(running_, [](const auto& s) { return s->finished; });
  return true;
}

void Scheduler::compute_logprobs(std::vector<LogprobItem>& items) {
  // Rows copied to the host a block at a time (an all_logits chunk of a 152K vocabulary is
  // 600 KB a row), then the log-softmax of the block's rows in parallel.
  const int V = m_.config().vocab_size;
  constexpr size_t kBlock = 32;
  for (size_t b = 0; b < items.size(); b += kBlock) {
    const size_t nb = std::min(kBlock, items.size() - b);
    lp_rows_.resize(nb * size_t(V));
    for (size_t i = 0; i < nb; ++i)
      m_.output_logits(items[b + i].row, std::span<float>(lp_rows_.data() + i * size_t(V), size_t(V)));
    backend::cpu::parallel_for(static_cast<int64_t>(nb), 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        LogprobItem& it = items[b + size_t(i)];
        it.out = token_logprob(std::span<const float>(lp_rows_.data() + size_t(i) * size_t(V), size_t(V)),
                               it.token, it.k);
      }
    });
  }
}

}  // namespace oscar::engine
