// Sampler properties: greedy, temperature, top-k, top-p, repetition penalty,
// seeding; stop strings; the generation loop on a random model.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "backend/cpu/backend_cpu.h"
#include "core/error.h"
#include "engine/generator.h"
#include "engine/sampler.h"
#include "engine/step_draw.h"
#include "kv/bf16_cache.h"
#include "model/forward_random.h"

namespace oscar::engine {
namespace {

const std::vector<float> kLogits = {1.0f, 3.0f, 2.0f, 3.0f, -1.0f, 0.5f};

TEST(Sampler, GreedyIsArgmaxLowestIdOnTies) {
  Sampler s({});
  EXPECT_EQ(s.sample(kLogits, {}), 1);
  std::vector<float> l = {0.f, 0.f, 5.f};
  EXPECT_EQ(s.sample(l, {}), 2);
}

TEST(Sampler, ProbabilitiesAreSoftmaxAtTemperature) {
  SamplingParams p;
  p.temperature = 0.7f;
  Sampler s(p);
  auto pr = s.probabilities(kLogits, {});
  double z = 0;
  for (float x : kLogits) z += std::exp(x / 0.7);
  for (size_t i = 0; i < kLogits.size(); ++i) EXPECT_NEAR(pr[i], std::exp(kLogits[i] / 0.7) / z, 1e-6);  // 0.7f vs 0.7
}

TEST(Sampler, TopKKeepsExactlyKBest) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 3;
  Sampler s(p);
  auto pr = s.probabilities(kLogits, {});
  int nonzero = 0;
  for (double x : pr) nonzero += x > 0;
  EXPECT_EQ(nonzero, 3);
  EXPECT_GT(pr[1], 0);
  EXPECT_GT(pr[3], 0);
  EXPECT_GT(pr[2], 0);
  for (int i = 0; i < 200; ++i) {
    int t = s.sample(kLogits, {});
    EXPECT_TRUE(t == 1 || t == 2 || t == 3) << t;
  }
}

TEST(Sampler, TopPKeepsSmallestSetReachingP) {
  // softmax of kLogits: ids 1 and 3 0.384 each, id 2 0.141, id 0 0.052, ...
  // top_p 0.75 -> {1, 3} (0.768); top_p 0.8 -> {1, 2, 3} (0.909).
  for (auto [top_p, want] : {std::pair{0.75f, std::vector<int>{1, 3}},
                             std::pair{0.8f, std::vector<int>{1, 2, 3}}}) {
    SamplingParams p;
    p.temperature = 1.0f;
    p.top_p = top_p;
    Sampler s(p);
    auto pr = s.probabilities(kLogits, {});
    std::vector<int> kept;
    for (int i = 0; i < 6; ++i)
      if (pr[i] > 0) kept.push_back(i);
    EXPECT_EQ(kept, want) << "top_p " << top_p;
    double sum = 0;
    for (double x : pr) sum += x;
    EXPECT_NEAR(sum, 1.0, 1e-12);
  }
}

TEST(Sampler, RepetitionPenaltyDividesPositiveMultipliesNegative) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  Sampler s(p);
  // id 1 (3.0) seen -> 1.5, id 3 (3.0) wins greedy.
  std::vector<int> hist = {1, 1, 4};
  EXPECT_EQ(s.sample(kLogits, hist), 3);
  p.temperature = 1.0f;
  Sampler t(p);
  auto pr = t.probabilities(kLogits, hist);
  std::vector<double> adj = {1.0, 1.5, 2.0, 3.0, -2.0, 0.5};
  double z = 0;
  for (double x : adj) z += std::exp(x);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(pr[i], std::exp(adj[i]) / z, 1e-9) << i;
}

// Presence and frequency penalties (OpenAI's, over the generated tokens only): an id generated c
// times loses frequency · c + presence, after the repetition penalty; the prompt's tokens (the
// first prompt_tokens of the history) count for neither.
TEST(Sampler, PresenceAndFrequencyPenalizeGeneratedTokens) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.presence_penalty = 0.25f;
  p.frequency_penalty = 0.5f;
  // Prompt {1, 2}; generated 3, 3, 5, 1 (1 also in the prompt: counted once, as generated).
  const std::vector<int> hist = {1, 2, 3, 3, 5, 1, 99, -4};  // (ids outside the vocabulary ignored)
  Sampler s(p, 2);
  auto pr = s.probabilities(kLogits, hist);
  std::vector<double> adj = {1.0, 3.0 - 0.75, 2.0, 3.0 - 1.25, -1.0, 0.5 - 0.75};
  double z = 0;
  for (double x : adj) z += std::exp(x);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(pr[i], std::exp(adj[i]) / z, 1e-6) << i;
  // With the repetition penalty first: 1 and 2 (prompt) and 3, 5 (generated) divided / multiplied.
  p.repetition_penalty = 2.0f;
  auto pr2 = Sampler(p, 2).probabilities(kLogits, hist);
  adj = {1.0, 1.5 - 0.75, 1.0, 1.5 - 1.25, -1.0, 0.25 - 0.75};
  z = 0;
  for (double x : adj) z += std::exp(x);
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(pr2[i], std::exp(adj[i]) / z, 1e-6) << i;
  // Greedy: with presence 1, ids 1 (3.0 - 1.5) and 3 (3.0 - 2.0) fall below 2 (2.0); with every token
  // as the prompt nothing changes (1 and 3 tie: the lower id).
  p.temperature = 0.0f;
  p.repetition_penalty = 1.0f;
  p.presence_penalty = 1.0f;
  EXPECT_EQ(Sampler(p, 2).sample(kLogits, hist), 2);
  EXPECT_EQ(Sampler(p, int(hist.size())).sample(kLogits, hist), 1);
  // A negative penalty favours repeats.
  p.frequency_penalty = -1.0f;
  p.presence_penalty = 0.0f;
  EXPECT_EQ(Sampler(p, 2).sample(kLogits, hist), 3);
  // Range: [-2, 2] each.
  for (float bad : {2.5f, -2.01f, NAN}) {
    SamplingParams q;
    q.presence_penalty = bad;
    EXPECT_THROW(Sampler{q}, Error) << bad;
    q.presence_penalty = 0;
    q.frequency_penalty = bad;
    EXPECT_THROW(Sampler{q}, Error) << bad;
  }
}

