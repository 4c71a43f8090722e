// Teacher-forced evaluation through the real engine (eval.h, evaluate_engine).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "core/error.h"
#include "engine/session.h"
#include "eval/eval.h"
#include "model/forward.h"

namespace oscar::eval {

std::vector<EvalResult> evaluate_engine(const model::ModelWeights& w,
                                        const std::vector<kv::KvMethod>& methods,
                                        const std::vector<int32_t>& tokens,
                                        const EngineEvalOptions& opts, const EvalProgress& progress) {
  const int V = w.cfg.vocab_size, M = int(methods.size());
  if (opts.chunk <= 0) throw Error(fmt::format("eval: prefill chunk {} must be positive", opts.chunk));
  if (M == 0) throw Error("eval: no method to evaluate");
  for (int ctx : opts.ctx)
    if (ctx < 2 || int64_t(ctx) * opts.windows > int64_t(tokens.size()))
      throw Error(fmt::format("eval: the text has {} tokens; {} window(s) of {} tokens need {}",
                              tokens.size(), opts.windows, ctx, int64_t(ctx) * opts.windows));
  int score_from = opts.score_from;
  if (score_from < 0) {
    score_from = 64 + 256 + opts.page_size;
    for (const kv::KvMethod& m : methods)
      if (m.kind != kv::KvMethod::Kind::kBf16) {
        score_from = m.sink + m.recent + opts.page_size;
        break;
      }
  }
  // The BF16 reference engine stays; the methods' engines are made one at a time (host
  // memory: a 1.5B model's engine is ~3 GB in BF16), each run in lockstep with the reference
  // so that each chunk's reference log-probabilities serve the method's KL without being stored.
  kv::KvMethod bf16;
  bf16.label = "bf16";
  engine::PreparedModel ref = engine::prepare_model(w, bf16, opts.device, opts.weights, opts.threads);

  const size_t C = opts.ctx.size();
  std::vector<double> ref_nll(C, 0);
  std::vector<int64_t> npos(C, 0);
  std::vector<std::vector<double>> nll(M, std::vector<double>(C, 0)), kl = nll, top1 = nll;
  std::vector<double> logp;
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
          caches[e] = kv::make_method_cache(*kms[e], eng[e]->model->cache_shape(opts.page_size),
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
          // Scored rows of this chunk: position t predicts t + 1.
          const int r0 = std::max(t0, score_from), r1 = std::min(t0 + n, ctx - 1);
          for (int t = r0; t < r1; ++t) {
            auto log_softmax = [&](const float* z, std::vector<double>& lp) {
              double mx = *std::max_element(z, z + V), s = 0;
              for (int j = 0; j < V; ++j) s += std::exp(double(z[j]) - mx);
              const double lse = mx + std::log(s);
              lp.resize(size_t(V));
              for (int j = 0; j < V; ++j) lp[size_t(j)] = z[j] - lse;
            };
            const float* zr = lr.data() + size_t(t - t0) * V;
            const float* zm = lm.data() + size_t(t - t0) * V;
            log_softmax(zr, logp);
            double mx = *std::max_element(zm, zm + V), s = 0;
            for (int j = 0; j < V; ++j) s += std::exp(double(zm[j]) - mx);
            const double lse = mx + std::log(s);
            double k = 0;
            for (int j = 0; j < V; ++j) k += std::exp(logp[size_t(j)]) * (logp[size_t(j)] - (zm[j] - lse));
            if (mi == 0) {
              ref_nll[ci] -= logp[size_t(seq[t + 1])];
              npos[ci] += 1;
            }
            kl[size_t(mi)][ci] += std::max(0.0, k);
            nll[size_t(mi)][ci] -= zm[seq[t + 1]] - lse;
            top1[size_t(mi)][ci] += (std::max_element(zm, zm + V) - zm) == (std::max_element(zr, zr + V) - zr);
          }
        }
      }
    }
  }
  std::vector<EvalResult> out;
  for (size_t ci = 0; ci < C; ++ci) {
    const double np = double(std::max<int64_t>(1, npos[ci]));
    EvalResult r;
    r.method = "bf16 (reference)";
    r.ctx = opts.ctx[ci];
    r.windows = opts.windows;
    r.positions = npos[ci];
    r.bpe = 16.0;
    r.nll = ref_nll[ci] / np;
    r.ppl = std::exp(r.nll);
    r.top1 = 1.0;
    bool listed = false;
    for (const kv::KvMethod& m : methods) listed |= m.kind == kv::KvMethod::Kind::kBf16;
    if (!listed) out.push_back(r);
    for (int mi = 0; mi < M; ++mi) {
      EvalResult e;
      e.method = methods[size_t(mi)].label;
      e.ctx = opts.ctx[ci];
      e.windows = opts.windows;
      e.positions = npos[ci];
      e.bpe = methods[size_t(mi)].bits_per_element(e.ctx, w.cfg.head_dim, opts.page_size);
      e.nll = nll[size_t(mi)][ci] / np;
      e.ppl = std::exp(e.nll);
      e.kl = kl[size_t(mi)][ci] / np;
      e.top1 = top1[size_t(mi)][ci] / np;
      out.push_back(e);
    }
  }
  return out;
}

}  // namespace oscar::eval
