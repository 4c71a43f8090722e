// Teacher-forced evaluation through the real engine (eval.h, evaluate_engine).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "backend/cpu/ops_threads.h"
#include "core/error.h"
#include "engine/session.h"
#include "eval/eval.h"
#include "eval/scoring.h"
#include "model/forward.h"

namespace oscar::eval {

std::vector<EvalResult> evaluate_engine(const model::ModelWeights& w,
                                        const std::vector<kv::KvMethod>& methods,
                                        const std::vector<int32_t>& tokens,
                                        const EngineEvalOptions& opts, const EvalProgress& progress) {
  const int V = w.cfg.vocab_size, M = int(methods.size());
  if (opts.chunk <= 0) throw Error(fmt::format("eval: prefill chunk {} must be positive", opts.chunk));
  if (M == 0) throw Error("eval: no method to evaluate");
  detail::check_windows(opts.ctx, opts.windows, tokens.size());
  const int score_from = detail::first_scored(methods, opts.score_from, opts.page_size);
  // The BF16 reference engine stays; the methods' engines are made one at a time (host
  // memory: a 1.5B model's engine is ~3 GB in BF16), each run in lockstep with the reference
  // so that each chunk's reference log-probabilities serve the method's KL without being stored.
  kv::KvMethod bf16;
  bf16.label = "bf16";
  engine::PreparedModel ref = engine::prepare_model(w, bf16, opts.device, opts.weights, opts.threads);

  const size_t C = opts.ctx.size();
  detail::TokenScores ts(M, C);
  // One scored row: the reference's log p(target), and the method's −log p(target), KL and
  // top-1 agreement (detail::score_row from zero).
  struct RowScore {
    double ref = 0, nll = 0, kl = 0, top1 = 0;
  };
  std::vector<RowScore> rows;
  std::vector<float> lr, lm;
  for (int mi = 0; mi < M; ++mi) {
    const kv::KvMethod& km = methods[size_t(mi)];
    engine::PreparedModel me = engine::prepare_model(w, km, opts.device, opts.weights, opts.threads);
    engine::PreparedModel* eng[2] = {&ref, &me};
    const kv::KvMethod* kms[2] = {&bf16, &km};
    for (size_t ci = 0; ci < C; ++ci) {
      const int ctx = opts.ctx[ci];
      for (int win = 0; win < opts.windows; ++win) {
        const int32_t* seq = tokens.data() + int64_t(win) * ctx;
        std::unique_ptr<kv::KvCache> caches[2];
        kv::SeqId ids[2];
        for (int e = 0; e < 2; ++e) {
          // Every chunk reads the earlier ones as the cache stores them (no BF16 prompt): the
          // measurement is of what decode steps read.
          kv::KvMethod cm = *kms[e];
          cm.prompt_bf16 = false;
          caches[e] = kv::make_method_cache(cm, eng[e]->model->cache_shape(opts.page_size),
                                            int64_t(ctx) + opts.chunk + 2 * opts.page_size, false,
                                            eng[e]->backend->page_store_factory());
          ids[e] = caches[e]->create();
        }
        for (int t0 = 0; t0 < ctx; t0 += opts.chunk) {
          const int n = std::min(opts.chunk, ctx - t0);
          if (progress)
            progress(fmt::format("{}: ctx {} window {}: tokens {}-{} of {}", km.label, ctx, win + 1, t0, t0 + n,
                                 ctx));
          auto step = [&](int e, std::vector<float>& out) {
            const model::SeqStep st{ids[e], std::span<const int32_t>(seq + t0, size_t(n)), true};
            eng[e]->model->forward(std::span<const model::SeqStep>(&st, 1), *caches[e], out);
            if (out.size() != size_t(n) * V)
              throw Error(fmt::format("eval: engine returned {} logits for {} tokens", out.size(), n));
          };
          step(0, lr);
          step(1, lm);
          // Scored rows of this chunk: position t predicts t + 1 (the reference counted once).
          // Each row's two log-softmaxes over the vocabulary are most of the host's time when
          // the engine runs on a GPU: rows in parallel (op threads), summed in row order, so
          // the sums are those of a serial loop whatever the thread count.
          const int r0 = std::max(t0, score_from), r1 = std::min(t0 + n, ctx - 1);
          if (r1 > r0) {
            rows.assign(size_t(r1 - r0), RowScore{});
            backend::cpu::parallel_for(r1 - r0, 1, [&](int64_t i0, int64_t i1) {
              thread_local std::vector<double> logp;
              logp.resize(size_t(V));
              for (int64_t i = i0; i < i1; ++i) {
                const int t = r0 + int(i);
                RowScore& rs = rows[size_t(i)];
                const int ref_top = detail::ref_log_probs(lr.data() + size_t(t - t0) * V, V, logp.data());
                rs.ref = logp[size_t(seq[t + 1])];
                detail::score_row(logp.data(), ref_top, lm.data() + size_t(t - t0) * V, V, seq[t + 1], rs.nll,
                                  rs.kl, rs.top1);
              }
            });
            for (const RowScore& rs : rows) {
              if (mi == 0) {
                ts.ref_nll[ci] -= rs.ref;
                ts.npos[ci] += 1;
              }
              ts.nll[size_t(mi)][ci] += rs.nll;
              ts.kl[size_t(mi)][ci] += rs.kl;
              ts.top1[size_t(mi)][ci] += rs.top1;
            }
          }
        }
      }
    }
  }
  return detail::result_rows(ts, methods, opts.ctx, opts.windows, w.cfg.head_dim, opts.page_size);
}

}  // namespace oscar::eval