// The Sampler with presence / frequency penalties equals the reference (reference_sample, a dense
// count of the generated ids) token for token, with and without the repetition penalty, over
// temperatures, top-k and top-p, and prompt lengths that cut the history anywhere.
TEST(Sampler, PresenceAndFrequencyDrawsEqualTheReference) {
  std::mt19937 rng(9);
  int draws = 0;
  for (int V : {7, 1000, 20000}) {
    std::vector<float> l(static_cast<size_t>(V));
    std::normal_distribution<float> nd(0.0f, 2.0f);
    for (float& x : l) x = nd(rng);
    std::vector<int> hist;
    for (int i = 0; i < 60; ++i) hist.push_back(int(rng() % uint32_t(std::min(V, 40))));  // repeats
    for (float T : {0.0f, 0.7f, 1.3f})
      for (int k : {0, 5})
        for (float top_p : {1.0f, 0.9f})
          for (float rep : {1.0f, 1.3f})
            for (auto [pres, freq] : {std::pair{0.5f, 0.0f}, {0.0f, 0.7f}, {-0.4f, 1.1f}, {2.0f, -2.0f}}) {
              SamplingParams p{T, k, top_p, rep, uint64_t(77 + draws), pres, freq};
              const int prompt = int(rng() % 61);
              Sampler s(p, prompt);
              std::mt19937_64 ref_rng(p.seed);
              for (int d = 0; d < 4; ++d, ++draws)
                ASSERT_EQ(s.sample(l, hist), reference_sample(p, ref_rng, l, hist, prompt))
                    << "V " << V << " T " << T << " k " << k << " top_p " << top_p << " rep " << rep << " pres "
                    << pres << " freq " << freq << " prompt " << prompt;
            }
  }
  EXPECT_EQ(draws, 3 * 3 * 2 * 2 * 2 * 4 * 4);
}

// min_p keeps the ids of at least min_p times the best one's probability (at the temperature),
// before top-p; with top-k the shorter prefix; a backend draws it (device_draw carries it).
TEST(Sampler, MinPKeepsTokensNearTheBest) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.min_p = 0.5f;  // weights relative to the best (3.0): ids 1, 3: 1; 2: e^-1 = 0.37; the rest less
  auto pr = Sampler(p).probabilities(kLogits, {});
  EXPECT_NEAR(pr[1], 0.5, 1e-12);
  EXPECT_NEAR(pr[3], 0.5, 1e-12);
  for (int i : {0, 2, 4, 5}) EXPECT_EQ(pr[size_t(i)], 0.0) << i;
  p.min_p = 0.3f;  // id 2 joins
  pr = Sampler(p).probabilities(kLogits, {});
  const double z = 2 + std::exp(-1.0);
  EXPECT_NEAR(pr[2], std::exp(-1.0) / z, 1e-12);
  EXPECT_EQ(pr[0], 0.0);
  p.temperature = 2.0f;  // at T 2 id 2 weighs e^-0.5 = 0.61, id 0 e^-1 = 0.37: both kept at 0.3
  pr = Sampler(p).probabilities(kLogits, {});
  EXPECT_GT(pr[0], 0.0);
  EXPECT_EQ(pr[4], 0.0);
  p.top_k = 2;  // the shorter prefix: top-k's
  pr = Sampler(p).probabilities(kLogits, {});
  EXPECT_NEAR(pr[1] + pr[3], 1.0, 1e-12);
  p.top_k = 0;
  p.min_p = 1.0f;  // only the ties of the best: every draw is 1 or 3
  Sampler one(p);
  for (int i = 0; i < 50; ++i) {
    const int t = one.sample(kLogits, {});
    EXPECT_TRUE(t == 1 || t == 3) << t;
  }
  EXPECT_EQ(Sampler(p).device_draw(0.5).mode, backend::RowDraw::kSample);
  EXPECT_EQ(Sampler(p).device_draw(0.5).min_p, 1.0f);
  p.temperature = 0.0f;
  EXPECT_EQ(Sampler(p).device_draw(0.5).mode, backend::RowDraw::kArgmax);
  for (float bad : {-0.1f, 1.5f, NAN}) {
    SamplingParams q;
    q.min_p = bad;
    EXPECT_THROW(Sampler{q}, Error) << bad;
  }
}

// The Sampler with min_p equals the reference draw token for token, over temperatures, top-k,
// top-p, and flat, peaked and tied logits.
TEST(Sampler, MinPDrawsEqualTheReference) {
  std::mt19937 rng(12);
  int draws = 0;
  for (int V : {7, 1000, 20000})
    for (int shape = 0; shape < 3; ++shape) {
      std::vector<float> l(static_cast<size_t>(V));
      std::normal_distribution<float> nd(0.0f, shape == 1 ? 1.0f : 3.0f);
      for (float& x : l) x = nd(rng);
      if (shape == 1) l[size_t(V / 2)] = 6.0f;
      if (shape == 2)
        for (float& x : l) x = std::round(x);
      for (float T : {0.5f, 1.0f, 1.6f})
        for (int k : {0, 3, 200})
          for (float top_p : {1.0f, 0.8f})
            for (float mp : {0.01f, 0.1f, 0.5f, 1.0f}) {
              SamplingParams p{T, k, top_p, 1.0f, uint64_t(300 + draws)};
              p.min_p = mp;
              Sampler s(p);
              std::mt19937_64 ref_rng(p.seed);
              for (int d = 0; d < 3; ++d, ++draws)
                ASSERT_EQ(s.sample(l, {}), reference_sample(p, ref_rng, l, {}))
                    << "V " << V << " shape " << shape << " T " << T << " k " << k << " top_p " << top_p << " min_p "
                    << mp;
            }
    }
  EXPECT_EQ(draws, 3 * 3 * 3 * 3 * 2 * 4 * 3);
}

