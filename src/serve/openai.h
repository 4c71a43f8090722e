// The OpenAI HTTP API's request parsing and response shapes (/v1/completions,
// /v1/chat/completions), independent of the HTTP library so tests can call them.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "engine/generator.h"
#include "core/error.h"

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
  std::string prompt_text;               // completions with a string prompt
  std::vector<int> prompt_tokens;        // completions with token ids
  bool prompt_is_tokens = false;
  nlohmann::ordered_json messages;       // chat
  int max_tokens = -1;                   // -1 = not given
  engine::SamplingParams sampling;
  std::vector<std::string> stop;
  bool stream = false, include_usage = false, ignore_eos = false;
};

// Parses and type-checks a request body. Throws ApiError (400) naming the field.
CompletionRequest parse_completion_request(const std::string& body, bool chat);

// Pieces of responses; `id` like "cmpl-1", `created` in Unix seconds.
struct ResponseMeta {
  std::string id, model;
  int64_t created = 0;
  bool chat = false;
};
nlohmann::json usage_json(int prompt_tokens, int completion_tokens);
// The whole (non-streamed) response.
nlohmann::json completion_response(const ResponseMeta& m, const std::string& text,
                                   const std::string& finish_reason, int prompt_tokens,
                                   int completion_tokens);
// One streamed chunk: text (may be empty), finish_reason ("" = null), and for chat
// whether this is the first chunk (carries the role).
nlohmann::json completion_chunk(const ResponseMeta& m, const std::string& text,
                                const std::string& finish_reason, bool first);
// The streamed usage chunk (choices empty), for stream_options.include_usage.
nlohmann::json usage_chunk(const ResponseMeta& m, int prompt_tokens, int completion_tokens);

// JSON text of a value whose strings may hold invalid UTF-8 (replaced by U+FFFD).
std::string dump_json(const nlohmann::json& j);

}  // namespace oscar::serve
