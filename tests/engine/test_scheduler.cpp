// The continuous-batching scheduler (engine/scheduler.h) and its thread
// (engine/async_engine.h) on a random tiny model: greedy tokens equal the
// static Generator's for each request alone, whatever arrives when, whatever is
// preempted; pages all come back; aborts, refusals and the queue limit; the OSCAR
// cache's page promises (kv::KvCache::pages_needed) under the scheduler.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <thread>

#include "backend/cpu/backend_cpu.h"
#include "core/calibration.h"
#include "engine/async_engine.h"
#include "engine/scheduler.h"
#include "kv/bf16_cache.h"
#include "kv/oscar_cache.h"
#include "kv/quant_methods.h"
#include "model/forward_random.h"

namespace oscar::engine {
namespace {

struct Rig {
  Rig()
      : w(model::random_weights(model::tiny_config(model::Arch::kLlama), 3)),
        be(backend::make_cpu_backend({backend::WeightDtype::kF32, 0})),
        m(w, *be) {}
  // A Hadamard-rotated INT2 cache for this model, pages of 16, sink 16, window
  // 16 (demotes early); `o` gives the pool sizes and prefix caching.
  std::unique_ptr<kv::OscarKvCache> oscar_cache(kv::OscarCacheOptions o) {
    const auto& c = m.config();
    ModelFingerprint fp{"llama", c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim, "t"};
    auto calib = std::make_shared<Calibration>(
        data_free_calibration(Composition::kHadamard, fp, 1.0f, 1.0f, 2, c.head_dim));
    o.sink = 16;
    o.recent = 16;
    o.group_size = c.head_dim;
    return std::make_unique<kv::OscarKvCache>(m.cache_shape(16), calib, o);
  }
  model::ModelWeights w;
  std::unique_ptr<backend::Backend> be;
  model::Model m;
};

std::vector<Request> requests(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Request> out(n);
  for (int i = 0; i < n; ++i) {
    const int len = 1 + int(rng() % 40);
    for (int t = 0; t < len; ++t) out[i].prompt.push_back(int(rng() % vocab));
    out[i].max_new_tokens = 4 + int(rng() % 14);
  }
  return out;
}

// Each request alone through the static generator (the reference).
std::vector<std::vector<int>> alone(Rig& r, const std::vector<Request>& reqs, kv::KvCache& cache) {
  std::vector<std::vector<int>> out;
  for (const auto& q : reqs) {
    Generator g(r.m, cache);
    out.push_back(g.run({&q, 1})[0].tokens);
  }
  return out;
}

struct Collected {
  std::vector<int> tokens;
  std::string reason;
  std::string error;
  int finished = 0;
  int completion_tokens = -1;
};

// A request's events into got[id]: its tokens, and at the finish the reason, the error, the
// completion tokens and how many finish events came.
EventFn collect_into(std::map<RequestId, Collected>& got) {
  return [&got](const RequestEvent& e) {
    auto& c = got[e.id];
    c.tokens.insert(c.tokens.end(), e.tokens.begin(), e.tokens.end());
    if (e.finished) {
      ++c.finished;
      c.reason = e.finish_reason;
      c.error = e.error;
      c.completion_tokens = e.completion_tokens;
    }
  };
}

TEST(Scheduler, GreedyTokensEqualEachRequestAloneWhileRequestsArriveAndLeave) {
  Rig r;
  kv::Bf16KvCache big(r.m.cache_shape(16), 256);
  const auto reqs = requests(9, r.m.config().vocab_size, 7);
  const auto want = alone(r, reqs, big);

  kv::Bf16KvCache cache(r.m.cache_shape(16), 256);
  SchedulerConfig cfg;
  cfg.max_batch_tokens = 13;  // prompts split over steps, mixed with decodes
  cfg.max_running = 4;        // the rest wait
  Scheduler s(r.m, cache, nullptr, cfg);
  std::map<RequestId, Collected> got;
  std::vector<RequestId> ids;
  auto add = [&](int i) { ids.push_back(s.add(reqs[i], collect_into(got))); };
  for (int i = 0; i < 3; ++i) add(i);
  int steps = 0, next = 3;
  while (!s.idle() || next < int(reqs.size())) {
    if (next < int(reqs.size()) && steps % 3 == 0) add(next++);  // arrivals mid-run
    s.step();
    ++steps;
    ASSERT_LT(steps, 1000);
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    const auto& c = got[ids[i]];
    EXPECT_EQ(c.tokens, want[i]) << "request " << i;
    EXPECT_EQ(c.finished, 1);
    EXPECT_EQ(c.reason, "length");
    EXPECT_EQ(c.completion_tokens, reqs[i].max_new_tokens);
  }
  EXPECT_EQ(cache.pool().num_used(), 0);
  EXPECT_EQ(s.metrics().preemptions, 0);
  EXPECT_EQ(s.metrics().finished_length, int64_t(reqs.size()));
  EXPECT_EQ(s.metrics().ttft.count, int64_t(reqs.size()));
  // Every forward step is timed once, as decode-only or as a step with a prompt chunk (each
  // request's prompt ran in at least one of those).
  const SchedulerMetrics& m = s.metrics();
  EXPECT_EQ(m.decode_step.count + m.mixed_step.count, m.steps);
  EXPECT_GE(m.mixed_step.count, int64_t(reqs.size()));
  EXPECT_GT(m.decode_step.count, 0);
  EXPECT_GT(m.decode_step.sum, 0.0);
}

TEST(Scheduler, PreemptsWhenPagesRunOutAndEveryRequestStillFinishesWithTheSameTokens) {
  Rig r;
  kv::Bf16KvCache big(r.m.cache_shape(16), 256);
  auto reqs = requests(6, r.m.config().vocab_size, 11);
  for (auto& q : reqs) {
    while (q.prompt.size() < 30) q.prompt.push_back(q.prompt.size() % 50 + 1);
    q.max_new_tokens = 20;  // each sequence grows to ~50 tokens = 4 pages
  }
  const auto want = alone(r, reqs, big);

  kv::Bf16KvCache cache(r.m.cache_shape(16), 9);  // room for two such sequences at once
  SchedulerConfig cfg;
  cfg.max_batch_tokens = 64;
  cfg.max_running = 6;
  Scheduler s(r.m, cache, nullptr, cfg);
  std::map<RequestId, Collected> got;
  std::vector<RequestId> ids;
  for (const auto& q : reqs) ids.push_back(s.add(q, collect_into(got)));
  for (int steps = 0; !s.idle(); ++steps) {
    s.step();
    ASSERT_LT(steps, 5000);
    ASSERT_LE(cache.pool().num_used(), cache.pool().num_pages());
  }
  EXPECT_GT(s.metrics().preemptions, 0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[ids[i]].tokens, want[i]) << "request " << i;
    EXPECT_EQ(got[ids[i]].finished, 1);
    EXPECT_EQ(got[ids[i]].reason, "length");
  }
  EXPECT_EQ(cache.pool().num_used(), 0);
}

TEST(Scheduler, RefusesWhatCanNeverRunAndWhatIsMalformed) {
  Rig r;
  kv::Bf16KvCache cache(r.m.cache_shape(16), 4);  // 64 tokens
  SchedulerConfig cfg;
  cfg.max_waiting = 2;
  cfg.max_model_len = 100;
  Scheduler s(r.m, cache, nullptr, cfg);
  auto kind = [&](Request q) {
    try {
      s.add(std::move(q), nullptr);
    } catch (const Rejected& e) {
      EXPECT_FALSE(std::string(e.what()).empty());
      return int(e.kind);
    }
    return -1;
  };
  Request ok;
  ok.prompt = {1, 2, 3};
  ok.max_new_tokens = 4;
  Request q = ok;
  q.prompt.clear();
  EXPECT_EQ(kind(q), Rejected::kInvalid);
  q = ok;
  q.prompt.push_back(r.m.config().vocab_size);
  EXPECT_EQ(kind(q), Rejected::kInvalid);
  q = ok;
  q.max_new_tokens = -1;
  EXPECT_EQ(kind(q), Rejected::kInvalid);
  q = ok;
  q.prompt.assign(100, 1);  // the whole context
  EXPECT_EQ(kind(q), Rejected::kInvalid);
  // The context is lowered to what the cache holds for one sequence (64 tokens).
  EXPECT_EQ(s.config().max_model_len, 64);
  q = ok;
  q.prompt.assign(64, 1);
  EXPECT_EQ(kind(q), Rejected::kInvalid);
  q = ok;
  q.sampling.temperature = -1;
  EXPECT_EQ(kind(q), Rejected::kInvalid);
  q = ok;
  q.stop_strings = {"x"};  // no tokenizer
  EXPECT_EQ(kind(q), Rejected::kInvalid);
  EXPECT_EQ(kind(ok), -1);
  EXPECT_EQ(kind(ok), -1);
  EXPECT_EQ(kind(ok), Rejected::kBusy);  // queue limit 2
  EXPECT_EQ(s.metrics().requests_rejected, 8);
  while (!s.idle()) s.step();
  EXPECT_EQ(cache.pool().num_used(), 0);
}

TEST(Scheduler, AbortFinishesOnceAndFreesPages) {
  Rig r;
  kv::Bf16KvCache cache(r.m.cache_shape(16), 64);
  Scheduler s(r.m, cache, nullptr);
  std::map<RequestId, Collected> got;
  const EventFn on = collect_into(got);
  Request q;
  q.prompt = {4, 5, 6, 7};
  q.max_new_tokens = 50;
  const RequestId a = s.add(q, on), b = s.add(q, on), c = s.add(q, on);
  s.step();
  s.step();
  EXPECT_GT(cache.pool().num_used(), 0);
  s.abort(a);
  s.abort(a);      // twice: still one finished event
  s.abort(12345);  // unknown: ignored
  s.step();
  EXPECT_EQ(got[a].finished, 1);
  EXPECT_EQ(got[a].reason, "abort");
  EXPECT_LT(got[a].tokens.size(), 50u);
  s.abort_all();
  s.step();
  EXPECT_EQ(got[b].reason, "abort");
  EXPECT_EQ(got[c].reason, "abort");
  EXPECT_TRUE(s.idle());
  EXPECT_EQ(cache.pool().num_used(), 0);
  EXPECT_EQ(s.metrics().finished_abort, 3);
}

TEST(Scheduler, StopTokensAndMaxTokensZero) {
  Rig r;
  kv::Bf16KvCache cache(r.m.cache_shape(16), 64);
  Request q;
  q.prompt = {9, 8, 7};
  q.max_new_tokens = 12;
  Generator g(r.m, cache);
  const auto ref = g.run({&q, 1})[0].tokens;
  ASSERT_GE(ref.size(), 4u);
  Scheduler s(r.m, cache, nullptr);
  std::map<RequestId, Collected> got;
  const EventFn on = collect_into(got);
  Request stop = q;
  stop.stop_tokens = {ref[2]};
  Request zero = q;
  zero.max_new_tokens = 0;
  const RequestId a = s.add(stop, on), b = s.add(zero, on);
  while (!s.idle()) s.step();
  const auto first = std::find(ref.begin(), ref.end(), ref[2]);
  EXPECT_EQ(got[a].tokens, std::vector<int>(ref.begin(), first + 1));
  EXPECT_EQ(got[a].reason, "stop");
  EXPECT_TRUE(got[b].tokens.empty());
  EXPECT_EQ(got[b].reason, "length");
  EXPECT_EQ(cache.pool().num_used(), 0);
}

// The OSCAR cache: demotions at commit take quantized pages; with several
// sequences growing in one step the cache must promise them up front.
TEST(Scheduler, OscarCacheUnderPreemptionFinishesEverythingAndReturnsEveryPage) {
  Rig r;
  const auto& cfg_m = r.m.config();
  kv::OscarCacheOptions o;
  o.bf16_pages = 10;
  o.quant_pages = 6;
  auto owned = r.oscar_cache(o);
  kv::OscarKvCache& cache = *owned;
  SchedulerConfig cfg;
  cfg.max_batch_tokens = 24;
  Scheduler s(r.m, cache, nullptr, cfg);
  auto reqs = requests(6, cfg_m.vocab_size, 5);
  for (auto& q : reqs) q.max_new_tokens = 40;  // > sink + window + page: demotes
  int finished = 0;
  for (const auto& q : reqs)
    s.add(q, [&](const RequestEvent& e) {
      if (e.finished) {
        ++finished;
        EXPECT_EQ(e.finish_reason, "length");
        EXPECT_EQ(e.completion_tokens, 40);
      }
    });
  for (int steps = 0; !s.idle(); ++steps) {
    s.step();
    ASSERT_LT(steps, 5000);
    const auto f = cache.pages_free();
    ASSERT_GE(f.bf16, 0);
    ASSERT_GE(f.quant, 0);
  }
  EXPECT_EQ(finished, 6);
  EXPECT_GT(cache.usage().total.quant, 0);
  EXPECT_EQ(cache.usage().used.bf16, 0);
  EXPECT_EQ(cache.usage().used.quant, 0);
  EXPECT_EQ(cache.pages_free().quant, 6);
  EXPECT_EQ(s.metrics().finished_error, 0);
}

TEST(OscarCachePromises, ASecondSequenceCannotTakeTheQuantizedPagesPromisedToTheFirst) {
  Rig r;
  kv::OscarCacheOptions o;
  o.bf16_pages = 20;
  o.quant_pages = 1;
  auto owned = r.oscar_cache(o);
  kv::OscarKvCache& cache = *owned;
  const kv::SeqId a = cache.create(), b = cache.create();
  // 48 tokens: sink 16 + 32 recent >= W + page: one demotion at commit.
  EXPECT_EQ(cache.pages_needed(a, 48).quant, 1);
  EXPECT_TRUE(cache.can_reserve(a, 48));
  cache.reserve(a, 48);
  EXPECT_EQ(cache.pages_free().quant, 0);
  EXPECT_EQ(cache.pages_needed(a, 48).quant, 0);  // already promised
  EXPECT_FALSE(cache.can_reserve(b, 48));
  EXPECT_THROW(cache.reserve(b, 48), Error);
  cache.release(a);
  EXPECT_EQ(cache.pages_free().quant, 1);
  EXPECT_TRUE(cache.can_reserve(b, 48));
}

TEST(AsyncEngine, ServesManyThreadsAndDrainsOnShutdown) {
  Rig r;
  kv::Bf16KvCache big(r.m.cache_shape(16), 256);
  const auto reqs = requests(8, r.m.config().vocab_size, 3);
  const auto want = alone(r, reqs, big);
  kv::Bf16KvCache cache(r.m.cache_shape(16), 256);
  SchedulerConfig cfg;
  cfg.max_batch_tokens = 16;
  Scheduler s(r.m, cache, nullptr, cfg);
  std::mutex mu;
  std::map<RequestId, Collected> got;
  std::vector<RequestId> ids(reqs.size());
  {
    AsyncEngine eng(s);
    std::vector<std::thread> th;
    for (size_t i = 0; i < reqs.size(); ++i)
      th.emplace_back([&, i] {
        ids[i] = eng.submit(reqs[i], [&](const RequestEvent& e) {
          std::lock_guard lk(mu);
          auto& c = got[e.id];
          c.tokens.insert(c.tokens.end(), e.tokens.begin(), e.tokens.end());
          if (e.finished) {
            ++c.finished;
            c.reason = e.finish_reason;
          }
        });
      });
    for (auto& t : th) t.join();
    eng.shutdown(/*drain=*/true);
    EXPECT_THROW(eng.submit(reqs[0], nullptr), Rejected);
    const auto snap = eng.snapshot();
    EXPECT_EQ(snap.running + snap.waiting, 0);
    EXPECT_EQ(snap.metrics.finished_length, int64_t(reqs.size()));
  }
  for (size_t i = 0; i < reqs.size(); ++i) {
    EXPECT_EQ(got[ids[i]].tokens, want[i]) << "request " << i;
    EXPECT_EQ(got[ids[i]].finished, 1);
  }
  EXPECT_EQ(cache.pool().num_used(), 0);
}

TEST(Utf8, CompletePrefixHoldsBackAnUnfinishedCharacter) {
  EXPECT_EQ(utf8_complete_prefix(""), 0u);
  EXPECT_EQ(utf8_complete_prefix("abc"), 3u);
  const std::string e_acute = "\xC3\xA9", euro = "\xE2\x82\xAC", emoji = "\xF0\x9F\x98\x80";
  EXPECT_EQ(utf8_complete_prefix("a" + e_acute), 3u);
  EXPECT_EQ(utf8_complete_prefix("a" + e_acute.substr(0, 1)), 1u);
  EXPECT_EQ(utf8_complete_prefix("a" + euro.substr(0, 2)), 1u);
  EXPECT_EQ(utf8_complete_prefix("a" + emoji.substr(0, 3)), 1u);
  EXPECT_EQ(utf8_complete_prefix("a" + emoji), 5u);
}

}  // namespace
}  // namespace oscar::engine