TEST(Sampler, SameSeedSameTokensAndFrequenciesFollowProbabilities) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.seed = 42;
  Sampler a(p), b(p);
  std::map<int, int> counts;
  const int N = 20000;
  for (int i = 0; i < N; ++i) {
    int x = a.sample(kLogits, {});
    ASSERT_EQ(x, b.sample(kLogits, {}));
    counts[x]++;
  }
  auto pr = Sampler(p).probabilities(kLogits, {});
  for (int i = 0; i < 6; ++i) {
    const double sd = std::sqrt(pr[i] * (1 - pr[i]) / N);
    EXPECT_NEAR(counts[i] / double(N), pr[i], 5 * sd + 1e-9) << "token " << i;
  }
  p.seed = 43;
  Sampler c(p);
  Sampler d(SamplingParams{1.0f, 0, 1.0f, 1.0f, 42});
  int differ = 0;
  for (int i = 0; i < 100; ++i) differ += c.sample(kLogits, {}) != d.sample(kLogits, {});
  EXPECT_GT(differ, 0);
}

// The Sampler's draws equal the reference's (reference_sample), token for token, over vocabularies of 7 to 20K
// (prefixes grown by nth_element and by partial_sort), flat, peaked and tied logits, every
// transform and their combinations (the largest vocabulary on a coarser grid: the reference
// sorts it whole for every draw).
TEST(Sampler, DrawsEqualTheFullSortReference) {
  std::mt19937 rng(5);
  int configs = 0, draws = 0;
  for (int V : {7, 1000, 20000})
    for (int shape = 0; shape < 3; ++shape) {
      std::vector<float> l(static_cast<size_t>(V));
      std::normal_distribution<float> nd(0.0f, shape == 1 ? 1.0f : 4.0f);
      for (float& x : l) x = nd(rng);
      if (shape == 1) l[size_t(V / 3)] = 12.0f;               // peaked
      if (shape == 2)
        for (float& x : l) x = std::round(x);                  // many ties
      const std::vector<int> hist = {0, 3, V - 1, 3, V / 3};
      const bool big = V > 1000;
      for (float T : {0.0f, 0.4f, 1.0f, 1.7f})
        for (int k : {0, 1, 5, 300})
          for (float top_p : {1.0f, 0.5f, 0.9f, 0.999f})
            for (float rep : {1.0f, 1.3f}) {
              if (big && (T == 0.0f || T == 1.7f || k == 1 || k == 5 || top_p == 0.5f || top_p == 0.999f)) continue;
              SamplingParams p{T, k, top_p, rep, uint64_t(1000 + configs)};
              Sampler s(p);
              std::mt19937_64 ref_rng(p.seed);
              for (int d = 0; d < 12; ++d, ++draws)
                ASSERT_EQ(s.sample(l, hist), reference_sample(p, ref_rng, l, hist))
                    << "V " << V << " shape " << shape << " T " << T << " top_k " << k << " top_p " << top_p
                    << " rep " << rep << " draw " << d;
              ++configs;
            }
    }
  EXPECT_EQ(configs, 2 * 3 * 4 * 4 * 4 * 2 + 3 * 2 * 2 * 2 * 2);
  EXPECT_EQ(draws, configs * 12);
}

// The draw a backend runs (backend::reference_draw, the specification of Backend::sample_rows)
// is the Sampler's: sample_u with a given u equals it token for token, sample() is next_u then
// sample_u (one u per token at temperature > 0, none when greedy), and device_draw says which
// rows a backend may draw.
TEST(Sampler, SampleWithUEqualsTheBackendsReferenceDraw) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  int checked = 0;
  for (int V : {1, 7, 1000, 20000})
    for (int shape = 0; shape < 3; ++shape) {
      std::vector<float> l(static_cast<size_t>(V));
      std::normal_distribution<float> nd(0.0f, shape == 1 ? 1.0f : 4.0f);
      for (float& x : l) x = nd(rng);
      if (shape == 1) l[size_t(V / 3)] = 12.0f;
      if (shape == 2)
        for (float& x : l) x = std::round(x);
      for (float T : {0.4f, 1.0f, 1.7f})
        for (int k : {0, 1, 5, 300})
          for (float top_p : {1.0f, 0.5f, 0.9f}) {
            Sampler s({T, k, top_p, 1.0f, 0});
            for (int d = 0; d < 4; ++d, ++checked) {
              const double u = uni(rng);
              const backend::RowDraw rd = s.device_draw(u);
              ASSERT_EQ(rd.mode, backend::RowDraw::kSample);
              EXPECT_EQ(rd.u, u);
              ASSERT_EQ(s.sample_u(l, {}, u), backend::reference_draw(l.data(), V, T, k, top_p, u))
                  << "V " << V << " shape " << shape << " T " << T << " k " << k << " p " << top_p << " u " << u;
            }
          }
    }
  EXPECT_EQ(checked, 4 * 3 * 3 * 4 * 3 * 4);
  EXPECT_EQ(backend::reference_draw(std::vector<float>{1.0f, NAN}.data(), 2, 1.0f, 0, 1.0f, 0.5), backend::kDrawNaN);
  // sample() = next_u() + sample_u() on a twin with the same seed.
  const SamplingParams p{0.8f, 0, 0.9f, 1.0f, 77};
  Sampler a(p), b(p);
  std::vector<float> l(500);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int t = 0; t < 20; ++t) {
    for (float& x : l) x = nd(rng);
    EXPECT_EQ(a.sample(l, {}), b.sample_u(l, {}, b.next_u())) << "token " << t;
  }
  // Greedy takes no u; a repetition penalty travels with the draw.
  Sampler g({}), rep({0.8f, 0, 1.0f, 1.2f, 1});
  EXPECT_EQ(g.next_u(), 0.0);
  EXPECT_EQ(g.device_draw(0.0).mode, backend::RowDraw::kArgmax);
  EXPECT_EQ(g.device_draw(0.0).penalty, 1.0f);
  EXPECT_EQ(rep.device_draw(0.5).mode, backend::RowDraw::kSample);
  EXPECT_EQ(rep.device_draw(0.5).penalty, 1.2f);
  EXPECT_EQ(Sampler({0.0f, 0, 1.0f, 1.2f, 1}).device_draw(0.0).mode, backend::RowDraw::kArgmax);
}

