// Host sampling cost per token (engine/sampler.h) at a real vocabulary, against the previous
// sampler's draw (engine::reference_sample: every id sorted by logit, or the top_k by a partial
// sort, and the softmax over all of them) in the same run,
// and a batch of rows through sample_rows (the CPU thread pool) against the same rows drawn
// one after the other.
//
//   bench_sampler [--vocab 151936] [--rows 32] [--reps 20]
//
// The logits: N(0, 3) per id, flat, or the same with one id 25 above the rest (a peaked row,
// what a trained model mostly gives). Same tokens from both draws (checked).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/ops_threads.h"
#include "engine/sampler.h"

using namespace oscar;
using Clock = std::chrono::steady_clock;

namespace {

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

}  // namespace

int main(int argc, char** argv) {
  int V = 151936, rows = 32, reps = 20;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::atoi(argv[++i]) : 0; };
    if (a == "--vocab") V = next();
    else if (a == "--rows") rows = next();
    else if (a == "--reps") reps = next();
    else {
      std::fprintf(stderr, "usage: bench_sampler [--vocab N] [--rows R] [--reps N]\n");
      return 2;
    }
  }
  if (V < 2 || rows < 1 || reps < 1) {
    std::fprintf(stderr, "bench_sampler: --vocab >= 2, --rows >= 1, --reps >= 1\n");
    return 2;
  }
  std::mt19937 gen(1);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> flat(static_cast<size_t>(V));
  for (float& x : flat) x = nd(gen);
  std::vector<float> peaked = flat;
  peaked[size_t(V) / 3] = 25.0f;
  struct Config {
    const char* name;
    engine::SamplingParams p;
  } configs[] = {
      {"T 0.7, top_p 0.9", {0.7f, 0, 0.9f, 1.0f, 7}},
      {"T 1.0", {1.0f, 0, 1.0f, 1.0f, 7}},
      {"T 0.7, top_k 40", {0.7f, 40, 1.0f, 1.0f, 7}},
      {"T 0.7, top_p 0.95, top_k 50", {0.7f, 50, 0.95f, 1.0f, 7}},
  };
  std::printf("vocab %d, %d reps per row, %d op threads\n\n", V, reps, backend::cpu::op_threads());
  std::printf("| sampling | logits | previous (ms/token) | sampler (ms/token) | speedup |\n|---|---|---|---|---|\n");
  int mismatches = 0;
  for (const Config& c : configs)
    for (int pk = 0; pk < 2; ++pk) {
      const std::vector<float>& l = pk ? peaked : flat;
      std::mt19937_64 rng(c.p.seed);
      std::vector<int> ref(static_cast<size_t>(reps)), got(static_cast<size_t>(reps));
      auto t0 = Clock::now();
      for (int r = 0; r < reps; ++r) ref[size_t(r)] = engine::reference_sample(c.p, rng, l, {});
      const double t_ref = ms_since(t0) / reps;
      engine::Sampler s(c.p);
      t0 = Clock::now();
      for (int r = 0; r < reps; ++r) got[size_t(r)] = s.sample(l, {});
      const double t_new = ms_since(t0) / reps;
      mismatches += ref != got;
      std::printf("| %s | %s | %.3f | %.3f | %.1f× |\n", c.name, pk ? "peaked" : "flat", t_ref, t_new, t_ref / t_new);
    }
  // A batch of rows: serial draws against sample_rows, the same samplers' seeds.
  const engine::SamplingParams p{0.7f, 0, 0.9f, 1.0f, 11};
  std::vector<float> logits(size_t(rows) * size_t(V));
  for (int r = 0; r < rows; ++r)
    std::copy(peaked.begin(), peaked.end(), logits.begin() + std::ptrdiff_t(size_t(r) * size_t(V)));
  const engine::Sampler proto(p);
  std::vector<engine::Sampler> a(static_cast<size_t>(rows), proto), b(static_cast<size_t>(rows), proto);
  std::vector<int> serial(static_cast<size_t>(rows));
  auto t0 = Clock::now();
  for (int rep = 0; rep < reps; ++rep)
    for (int r = 0; r < rows; ++r)
      serial[size_t(r)] = a[size_t(r)].sample({logits.data() + size_t(r) * size_t(V), size_t(V)}, {});
  const double t_serial = ms_since(t0) / reps;
  std::vector<engine::SampleJob> jobs(static_cast<size_t>(rows));
  t0 = Clock::now();
  for (int rep = 0; rep < reps; ++rep) {
    for (int r = 0; r < rows; ++r) {
      jobs[size_t(r)] = {};
      jobs[size_t(r)].sampler = &b[size_t(r)];
      jobs[size_t(r)].logits = {logits.data() + size_t(r) * size_t(V), size_t(V)};
    }
    engine::sample_rows(jobs);
  }
  const double t_rows = ms_since(t0) / reps;
  for (int r = 0; r < rows; ++r) mismatches += jobs[size_t(r)].token != serial[size_t(r)];
  std::printf("\n| %d rows (T 0.7, top_p 0.9, peaked) | serial (ms/step) | sample_rows (ms/step) | speedup |\n|---|---|---|---|\n",
              rows);
  std::printf("| | %.3f | %.3f | %.1f× |\n", t_serial, t_rows, t_serial / t_rows);
  if (mismatches) {
    std::printf("\nMISMATCH: %d configurations drew different tokens\n", mismatches);
    return 1;
  }
  std::printf("\nsame tokens from both draws in every configuration\n");
  return 0;
}
