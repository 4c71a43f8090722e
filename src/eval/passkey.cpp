#include "eval/passkey.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>

#include "core/error.h"
#include "engine/generator.h"
#include "engine/session.h"
#include "model/fold_rotation.h"
#include "model/forward.h"

namespace oscar::eval {

namespace {

// A model + cache of one method, in the engine's real serving path (on the
// CPU or a GPU: engine::prepare_model, the assembly generate and serve use).
struct Engine {
  engine::PreparedModel pm;
  Engine(const model::ModelWeights& w, const kv::KvMethod& km, const PasskeyOptions& o)
      : pm(engine::prepare_model(w, km, o.device, o.weights, 0)) {}
  // Greedy continuation of `prompt` by `n` tokens through a fresh cache.
  std::vector<int> greedy(const kv::KvMethod& km, const std::vector<int>& prompt, int n,
                          int page, int chunk) {
    model::Model& m = *pm.model;
    auto cache = kv::make_method_cache(km, m.cache_shape(page), int64_t(prompt.size()) + n + 2 * page,
                                       false, pm.backend->page_store_factory());
    engine::Generator g(m, *cache, nullptr, chunk);
    engine::Request r;
    r.prompt = prompt;
    r.max_new_tokens = n;
    r.sampling.temperature = 0.0f;
    std::vector<engine::Request> reqs{r};
    return g.run(reqs)[0].tokens;
  }
};

}  // namespace

std::vector<int> passkey_prompt(const model::Tokenizer& tok, const std::vector<int>& hay, int ctx,
                                double depth, const std::string& key, size_t offset) {
  const std::vector<int> intro = tok.encode(
      "There is an important piece of information hidden inside a lot of irrelevant text. "
      "Find it and memorize it. I will quiz you about it.\n\n");
  const std::vector<int> needle =
      tok.encode("\n\nThe pass key is " + key + ". Remember it. " + key + " is the pass key.\n\n");
  const std::vector<int> question = tok.encode("\n\nWhat is the pass key? The pass key is");
  const int fill = ctx - int(intro.size() + needle.size() + question.size());
  if (fill < 16) throw Error(fmt::format("passkey: context {} is too short for the prompt", ctx));
  if (hay.size() < size_t(fill) + 1) throw Error(fmt::format("passkey: haystack has {} tokens, {} needed", hay.size(), fill));
  offset %= hay.size() - size_t(fill);
  const int at = int(depth * fill);
  std::vector<int> p = intro;
  p.insert(p.end(), hay.begin() + offset, hay.begin() + offset + at);
  p.insert(p.end(), needle.begin(), needle.end());
  p.insert(p.end(), hay.begin() + offset + at, hay.begin() + offset + fill);
  p.insert(p.end(), question.begin(), question.end());
  return p;
}

std::vector<PasskeyResult> run_passkey(const model::ModelWeights& w, const model::Tokenizer& tok,
                                       const std::string& haystack,
                                       const std::vector<kv::KvMethod>& methods,
                                       const PasskeyOptions& opts, const LongProgress& progress,
                                       const PasskeyPartial& on_method) {
  const std::vector<int> hay = tok.encode(haystack);
  // The same prompts for every method.
  struct Case {
    int ctx;
    double depth;
    std::string key;
    std::vector<int> prompt;
  };
  std::vector<Case> cases;
  std::mt19937_64 rng(opts.seed);
  for (int ctx : opts.ctx)
    for (double d : opts.depths)
      for (int t = 0; t < opts.trials; ++t) {
        const std::string key = std::to_string(10000 + rng() % 90000);
        const size_t off = size_t(rng() % 1000003);
        cases.push_back({ctx, d, key, passkey_prompt(tok, hay, ctx, d, key, off)});
      }
  std::vector<PasskeyResult> out;
  for (const kv::KvMethod& km : methods) {
    Engine e(w, km, opts);
    std::map<std::pair<int, double>, PasskeyResult> agg;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      if (progress) progress(fmt::format("passkey {}: ctx {} depth {:.2f} ({}/{})", km.label, c.ctx, c.depth, i + 1, cases.size()));
      const std::vector<int> gen = e.greedy(km, c.prompt, 8, opts.page_size, opts.prefill_chunk);
      const std::string text = tok.decode(gen, true);
      PasskeyResult& r = agg[{c.ctx, c.depth}];
      r.method = km.label;
      r.ctx = c.ctx;
      r.depth = c.depth;
      const bool ok = text.find(c.key) != std::string::npos;
      r.trials += 1;
      r.correct += ok;
      r.hits.push_back(ok);
    }
    for (auto& [k, r] : agg) out.push_back(r);
    if (on_method) on_method(out);
  }
  return out;
}