// sample_rows draws every row with its own sampler, in parallel: the tokens equal serial draws
// of identical samplers, and a row with NaN logits gets -1 and a message while the others draw.
TEST(Sampler, SampleRowsEqualsSerialAndIsolatesABadRow) {
  const int V = 3000, R = 37;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> logits(size_t(R) * V);
  for (float& x : logits) x = nd(rng);
  logits[size_t(11) * V + 17] = NAN;
  std::vector<Sampler> par, ser;
  for (int r = 0; r < R; ++r) {
    SamplingParams p{r % 4 == 0 ? 0.0f : 0.8f, r % 3 == 0 ? 20 : 0, r % 2 ? 0.9f : 1.0f, 1.0f, uint64_t(r)};
    par.emplace_back(p);
    ser.emplace_back(p);
  }
  const std::vector<int> hist = {1, 2};
  for (int step = 0; step < 5; ++step) {
    std::vector<SampleJob> jobs(R);
    for (int r = 0; r < R; ++r) {
      jobs[size_t(r)].sampler = &par[size_t(r)];
      jobs[size_t(r)].logits = {logits.data() + size_t(r) * V, size_t(V)};
      jobs[size_t(r)].history = hist;
    }
    sample_rows(jobs);
    for (int r = 0; r < R; ++r) {
      if (r == 11) {
        EXPECT_EQ(jobs[size_t(r)].token, -1);
        EXPECT_NE(jobs[size_t(r)].error.find("NaN"), std::string::npos);
        continue;
      }
      EXPECT_TRUE(jobs[size_t(r)].error.empty());
      EXPECT_EQ(jobs[size_t(r)].token, ser[size_t(r)].sample({logits.data() + size_t(r) * V, size_t(V)}, hist))
          << "row " << r << " step " << step;
    }
  }
}

// A one-token vocabulary: every setting returns id 0.
TEST(Sampler, OneTokenVocabulary) {
  const std::vector<float> one = {2.5f};
  for (float T : {0.0f, 1.0f})
    for (int k : {0, 1, 3})
      for (float top_p : {1.0f, 0.5f}) {
        Sampler s({T, k, top_p, 1.0f, 3});
        EXPECT_EQ(s.sample(one, {}), 0);
        EXPECT_EQ(s.probabilities(one, {}), std::vector<double>{1.0});
      }
}

TEST(Sampler, BadParamsAndNaNThrow) {
  SamplingParams p;
  p.temperature = -1;
  EXPECT_THROW(Sampler{p}, Error);
  p = {};
  p.top_p = 0;
  EXPECT_THROW(Sampler{p}, Error);
  p = {};
  p.repetition_penalty = 0;
  EXPECT_THROW(Sampler{p}, Error);
  Sampler s({});
  std::vector<float> l = {1.f, NAN};
  EXPECT_THROW(s.sample(l, {}), Error);
}

TEST(StopStrings, HoldsBackPrefixesAndCutsAtTheStop) {
  StopStringMatcher m({"</s>", "STOP"});
  EXPECT_EQ(m.push("Hello <"), "Hello ");
  EXPECT_EQ(m.push("/"), "");
  EXPECT_EQ(m.push("x"), "</x");  // not a stop after all
  EXPECT_EQ(m.push(" ST"), " ");
  EXPECT_EQ(m.push("OP and more"), "");
  EXPECT_TRUE(m.stopped());
  StopStringMatcher n({"ab"});
  EXPECT_EQ(n.push("xxa"), "xx");
  EXPECT_FALSE(n.stopped());
  EXPECT_EQ(n.flush(), "a");
}

// --- the generation loop on a random model (head_dim 64, kernels path)
struct Rig {
  Rig()
      : w(model::random_weights(model::tiny_config(model::Arch::kLlama), 3)),
        be(backend::make_cpu_backend({backend::WeightDtype::kF32, 0})),
        m(w, *be),
        cache(m.cache_shape(16), 64) {}
  model::ModelWeights w;
  std::unique_ptr<backend::Backend> be;
  model::Model m;
  kv::Bf16KvCache cache;
};

