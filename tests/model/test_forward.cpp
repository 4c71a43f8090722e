// The paged, batched forward against a naive dense reference (test_forward_ref.h),
// over every architecture flavour, chunkings, batch mixes, page offsets and forks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/cpu/backend_cpu.h"
#include "backend/cpu/ops_gemv.h"
#include "backend/cpu/ops_gemv_q8.h"
#include "core/error.h"
#include "kv/bf16_cache.h"
#include "model/forward.h"
#include "model/forward_random.h"
#include "model/rope.h"
#include "test_forward_ref.h"

namespace oscar::model {
namespace {

using testing::ref_forward;

// One step of a schedule: (sequence index, tokens to add) pairs run in one forward call.
using Step = std::vector<std::pair<int, int>>;

struct RunResult {
  std::vector<std::vector<float>> logits;  // per sequence: [T][vocab], every position
  std::vector<std::vector<int>> chunk_start;
};

std::vector<int> random_tokens(int n, int vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> t(n);
  for (int& x : t) x = static_cast<int>(rng() % vocab);
  return t;
}

// Runs `schedule` over sequences with the given full token lists.
RunResult run_schedule(Model& m, kv::KvCache& cache, const std::vector<std::vector<int>>& toks,
                 const std::vector<Step>& schedule) {
  const int V = m.config().vocab_size;
  const int S = static_cast<int>(toks.size());
  RunResult r;
  r.logits.resize(S);
  r.chunk_start.resize(S);
  std::vector<kv::SeqId> ids(S);
  std::vector<int> done(S, 0);
  for (int s = 0; s < S; ++s) ids[s] = cache.create();
  std::vector<std::vector<int32_t>> buf(S);
  for (const Step& st : schedule) {
    std::vector<SeqStep> steps;
    for (auto [s, n] : st) {
      buf[s].assign(toks[s].begin() + done[s], toks[s].begin() + done[s] + n);
      steps.push_back({ids[s], buf[s], true});
    }
    std::vector<float> lg;
    m.forward(steps, cache, lg);
    size_t row = 0;
    for (auto [s, n] : st) {
      // A single token goes through the decode kernel, which reads its own
      // row back from the cache (bf16) too: "cached from position done+1".
      for (int i = 0; i < n; ++i) r.chunk_start[s].push_back(n == 1 ? done[s] + 1 : done[s]);
      r.logits[s].insert(r.logits[s].end(), lg.begin() + row * V, lg.begin() + (row + n) * V);
      row += n;
      done[s] += n;
    }
  }
  for (int s = 0; s < S; ++s) cache.release(ids[s]);
  return r;
}

// max |a - b| over max(1, max |b|): logits are O(1..10), a wrong position/page
// gives O(1) differences; measured fp32-vs-fp64 accumulation ~1e-5 (the
// reference emulates the bf16 cache exactly, up to rare rounding-boundary flips).
double rel_err(const std::vector<float>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double mx = 1.0, err = 0.0;
  for (size_t i = 0; i < b.size() && i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    mx = std::max(mx, std::abs(b[i]));
    err = std::max(err, std::abs(a[i] - b[i]));
  }
  return err / mx;
}

constexpr double kTol = 2e-4;

void expect_matches_ref(const ModelWeights& ref_w, const std::vector<std::vector<int>>& toks,
                        const RunResult& r, double tol = kTol, bool own_rows_bf16 = false) {
  for (size_t s = 0; s < toks.size(); ++s) {
    auto ref = ref_forward(ref_w, toks[s], r.chunk_start[s], own_rows_bf16);
    EXPECT_LT(rel_err(r.logits[s], ref), tol) << "sequence " << s;
  }
}

struct Fixture {
  explicit Fixture(ModelConfig cfg, backend::WeightDtype wd = backend::WeightDtype::kF32, int page = 16,
                   uint64_t seed = 7)
      : w(random_weights(cfg, seed)),
        be(backend::make_cpu_backend({wd, 0})),
        m(w, *be),
        cache(m.cache_shape(page), 512) {}
  ModelWeights w;
  std::unique_ptr<backend::Backend> be;
  Model m;
  kv::Bf16KvCache cache;
};

struct ArchCase {
  Arch arch;
  bool tied;
  backend::WeightDtype wd;
};

// Named printing (gtest would otherwise dump the struct's padding bytes).
void PrintTo(const ArchCase& c, std::ostream* os) {
  *os << (c.arch == Arch::kLlama ? "llama" : c.arch == Arch::kQwen2 ? "qwen2" : "qwen3")
      << (c.tied ? "-tied-" : "-untied-") << backend::to_string(c.wd);
}

class ForwardArch : public ::testing::TestWithParam<ArchCase> {};

TEST_P(ForwardArch, PrefillThenDecodeMatchesReference) {
  const auto p = GetParam();
  Fixture f(tiny_config(p.arch, p.tied), p.wd);
  auto toks = std::vector<std::vector<int>>{random_tokens(45, f.w.cfg.vocab_size, 11)};
  // Prefill 37 (crosses two 16-token pages), then 8 single decode tokens.
  std::vector<Step> sched = {{{0, 37}}};
  for (int i = 0; i < 8; ++i) sched.push_back({{0, 1}});
  RunResult r = run_schedule(f.m, f.cache, toks, sched);
  // q8 needs the AVX-512 kernels; without them the CPU backend keeps the matrices in BF16.
  const bool q8 = p.wd == backend::WeightDtype::kQ8 && backend::cpu::q8_supported();
  const bool bf16 = p.wd == backend::WeightDtype::kBf16 || (p.wd == backend::WeightDtype::kQ8 && !q8);
  const ModelWeights ref_w = bf16 ? testing::round_matrices_bf16(f.w) : q8 ? testing::round_matrices_q8(f.w) : f.w;
  // Reduced-precision weights: the backend reads the chunk's own rows in bf16 as well.
  expect_matches_ref(ref_w, toks, r, kTol, p.wd != backend::WeightDtype::kF32);
  EXPECT_EQ(f.cache.pool().num_used(), 0) << "pages leaked";
}

INSTANTIATE_TEST_SUITE_P(
    All, ForwardArch,
    ::testing::Values(ArchCase{Arch::kLlama, false, backend::WeightDtype::kF32},
                      ArchCase{Arch::kLlama, true, backend::WeightDtype::kF32},
                      ArchCase{Arch::kQwen2, false, backend::WeightDtype::kF32},
                      ArchCase{Arch::kQwen3, true, backend::WeightDtype::kF32},
                      ArchCase{Arch::kLlama, false, backend::WeightDtype::kBf16},
                      ArchCase{Arch::kQwen2, true, backend::WeightDtype::kBf16},
                      ArchCase{Arch::kQwen3, false, backend::WeightDtype::kBf16},
                      ArchCase{Arch::kLlama, true, backend::WeightDtype::kQ8},
                      ArchCase{Arch::kQwen2, false, backend::WeightDtype::kQ8}));

TEST(Forward, WrongPositionWouldBeCaught) {
  // The comparison is sharp enough to see a one-position RoPE shift.
  Fixture f(tiny_config(Arch::kLlama));
  auto toks = std::vector<std::vector<int>>{random_tokens(20, f.w.cfg.vocab_size, 3)};
  RunResult r = run_schedule(f.m, f.cache, toks, {{{0, 20}}});
  auto shifted = toks;
  shifted[0].insert(shifted[0].begin(), 5);  // every position moves by one
  auto ref = ref_forward(f.w, shifted[0], std::vector<int>(21, 0));
  ref.erase(ref.begin(), ref.begin() + f.w.cfg.vocab_size);
  EXPECT_GT(rel_err(r.logits[0], ref), 10 * kTol);
}

TEST(Forward, MixedBatchEqualsOneSequenceAtATime) {
  Fixture f(tiny_config(Arch::kQwen2));
  const int V = f.w.cfg.vocab_size;
  std::vector<std::vector<int>> toks = {random_tokens(30, V, 1), random_tokens(40, V, 2),
                                        random_tokens(12, V, 3), random_tokens(20, V, 4)};
  // Prefill chunks and decode tokens of different sequences in the same calls.
  std::vector<Step> sched = {
      {{0, 20}},
      {{0, 1}, {1, 17}, {2, 1}},
      {{0, 1}, {1, 16}, {2, 5}, {3, 19}},
      {{2, 1}, {0, 1}, {1, 1}, {3, 1}},
      {{1, 6}, {0, 7}, {2, 5}},
  };
  RunResult batched = run_schedule(f.m, f.cache, toks, sched);
  expect_matches_ref(f.w, toks, batched);
  // The same chunking, one sequence per call: equal up to fp32 reassociation.
  for (size_t s = 0; s < toks.size(); ++s) {
    std::vector<Step> alone;
    for (const Step& st : sched)
      for (auto [i, n] : st)
        if (i == int(s)) alone.push_back({{0, n}});
    RunResult one = run_schedule(f.m, f.cache, {toks[s]}, alone);
    ASSERT_EQ(one.logits[0].size(), batched.logits[s].size());
    double err = 0;
    for (size_t i = 0; i < one.logits[0].size(); ++i)
      err = std::max(err, double(std::abs(one.logits[0][i] - batched.logits[s][i])));
    EXPECT_LT(err, 1e-3) << "sequence " << s;
  }
}

// forward_argmax: the same step as forward, each output row's argmax instead of its
// logits (ties to the lowest id, as the greedy sampler). Two identical caches, one fed
// through each call, over a mixed prefill + decode schedule.
TEST(Forward, ArgmaxEqualsArgmaxOfLogits) {
  Fixture f(tiny_config(Arch::kLlama));
  kv::Bf16KvCache other(f.m.cache_shape(16), 512);
  const int V = f.w.cfg.vocab_size;
  const auto ta = random_tokens(40, V, 11), tb = random_tokens(40, V, 12);
  const kv::SeqId a = f.cache.create(), b = f.cache.create();
  ASSERT_EQ(a, other.create());
  ASSERT_EQ(b, other.create());
  int fa = 0, fb = 0, checked = 0;
  for (int step = 0; step < 12; ++step) {
    // a: 9-token chunks then single tokens; b: single tokens throughout.
    const int na = fa < 27 ? 9 : 1;
    std::vector<int32_t> ca(ta.begin() + fa, ta.begin() + fa + na), cb{tb[fb]};
    std::vector<SeqStep> st = {{a, ca, false}, {b, cb, false}};
    std::vector<float> lg;
    std::vector<int32_t> ids;
    f.m.forward(st, f.cache, lg);
    f.m.forward_argmax(st, other, ids);
    ASSERT_EQ(lg.size(), 2u * V);
    ASSERT_EQ(ids.size(), 2u);
    for (int r = 0; r < 2; ++r) {
      const auto row = lg.begin() + r * V;
      EXPECT_EQ(ids[r], int32_t(std::max_element(row, row + V) - row)) << "step " << step << " row " << r;
      ++checked;
    }
    fa += na;
    ++fb;
  }
  EXPECT_EQ(checked, 24);
  // Ties and NaN in the backend's own op: the first maximum wins, NaN never does.
  std::vector<float> x = {1, 3, 3, 2, NAN, NAN, NAN, NAN, NAN, -1, 5, 5};
  auto buf = f.be->alloc(x.size());
  f.be->from_host(x.data(), buf->data(), x.size());
  std::vector<int32_t> out(4);
  f.be->argmax_rows(buf->data(), 4, 3, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{1, 0, 0, 1}));
}

TEST(Forward, PageBoundariesAtEveryOffset) {
  // Page size 16: a chunk of 5 tokens starting at every offset 0..33 (so the
  // cached part ends, and the chunk starts and ends, at every slot of a page),
  // followed by two decode tokens.
  Fixture f(tiny_config(Arch::kLlama), backend::WeightDtype::kF32, 16);
  const int V = f.w.cfg.vocab_size;
  for (int c0 = 0; c0 <= 33; ++c0) {
    auto toks = std::vector<std::vector<int>>{random_tokens(c0 + 7, V, 100 + c0)};
    std::vector<Step> sched;
    if (c0 > 0) sched.push_back({{0, c0}});
    sched.push_back({{0, 5}});
    sched.push_back({{0, 1}});
    sched.push_back({{0, 1}});
    RunResult r = run_schedule(f.m, f.cache, toks, sched);
    auto ref = ref_forward(f.w, toks[0], r.chunk_start[0]);
    EXPECT_LT(rel_err(r.logits[0], ref), kTol) << "chunk at offset " << c0;
  }
}

TEST(Forward, TokenByTokenDecodeOverManyPages) {
  Fixture f(tiny_config(Arch::kQwen3), backend::WeightDtype::kF32, 16);
  auto toks = std::vector<std::vector<int>>{random_tokens(70, f.w.cfg.vocab_size, 9)};
  std::vector<Step> sched(70, Step{{0, 1}});
  RunResult r = run_schedule(f.m, f.cache, toks, sched);
  expect_matches_ref(f.w, toks, r);
}

TEST(Forward, ForkedSequencesDivergeCorrectly) {
  Fixture f(tiny_config(Arch::kLlama), backend::WeightDtype::kF32, 16);
  const int V = f.w.cfg.vocab_size;
  auto prefix = random_tokens(21, V, 5);  // ends mid-page: the partial page is copied
  auto a = prefix, b = prefix;
  for (int t : random_tokens(6, V, 6)) a.push_back(t);
  for (int t : random_tokens(6, V, 7)) b.push_back(t);
  kv::SeqId sa = f.cache.create();
  std::vector<int32_t> p32(prefix.begin(), prefix.end());
  std::vector<float> lg;
  SeqStep st{sa, p32, false};
  f.m.forward({&st, 1}, f.cache, lg);
  kv::SeqId sb = f.cache.fork(sa);
  EXPECT_EQ(f.cache.block_table(sa)[0], f.cache.block_table(sb)[0]) << "full page not shared";
  EXPECT_NE(f.cache.block_table(sa)[1], f.cache.block_table(sb)[1]) << "partial page shared";
  std::vector<float> la, lb;
  for (int i = 21; i < 27; ++i) {
    int32_t ta = a[i], tb = b[i];
    std::vector<SeqStep> steps = {{sa, {&ta, 1}, false}, {sb, {&tb, 1}, false}};
    f.m.forward(steps, f.cache, lg);
    la.insert(la.end(), lg.begin(), lg.begin() + V);
    lb.insert(lb.end(), lg.begin() + V, lg.begin() + 2 * V);
  }
  std::vector<int> cs(27);
  for (int i = 0; i < 27; ++i) cs[i] = i < 21 ? 0 : i + 1;
  for (auto [toks, got] : {std::pair{a, la}, std::pair{b, lb}}) {
    auto ref = ref_forward(f.w, toks, cs);
    ref.erase(ref.begin(), ref.begin() + 21 * V);
    EXPECT_LT(rel_err(got, ref), kTol);
  }
  f.cache.release(sa);
  f.cache.release(sb);
  EXPECT_EQ(f.cache.pool().num_used(), 0);
}

TEST(Forward, BadInputsThrow) {
  Fixture f(tiny_config(Arch::kLlama));
  kv::SeqId s = f.cache.create();
  int32_t bad = f.w.cfg.vocab_size;
  std::vector<float> lg;
  SeqStep st{s, {&bad, 1}, false};
  EXPECT_THROW(f.m.forward({&st, 1}, f.cache, lg), oscar::Error);
  SeqStep twice[2] = {{s, {&bad, 1}, false}, {s, {&bad, 1}, false}};
  EXPECT_THROW(f.m.forward(twice, f.cache, lg), oscar::Error);
  ModelWeights w = f.w;
  w.layers[1].wk.shape = {64, 96};
  EXPECT_THROW(Model(w, *f.be), oscar::Error);
}

// Backend::qkv_heads_into_cache (what a step runs before its attention; one launch on the GPU,
// tests/cuda_backend): the CPU backend's composition equals qkv_heads, the store's query / key
// transform and its BF16 write called one by one, and a placement that does not cover the step or
// a layer outside the cache is refused before anything is written.
TEST(Forward, QkvHeadsIntoCacheEqualsItsThreeSteps) {
  auto be = backend::make_cpu_backend({backend::WeightDtype::kF32, 1});
  const int n = 3, Hq = 4, Hkv = 2, d = 64, ps = 16;
  backend::PageStoreSpec spec;
  spec.n_layers = 2;
  spec.num_kv_heads = Hkv;
  spec.head_dim = d;
  spec.page_size = ps;
  spec.bf16_pages = 2;
  spec.group_size = 32;
  std::vector<backend::LayerQuant> lq(2);
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& q : lq) {
    q.k_clip.assign(Hkv, 1.0f);
    q.v_clip.assign(Hkv, 1.0f);
    q.identity = false;
    q.xf.d = d;
    q.xf.key.resize(size_t(d) * d);
    q.xf.query.resize(size_t(d) * d);
    q.xf.mean.resize(size_t(Hkv) * d);
    for (float* v : {q.xf.key.data(), q.xf.query.data()})
      for (int i = 0; i < d * d; ++i) v[i] = 0.1f * nd(rng);
    for (float& v : q.xf.mean) v = nd(rng);
  }
  auto one = backend::make_host_page_store(spec), three = backend::make_host_page_store(spec);
  one->set_quant(lq);
  three->set_quant(lq);
  backend::RowPlacement rows;
  rows.pages = {1, 0, 1};
  rows.slots = {5, 9, 0};
  std::vector<float> qkv(size_t(n) * (Hq + 2 * Hkv) * d), cs(size_t(n) * d / 2), sn(size_t(n) * d / 2);
  for (float& v : qkv) v = nd(rng);
  for (size_t i = 0; i < cs.size(); ++i) cs[i] = std::cos(0.1f * float(i)), sn[i] = std::sin(0.1f * float(i));
  std::vector<float> q1(size_t(n) * Hq * d), k1(size_t(n) * Hkv * d), v1(k1.size());
  std::vector<float> q3(q1.size()), k3(k1.size()), v3(k1.size());
  be->qkv_heads_into_cache(qkv.data(), n, Hq, Hkv, d, nullptr, nullptr, 1e-6f, cs.data(), sn.data(), q1.data(),
                           k1.data(), v1.data(), *one, 1, rows);
  be->qkv_heads(qkv.data(), n, Hq, Hkv, d, nullptr, nullptr, 1e-6f, cs.data(), sn.data(), q3.data(), k3.data(),
                v3.data());
  three->transform_queries_keys(1, q3.data(), Hq, k3.data(), n);
  three->write_bf16(1, rows, k3.data(), v3.data());
  EXPECT_EQ(q1, q3);
  EXPECT_EQ(k1, k3);
  EXPECT_EQ(v1, v3);
  const kv::Bf16PagePool a = one->bf16_pool(1), b = three->bf16_pool(1);
  for (int i = 0; i < n; ++i)
    for (int h = 0; h < Hkv; ++h) {
      const size_t row = ((size_t(rows.pages[i]) * Hkv + h) * ps + rows.slots[i]) * d;
      EXPECT_TRUE(std::equal(a.k + row, a.k + row + d, b.k + row)) << "K row " << i << ", head " << h;
      EXPECT_TRUE(std::equal(a.v + row, a.v + row + d, b.v + row)) << "V row " << i << ", head " << h;
    }
  // The rotation really ran: the stored keys are not the roped keys before it.
  std::vector<float> q0(q1.size()), k0(k1.size()), v0(k1.size());
  be->qkv_heads(qkv.data(), n, Hq, Hkv, d, nullptr, nullptr, 1e-6f, cs.data(), sn.data(), q0.data(), k0.data(),
                v0.data());
  EXPECT_NE(k0, k1);
  backend::RowPlacement two = rows;
  two.pages.pop_back();
  two.slots.pop_back();
  const std::vector<float> before = q1;
  EXPECT_THROW(be->qkv_heads_into_cache(qkv.data(), n, Hq, Hkv, d, nullptr, nullptr, 1e-6f, cs.data(), sn.data(),
                                        q1.data(), k1.data(), v1.data(), *one, 1, two),
               oscar::Error);
  EXPECT_THROW(be->qkv_heads_into_cache(qkv.data(), n, Hq, Hkv, d, nullptr, nullptr, 1e-6f, cs.data(), sn.data(),
                                        q1.data(), k1.data(), v1.data(), *one, 2, rows),
               oscar::Error);
  EXPECT_EQ(q1, before);
}