namespace oscar::engine {
namespace {

// Requests sharing a long prefix, one after another: with prefix caching the
// later ones start from the cached pages, and the tokens are the same as without.
std::vector<Request> shared_prefix(int n, int prefix, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int> common;
  for (int t = 0; t < prefix; ++t) common.push_back(int(rng() % vocab));
  std::vector<Request> out(n);
  for (int i = 0; i < n; ++i) {
    out[i].prompt = common;
    for (int t = 0; t < 5 + i; ++t) out[i].prompt.push_back(int(rng() % vocab));
    out[i].max_new_tokens = 6;
  }
  return out;
}

std::vector<std::vector<int>> run_one_by_one(Rig& r, kv::KvCache& cache,
                                             const std::vector<Request>& reqs,
                                             SchedulerMetrics* metrics, int batch_tokens) {
  SchedulerConfig cfg;
  cfg.max_batch_tokens = batch_tokens;
  Scheduler s(r.m, cache, nullptr, cfg);
  std::vector<std::vector<int>> out;
  for (const auto& q : reqs) {
    std::vector<int> toks;
    s.add(q, [&toks](const RequestEvent& e) { toks.insert(toks.end(), e.tokens.begin(), e.tokens.end()); });
    while (!s.idle()) s.step();
    out.push_back(toks);
  }
  if (metrics) *metrics = s.metrics();
  return out;
}

TEST(PrefixCache, Bf16SameTokensWithAndWithoutAndHitsCounted) {
  Rig r;
  const auto reqs = shared_prefix(4, 45, r.m.config().vocab_size, 21);
  kv::Bf16KvCache off(r.m.cache_shape(16), 64, false), on(r.m.cache_shape(16), 64, true);
  SchedulerMetrics m_off, m_on;
  const auto want = run_one_by_one(r, off, reqs, &m_off, 512);
  const auto got = run_one_by_one(r, on, reqs, &m_on, 512);
  EXPECT_EQ(got, want);
  EXPECT_EQ(m_off.prefix_hits, 0);
  EXPECT_EQ(m_on.prefix_hits, 3 * 32);  // two full pages of the 45-token prefix, requests 2..4
  EXPECT_EQ(m_on.prefill_tokens + m_on.prefix_hits, m_off.prefill_tokens);
  EXPECT_EQ(on.pool().num_used(), 0);
  EXPECT_GT(on.usage().cached.bf16, 0);  // kept for the next request
}

TEST(PrefixCache, Bf16EvictsCachedPagesWhenTheyAreNeededAndStaysCorrect) {
  Rig r;
  auto reqs = shared_prefix(3, 40, r.m.config().vocab_size, 4);
  const auto other = shared_prefix(3, 40, r.m.config().vocab_size, 99);
  reqs.insert(reqs.end(), other.begin(), other.end());
  reqs.push_back(reqs[0]);
  kv::Bf16KvCache off(r.m.cache_shape(16), 64, false), on(r.m.cache_shape(16), 5, true);
  SchedulerMetrics m;
  EXPECT_EQ(run_one_by_one(r, on, reqs, &m, 512), run_one_by_one(r, off, reqs, nullptr, 512));
  EXPECT_GT(m.prefix_hits, 0);
  EXPECT_EQ(on.pool().num_used(), 0);
}

// OSCAR: with steps of one page the pages a request finds are the ones it would
// have computed (same demotion points), so greedy tokens match exactly.
TEST(PrefixCache, OscarSameTokensWithAndWithoutAndMiddlePagesShared) {
  Rig r;
  const auto& c = r.m.config();
  auto make = [&](bool prefix) {
    kv::OscarCacheOptions o;
    o.max_tokens = 2048;
    o.prefix_caching = prefix;
    return r.oscar_cache(o);
  };
  auto off = make(false), on = make(true);
  const auto reqs = shared_prefix(3, 90, c.vocab_size, 8);  // 5 full pages: sink, 3 middle, 1 recent
  SchedulerMetrics m;
  EXPECT_EQ(run_one_by_one(r, *on, reqs, &m, 16), run_one_by_one(r, *off, reqs, nullptr, 16));
  EXPECT_EQ(m.prefix_hits, 2 * 80);
  EXPECT_GT(on->usage().cached.quant, 0);
  EXPECT_EQ(on->usage().used.bf16 + on->usage().used.quant, 0);
}

// In-batch prefix sharing: requests that begin with the same full pages, added together, compute
// those pages once (the others wait for them and attach them) and give the tokens they give one
// after another with the prefix cache; a request with another prompt is not held up.
std::vector<std::vector<int>> run_together(Rig& r, kv::KvCache& cache, const std::vector<Request>& reqs,
                                           SchedulerMetrics* metrics, int batch_tokens, int* first_step_running) {
  SchedulerConfig cfg;
  cfg.max_batch_tokens = batch_tokens;
  Scheduler s(r.m, cache, nullptr, cfg);
  std::map<RequestId, Collected> got;
  std::vector<RequestId> ids;
  for (const auto& q : reqs) ids.push_back(s.add(q, collect_into(got)));
  for (int steps = 0; !s.idle(); ++steps) {
    s.step();
    if (steps == 0 && first_step_running) *first_step_running = s.num_running();
    EXPECT_LT(steps, 2000);
    if (steps >= 2000) break;
  }
  if (metrics) *metrics = s.metrics();
  std::vector<std::vector<int>> out;
  for (RequestId id : ids) {
    EXPECT_EQ(got[id].finished, 1);
    out.push_back(got[id].tokens);
  }
  return out;
}

TEST(PrefixCache, RequestsAddedTogetherComputeASharedPromptOnce) {
  Rig r;
  const int V = r.m.config().vocab_size;
  auto reqs = shared_prefix(3, 90, V, 17);  // 90 shared tokens: 5 full pages of 16
  reqs.push_back(reqs[0]);                  // n = 2 of the first prompt
  std::mt19937 rng(3);
  Request other;                            // another prompt: not held up
  for (int t = 0; t < 40; ++t) other.prompt.push_back(int(rng() % unsigned(V)));
  other.max_new_tokens = 6;
  reqs.push_back(other);
  int64_t prompt_tokens = 0;
  for (const auto& q : reqs) prompt_tokens += int64_t(q.prompt.size());

  kv::Bf16KvCache off(r.m.cache_shape(16), 128, false), on(r.m.cache_shape(16), 128, true);
  SchedulerMetrics m_off, m_on;
  int running_off = 0, running_on = 0;
  // (128 tokens a step: the first prompt's 95 and a first chunk of `other` in the first step.)
  const auto want = run_together(r, off, reqs, &m_off, 128, &running_off);
  const auto got = run_together(r, on, reqs, &m_on, 128, &running_on);
  EXPECT_EQ(got, want);  // BF16 pages: attaching equals computing
  EXPECT_EQ(m_off.prefill_tokens, prompt_tokens);
  EXPECT_EQ(m_on.prefix_hits, 3 * 80);  // the 80 tokens of 5 full pages, for the 3 that waited
  EXPECT_EQ(m_on.prefill_tokens, prompt_tokens - 3 * 80);
  EXPECT_GT(m_on.prefix_waits, 0);
  EXPECT_EQ(running_on, 2);  // the first of the shared prompt and `other`; the rest wait
  EXPECT_EQ(on.pool().num_used(), 0);

  // OSCAR with the BF16 prompt: the waiting requests attach once the first has settled its pages
  // (its first decode step demotes the middle), so they match the same requests run one by one.
  auto make = [&]() {
    kv::OscarCacheOptions o;
    o.max_tokens = 4096;
    o.prefix_caching = true;
    o.prompt_bf16 = true;
    return r.oscar_cache(o);
  };
  auto seq_cache = make(), tog_cache = make();
  SchedulerMetrics m_seq, m_tog;
  const auto one_by_one = run_one_by_one(r, *seq_cache, reqs, &m_seq, 16);
  const auto together = run_together(r, *tog_cache, reqs, &m_tog, 16, nullptr);
  EXPECT_EQ(together, one_by_one);
  EXPECT_EQ(m_tog.prefix_hits, m_seq.prefix_hits);
  EXPECT_GT(m_tog.prefix_hits, 0);
  EXPECT_GT(m_tog.prefix_waits, 0);
  EXPECT_EQ(tog_cache->usage().used.bf16 + tog_cache->usage().used.quant, 0);
}

// A request whose logits turn NaN (its prompt holds a token whose embedding is NaN) fails alone,
// with "error" and a message naming NaN, while the sampled requests stepped beside it finish
// normally and every page comes back.
TEST(Scheduler, NaNLogitsFailOnlyTheirRequest) {
  model::ModelWeights w = model::random_weights(model::tiny_config(model::Arch::kLlama), 3);
  const int bad = 5, H = w.cfg.hidden;
  for (int c = 0; c < H; ++c) w.tok_embd.data[size_t(bad) * size_t(H) + size_t(c)] = NAN;
  auto be = backend::make_cpu_backend({backend::WeightDtype::kF32, 0});
  model::Model m(w, *be);
  kv::Bf16KvCache cache(m.cache_shape(16), 64);
  Scheduler s(m, cache, nullptr, SchedulerConfig{});
  std::map<RequestId, Collected> got;
  const EventFn on = collect_into(got);
  std::vector<RequestId> ids;
  for (int i = 0; i < 3; ++i) {
    Request q;
    q.prompt = {1, 2, i == 1 ? bad : 3, 4};
    q.max_new_tokens = 6;
    q.sampling.temperature = 0.8f;
    q.sampling.top_p = 0.9f;
    q.sampling.seed = uint64_t(i);
    ids.push_back(s.add(q, on));
  }
  for (int steps = 0; !s.idle(); ++steps) {
    s.step();
    ASSERT_LT(steps, 100);
  }
  for (int i = 0; i < 3; ++i) {
    const auto& c = got[ids[size_t(i)]];
    EXPECT_EQ(c.finished, 1) << i;
    if (i == 1) {
      EXPECT_TRUE(c.tokens.empty());
      EXPECT_EQ(c.reason, "error");
      EXPECT_NE(c.error.find("NaN"), std::string::npos) << c.error;
    } else {
      EXPECT_EQ(c.reason, "length") << i;
      EXPECT_EQ(c.tokens.size(), 6u) << i;
    }
  }
  EXPECT_EQ(cache.pool().num_used(), 0);
  // The CPU backend leaves every sampled row to the host sampler: 6 + 6 tokens and the NaN row's one try.
  EXPECT_EQ(s.metrics().host_draws, 13);
}

// Log probabilities (Request::logprobs / prompt_logprobs) against the teacher-forced logits of
// the whole sequence in one step on a fresh cache: the prompt's over several chunks (and again
// with the prompt in the prefix cache, which such a request must not use), the drawn tokens'
// at each step; greedy tokens are their row's first alternative.
struct LogprobsGot {
  std::vector<int> tokens;
  std::vector<TokenLogprob> lps, prompt_lps;
  int finished = 0;
  std::string reason;
  bool prompt_after_token = false;  // a prompt log probability came after a drawn token
};

EventFn collect_logprobs(std::map<RequestId, LogprobsGot>& got) {
  return [&got](const RequestEvent& e) {
    auto& c = got[e.id];
    if (!e.prompt_logprobs.empty() && !c.tokens.empty()) c.prompt_after_token = true;
    c.tokens.insert(c.tokens.end(), e.tokens.begin(), e.tokens.end());
    c.lps.insert(c.lps.end(), e.logprobs.begin(), e.logprobs.end());
    c.prompt_lps.insert(c.prompt_lps.end(), e.prompt_logprobs.begin(), e.prompt_logprobs.end());
    if (e.finished) ++c.finished, c.reason = e.finish_reason;
  };
}

// log_softmax rows of the teacher-forced sequence, fed as the scheduler feeds one request alone:
// the first `prompt` tokens in chunks of `chunk`, then one token a step (earlier chunks are read
// back as BF16 rows, so other chunkings differ by ~1e-3). Row p predicts token p + 1.
std::vector<std::vector<double>> teacher_forced(Rig& r, const std::vector<int>& seq, int prompt, int chunk) {
  kv::Bf16KvCache cache(r.m.cache_shape(16), 64);
  const kv::SeqId id = cache.create();
  std::vector<int32_t> toks(seq.begin(), seq.end());
  std::vector<float> logits, all;
  for (int p = 0; p < int(seq.size());) {
    const int n = p < prompt ? std::min(chunk, prompt - p) : 1;
    std::vector<model::SeqStep> steps = {{id, std::span<const int32_t>(toks.data() + p, size_t(n)), true}};
    r.m.forward(steps, cache, logits);
    all.insert(all.end(), logits.begin(), logits.end());
    p += n;
  }
  cache.release(id);
  const size_t V = size_t(r.m.config().vocab_size);
  std::vector<std::vector<double>> out;
  for (size_t p = 0; p < seq.size(); ++p) {
    const float* x = all.data() + p * V;
    const double mx = *std::max_element(x, x + V);
    double sum = 0;
    for (size_t i = 0; i < V; ++i) sum += std::exp(double(x[i]) - mx);
    std::vector<double> row(V);
    for (size_t i = 0; i < V; ++i) row[i] = double(x[i]) - mx - std::log(sum);
    out.push_back(std::move(row));
  }
  return out;
}

void expect_matches(const TokenLogprob& got, const std::vector<double>& row, int token, int k, const std::string& what) {
  EXPECT_EQ(got.token, token) << what;
  EXPECT_NEAR(got.logprob, row[size_t(token)], 1e-5) << what;
  ASSERT_EQ(static_cast<int>(got.top.size()), k) << what;
  for (const TopLogprob& t : got.top) EXPECT_NEAR(t.logprob, row[size_t(t.token)], 1e-5) << what;
  for (size_t i = 1; i < got.top.size(); ++i) EXPECT_GE(got.top[i - 1].logprob, got.top[i].logprob) << what;
  // Nothing outside the list beats its last entry.
  if (k > 0) {
    int above = 0;
    for (double v : row) above += v > double(got.top.back().logprob) + 1e-5;
    EXPECT_LT(above, k) << what;
  }
}

TEST(Scheduler, LogprobsEqualTeacherForcedLogitsOverChunksAndWithACachedPrefix) {
  Rig r;
  const int V = r.m.config().vocab_size;
  std::mt19937 rng(31);
  Request q;
  for (int i = 0; i < 70; ++i) q.prompt.push_back(int(rng() % unsigned(V)));
  q.max_new_tokens = 6;
  q.logprobs = 3;
  q.prompt_logprobs = 2;
  kv::Bf16KvCache cache(r.m.cache_shape(16), 64, /*prefix_caching=*/true);
  SchedulerConfig cfg;
  cfg.max_batch_tokens = 24;  // the prompt in chunks of 24
  Scheduler s(r.m, cache, nullptr, cfg);
  std::map<RequestId, LogprobsGot> got;
  Request plain = q;  // the same prompt first without log probabilities: it fills the prefix cache
  plain.logprobs = plain.prompt_logprobs = -1;
  const RequestId p0 = s.add(plain, collect_logprobs(got));
  while (!s.idle()) s.step();
  const int64_t hits_before = s.metrics().prefix_hits;
  const RequestId a = s.add(q, collect_logprobs(got));
  while (!s.idle()) s.step();
  EXPECT_EQ(s.metrics().prefix_hits, hits_before);  // the prompt was recomputed, not attached
  const RequestId b = s.add(plain, collect_logprobs(got));  // ... and is still cached for others
  while (!s.idle()) s.step();
  EXPECT_GT(s.metrics().prefix_hits, hits_before);

  const LogprobsGot& g = got[a];
  ASSERT_EQ(g.finished, 1);
  EXPECT_EQ(g.tokens, got[p0].tokens);
  EXPECT_EQ(got[b].tokens, got[p0].tokens);
  EXPECT_TRUE(got[p0].lps.empty() && got[p0].prompt_lps.empty());
  EXPECT_FALSE(g.prompt_after_token);
  ASSERT_EQ(g.prompt_lps.size(), q.prompt.size() - 1);
  ASSERT_EQ(g.lps.size(), g.tokens.size());
  std::vector<int> seq = q.prompt;
  seq.insert(seq.end(), g.tokens.begin(), g.tokens.end() - 1);
  const auto rows = teacher_forced(r, seq, int(q.prompt.size()), cfg.max_batch_tokens);
  for (size_t i = 1; i < q.prompt.size(); ++i)
    expect_matches(g.prompt_lps[i - 1], rows[i - 1], q.prompt[i], 2, "prompt token " + std::to_string(i));
  for (size_t i = 0; i < g.tokens.size(); ++i) {
    expect_matches(g.lps[i], rows[q.prompt.size() - 1 + i], g.tokens[i], 3, "drawn token " + std::to_string(i));
    EXPECT_EQ(g.lps[i].top[0].token, g.tokens[i]);  // greedy
  }
  EXPECT_EQ(cache.pool().num_used(), 0);
}

// Under preemption (prompts recomputed from the start), every prompt log probability still comes
// exactly once and in order, equal to the request's alone (within 1e-2: its chunks differ, and with
// them the BF16 rounding of the rows read back; a row off by one position differs by ~1);
// max_tokens 0 gives them and no token.
TEST(Scheduler, PromptLogprobsComeOnceUnderPreemptionAndWithMaxTokensZero) {
  Rig r;
  auto reqs = requests(6, r.m.config().vocab_size, 11);
  for (size_t i = 0; i < reqs.size(); ++i) {
    Request& q = reqs[i];
    while (q.prompt.size() < 30) q.prompt.push_back(q.prompt.size() % 50 + 1);
    q.max_new_tokens = i == 2 ? 0 : 20;
    q.prompt_logprobs = int(i % 3);
    q.logprobs = 1;
  }
  std::map<RequestId, LogprobsGot> want_got, got;
  std::vector<RequestId> want_ids, ids;
  {
    kv::Bf16KvCache big(r.m.cache_shape(16), 256);
    Scheduler alone(r.m, big, nullptr, SchedulerConfig{});
    for (const auto& q : reqs) {
      want_ids.push_back(alone.add(q, collect_logprobs(want_got)));
      while (!alone.idle()) alone.step();
    }
  }
  kv::Bf16KvCache cache(r.m.cache_shape(16), 9);  // room for two such sequences at once
  SchedulerConfig cfg;
  cfg.max_batch_tokens = 16;
  cfg.max_running = 6;
  Scheduler s(r.m, cache, nullptr, cfg);
  for (const auto& q : reqs) ids.push_back(s.add(q, collect_logprobs(got)));
  for (int steps = 0; !s.idle(); ++steps) {
    s.step();
    ASSERT_LT(steps, 5000);
  }
  EXPECT_GT(s.metrics().preemptions, 0);
  for (size_t i = 0; i < reqs.size(); ++i) {
    const LogprobsGot &g = got[ids[i]], &w = want_got[want_ids[i]];
    EXPECT_EQ(g.finished, 1);
    EXPECT_EQ(g.tokens, w.tokens) << "request " << i;
    ASSERT_EQ(g.prompt_lps.size(), reqs[i].prompt.size() - 1) << "request " << i;
    ASSERT_EQ(g.lps.size(), g.tokens.size());
    for (size_t t = 0; t < g.prompt_lps.size(); ++t) {
      EXPECT_EQ(g.prompt_lps[t].token, reqs[i].prompt[t + 1]);
      EXPECT_NEAR(g.prompt_lps[t].logprob, w.prompt_lps[t].logprob, 1e-2) << "request " << i << " token " << t;
      EXPECT_EQ(static_cast<int>(g.prompt_lps[t].top.size()), reqs[i].prompt_logprobs);
    }
    for (size_t t = 0; t < g.lps.size(); ++t) EXPECT_NEAR(g.lps[t].logprob, w.lps[t].logprob, 1e-2);
  }
  EXPECT_TRUE(got[ids[2]].tokens.empty());
  EXPECT_EQ(got[ids[2]].reason, "length");
  EXPECT_EQ(cache.pool().num_used(), 0);
}

TEST(Scheduler, RefusesLogprobCountsOutOfRange) {
  Rig r;
  kv::Bf16KvCache cache(r.m.cache_shape(16), 16);
  Scheduler s(r.m, cache, nullptr);
  Request q;
  q.prompt = {1, 2, 3};
  q.logprobs = kMaxLogprobs + 1;
  EXPECT_THROW(s.add(q, nullptr), Rejected);
  q.logprobs = -1;
  q.prompt_logprobs = -2;
  EXPECT_THROW(s.add(q, nullptr), Rejected);
}

}  // namespace
}  // namespace oscar::engine