TEST(Generator, BatchedGreedyEqualsOneAtATime) {
  Rig r;
  std::vector<Request> reqs(3);
  reqs[0].prompt = {5, 6, 7};
  reqs[1].prompt = {9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14, 15, 16, 17, 18};
  reqs[2].prompt = {42};
  for (auto& q : reqs) q.max_new_tokens = 12;
  reqs[2].max_new_tokens = 5;
  Generator g(r.m, r.cache, nullptr, 8);  // chunk 8: prompts prefilled over several calls
  auto batched = g.run(reqs);
  EXPECT_EQ(r.cache.pool().num_used(), 0);
  for (int i = 0; i < 3; ++i) {
    Generator one(r.m, r.cache);
    auto alone = one.run({&reqs[i], 1});
    EXPECT_EQ(alone[0].tokens, batched[i].tokens) << "request " << i;
    EXPECT_EQ(batched[i].finish_reason, "length");
    EXPECT_EQ(int(batched[i].tokens.size()), reqs[i].max_new_tokens);
  }
  EXPECT_EQ(g.stats().prompt_tokens, 3 + 18 + 1);
  EXPECT_EQ(g.stats().generated_tokens, 12 + 12 + 5);
}

TEST(Generator, StopTokenAndStopStringEndGeneration) {
  Rig r;
  Request q;
  q.prompt = {5, 6, 7};
  q.max_new_tokens = 20;
  Generator g0(r.m, r.cache);
  auto free_run = g0.run({&q, 1})[0].tokens;
  ASSERT_EQ(free_run.size(), 20u);
  // Stop at the 4th generated token.
  q.stop_tokens = {free_run[3]};
  auto res = g0.run({&q, 1})[0];
  const size_t first = std::find(free_run.begin(), free_run.end(), free_run[3]) - free_run.begin();
  EXPECT_EQ(res.tokens.size(), first + 1);
  EXPECT_EQ(res.finish_reason, "stop");
  // Stop string over a fake detokenizer: token t -> "<t>".
  q.stop_tokens.clear();
  const std::string stop = "<" + std::to_string(free_run[5]) + ">";
  q.stop_strings = {stop};
  Generator g1(r.m, r.cache, [](int t) { return "<" + std::to_string(t) + ">"; });
  std::string streamed;
  auto res2 = g1.run({&q, 1}, [&](int, std::string_view s) { streamed += s; })[0];
  EXPECT_EQ(res2.finish_reason, "stop");
  EXPECT_EQ(res2.text, streamed);
  EXPECT_EQ(res2.text.find(stop), std::string::npos);
  EXPECT_EQ(r.cache.pool().num_used(), 0);
}

TEST(Generator, BadRequestsThrowAndLeakNothing) {
  Rig r;
  Generator g(r.m, r.cache);
  Request q;
  EXPECT_THROW(g.run({&q, 1}), Error);  // empty prompt
  q.prompt = {100000};
  EXPECT_THROW(g.run({&q, 1}), Error);
  q.prompt = {1};
  q.stop_strings = {"x"};
  EXPECT_THROW(g.run({&q, 1}), Error);  // no tokenizer
  EXPECT_EQ(r.cache.pool().num_used(), 0);
}

// The distinct ids of h in [0, V) in first-occurrence order: what PenaltyIds must give, computed
// from scratch.
std::vector<int32_t> fresh_distinct(const std::vector<int>& h, int V) {
  std::vector<int32_t> out;
  std::vector<char> seen(size_t(V), 0);
  for (int t : h)
    if (t >= 0 && t < V && !seen[size_t(t)]) seen[size_t(t)] = 1, out.push_back(t);
  return out;
}

// The (id, count) pairs of h[from, end) in [0, V), first-occurrence order, from scratch.
std::vector<int32_t> fresh_counts(const std::vector<int>& h, int from, int V) {
  std::vector<int32_t> ids, out;
  std::vector<int> c(size_t(V), 0);
  for (size_t i = size_t(from); i < h.size(); ++i)
    if (h[i] >= 0 && h[i] < V && c[size_t(h[i])]++ == 0) ids.push_back(h[i]);
  for (int32_t t : ids) out.push_back(t), out.push_back(c[size_t(t)]);
  return out;
}

// The ids [0, V) set in a penalty slot's bitmap (backend::apply_penalty_slot's layout), ascending.
std::vector<int32_t> slot_ids(const std::vector<uint64_t>& slot, int V) {
  std::vector<int32_t> out;
  for (int t = 0; t < V; ++t)
    if (slot[size_t(t) / 64] >> (t % 64) & 1) out.push_back(t);
  return out;
}

// The penalty's distinct ids kept per sampler across steps (PenaltyIds, without slots) against a fresh
// first-occurrence dedupe of the whole history, over steps whose histories grow (the usual case),
// are replaced by others (a new request at a reused address), shrink, stay, hold ids outside the
// vocabulary, or come with another vocabulary size; keys unused in a step are dropped at the next.
TEST(PenaltyIds, EqualFreshDedupeOfTheWholeHistory) {
  std::mt19937 rng(5);
  PenaltyIds ids;
  std::vector<std::vector<int>> hist(6);
  int keys_used = 0, grew = 0, replaced = 0;
  for (int step = 0; step < 400; ++step) {
    ids.begin_step();
    EXPECT_EQ(ids.keys(), size_t(keys_used)) << "step " << step;
    keys_used = 0;
    const int V = step % 97 == 96 ? 50 : 300;
    for (size_t k = 0; k < hist.size(); ++k) {
      if (rng() % 5 == 0) continue;  // not in this step
      std::vector<int>& h = hist[k];
      const unsigned op = rng() % 10;
      if (op < 6) {  // grows by a few tokens
        for (unsigned i = rng() % 4; i > 0; --i) h.push_back(int(rng() % 330) - 10);
        ++grew;
      } else if (op == 6) {  // another history of any length
        h.assign(rng() % 60, 0);
        for (int& t : h) t = int(rng() % 300);
        ++replaced;
      } else if (op == 7 && !h.empty()) {  // shorter
        h.resize(rng() % h.size());
      } else if (op == 8 && !h.empty()) {  // one earlier token changed, same length
        h[rng() % h.size()] = int(rng() % 300);
      }
      const std::span<const int32_t> got = ids.row(&hist[k], h, V, 0).ids;
      const std::vector<int32_t> want = fresh_distinct(h, V);
      ASSERT_EQ(std::vector<int32_t>(got.begin(), got.end()), want) << "step " << step << ", key " << k;
      ++keys_used;
    }
  }
  EXPECT_GT(grew, 1000);
  EXPECT_GT(replaced, 100);
}

