// Generation: prompts in, tokens and text out, over a Model and a KvCache.
//
// Static batching: all requests are prefilled together (chunks of up to
// `prefill_chunk` tokens per call, several sequences per call), then decoded
// one token per sequence per call until each stops. Finished sequences leave
// the batch and free their pages at once. (The server's continuous-batching
// scheduler, engine/scheduler.h, builds on the same Model::forward; this loop is
// the CLI's.)
#pragma once

#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/logprobs.h"
#include "engine/sampler.h"
#include "kv/kv_cache.h"
#include "model/forward.h"

namespace oscar::engine {

struct Request {
  std::vector<int> prompt;  // token ids, non-empty
  SamplingParams sampling;
  int max_new_tokens = 128;
  std::vector<int> stop_tokens;           // end generation (not part of the text)
  std::vector<std::string> stop_strings;  // end generation; the text stops before them
  // Log probabilities (engine/logprobs.h; Scheduler only): -1 none, else k in [0, kMaxLogprobs]
  // alternatives per position. `logprobs`: of each generated token; `prompt_logprobs`: of each
  // prompt token after the first (its prefill then yields every position's logits, in chunks of
  // at most Scheduler::kPromptLogprobChunk tokens, and skips the prefix cache).
  int logprobs = -1;
  int prompt_logprobs = -1;
};

struct Result {
  std::vector<int> tokens;    // generated ids (a final stop token included)
  std::string text;           // decoded generation, up to any stop string
  std::string finish_reason;  // "length" | "stop"
};

struct Stats {
  int prompt_tokens = 0, generated_tokens = 0;
  double prefill_s = 0, decode_s = 0;
  double prefill_tok_s() const { return prefill_s > 0 ? prompt_tokens / prefill_s : 0; }
  // Decode steps produce all but the first token of each request (that one
  // comes from the prefill logits).
  int decode_tokens = 0;
  double decode_tok_s() const { return decode_s > 0 ? decode_tokens / decode_s : 0; }
};

// Bytes of one token (model::Tokenizer::token_str); may be a partial UTF-8 sequence.
using TokenText = std::function<std::string(int id)>;
// Streamed text of request i (complete; never a piece of a stop string).
using OnText = std::function<void(int request, std::string_view text)>;

class Generator {
 public:
  Generator(model::Model& m, kv::KvCache& cache, TokenText token_text = nullptr,
            int prefill_chunk = 512);
  std::vector<Result> run(std::span<const Request> reqs, const OnText& on_text = nullptr);
  const Stats& stats() const { return stats_; }

 private:
  model::Model& m_;
  kv::KvCache& cache_;
  TokenText token_text_;
  int prefill_chunk_;
  Stats stats_;
};

// Holds back streamed text that might be the start of a stop string.
class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Adds text; returns what may be emitted now. Sets stopped() when a stop
  // string completed (the returned text ends right before it).
  std::string push(std::string_view text);
  // The held-back remainder (at the end of a generation without a stop).
  std::string flush();
  bool stopped() const { return stopped_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
};

}  // namespace oscar::engine
