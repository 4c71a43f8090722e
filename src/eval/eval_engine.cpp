// Teacher-forced evaluation through the real engine (eval.h, evaluate_engine).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

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
  // One engine per method and the BF16 reference, all alive, so that each chunk's reference
  // log-probabilities are computed once and compared with every method's at once.
  kv::KvMethod bf16;
  bf16.label = "bf16";
  std::vector<engine::PreparedModel> eng;
  eng.push_back(engine::prepare_model(w, bf16, opts.device, opts.weights, opts.threads));
  for (const kv::KvMethod& m : methods)
    eng.push_back(engine::prepare_model(w, m, opts.device, opts.weights, opts.threads));

  const size_t C = opts.ctx.size();
  std::vector<double> ref_nll(C, 0);
  std::vector<int64_t> npos(C, 0);
  std::vector<std::vector<double>> nll(M, std::vector<double>(C, 0)), kl = nll, top1 = nll;
  std::vector<double> logp;
  std::vector<float> lr, lm;
  for (size_t ci = 0; ci < C; ++ci) {
    const int ctx = opts.ctx[ci];
    for (int win = 0; win < opts.windows; ++win) {
      const int32_t* seq = tokens.data() + int64_t(win) * ctx;
      // A fresh cache per engine and window.
      std::vector<std::unique_ptr<kv::KvCache>> caches;
      std::vector<kv::SeqId> ids;
      for (int e = 0; e <= M; ++e) {
        const kv::KvMethod& km = e == 0 ? bf16 : methods[size_t(e - 1)];
        model::Model& mdl = *eng[size_t(e)].model;
        caches.push_back(kv::make_method_cache(km, mdl.cache_shape(opts.page_size),
                                               int64_t(ctx) + opts.chunk + 2 * opts.page_size, false,
                                               eng[size_t(e)].backend->page_store_factory()));
        ids.push_back(caches.back()->create());
      }
      for (int t0 = 0; t0 < ctx; t0 += opts.chunk) {
        const int n = std::min(opts.chunk, ctx - t0);
        if (progress)
          progress(fmt::format("ctx {} window {}: tokens {}-{} of {}", ctx, win + 1, t0, t0 + n, ctx));
        auto step = [&](int e, std::vector<float>& out) {
          const model::SeqStep st{ids[size_t(e)], std::span<const int32_t>(seq + t0, size_t(n)), true};
          eng[size_t(e)].model->forward(std::span<const model::SeqStep>(&st, 1), *caches[size_t(e)], out);
          if (out.size() != size_t(n) * V)
            throw Error(fmt::format("eval: engine returned {} logits for {} tokens", out.size(), n));
        };
        step(0, lr);
        // Scored rows of this chunk: position t predicts t + 1.
        const int r0 = std::max(t0, score_from), r1 = std::min(t0 + n, ctx - 1);
        if (r1 <= r0) {
          for (int e = 1; e <= M; ++e) step(e, lm);  // the caches advance all the same
          continue;
        }
        logp.assign(size_t(r1 - r0) * V, 0.0);
        std::vector<int> ref_top(size_t(r1 - r0));
        for (int t = r0; t < r1; ++t) {
          const float* z = lr.data() + size_t(t - t0) * V;
          double mx = *std::max_element(z, z + V), s = 0;
          for (int j = 0; j < V; ++j) s += std::exp(double(z[j]) - mx);
          const double lse = mx + std::log(s);
          double* lp = logp.data() + size_t(t - r0) * V;
          for (int j = 0; j < V; ++j) lp[j] = z[j] - lse;
          ref_top[size_t(t - r0)] = int(std::max_element(z, z + V) - z);
          ref_nll[ci] -= lp[seq[t + 1]];
        }
        npos[ci] += r1 - r0;
        for (int e = 1; e <= M; ++e) {
          step(e, lm);
          for (int t = r0; t < r1; ++t) {
            const float* z = lm.data() + size_t(t - t0) * V;
            double mx = *std::max_element(z, z + V), s = 0;
            for (int j = 0; j < V; ++j) s += std::exp(double(z[j]) - mx);
            const double lse = mx + std::log(s);
            const double* lp = logp.data() + size_t(t - r0) * V;
            double k = 0;
            for (int j = 0; j < V; ++j) k += std::exp(lp[j]) * (lp[j] - (z[j] - lse));
            kl[size_t(e - 1)][ci] += std::max(0.0, k);
            nll[size_t(e - 1)][ci] -= z[seq[t + 1]] - lse;
            top1[size_t(e - 1)][ci] += int(std::max_element(z, z + V) - z) == ref_top[size_t(t - r0)];
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
