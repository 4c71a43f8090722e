// The HTTP request body of /v1/completions and /v1/chat/completions: JSON
// syntax, field types and ranges; a chat request that parses is rendered with
// the ChatML template as the server would (tools too). Only ApiError (a 400 for the
// client) and oscar::Error (a message the server returns) may come out. The same bytes also go
// through the tool-call parser as model output, which must not throw.
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "serve/chat_template.h"
#include "serve/openai.h"
#include "serve/tool_calls.h"

using namespace oscar;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string body(reinterpret_cast<const char*>(data), size);
  static const serve::ChatTemplate chatml(serve::ChatTemplate::chatml_source(), "<s>", "</s>");
  for (bool chat : {false, true}) {
    try {
      serve::CompletionRequest r = serve::parse_completion_request(body, chat);
      if (chat) (void)chatml.render(r.messages, true, r.tools);
    } catch (const Error&) {
    }
  }
  // The same bytes as a model's output: tool calls are parsed or left as text, never thrown.
  for (auto f : {serve::ToolFormat::kHermes, serve::ToolFormat::kJson}) {
    (void)serve::parse_tool_calls(body, f, {"get_weather", "f"});
    if (serve::tool_safe_prefix(body, f) > body.size()) __builtin_trap();
  }
  return 0;
}