// The slot protocol of PenaltyIds (a backend that keeps each sampler's ids from step to step,
// RowDraw::pen_slot) against a mirror of the backend's slots updated by the rule the backend
// runs (backend::apply_penalty_slot): after every update, a row's slot holds exactly the distinct
// ids of its history, over the histories of the test above, with steps that fail before the
// backend's update or after it (no commit), keys named twice in a step, and fewer slots than keys.
TEST(PenaltyIds, SlotsHoldTheDistinctIdsAcrossFailedSteps) {
  for (const int slots : {64, 3}) {
    std::mt19937 rng(uint32_t(11 + slots));
    PenaltyIds ids;
    constexpr int kMaxV = 300;
    std::vector<std::vector<uint64_t>> mirror(size_t(slots), std::vector<uint64_t>((kMaxV + 63) / 64, ~uint64_t(0)));
    std::vector<std::vector<int>> hist(6);
    int slotted = 0, whole = 0, resets = 0, deltas = 0, failed = 0, twice = 0, shrunk_after = 0;
    for (int step = 0; step < 600; ++step) {
      ids.begin_step();
      const int V = step % 97 == 96 ? 50 : kMaxV;
      struct Sent {
        PenaltyIds::Row row;
        std::vector<int32_t> list;  // (a copy: the span lasts until the next call)
        std::vector<int32_t> want;
      };
      std::vector<Sent> sent;
      for (size_t k = 0; k < hist.size(); ++k) {
        if (rng() % 5 == 0) continue;  // not in this step
        std::vector<int>& h = hist[k];
        const unsigned op = rng() % 12;
        if (op < 7) {  // grows by a few tokens (or none)
          for (unsigned i = rng() % 4; i > 0; --i) h.push_back(int(rng() % 330) - 10);
        } else if (op == 7) {  // another history
          h.assign(rng() % 60, 0);
          for (int& t : h) t = int(rng() % 300);
        } else if (op == 8 && !h.empty()) {
          h.resize(rng() % h.size());
        } else if (op == 9 && !h.empty()) {
          h[rng() % h.size()] = int(rng() % 300);
        }
        for (int again = 0; again < (op == 10 ? 2 : 1); ++again) {  // op 10: the key twice, the second longer
          if (again) h.push_back(int(rng() % 300)), ++twice;
          const PenaltyIds::Row r = ids.row(&hist[k], h, V, slots);
          sent.push_back({r, std::vector<int32_t>(r.ids.begin(), r.ids.end()), fresh_distinct(h, V)});
        }
        if (op == 11 && h.size() >= 2) {  // then its generated ids' counts for a shorter history (taken
          h.resize(h.size() - 1 - rng() % 2);  // from scratch after the row: that row is not committed)
          (void)ids.generated(&hist[k], h, 3, V);
          ++shrunk_after;
        }
      }
      std::vector<int> named;
      for (const Sent& s : sent)
        if (s.row.slot >= 0) {
          ASSERT_LT(s.row.slot, slots);
          named.push_back(s.row.slot);
        }
      std::sort(named.begin(), named.end());
      ASSERT_TRUE(std::adjacent_find(named.begin(), named.end()) == named.end()) << "a slot named twice, step " << step;
      const unsigned fate = rng() % 10;  // 0: fails before the update, 1: after it, else goes through
      if (fate != 0)
        for (const Sent& s : sent)
          if (s.row.slot >= 0) {
            backend::apply_penalty_slot(mirror[size_t(s.row.slot)].data(), V, s.row.reset, s.list.data(),
                                        int(s.list.size()));
            resets += s.row.reset;
            deltas += !s.row.reset;
          }
      if (fate <= 1) {
        ++failed;
        continue;
      }
      ids.commit();
      for (const Sent& s : sent) {
        if (s.row.slot < 0) {  // the whole list
          ASSERT_EQ(s.list, s.want) << "step " << step;
          ++whole;
          continue;
        }
        ++slotted;
        std::vector<int32_t> want = s.want;
        std::sort(want.begin(), want.end());
        ASSERT_EQ(slot_ids(mirror[size_t(s.row.slot)], V), want)
            << "slot " << s.row.slot << ", step " << step << " (" << slots << " slots)";
      }
    }
    EXPECT_GT(slotted, 1000) << slots << " slots";
    EXPECT_GT(deltas, slots == 3 ? 300 : 1000) << "rows that send only their new ids";
    EXPECT_GT(failed, 60);
    EXPECT_GT(twice, 50);
    EXPECT_GT(shrunk_after, 30);
    if (slots == 3) {
      EXPECT_GT(whole, 200) << "keys beyond the slots send their whole lists";
    }
  }
}

