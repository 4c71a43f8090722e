// Long-context checks through the REAL engine (Model::forward over the paged
// cache of each method, chunked prefill + token-by-token decode, so demotion
// runs): passkey retrieval and greedy generation agreement with BF16
// (DESIGN §6.2 item 6). Every method runs through its real cache (kivi2 too).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kv/quant_methods.h"
#include "backend/backend.h"
#include "model/tokenizer.h"
#include "model/weights.h"

namespace oscar::eval {

struct PasskeyOptions {
  std::vector<int> ctx = {1024, 2048};
  std::vector<double> depths = {0.1, 0.3, 0.5, 0.7, 0.9};
  int trials = 2;  // per (ctx, depth): different keys and filler offsets
  uint64_t seed = 1;
  int page_size = 64;
  int prefill_chunk = 512;
  backend::WeightDtype weights = backend::WeightDtype::kBf16;
  std::string device = "cpu";  // cpu | cuda | cuda:N (engine::make_backend)
};

struct PasskeyResult {
  std::string method;
  int ctx = 0;
  double depth = 0;
  int trials = 0, correct = 0;
  std::vector<uint8_t> hits;  // per trial (same prompts, same order, for every method)
};

// Wilson score interval of a binomial proportion k/n (z = 1.96: 95 %).
// n = 0 gives [0, 1]; throws oscar::Error for k < 0, k > n or z <= 0.
struct Interval {
  double lo = 0, hi = 1;
};
Interval wilson_interval(int k, int n, double z = 1.96);

// The passkey prompt of about `ctx` tokens: instructions, filler from
// `haystack_tokens` (starting at `offset`), the needle at `depth`, the question.
std::vector<int> passkey_prompt(const model::Tokenizer& tok, const std::vector<int>& haystack_tokens,
                                int ctx, double depth, const std::string& key, size_t offset);

using LongProgress = std::function<void(const std::string&)>;
// Called after each method with every result so far (a long run that is cut short keeps them).
using PasskeyPartial = std::function<void(const std::vector<PasskeyResult>&)>;

std::vector<PasskeyResult> run_passkey(const model::ModelWeights& w, const model::Tokenizer& tok,
                                       const std::string& haystack,
                                       const std::vector<kv::KvMethod>& methods,
                                       const PasskeyOptions& opts,
                                       const LongProgress& progress = nullptr,
                                       const PasskeyPartial& on_method = nullptr);

struct AgreementResult {
  std::string method;
  int ctx = 0, prompts = 0, new_tokens = 0;
  double match_rate = 0;     // fraction of generated positions equal to BF16's
  double prefix_len = 0;     // mean tokens before the first divergence
};

// Greedy continuations of `new_tokens` after prompts of ctx tokens of `tokens`
// (`prompts` disjoint windows), each method vs bf16.
std::vector<AgreementResult> run_agreement(const model::ModelWeights& w,
                                           const std::vector<int32_t>& tokens,
                                           const std::vector<kv::KvMethod>& methods,
                                           const std::vector<int>& ctx, int prompts, int new_tokens,
                                           const PasskeyOptions& opts,
                                           const LongProgress& progress = nullptr);

std::string format_passkey(const std::vector<PasskeyResult>& r);
std::string format_agreement(const std::vector<AgreementResult>& r);

}  // namespace oscar::eval