TEST(Rope, Llama3ScalingMatchesHuggingFace) {
  // Llama-3.1 scaling (factor 8, low 1, high 4, original 8192), theta 500000,
  // head_dim 128: the highest frequencies are untouched, the lowest divided by 8.
  ModelConfig c;
  c.head_dim = 128;
  c.rope_theta = 500000.f;
  c.rope_scaling.type = RopeScaling::Type::kLlama3;
  c.rope_scaling.factor = 8.f;
  auto f = rope_inv_freq(c);
  ASSERT_EQ(f.size(), 64u);
  EXPECT_FLOAT_EQ(f[0], 1.0f);
  EXPECT_NEAR(f[63], std::pow(500000.0, -126.0 / 128) / 8, 1e-12);
  // Index 40: wavelength 2*pi*500000^(80/128) ~ 23.4K > 8192 -> divided by 8.
  EXPECT_NEAR(f[40], std::pow(500000.0, -80.0 / 128) / 8, 1e-9);
  // Index 30: wavelength ~ 7.6K, between 2048 and 8192 -> smoothed.
  const double f30 = std::pow(500000.0, -60.0 / 128), wl = 2 * M_PI / f30;
  const double smooth = (8192 / wl - 1) / 3;
  EXPECT_NEAR(f[30], (1 - smooth) * f30 / 8 + smooth * f30, 1e-9);
}

}  // namespace
}  // namespace oscar::model