// The generated ids' counts kept per sampler (PenaltyIds::generated, the presence / frequency
// penalties' input) against a fresh count of history[prompt, end), in first-occurrence order, over
// the histories of the tests above (growing, replaced, shrunk, edited, another vocabulary), the
// prompt length of a key changing now and then, and row() (the repetition penalty's ids) called on
// the same entries in between.
TEST(PenaltyIds, GeneratedCountsEqualAFreshCount) {
  std::mt19937 rng(8);
  PenaltyIds ids;
  std::vector<std::vector<int>> hist(5);
  std::vector<int> prompt(5, 0);
  int checked = 0, counted = 0;
  for (int step = 0; step < 500; ++step) {
    ids.begin_step();
    const int V = step % 89 == 88 ? 40 : 200;
    for (size_t k = 0; k < hist.size(); ++k) {
      if (rng() % 6 == 0) continue;
      std::vector<int>& h = hist[k];
      const unsigned op = rng() % 12;
      if (op < 8) {
        for (unsigned i = rng() % 3; i > 0; --i) h.push_back(int(rng() % 210) - 5);
      } else if (op == 8) {
        h.assign(rng() % 40, 0);
        for (int& t : h) t = int(rng() % 200);
      } else if (op == 9 && !h.empty()) {
        h.resize(rng() % h.size());
      } else if (op == 10 && !h.empty()) {
        h[rng() % h.size()] = int(rng() % 200);
      } else {
        prompt[k] = int(rng() % 30);
      }
      if (rng() % 2) (void)ids.row(&hist[k], h, V, 8);
      const std::span<const int32_t> got = ids.generated(&hist[k], h, prompt[k], V);
      const std::vector<int32_t> want = fresh_counts(h, prompt[k], V);
      ASSERT_EQ(std::vector<int32_t>(got.begin(), got.end()), want) << "step " << step << ", key " << k;
      ++checked;
      counted += int(want.size()) / 2;
    }
    if (rng() % 4) ids.commit();
  }
  EXPECT_GT(checked, 1500);
  EXPECT_GT(counted, 10000);
}

// The counts' id index is a hash table grown as ids come: a real vocabulary, thousands of distinct
// ids, many sharing their low bits (multiples of 1024), added a few a step: still a fresh count.
TEST(PenaltyIds, GeneratedCountsOverAWholeVocabulary) {
  constexpr int V = 151936, kPrompt = 7;
  std::mt19937 rng(5);
  PenaltyIds ids;
  std::vector<int> h(kPrompt, 3);
  for (int step = 0; step < 400; ++step) {
    ids.begin_step();
    for (unsigned i = 1 + rng() % 12; i > 0; --i)
      h.push_back(rng() % 3 ? int(rng() % 148) * 1024 : int(rng() % unsigned(V)));
    const std::span<const int32_t> got = ids.generated(&h, h, kPrompt, V, 1, true);
    if (step % 37 == 0 || step == 399) {
      ASSERT_EQ(std::vector<int32_t>(got.begin(), got.end()), fresh_counts(h, kPrompt, V)) << "step " << step;
    }
  }
  EXPECT_GT(fresh_counts(h, kPrompt, V).size() / 2, 1000u);
}

// With `appends` (the scheduler's promise that a request's history only grows) PenaltyIds does
// not compare a history with the one it kept, but a new owner at the same key (another request's
// sampler at a freed sampler's address: another identity) is still taken from scratch. Histories
// that only grow, owners replaced now and then with unrelated histories (some longer, some sharing
// the old one's last token at the old length): the slot mirror and the counts equal fresh ones.
TEST(PenaltyIds, AppendsTrustsTheCallerButNotANewOwner) {
  std::mt19937 rng(21);
  constexpr int V = 300, kSlots = 8;
  PenaltyIds ids;
  std::vector<std::vector<uint64_t>> mirror(kSlots, std::vector<uint64_t>((V + 63) / 64, ~uint64_t(0)));
  std::vector<std::vector<int>> hist(4);
  std::vector<uint64_t> owner(4, 1);
  uint64_t next_owner = 2;
  int new_owners = 0, checked = 0;
  for (int step = 0; step < 400; ++step) {
    ids.begin_step();
    for (size_t k = 0; k < hist.size(); ++k) {
      std::vector<int>& h = hist[k];
      if (rng() % 9 == 0) {  // another request's sampler at this address
        owner[k] = next_owner++;
        ++new_owners;
        std::vector<int> other(h.size() + rng() % 20);
        for (int& t : other) t = int(rng() % V);
        if (!h.empty() && other.size() >= h.size()) other[h.size() - 1] = h.back();  // a sanity check passes
        h = other;
      } else {
        for (unsigned i = rng() % 3; i > 0; --i) h.push_back(int(rng() % V));
      }
      const std::span<const int32_t> c = ids.generated(&hist[k], h, 5, V, owner[k], true);
      ASSERT_EQ(std::vector<int32_t>(c.begin(), c.end()), fresh_counts(h, 5, V)) << "step " << step << " key " << k;
      const PenaltyIds::Row r = ids.row(&hist[k], h, V, kSlots, owner[k], true);
      ASSERT_GE(r.slot, 0);
      backend::apply_penalty_slot(mirror[size_t(r.slot)].data(), V, r.reset, r.ids.data(), int(r.ids.size()));
      std::vector<int32_t> want = fresh_distinct(h, V);
      std::sort(want.begin(), want.end());
      ASSERT_EQ(slot_ids(mirror[size_t(r.slot)], V), want) << "step " << step << " key " << k;
      ++checked;
    }
    ids.commit();
  }
  EXPECT_GT(new_owners, 100);
  EXPECT_EQ(checked, 1600);
}

