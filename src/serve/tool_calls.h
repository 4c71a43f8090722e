// Tool calls in a chat model's output, as OpenAI's API returns them (message.tool_calls).
//
// Two output formats, chosen by the chat template:
//   - kHermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen2.5, Hermes and
//     the templates that write "<tool_call>" into their tool prompt); text outside the blocks is
//     the message content;
//   - kJson: the whole output one JSON object {"tool_calls": [{"name", "arguments"}], "content"?}
//     (or {"tool_call": {...}}): the form minja's polyfill asks of templates without tool support.
// A block or object that is not valid JSON with a string "name" is content, not a call.
// Small models often answer a tool prompt with a bare call instead of the template's format: an
// output that is, as a whole, one JSON object {"name", "arguments"} (or a list of them), maybe in
// a ``` fence, whose names are all among the offered tools, is taken as those calls too.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace oscar::serve {

class ChatTemplate;

enum class ToolFormat { kHermes, kJson };
ToolFormat tool_format(const ChatTemplate& t);

struct ToolCall {
  std::string name;
  std::string arguments;  // JSON text of an object
};

struct ToolParse {
  std::string content;  // the text outside the calls
  std::vector<ToolCall> calls;
};

// `offered`: the names of the request's tools (the bare-call fallback needs them; empty: none).
ToolParse parse_tool_calls(std::string_view text, ToolFormat f, const std::vector<std::string>& offered = {});

// Streaming: how much of the text generated so far can go out as content now, because no later
// token can make it part of a call (kHermes: up to the first "<tool_call>", or to a suffix that
// may begin one; both: nothing while the text, left-trimmed, is empty or begins with '{' or '`',
// which may be a bare call).
size_t tool_safe_prefix(std::string_view text, ToolFormat f);

}  // namespace oscar::serve