std::vector<AgreementResult> run_agreement(const model::ModelWeights& w,
                                           const std::vector<int32_t>& tokens,
                                           const std::vector<kv::KvMethod>& methods,
                                           const std::vector<int>& ctxs, int prompts, int new_tokens,
                                           const PasskeyOptions& opts, const LongProgress& progress) {
  kv::KvMethod bf16;
  bf16.label = "bf16";
  std::map<std::pair<int, int>, std::vector<int>> ref;  // (ctx, prompt) -> tokens
  Engine eb(w, bf16, opts);
  auto prompt_of = [&](int ctx, int p) {
    if (int64_t(ctx) * (p + 1) > int64_t(tokens.size()))
      throw Error(fmt::format("agreement: text too short for {} prompts of {} tokens", prompts, ctx));
    return std::vector<int>(tokens.begin() + int64_t(ctx) * p, tokens.begin() + int64_t(ctx) * (p + 1));
  };
  for (int ctx : ctxs)
    for (int p = 0; p < prompts; ++p) {
      if (progress) progress(fmt::format("agreement bf16: ctx {} prompt {}", ctx, p + 1));
      ref[{ctx, p}] = eb.greedy(bf16, prompt_of(ctx, p), new_tokens, opts.page_size, opts.prefill_chunk);
    }
  std::vector<AgreementResult> out;
  for (const kv::KvMethod& km : methods) {
    if (km.kind == kv::KvMethod::Kind::kBf16) continue;
    Engine e(w, km, opts);
    for (int ctx : ctxs) {
      AgreementResult r;
      r.method = km.label;
      r.ctx = ctx;
      r.prompts = prompts;
      r.new_tokens = new_tokens;
      int64_t same = 0, total = 0;
      for (int p = 0; p < prompts; ++p) {
        if (progress) progress(fmt::format("agreement {}: ctx {} prompt {}", km.label, ctx, p + 1));
        const std::vector<int> g = e.greedy(km, prompt_of(ctx, p), new_tokens, opts.page_size, opts.prefill_chunk);
        const std::vector<int>& b = ref[{ctx, p}];
        const size_t n = std::min(g.size(), b.size());
        size_t pre = 0;
        while (pre < n && g[pre] == b[pre]) ++pre;
        for (size_t i = 0; i < n; ++i) same += g[i] == b[i];
        total += int64_t(std::max(g.size(), b.size()));
        r.prefix_len += double(pre) / prompts;
      }
      r.match_rate = total ? double(same) / total : 0.0;
      out.push_back(r);
    }
  }
  return out;
}

Interval wilson_interval(int k, int n, double z) {
  if (k < 0 || n < 0 || k > n || !(z > 0))
    throw Error(fmt::format("wilson_interval: {} successes of {} trials (z {})", k, n, z));
  if (n == 0) return {0.0, 1.0};
  const double p = double(k) / n, z2 = z * z, den = 1.0 + z2 / n;
  const double c = (p + z2 / (2.0 * n)) / den;
  const double h = z * std::sqrt(p * (1.0 - p) / n + z2 / (4.0 * n * n)) / den;
  return {std::max(0.0, c - h), std::min(1.0, c + h)};
}

std::string format_passkey(const std::vector<PasskeyResult>& rs) {
  std::string s = fmt::format("{:<22} {:>6} {:>6} {:>8}\n", "method", "ctx", "depth", "correct");
  for (const PasskeyResult& r : rs)
    s += fmt::format("{:<22} {:>6} {:>6.2f} {:>4}/{:<3}\n", r.method, r.ctx, r.depth, r.correct, r.trials);
  // Per method and context: accuracy over depths with a 95 % Wilson interval,
  // and, when bf16 ran on the same prompts, the paired view: of the prompts
  // BF16 solves, how many the method solves too (and how many BF16 misses it solves).
  struct Acc {
    int correct = 0, trials = 0;
    std::vector<uint8_t> hits;  // over depths, in order
  };
  std::map<std::pair<std::string, int>, Acc> acc;
  std::vector<std::pair<std::string, int>> order;
  for (const PasskeyResult& r : rs) {
    auto key = std::make_pair(r.method, r.ctx);
    if (!acc.count(key)) order.push_back(key);
    Acc& a = acc[key];
    a.correct += r.correct;
    a.trials += r.trials;
    a.hits.insert(a.hits.end(), r.hits.begin(), r.hits.end());
  }
  s += fmt::format("\n{:<22} {:>6} {:>9} {:>17} {:>16} {:>14}\n", "method", "ctx", "accuracy",
                   "95% CI (Wilson)", "of bf16's solved", "bf16 missed");
  for (auto& k : order) {
    const Acc& a = acc[k];
    const Interval ci = wilson_interval(a.correct, a.trials);
    std::string paired = "-", extra = "-";
    auto ref = acc.find({"bf16", k.second});
    if (ref != acc.end() && ref->second.hits.size() == a.hits.size() && !a.hits.empty()) {
      int both = 0, ref_ok = 0, only = 0;
      for (size_t i = 0; i < a.hits.size(); ++i) {
        ref_ok += ref->second.hits[i];
        both += ref->second.hits[i] && a.hits[i];
        only += !ref->second.hits[i] && a.hits[i];
      }
      paired = fmt::format("{}/{}", both, ref_ok);
      extra = fmt::format("+{}", only);
    }
    s += fmt::format("{:<22} {:>6} {:>5}/{:<3} {:>6.1f}-{:<5.1f}%  {:>16} {:>14}\n", k.first, k.second,
                     a.correct, a.trials, 100.0 * ci.lo, 100.0 * ci.hi, paired, extra);
  }
  return s;
}

std::string format_agreement(const std::vector<AgreementResult>& rs) {
  std::string s = fmt::format("{:<22} {:>6} {:>8} {:>10} {:>12}\n", "method", "ctx", "prompts",
                              "match", "prefix len");
  for (const AgreementResult& r : rs)
    s += fmt::format("{:<22} {:>6} {:>8} {:>9.1f}% {:>8.1f}/{}\n", r.method, r.ctx, r.prompts,
                     100.0 * r.match_rate, r.prefix_len, r.new_tokens);
  return s;
}

}  // namespace oscar::eval
