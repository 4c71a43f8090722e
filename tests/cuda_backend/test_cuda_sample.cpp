// Token draws on the device (Backend::sample_rows, backend/cuda/sample.cu) against their
// specification, backend::reference_draw, on fresh random logits; and the engine's step
// (StepDrawer) on the CUDA backend against host draws of the same logits.
//
// Exactness: the device sums the same double weights as the reference in other orders, so a
// token could differ only where u · mass or top_p · total falls within ~1e-16 (relative) of a
// running weight; with random u, and rows built without such exact ties (see kind 5), no row
// comes near that, and the tests ask for equality. kDrawHost (the row is
// left to the host) is allowed only for a row without a finite logit, and for a row so flat
// that more than 8192 ids share the 1/16 nat of the order the draw has to resolve: never for a
// vocabulary of at most 8192 nor for a peaked (LLM-like) row; counted and printed for the others.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/cpu/backend_cpu.h"
#include "backend/cuda/backend_cuda.h"
#include "backend/sample.h"
#include "core/error.h"
#include "engine/sampler.h"
#include "engine/step_draw.h"
#include "kv/bf16_cache.h"
#include "kv/quant_methods.h"
#include "model/forward.h"
#include "model/forward_random.h"

namespace oscar {
namespace {

using backend::RowDraw;

#define SKIP_WITHOUT_GPU() \
  if (!backend::cuda_device_available()) GTEST_SKIP() << "no CUDA device"

// Rows of every kind a model gives and some it should not: LLM-like (a few ids carry most
// of the mass), flat, ties, -inf ids, very peaked.
std::vector<float> logits_rows(int rows, int V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> l(size_t(rows) * V);
  for (int r = 0; r < rows; ++r) {
    float* x = l.data() + size_t(r) * V;
    const int kind = r % 6;
    const float scale = kind == 0 ? 4.0f : kind == 1 ? 1.5f : kind == 2 ? 0.05f : kind == 3 ? 3.0f : kind == 4 ? 8.0f : 2.0f;
    for (int i = 0; i < V; ++i) x[i] = nd(rng) * scale;
    if (kind == 1)
      for (int i = 0; i < V; ++i) x[i] = std::round(x[i] * 8.0f) / 8.0f;  // ties
    if (kind == 3)
      for (int i = 0; i < V; i += 10) x[i] = -INFINITY;
    // Three equal leaders (ties go to the lowest id). Not two: with two, top-p 0.5 would put its
    // point exactly on the first leader's running weight, a rounding tie (backend/sample.h).
    if (kind == 5 && V > 4) x[V / 2] = x[V / 3] = x[V / 4] = 30.0f;
  }
  return l;
}

// A row's logits after the repetition penalty on `ids` (distinct), as engine::Sampler applies it.
std::vector<float> penalized(const float* x, int V, const std::vector<int32_t>& ids, float pen) {
  std::vector<float> y(x, x + V);
  for (int32_t t : ids) y[size_t(t)] = y[size_t(t)] > 0 ? y[size_t(t)] / pen : y[size_t(t)] * pen;
  return y;
}

// The token an argmax or sample row must yield from its logits y after every penalty (argmax
// by the CPU backend, else the reference draw).
int32_t expected_token(backend::Backend& cpu, const std::vector<float>& y, int V, const RowDraw& q) {
  int32_t want = 0;
  if (q.mode == RowDraw::kArgmax)
    cpu.argmax_rows(y.data(), 1, V, &want);
  else
    want = backend::reference_draw(y.data(), V, q.temperature, q.top_k, q.top_p, q.u, q.min_p);
  return want;
}

// A sampled flat row (logits_rows' kind 2) of a vocabulary beyond one CTA's shared memory may be
// left to the host.
bool flat_row_may_go_to_host(const RowDraw& q, int V, int r) {
  return q.mode == RowDraw::kSample && V > 8192 && r % 6 == 2;
}

// Every row mode, on vocabularies from 1 to the Qwen size, over many (T, top_k, top_p, u), a
// third of the rows with a repetition penalty on a random set of ids (the row's best among them).
TEST(CudaSample, RowsEqualTheReferenceDraw) {
  SKIP_WITHOUT_GPU();
  auto gpu = backend::make_cuda_backend({backend::WeightDtype::kF32, 0});
  auto cpu = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  const std::vector<float> temps = {0.3f, 0.7f, 1.0f, 1.5f};
  const std::vector<int> ks = {0, 1, 5, 50, 1000};
  const std::vector<float> ps = {1.0f, 0.95f, 0.9f, 0.5f};
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (int V : {1, 7, 1000, 8192, 32000, 151936}) {
    SCOPED_TRACE("V " + std::to_string(V));
    const int rows = 48;
    const auto l = logits_rows(rows, V, 100 + V);
    auto dl = gpu->alloc(l.size());
    gpu->from_host(l.data(), dl->data(), l.size());
    int sampled = 0, host = 0, host_llm = 0, llm = 0;
    for (int round = 0; round < 8; ++round) {
      std::vector<RowDraw> d(rows);
      std::vector<int32_t> hist;
      std::vector<std::vector<int32_t>> ids(rows);
      for (int r = 0; r < rows; ++r) {
        const int c = (r + round * 7) % 37;
        d[size_t(r)].mode = c == 0 || c == 5 ? RowDraw::kArgmax : c == 1 ? RowDraw::kSkip : c == 2 ? RowDraw::kHost : RowDraw::kSample;
        d[size_t(r)].temperature = temps[size_t(c) % temps.size()];
        d[size_t(r)].top_k = ks[size_t(c / 4) % ks.size()];
        d[size_t(r)].top_p = ps[size_t(c / 3 + round) % ps.size()];
        d[size_t(r)].u = uni(rng);
        if ((r + round) % 3 == 0) {  // penalty 1.3 or 0.8 on up to 40 distinct ids, the row's max among them
          d[size_t(r)].penalty = (r + round) % 2 ? 1.3f : 0.8f;
          std::vector<char> seen(size_t(V), 0);
          const float* x = l.data() + size_t(r) * V;
          const int am = int(std::max_element(x, x + V) - x);
          seen[size_t(am)] = 1, ids[size_t(r)].push_back(am);
          for (int j = 0; j < 40; ++j) {
            const int t = int(rng() % uint64_t(V));
            if (!seen[size_t(t)]) seen[size_t(t)] = 1, ids[size_t(r)].push_back(t);
          }
          d[size_t(r)].hist_off = int32_t(hist.size());
          d[size_t(r)].hist_len = int32_t(ids[size_t(r)].size());
          hist.insert(hist.end(), ids[size_t(r)].begin(), ids[size_t(r)].end());
        }
      }
      std::vector<int32_t> got(rows, 12345);
      gpu->sample_rows(dl->data(), rows, V, d.data(), hist.data(), int64_t(hist.size()), got.data());
      for (int r = 0; r < rows; ++r) {
        const RowDraw& q = d[size_t(r)];
        const std::vector<float> y = penalized(l.data() + size_t(r) * V, V, ids[size_t(r)], q.penalty);
        const float* x = y.data();
        SCOPED_TRACE("row " + std::to_string(r) + " kind " + std::to_string(r % 6) + " T " +
                     std::to_string(q.temperature) + " k " + std::to_string(q.top_k) + " p " +
                     std::to_string(q.top_p) + " u " + std::to_string(q.u));
        if (q.mode == RowDraw::kSkip) {
          EXPECT_EQ(got[size_t(r)], backend::kDrawSkipped);
        } else if (q.mode == RowDraw::kHost) {
          EXPECT_EQ(got[size_t(r)], backend::kDrawHost);
        } else if (q.mode == RowDraw::kArgmax) {
          int32_t want = 0;
          cpu->argmax_rows(x, 1, V, &want);
          EXPECT_EQ(got[size_t(r)], want);
        } else {
          ++sampled;
          const bool llm_like = r % 6 == 0 || r % 6 == 4;
          llm += llm_like;
          if (got[size_t(r)] == backend::kDrawHost) {
            ++host;
            host_llm += llm_like;
            // Every id -inf (kind 3 at V 1) has no distribution: the host decides such rows.
            const bool degenerate = std::all_of(x, x + V, [](float v) { return std::isinf(v); });
            EXPECT_TRUE(V > 8192 || degenerate) << "a vocabulary that fits in shared memory is drawn on the device";
            continue;
          }
          ASSERT_EQ(got[size_t(r)], backend::reference_draw(x, V, q.temperature, q.top_k, q.top_p, q.u));
        }
      }
    }
    std::printf("V %6d: %d sampled rows, %d left to the host (%d of %d LLM-like rows)\n", V, sampled, host, host_llm,
                llm);
    EXPECT_EQ(host_llm, 0) << "peaked rows left to the host";
  }
}

// Penalty slots (RowDraw::pen_slot): over ten calls each row sends only some new ids (some of
// them sent before) to its slot, sometimes with a reset and a new set, and every token equals the
// reference draw on the logits penalized by all the ids the row's slot received since its last
// reset. The slot is updated also by kHost / kSkip rows and by a call without a penalty, the slots
// are spread up to 300 (the store grows and keeps the slots already written), and a call in the
// middle names no slot at all.
TEST(CudaSample, PenaltySlotsEqualTheWholeList) {
  SKIP_WITHOUT_GPU();
  auto gpu = backend::make_cuda_backend({backend::WeightDtype::kF32, 0});
  auto cpu = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  ASSERT_GE(gpu->penalty_slots(), 301);
  std::mt19937_64 rng(21);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (int V : {1000, 151936}) {
    SCOPED_TRACE("V " + std::to_string(V));
    const int rows = 12;
    const auto l = logits_rows(rows, V, 300 + V);
    auto dl = gpu->alloc(l.size());
    gpu->from_host(l.data(), dl->data(), l.size());
    std::vector<std::vector<int32_t>> held(rows);  // what each row's slot holds (distinct)
    std::vector<int32_t> slot_of(rows);
    for (int r = 0; r < rows; ++r) slot_of[size_t(r)] = r < 6 ? r : 300 - r;  // 0-5 and 289-294 (grown later)
    int checked = 0;
    for (int call = 0; call < 10; ++call) {
      SCOPED_TRACE("call " + std::to_string(call));
      std::vector<RowDraw> d(rows);
      std::vector<int32_t> hist;
      const bool no_slots = call == 4;
      for (int r = 0; r < rows; ++r) {
        if (r >= 6 && call < 2) continue;  // the high slots first named at call 2: the store grows then
        RowDraw& q = d[size_t(r)];
        const int c = (r + 3 * call) % 11;
        q.mode = c == 0 ? RowDraw::kHost : c == 1 ? RowDraw::kSkip : c % 3 == 0 ? RowDraw::kArgmax : RowDraw::kSample;
        q.temperature = 0.5f + 0.25f * float(c % 4);
        q.top_p = c % 2 ? 0.9f : 1.0f;
        q.u = uni(rng);
        q.penalty = c == 7 ? 1.0f : (r % 2 ? 1.3f : 0.7f);  // c 7: no penalty, the slot still updated
        const bool first = call == 0 || (r >= 6 && call == 2);
        std::vector<int32_t> list;
        if (no_slots) {
          list = held[size_t(r)];  // the whole list, no slot; the slot is left as it is
        } else {
          q.pen_slot = slot_of[size_t(r)];
          q.pen_reset = first || (call == 6 && r % 4 == 1);
          if (q.pen_reset) held[size_t(r)].clear();
          const float* x = l.data() + size_t(r) * V;
          if (call % 3 == 0) list.push_back(int32_t(std::max_element(x, x + V) - x));  // its best
          for (int j = int(rng() % 6); j > 0; --j) list.push_back(int32_t(rng() % uint64_t(V)));
          if (!held[size_t(r)].empty() && rng() % 2)  // one it was sent before
            list.push_back(held[size_t(r)][rng() % held[size_t(r)].size()]);
          for (int32_t t : list)
            if (std::find(held[size_t(r)].begin(), held[size_t(r)].end(), t) == held[size_t(r)].end())
              held[size_t(r)].push_back(t);
        }
        q.hist_off = int32_t(hist.size());
        q.hist_len = int32_t(list.size());
        hist.insert(hist.end(), list.begin(), list.end());
      }
      std::vector<int32_t> got(rows, 12345);
      gpu->sample_rows(dl->data(), rows, V, d.data(), hist.data(), int64_t(hist.size()), got.data());
      for (int r = 0; r < rows; ++r) {
        const RowDraw& q = d[size_t(r)];
        SCOPED_TRACE("row " + std::to_string(r));
        if (q.mode == RowDraw::kSkip) {
          EXPECT_EQ(got[size_t(r)], backend::kDrawSkipped);
          continue;
        }
        if (q.mode == RowDraw::kHost) {
          EXPECT_EQ(got[size_t(r)], backend::kDrawHost);
          continue;
        }
        const std::vector<float> y = penalized(l.data() + size_t(r) * V, V, held[size_t(r)], q.penalty);
        if (got[size_t(r)] == backend::kDrawHost && flat_row_may_go_to_host(q, V, r)) continue;
        ASSERT_EQ(got[size_t(r)], expected_token(*cpu, y, V, q));
        checked += q.penalty != 1.0f;
      }
    }
    EXPECT_GT(checked, 50);
  }
  std::vector<RowDraw> bad(1);
  bad[0].mode = RowDraw::kArgmax;
  bad[0].pen_slot = gpu->penalty_slots();
  std::vector<int32_t> got(1);
  auto dl = gpu->alloc(16);
  EXPECT_THROW(gpu->sample_rows(dl->data(), 1, 16, bad.data(), nullptr, 0, got.data()), Error);
}

// Presence and frequency penalties: rows with (id, count) pairs of generated ids (the row's best
// among them), alone and after a repetition penalty from a list or a slot, every mode; each token
// equals the reference draw on the logits penalized as engine::Sampler does (repetition first,
// then fma(frequency, count, presence) subtracted). Rows without them in the same call stay as
// they were.
TEST(CudaSample, PresenceAndFrequencyEqualTheReference) {
  SKIP_WITHOUT_GPU();
  auto gpu = backend::make_cuda_backend({backend::WeightDtype::kF32, 0});
  auto cpu = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  std::mt19937_64 rng(33);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  for (int V : {50, 1000, 151936}) {
    SCOPED_TRACE("V " + std::to_string(V));
    const int rows = 24;
    const auto l = logits_rows(rows, V, 500 + V);
    auto dl = gpu->alloc(l.size());
    gpu->from_host(l.data(), dl->data(), l.size());
    int checked = 0;
    for (int call = 0; call < 3; ++call) {
      std::vector<RowDraw> d(rows);
      std::vector<int32_t> hist;
      std::vector<std::vector<int32_t>> rep_ids(rows);
      std::vector<std::vector<std::pair<int32_t, int32_t>>> counts(rows);
      for (int r = 0; r < rows; ++r) {
        RowDraw& q = d[size_t(r)];
        const int c = (r + 5 * call) % 8;
        q.mode = c == 0 ? RowDraw::kArgmax : c == 7 ? RowDraw::kHost : RowDraw::kSample;
        q.temperature = 0.6f + 0.3f * float(c % 3);
        q.top_p = c % 2 ? 0.9f : 1.0f;
        q.top_k = c == 3 ? 20 : 0;
        q.u = uni(rng);
        const float* x = l.data() + size_t(r) * V;
        const int best = int(std::max_element(x, x + V) - x);
        if (r % 4 != 3) {  // (every fourth row: no presence / frequency penalty)
          q.presence = r % 3 == 0 ? 0.0f : (r % 2 ? 0.7f : -0.5f);
          q.frequency = r % 3 == 1 ? 0.0f : (r % 2 ? 1.3f : 0.4f);
          std::vector<char> seen(size_t(V), 0);
          counts[size_t(r)].push_back({best, 1 + r % 5});
          seen[size_t(best)] = 1;
          for (int j = 0; j < 30; ++j) {
            const int t = int(rng() % uint64_t(V));
            if (!seen[size_t(t)]) seen[size_t(t)] = 1, counts[size_t(r)].push_back({t, 1 + int(rng() % 4)});
          }
          q.cnt_off = int32_t(hist.size());
          q.cnt_len = int32_t(counts[size_t(r)].size());
          for (auto [t, n] : counts[size_t(r)]) hist.push_back(t), hist.push_back(n);
        }
        if (r % 2 == 0) {  // a repetition penalty too, on a few ids and the best
          q.penalty = 1.25f;
          rep_ids[size_t(r)] = {best, int32_t((best + 1) % V)};
          if (V > 2) rep_ids[size_t(r)].push_back(int32_t((best + V / 2) % V));
          std::sort(rep_ids[size_t(r)].begin(), rep_ids[size_t(r)].end());
          rep_ids[size_t(r)].erase(std::unique(rep_ids[size_t(r)].begin(), rep_ids[size_t(r)].end()),
                                   rep_ids[size_t(r)].end());
          if (r % 4 == 0) {  // through a slot (reset with the whole list every call)
            q.pen_slot = r;
            q.pen_reset = 1;
          }
          q.hist_off = int32_t(hist.size());
          q.hist_len = int32_t(rep_ids[size_t(r)].size());
          hist.insert(hist.end(), rep_ids[size_t(r)].begin(), rep_ids[size_t(r)].end());
        }
      }
      std::vector<int32_t> got(rows, 12345);
      gpu->sample_rows(dl->data(), rows, V, d.data(), hist.data(), int64_t(hist.size()), got.data());
      for (int r = 0; r < rows; ++r) {
        const RowDraw& q = d[size_t(r)];
        SCOPED_TRACE("call " + std::to_string(call) + " row " + std::to_string(r));
        if (q.mode == RowDraw::kHost) {
          EXPECT_EQ(got[size_t(r)], backend::kDrawHost);
          continue;
        }
        std::vector<float> y = penalized(l.data() + size_t(r) * V, V, rep_ids[size_t(r)], q.penalty);
        for (auto [t, n] : counts[size_t(r)]) y[size_t(t)] -= std::fma(q.frequency, float(n), q.presence);
        if (got[size_t(r)] == backend::kDrawHost && flat_row_may_go_to_host(q, V, r)) continue;
        ASSERT_EQ(got[size_t(r)], expected_token(*cpu, y, V, q));
        checked += q.cnt_len > 0;
      }
    }
    EXPECT_GT(checked, 30);
  }
}

// min_p: rows of every kind over vocabularies from 7 to the Qwen size, with top-k and top-p beside
// it, each token equal to the reference draw with the same min_p (a prefix of the order: the ids
// of weight >= min_p); kDrawHost only where the plain draw allows it (a flat row of a large
// vocabulary).
TEST(CudaSample, MinPEqualsTheReference) {
  SKIP_WITHOUT_GPU();
  auto gpu = backend::make_cuda_backend({backend::WeightDtype::kF32, 0});
  std::mt19937_64 rng(41);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  const std::vector<float> mps = {0.01f, 0.05f, 0.2f, 0.5f, 1.0f};
  for (int V : {7, 1000, 32000, 151936}) {
    SCOPED_TRACE("V " + std::to_string(V));
    const int rows = 30;
    const auto l = logits_rows(rows, V, 700 + V);
    auto dl = gpu->alloc(l.size());
    gpu->from_host(l.data(), dl->data(), l.size());
    int checked = 0;
    for (int round = 0; round < 4; ++round) {
      std::vector<RowDraw> d(rows);
      for (int r = 0; r < rows; ++r) {
        RowDraw& q = d[size_t(r)];
        q.mode = RowDraw::kSample;
        q.min_p = mps[size_t(r + round) % mps.size()];
        q.temperature = 0.4f + 0.4f * float((r + round) % 3);
        q.top_k = (r + round) % 4 == 1 ? 5 : 0;
        q.top_p = (r + round) % 3 == 2 ? 0.9f : 1.0f;
        q.u = uni(rng);
      }
      std::vector<int32_t> got(rows, 12345);
      gpu->sample_rows(dl->data(), rows, V, d.data(), nullptr, 0, got.data());
      for (int r = 0; r < rows; ++r) {
        const RowDraw& q = d[size_t(r)];
        SCOPED_TRACE("round " + std::to_string(round) + " row " + std::to_string(r) + " kind " + std::to_string(r % 6) +
                     " min_p " + std::to_string(q.min_p));
        const float* x = l.data() + size_t(r) * V;
        if (got[size_t(r)] == backend::kDrawHost) {
          const bool degenerate = std::all_of(x, x + V, [](float v) { return std::isinf(v); });
          EXPECT_TRUE(degenerate || (V > 8192 && r % 6 != 0 && r % 6 != 4)) << "left to the host";
          continue;
        }
        ASSERT_EQ(got[size_t(r)], backend::reference_draw(x, V, q.temperature, q.top_k, q.top_p, q.u, q.min_p));
        ++checked;
      }
    }
    EXPECT_GT(checked, 60);
  }
}

// A NaN fails a sampled row (kDrawNaN) and only that row; argmax skips NaN as argmax_rows does.
TEST(CudaSample, NaNFailsOnlyItsRow) {
  SKIP_WITHOUT_GPU();
  auto gpu = backend::make_cuda_backend({backend::WeightDtype::kF32, 0});
  const int V = 5000, rows = 4;
  auto l = logits_rows(rows, V, 9);
  l[size_t(1) * V + 77] = NAN;
  l[size_t(2) * V + 3] = NAN;
  l[size_t(2) * V + 4] = 1e6f;  // the argmax
  auto dl = gpu->alloc(l.size());
  gpu->from_host(l.data(), dl->data(), l.size());
  std::vector<RowDraw> d(rows);
  for (auto& q : d) q.mode = RowDraw::kSample, q.temperature = 0.8f, q.top_p = 0.9f, q.u = 0.3;
  d[2].mode = RowDraw::kArgmax;
  std::vector<int32_t> got(rows);
  gpu->sample_rows(dl->data(), rows, V, d.data(), nullptr, 0, got.data());
  EXPECT_EQ(got[1], backend::kDrawNaN);
  EXPECT_EQ(got[2], 4);
  for (int r : {0, 3}) EXPECT_EQ(got[size_t(r)], backend::reference_draw(l.data() + size_t(r) * V, V, 0.8f, 0, 0.9f, 0.3));
}

// The engine's step on the CUDA backend: greedy, sampled and penalized sequences over prefill
// chunks and decode steps; each token equals the host's draw from the same step's logits
// (Model::output_logits) with the same u, and no row went to the host.
TEST(CudaSample, EngineStepDrawsOnTheDevice) {
  SKIP_WITHOUT_GPU();
  model::ModelConfig c = model::tiny_config(model::Arch::kQwen3);
  c.vocab_size = 8000;  // fits one CTA's shared memory: every row without a penalty is drawn there
  const auto w = model::random_weights(c, 17);
  auto be = backend::make_cuda_backend({backend::WeightDtype::kF32, 0});
  model::Model m(w, *be);
  auto cache = kv::make_method_cache({}, m.cache_shape(16), 4096, false, be->page_store_factory());
  const std::vector<engine::SamplingParams> ps = {
      {}, {0.8f, 0, 0.9f, 1.0f, 5}, {1.0f, 40, 1.0f, 1.0f, 6}, {0.7f, 0, 0.95f, 1.2f, 7}, {1.0f, 0, 1.0f, 1.0f, 8},
      {0.0f, 0, 1.0f, 1.3f, 9}, {0.7f, 0, 0.95f, 1.2f, 10, 0.4f, 0.6f}, {0.0f, 0, 1.0f, 1.0f, 11, 1.0f, 0.5f},
      {1.0f, 0, 0.9f, 1.0f, 12, 0.0f, 0.0f, 0.05f}};
  const int S = int(ps.size()), V = c.vocab_size;
  std::vector<engine::Sampler> samplers(ps.begin(), ps.end());
  std::vector<std::vector<int>> hist(static_cast<size_t>(S));
  std::vector<kv::SeqId> seqs;
  std::vector<int> fed(static_cast<size_t>(S), 0);
  std::mt19937 rng(4);
  for (int i = 0; i < S; ++i) {
    seqs.push_back(cache->create());
    for (int t = 0; t < 5 + 9 * i; ++t) hist[size_t(i)].push_back(int(rng() % V));
  }
  engine::StepDrawer drawer;
  std::vector<float> row(static_cast<size_t>(V));
  int device_rows = 0, penalized_rows = 0;
  for (int step = 0; step < 30; ++step) {
    std::vector<model::SeqStep> steps;
    std::vector<std::vector<int32_t>> toks(static_cast<size_t>(S));
    std::vector<engine::SampleJob> jobs;
    for (int i = 0; i < S; ++i) {
      const int n = std::min<int>(16, int(hist[size_t(i)].size()) - fed[size_t(i)]);
      toks[size_t(i)].assign(hist[size_t(i)].begin() + fed[size_t(i)], hist[size_t(i)].begin() + fed[size_t(i)] + n);
      steps.push_back({seqs[size_t(i)], toks[size_t(i)], false});
      if (fed[size_t(i)] + n == int(hist[size_t(i)].size()))
        jobs.push_back({&samplers[size_t(i)], {}, hist[size_t(i)], -1, {}, i});
    }
    drawer.run(m, steps, *cache, jobs);
    int penalized = 0;
    for (const auto& j : jobs) {
      ASSERT_TRUE(j.error.empty()) << j.error;
      m.output_logits(j.row, row);
      const engine::SamplingParams& p = ps[size_t(j.row)];
      int want;
      if (p.repetition_penalty != 1.0f || p.presence_penalty != 0.0f || p.frequency_penalty != 0.0f) {
        ++penalized;
        engine::Sampler twin(p);
        want = twin.sample_u(row, j.history, j.u);
      } else if (p.temperature == 0.0f) {
        want = int(std::max_element(row.begin(), row.end()) - row.begin());
      } else {
        want = backend::reference_draw(row.data(), V, p.temperature, p.top_k, p.top_p, j.u, p.min_p);
      }
      ASSERT_EQ(j.token, want) << "sequence " << j.row << " step " << step;
    }
    EXPECT_EQ(drawer.host_rows(), 0) << "step " << step;
    penalized_rows += penalized;
    device_rows += int(jobs.size());
    for (int i = 0; i < S; ++i) fed[size_t(i)] += int(toks[size_t(i)].size());
    for (const auto& j : jobs) hist[size_t(j.row)].push_back(j.token);
  }
  EXPECT_GT(device_rows, 80);
  EXPECT_GT(penalized_rows, 40);  // greedy and sampled rows with penalties, on the device
}

}  // namespace
}  // namespace oscar
