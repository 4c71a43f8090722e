// Next-token scoring shared by the simulation (eval.cpp, evaluate) and the engine evaluation
// (eval_engine.cpp, evaluate_engine): the per-position arithmetic against the BF16 reference and
// the result rows. Internal to eval/.
#pragma once

#include <functional>
#include <vector>

#include "eval/eval.h"

namespace oscar::eval::detail {

// Sums over the scored positions, per context (C) and method (M).
struct TokenScores {
  std::vector<double> ref_nll;                     // [C]
  std::vector<int64_t> npos;                       // [C]
  std::vector<std::vector<double>> nll, kl, top1;  // [M][C]
  TokenScores(int M, size_t C)
      : ref_nll(C, 0.0), npos(C, 0), nll(size_t(M), std::vector<double>(C, 0.0)), kl(nll), top1(nll) {}
};

// Every context length fits `windows` windows of the text (else oscar::Error).
void check_windows(const std::vector<int>& ctx, int windows, size_t tokens);
// The first scored position: `score_from`, or (when < 0) the first query past the first demotion
// of the first windowed (kRow) method, sink + recent + page.
int first_scored(const std::vector<kv::KvMethod>& methods, int score_from, int page_size);

// The reference row: lp [V] = log-softmax(z) (fp64); returns argmax z.
int ref_log_probs(const float* z, int V, double* lp);
// One method's row against the reference row (lp, ref_top) for next token `target`:
// adds −log p(target), KL(p_ref || p) and the top-1 agreement.
void score_row(const double* lp, int ref_top, const float* z, int V, int target, double& nll, double& kl,
               double& top1);

// The result rows, per context: the BF16 reference (unless a method is bf16), then each method
// with ppl, KL, top-1 and bpe; `more(row, method, context)` fills what the caller measured too.
std::vector<EvalResult> result_rows(const TokenScores& s, const std::vector<kv::KvMethod>& methods,
                                    const std::vector<int>& ctx, int windows, int head_dim, int page_size,
                                    const std::function<void(EvalResult&, int, size_t)>& more = nullptr);

}  // namespace oscar::eval::detail