namespace oscar::backend::cpu {
namespace {

// The optimized linear paths (GEMV for few rows, tiled GEMM for many, threads,
// odd shapes with channel tails) against the scalar reference.
TEST(Linear, OptimizedMatchesReference) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (auto [out, in] : {std::pair{37, 96}, std::pair{256, 576}, std::pair{130, 19}}) {
    std::vector<float> w(size_t(out) * in), b(out), x(size_t(70) * in);
    for (float& v : w) v = nd(rng);
    for (float& v : b) v = nd(rng);
    for (float& v : x) v = nd(rng);
    std::vector<uint16_t> wb(w.size());
    for (size_t i = 0; i < w.size(); ++i) wb[i] = f32_to_bf16(w[i]);
    for (int n : {1, 3, 4, 5, 15, 16, 17, 64, 70}) {
      std::vector<float> y(size_t(n) * out), r(size_t(n) * out);
      linear_f32(w.data(), out, in, b.data(), x.data(), n, y.data());
      linear_f32_ref(w.data(), out, in, b.data(), x.data(), n, r.data());
      for (size_t i = 0; i < y.size(); ++i)
        ASSERT_NEAR(y[i], r[i], 1e-4 * std::sqrt(double(in))) << "f32 " << out << "x" << in << " n " << n;
      if (in % kQ8Block == 0) {
        std::vector<int8_t> q(w.size());
        std::vector<float> sc(w.size() / kQ8Block);
        quantize_q8(w.data(), out, in, q.data(), sc.data());
        linear_q8(q.data(), sc.data(), out, in, b.data(), x.data(), n, y.data());
        linear_q8_ref(q.data(), sc.data(), out, in, b.data(), x.data(), n, r.data());
        for (size_t i = 0; i < y.size(); ++i)
          ASSERT_NEAR(y[i], r[i], 1e-4 * std::sqrt(double(in))) << "q8 " << out << "x" << in << " n " << n;
        // Quantization error itself: |w - q*s| <= s/2 = absmax/254 per weight.
        for (int64_t i = 0; i < int64_t(w.size()); ++i)
          ASSERT_LE(std::abs(w[i] - q[i] * sc[i / kQ8Block]), sc[i / kQ8Block] * 0.5f + 1e-7f);
      }
      linear_bf16(wb.data(), out, in, nullptr, x.data(), n, y.data());
      linear_bf16_ref(wb.data(), out, in, nullptr, x.data(), n, r.data());
      for (size_t i = 0; i < y.size(); ++i)
        ASSERT_NEAR(y[i], r[i], 1e-4 * std::sqrt(double(in))) << "bf16 " << out << "x" << in << " n " << n;
    }
  }
}

}  // namespace
}  // namespace oscar::backend::cpu