// Model::forward_sample refuses draws it cannot run before the step (nothing is committed to the
// cache): a count that is not the output rows', penalty ids outside the list, and a penalty slot on
// a backend without them (the CPU backend keeps none), generated-id counts outside the list.
TEST(ForwardSample, BadDrawsThrowBeforeTheStep) {
  Rig r;
  ASSERT_EQ(r.m.penalty_slots(), 0);
  const kv::SeqId s = r.cache.create();
  const std::vector<int32_t> toks = {3, 4, 5};
  const model::SeqStep st{s, toks, false};
  std::vector<int32_t> out, hist = {7, 8};
  std::vector<backend::RowDraw> d(1);
  d[0].mode = backend::RowDraw::kArgmax;
  std::vector<backend::RowDraw> two(2, d[0]);
  EXPECT_THROW(r.m.forward_sample({&st, 1}, r.cache, two, hist, out), Error);
  d[0].penalty = 1.2f;
  d[0].hist_off = 1, d[0].hist_len = 2;
  EXPECT_THROW(r.m.forward_sample({&st, 1}, r.cache, d, hist, out), Error);
  d[0].hist_off = 0;
  d[0].frequency = 0.5f;
  d[0].cnt_off = 0, d[0].cnt_len = 2;  // two (id, count) pairs need 4 entries; 2 given
  EXPECT_THROW(r.m.forward_sample({&st, 1}, r.cache, d, hist, out), Error);
  d[0].cnt_len = 1;
  d[0].pen_slot = 0;
  EXPECT_THROW(r.m.forward_sample({&st, 1}, r.cache, d, hist, out), Error);
  EXPECT_EQ(r.cache.length(s), 0) << "a refused step commits nothing";
  d[0].pen_slot = -1;
  r.m.forward_sample({&st, 1}, r.cache, d, hist, out);
  ASSERT_EQ(out.size(), size_t(1));
  EXPECT_EQ(out[0], backend::kDrawHost) << "the CPU backend leaves a penalized row to the host sampler";
  EXPECT_EQ(r.cache.length(s), 3);
}

// The engine's step (StepDrawer) on the CPU backend: the plain argmax rows come from the
// backend, the sampled and penalized ones from the host; every token equals a plain forward + Sampler
// run of a twin model with the same seeds, over prefill chunks and decode steps of three
// sequences, one of which is a prefill chunk that yields no token.
TEST(StepDrawer, TokensEqualPlainForwardAndSamplerOfATwin) {
  Rig a, b;
  const int V = a.w.cfg.vocab_size;
  // greedy; top-p; top-k with a repetition penalty; presence + frequency; greedy with all three
  const std::vector<SamplingParams> ps = {{},
                                          {0.8f, 0, 0.9f, 1.0f, 5},
                                          {1.2f, 20, 1.0f, 1.3f, 6},
                                          {0.9f, 0, 1.0f, 1.0f, 7, 0.5f, 0.8f},
                                          {0.0f, 0, 1.0f, 1.1f, 8, 0.3f, 1.0f}};
  const int S = int(ps.size());
  std::vector<std::vector<int>> hist(static_cast<size_t>(S));
  hist[0] = {5, 6, 7};
  hist[1] = {9, 8, 7, 6, 5, 4, 3, 2, 1, 10};
  hist[2] = {42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53};
  hist[3] = {11, 12, 13, 11, 12};
  hist[4] = {20, 21, 22, 23, 24, 25, 26};
  std::vector<Sampler> sa, sb;
  for (int i = 0; i < S; ++i) {  // the prompt: the history so far (the penalties count what follows)
    sa.emplace_back(ps[size_t(i)], int(hist[size_t(i)].size()));
    sb.emplace_back(ps[size_t(i)], int(hist[size_t(i)].size()));
  }
  std::vector<kv::SeqId> seq_a, seq_b;
  for (int i = 0; i < S; ++i) seq_a.push_back(a.cache.create()), seq_b.push_back(b.cache.create());
  std::vector<int> fed(static_cast<size_t>(S), 0);
  StepDrawer drawer;
  std::vector<float> logits;
  for (int step = 0; step < 14; ++step) {
    std::vector<model::SeqStep> steps;
    std::vector<std::vector<int32_t>> toks(static_cast<size_t>(S));
    std::vector<SampleJob> jobs;
    for (int i = 0; i < S; ++i) {
      const size_t u = size_t(i);
      const int n = std::min<int>(6, int(hist[u].size()) - fed[u]);  // prompts in chunks of 6
      toks[u].assign(hist[u].begin() + fed[u], hist[u].begin() + fed[u] + n);
      steps.push_back({seq_a[u], toks[u], false});
      if (fed[u] + n == int(hist[u].size())) jobs.push_back({&sa[u], {}, hist[u], -1, {}, i});
    }
    drawer.run(a.m, steps, a.cache, jobs);
    for (auto& s : steps) s.seq = seq_b[size_t(&s - steps.data())];
    b.m.forward(steps, b.cache, logits);
    ASSERT_EQ(logits.size(), size_t(S) * V);
    size_t k = 0;
    for (int i = 0; i < S; ++i) {
      const size_t u = size_t(i);
      fed[u] += int(toks[u].size());
      if (fed[u] < int(hist[u].size())) continue;
      const SampleJob& j = jobs[k++];
      ASSERT_TRUE(j.error.empty()) << j.error;
      const int want = sb[u].sample({logits.data() + u * V, size_t(V)}, hist[u]);
      ASSERT_EQ(j.token, want) << "sequence " << i << " step " << step;
      hist[u].push_back(j.token);
    }
    ASSERT_EQ(k, jobs.size());
    EXPECT_EQ(drawer.host_rows(), int(std::count_if(jobs.begin(), jobs.end(), [](const SampleJob& j) {
                const backend::RowDraw d = j.sampler->device_draw(0.5);
                return d.mode != backend::RowDraw::kArgmax || d.penalty != 1.0f || d.presence != 0.0f ||
                       d.frequency != 0.0f;
              }))) << "the CPU backend draws only the plain argmax rows";
  }
  for (int i = 0; i < S; ++i) EXPECT_GT(hist[size_t(i)].size(), size_t(12)) << "sequence " << i << " generated";
}

}  // namespace
}  // namespace oscar::engine
