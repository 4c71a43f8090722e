// The host's bookkeeping of one decode step, the part a GPU waits for between steps (the step
// ends with the tokens on the host; the next one's tables are built before its first launch):
// the cache's tables (KvCache::make_batch), the rows' placement (KvCache::place), the CUDA
// decode plan (kernels::cuda::plan_decode, host code), and the penalty bookkeeping of the
// engine's step (engine::PenaltyIds: the repetition penalty's ids with penalty slots and as
// whole lists, the presence / frequency penalties' counts; each with the histories compared with
// the ones kept, and as the scheduler runs them, on its promise that they only grow), each row's
// history growing by one token a step as in serving.
//
//   bench_step_host [--steps N] [--history N]
//
// Caches: int2-hadamard (BF16 windows + INT2 middle; the tables are those of any 2-bit method)
// on one layer and one KV head of 64 dims in host memory: the tables do not depend on the shape.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/step_draw.h"
#include "kernels/cuda/decode_plan.h"
#include "kv/kv_cache.h"
#include "kv/quant_methods.h"

using namespace oscar;
using Clock = std::chrono::steady_clock;

namespace {

double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }

}  // namespace

int main(int argc, char** argv) {
  int steps = 50, history = 8192;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::atoi(argv[++i]) : 0; };
    if (a == "--steps") steps = next();
    else if (a == "--history") history = next();
    else {
      std::fprintf(stderr, "usage: bench_step_host [--steps N] [--history N]\n");
      return 2;
    }
  }
  constexpr int kVocab = 151936, kSms = 132, kKvHeads = 8;
  const kv::KvCacheShape shape{1, 1, 64, 64};
  kv::KvMethodOptions o;
  o.model.architecture = "llama";
  o.model.n_layers = 1, o.model.n_q_heads = 1, o.model.n_kv_heads = 1, o.model.head_dim = 64;
  const kv::KvMethod method = kv::resolve_kv_method("int2-hadamard", o);
  std::printf("host work of one decode step, mean over %d steps after the requests' first (plan: %d SMs, %d KV "
              "heads; penalties: %d-id histories, vocabulary %d)\n\n",
              steps, kSms, kKvHeads, history, kVocab);
  std::printf("| batch × context | make_batch | place | plan_decode | penalty ids, slots | penalty ids, whole "
              "lists (ids sent) | generated counts (pairs sent) | counts + ids (slots), appending |\n"
              "|---|---|---|---|---|---|---|---|\n");
  for (auto [B, C] : std::vector<std::pair<int, int>>{{1, 102400}, {8, 32768}, {64, 32768}, {128, 8192}}) {
    auto cache = kv::make_method_cache(method, shape, int64_t(B) * (C + steps + 256));
    std::vector<float> k(size_t(64) * 64, 0.1f), v(k);
    std::vector<kv::SeqId> seqs;
    for (int b = 0; b < B; ++b) {
      seqs.push_back(cache->create());
      cache->fill_with_rows(seqs.back(), C, k.data(), v.data(), 64);
    }
    // Histories: `history` tokens each (the prompt the last 1/4), growing by one a step.
    std::vector<std::vector<int>> hist(static_cast<size_t>(B));
    for (int b = 0; b < B; ++b)
      for (int j = 0; j < history; ++j) hist[size_t(b)].push_back(int((int64_t(j) * 7919 + b * 31) % kVocab));
    engine::PenaltyIds slots_ids, whole_ids, counts, sched;
    kv::KvBatch batch;
    backend::RowPlacement rows;
    std::vector<int> lens(static_cast<size_t>(B));
    double t_batch = 0, t_place = 0, t_plan = 0, t_slots = 0, t_whole = 0, t_counts = 0, t_sched = 0;
    int64_t sent_whole = 0, sent_pairs = 0;
    for (int s = -1; s < steps; ++s) {  // step -1: the requests' first (ids, counts taken whole), not timed
      if (s == 0) t_batch = t_place = t_plan = t_slots = t_whole = t_counts = t_sched = 0, sent_whole = sent_pairs = 0;
      for (int b = 0; b < B; ++b) {
        cache->reserve(seqs[size_t(b)], 1);
        lens[size_t(b)] = cache->length(seqs[size_t(b)]) + 1;
      }
      auto t0 = Clock::now();
      cache->make_batch(seqs, lens, batch);
      t_batch += us_since(t0);
      t0 = Clock::now();
      rows.clear();
      for (int b = 0; b < B; ++b) cache->place(seqs[size_t(b)], lens[size_t(b)] - 1, 1, rows);
      t_place += us_since(t0);
      t0 = Clock::now();
      kernels::cuda::HostRegions hr;
      hr.len[0] = batch.sink_len.data(), hr.len[1] = batch.mid_len.data(), hr.len[2] = batch.recent_len.data();
      hr.indptr[0] = batch.sink_indptr.data(), hr.indptr[1] = batch.mid_indptr.data();
      hr.indptr[2] = batch.recent_indptr.data();
      const kernels::cuda::DecodePlan plan = kernels::cuda::plan_decode(B, hr, kKvHeads, kSms);
      t_plan += us_since(t0);
      if (plan.num_chunks <= 0) std::fprintf(stderr, "no plan\n");
      // Penalties: every row penalized, its history one token longer than the step before.
      slots_ids.begin_step(), whole_ids.begin_step(), counts.begin_step(), sched.begin_step();
      t0 = Clock::now();
      for (int b = 0; b < B; ++b) (void)slots_ids.row(&hist[size_t(b)], hist[size_t(b)], kVocab, 4096);
      slots_ids.commit();
      t_slots += us_since(t0);
      t0 = Clock::now();
      for (int b = 0; b < B; ++b) sent_whole += int64_t(whole_ids.row(&hist[size_t(b)], hist[size_t(b)], kVocab, 0).ids.size());
      t_whole += us_since(t0);
      t0 = Clock::now();
      for (int b = 0; b < B; ++b)
        sent_pairs += int64_t(counts.generated(&hist[size_t(b)], hist[size_t(b)], history * 3 / 4, kVocab).size() / 2);
      t_counts += us_since(t0);
      t0 = Clock::now();  // the engine's step for a sampler with both: counts, then ids (slots), appends
      for (int b = 0; b < B; ++b) {
        (void)sched.generated(&hist[size_t(b)], hist[size_t(b)], history * 3 / 4, kVocab, uint64_t(b + 1), true);
        (void)sched.row(&hist[size_t(b)], hist[size_t(b)], kVocab, 4096, uint64_t(b + 1), true);
      }
      sched.commit();
      t_sched += us_since(t0);
      for (int b = 0; b < B; ++b) {
        cache->commit(seqs[size_t(b)], 1);
        hist[size_t(b)].push_back(int((int64_t(s + 1) * 104729 + b) % kVocab));
      }
    }
    std::printf("| %d × %d | %.1f µs | %.1f µs | %.1f µs | %.1f µs | %.1f µs (%lld) | %.1f µs (%lld) | %.1f µs |\n", B,
                C, t_batch / steps, t_place / steps, t_plan / steps, t_slots / steps, t_whole / steps,
                (long long)(sent_whole / steps), t_counts / steps, (long long)(sent_pairs / steps), t_sched / steps);
    std::fflush(stdout);
  }
  return 0;
}