#include "backend/cpu/ops_attention.h"
#include "kernels/cpu/attention.h"

namespace oscar::backend::cpu {
namespace {

// The scalar fallback attention (head dims the kernels do not take) against
// the kernels' reference on a head_dim both accept.
TEST(GenericAttention, MatchesKernelReference) {
  const int hq = 4, hkv = 2, d = 64;
  kv::Bf16KvCache cache({1, hkv, d, 16}, 16);
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  std::vector<kv::SeqId> seqs;
  std::vector<int> lens = {1, 16, 37};
  for (int len : lens) {
    kv::SeqId s = cache.create();
    cache.reserve(s, len);
    std::vector<float> k(size_t(len) * hkv * d), v(k.size());
    for (float& x : k) x = nd(rng);
    for (float& x : v) x = nd(rng);
    cache.write(0, s, 0, k.data(), v.data(), len);
    cache.commit(s, len);
    seqs.push_back(s);
  }
  kv::KvBatch b;
  cache.make_batch(seqs, lens, b);
  const kv::PagedKvView view = b.layer(0);
  std::vector<float> q(size_t(3) * hq * d), o1(q.size()), o2(q.size());
  for (float& x : q) x = nd(rng);
  decode_attention_generic(view, q.data(), hq, 0.125f, o1.data());
  kernels::cpu::decode_attention_ref(view, q.data(), hq, 0.125f, o2.data(), nullptr);
  for (size_t i = 0; i < o1.size(); ++i) ASSERT_NEAR(o1[i], o2[i], 1e-5) << i;
  // Prefill: 5 new tokens after the 37 cached of sequence 2 (the view says 37).
  const int n = 5;
  std::vector<float> qn(size_t(n) * hq * d), kn(size_t(n) * hkv * d), vn(kn.size());
  for (float& x : qn) x = nd(rng);
  for (float& x : kn) x = nd(rng);
  for (float& x : vn) x = nd(rng);
  std::vector<float> p1(qn.size()), p2(qn.size());
  prefill_attention_generic(view, 2, 37, qn.data(), kn.data(), vn.data(), n, hq, 0.125f, p1.data());
  kernels::cpu::prefill_attention_ref(view, 2, 37, qn.data(), kn.data(), vn.data(), n, hq, 0.125f,
                                      p2.data());
  for (size_t i = 0; i < p1.size(); ++i) ASSERT_NEAR(p1[i], p2[i], 1e-5) << i;
}

}  // namespace
}  // namespace oscar::backend::cpu
