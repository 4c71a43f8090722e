// Accuracy evaluation of KV cache methods (DESIGN §6.2) by prefill
// simulation: one dense teacher-forced forward per method and text window
// (model/calib_forward.h) in which every layer quantizes all its K/V rows once
// and query t sees
//   the dequantized rows for the positions its cache would hold quantized
//   (page-granular: [S0, S0 + mid(t)) with mid(t) = page * floor((t - S0 - W) / page),
//    the cache's state after committing tokens 0..t-1; kivi2 too, with S0 = 0,
//    W = 128 and its keys quantized per channel over 32-token spans of the pages),
//   BF16-rounded rows everywhere else,
// which is exactly what the real token-by-token decode path over
// kv::OscarKvCache computes (tests/eval/test_oscar_sim.cpp checks it, for
// kivi2 too).
//
// Metrics, on the scored positions (queries that attend to quantized history:
// t >= S0 + W + page by default), against the BF16 cache:
//   k_err, v_err     relative MSE of the quantized K / V rows (rotation-invariant,
//                    so equal in the original basis)
//   logit_err        relative MSE of the attention logits, attn_kl the mean
//                    KL(softmax_bf16 || softmax_quant) per (query, head)
//   o_err            relative MSE of the attention output (before o_proj)
//   proj_err         relative MSE of the attention block's output after o_proj,
//                    W_o·o_quant vs W_o·o_bf16 (basis-free: the folded W_o of a
//                    value rotation maps the rotated o to the same vector)
//   (these four "local" errors compare, at each layer, the quantized attention
//    with BF16 attention on the same, already perturbed, inputs)
//   hidden_err       relative MSE of the final hidden state (propagated error)
//   ppl, kl, top1    perplexity, mean KL(p_bf16 || p_quant) of next-token
//                    distributions, top-1 agreement with BF16
//   bpe              bits per cached element at T = ctx (DESIGN §5.4)
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kv/quant_methods.h"
#include "backend/backend.h"
#include "model/calib_forward.h"
#include "model/weights.h"

namespace oscar::eval {

// Quantized positions [begin, end) that query t sees under method m.
struct LoRange {
  int begin = 0, end = 0;
};
LoRange quantized_range(const kv::KvMethod& m, int t, int page_size);

struct EvalOptions {
  std::vector<int> ctx = {2048};
  int windows = 1;     // disjoint text windows per context length
  int page_size = 64;  // the cache's page (demotion granularity)
  int score_from = -1; // first scored position; -1 = sink + recent + page
  // RoPE position of each window's first token. Attention depends only on relative positions,
  // so the BF16 reference does not change, but the cached keys carry the phases of positions
  // first_position.. : a 4K window at first_position 28K tests what the cache does with the
  // keys of the end of a 32K context, at the cost of a 4K evaluation.
  int64_t first_position = 0;
  backend::WeightDtype weights = backend::WeightDtype::kF32;
  int threads = 0;
};

struct EvalResult {
  std::string method;
  int ctx = 0, windows = 0;
  int64_t positions = 0;  // scored next-token predictions
  double bpe = 0, ppl = 0, nll = 0, kl = 0, top1 = 0;
  double k_err = 0, v_err = 0, logit_err = 0, attn_kl = 0, o_err = 0, proj_err = 0,
         hidden_err = 0;
};

using EvalProgress = std::function<void(const std::string& msg)>;

// Evaluates every method at every context length on windows of `tokens`.
// The BF16 reference runs once per window. Throws oscar::Error when the text
// is shorter than ctx * windows tokens.
std::vector<EvalResult> evaluate(const model::ModelWeights& w,
                                 const std::vector<kv::KvMethod>& methods,
                                 const std::vector<int32_t>& tokens, const EvalOptions& opts,
                                 const EvalProgress& progress = nullptr);

// The simulation of one method on one sequence: final hidden states
// [T][hidden] (before the output norm). `w` must already have the method's
// value rotation folded in (model/fold_rotation.h) when m.folds_values().
// Local error sums go to `sums` when non-null (scored from `score_from`).
struct LocalErrorSums {
  double k_num = 0, k_den = 0, v_num = 0, v_den = 0;
  double logit_num = 0, logit_den = 0, o_num = 0, o_den = 0;
  double proj_num = 0, proj_den = 0;  // after o_proj, over all layers and scored rows
  double attn_kl = 0;
  int64_t attn_rows = 0;
};
void simulate(model::DenseForward& fwd, const kv::KvMethod& m, std::span<const int32_t> tokens,
              int page_size, int score_from, std::vector<float>& hidden, LocalErrorSums* sums,
              int64_t first_position = 0);

// Teacher-forced evaluation through the real engine (model/forward.h over each method's
// paged cache, on `device`: "cpu", "cuda" or "cuda:N"): every window is prefilled in chunks of
// `chunk` tokens with the logits of every position. A chunk's queries read the earlier chunks
// as the cache holds them (sink / INT2 middle / recent) and their own chunk in full precision,
// which is what a serving engine computes for a prompt; with chunk = 1 it is the token-by-token
// decode the simulation equals (tests/eval). The reference is the engine with the BF16 cache.
// Gives ppl, KL and top-1 (and bpe); the local errors need the simulation and stay 0. What it
// adds: contexts the CPU simulation cannot reach (32K+ on a GPU). The positions start at 0.
struct EngineEvalOptions {
  std::vector<int> ctx = {2048};
  int windows = 1;
  int page_size = 64;
  int score_from = -1;  // -1: as evaluate() (sink + recent + page of the first windowed method)
  int chunk = 256;      // prefill tokens per engine step
  std::string device = "cpu";
  backend::WeightDtype weights = backend::WeightDtype::kBf16;
  int threads = 0;
};
std::vector<EvalResult> evaluate_engine(const model::ModelWeights& w,
                                        const std::vector<kv::KvMethod>& methods,
                                        const std::vector<int32_t>& tokens,
                                        const EngineEvalOptions& opts,
                                        const EvalProgress& progress = nullptr);

// Table (fixed-width text) and JSON of results.
std::string format_table(const std::vector<EvalResult>& r);
std::string to_json(const std::vector<EvalResult>& r, const std::string& extra_json_fields = "");

}  // namespace oscar::eval
