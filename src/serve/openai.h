// The OpenAI HTTP API's request parsing and response shapes (/v1/completions,
// /v1/chat/completions), independent of the HTTP library so tests can call them.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <span>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "engine/logprobs.h"
#include "core/error.h"
#include "serve/tool_calls.h"

namespace oscar::serve {

// An error a client gets as OpenAI-style JSON: {"error": {message, type, param, code}}.
class ApiError : public Error {
 public:
  ApiError(int status, std::string message, std::string type = "invalid_request_error",
           std::string param = {}, std::string code = {})
      : Error(message), status(status), type(std::move(type)), param(std::move(param)),
        code(std::move(code)) {}
  int status;
  std::string type, param, code;
  nlohmann::json body() const;
};

// A parsed completion or chat request, not yet tokenized.
struct CompletionRequest {
  bool chat = false;
  std::string model;                     // as given ("" = not given)
  // Completions: one or more prompts (OpenAI's batch form: a list of strings or of token-id
  // lists), each a string or token ids.
  struct Prompt {
    bool is_tokens = false;
    std::string text;
    std::vector<int> tokens;
  };
  std::vector<Prompt> prompts;
  nlohmann::ordered_json messages;       // chat
  nlohmann::ordered_json tools;          // chat: the functions offered (null: none, or tool_choice "none")
  int max_tokens = -1;                   // -1 = not given
  engine::SamplingParams sampling;
  bool seeded = false;                   // `seed` given (else the server picks one per request)
  std::vector<std::string> stop;
  bool stream = false, include_usage = false, ignore_eos = false;
  // Log probabilities: alternatives per position (completions' `logprobs`; chat's `top_logprobs`
  // with `logprobs: true`), -1 = none.
  int logprobs = -1;
  bool echo = false;  // completions: the prompt before each choice's text (and its tokens' logprobs)
  bool tokens_as_ids = false;  // `return_tokens_as_token_ids` (vLLM's): logprobs name tokens "token_id:N"
  int n = 1;          // choices
};

// The most choices one request may ask for (`n`), and the most prompts of one completions request
// (prompts × n engine requests at most kMaxChoices × 4).
inline constexpr int kMaxChoices = 64;
inline constexpr int kMaxPrompts = 256;

// Parses and type-checks a request body. Throws ApiError (400) naming the field.
CompletionRequest parse_completion_request(const std::string& body, bool chat);

// Pieces of responses; `id` like "cmpl-1", `created` in Unix seconds.
struct ResponseMeta {
  std::string id, model;
  int64_t created = 0;
  bool chat = false;
};
nlohmann::json usage_json(int prompt_tokens, int completion_tokens);

// One choice of a whole response; `logprobs` null when not asked for.
struct Choice {
  std::string text;
  std::string finish_reason;
  nlohmann::json logprobs;
  nlohmann::json tool_calls = nullptr;  // chat: message.tool_calls (content null when `text` is blank)
};
// The whole (non-streamed) response; choice i gets index i.
nlohmann::json completion_response(const ResponseMeta& m, const std::vector<Choice>& choices, int prompt_tokens,
                                   int completion_tokens);
// One streamed chunk of choice `index`: text (may be empty), finish_reason ("" = null), for chat
// whether this is the choice's first chunk (carries the role), and its tokens' logprobs (null =
// none).
nlohmann::json completion_chunk(const ResponseMeta& m, int index, const std::string& text,
                                const std::string& finish_reason, bool first,
                                const nlohmann::json& logprobs = nullptr,
                                const nlohmann::json& tool_calls = nullptr);
// message.tool_calls (or, with `index` fields, a streamed delta's) of parsed calls; ids "call_" + hex.
nlohmann::json tool_calls_json(const std::vector<ToolCall>& calls, const std::vector<std::string>& ids,
                               bool streamed);
inline constexpr int kMaxTools = 128;

// Log probabilities in the two APIs' shapes. A token's text is its bytes (`TokenBytes`), which
// may be part of a UTF-8 character (JSON strings replace such bytes by U+FFFD; chat's `bytes`
// field keeps them).
using TokenBytes = std::function<std::string(int id)>;
// One position of a completion's logprobs; `known` false for the prompt's first token (echo),
// which has no log probability (null entries).
struct LogprobEntry {
  engine::TokenLogprob lp;
  bool known = true;
};
// Completions: {tokens, token_logprobs, top_logprobs, text_offset}; each top_logprobs entry maps
// the position's k best tokens and its own token to their logprobs. `text_offset` counts
// characters (code points) of the tokens' texts from `offset`, which advances past them.
nlohmann::json completion_logprobs(std::span<const LogprobEntry> entries, const TokenBytes& bytes,
                                   int64_t& offset);
// Chat: {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}.
nlohmann::json chat_logprobs(std::span<const engine::TokenLogprob> entries, const TokenBytes& bytes);
// The streamed usage chunk (choices empty), for stream_options.include_usage.
nlohmann::json usage_chunk(const ResponseMeta& m, int prompt_tokens, int completion_tokens);

// JSON text of a value whose strings may hold invalid UTF-8 (replaced by U+FFFD).
std::string dump_json(const nlohmann::json& j);

}  // namespace oscar::serve
