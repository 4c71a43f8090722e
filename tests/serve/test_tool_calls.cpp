// Tool calls parsed from model output (serve/tool_calls.h) in both formats, the streaming hold-back,
// and the request fields (tools, tool_choice) of serve/openai.h.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "serve/openai.h"
#include "serve/tool_calls.h"

namespace oscar::serve {
namespace {

TEST(ToolCalls, HermesBlocksBecomeCallsAndTheRestContent) {
  const std::string out =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
      "<tool_call>{\"name\": \"get_time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}</tool_call>";
  ToolParse p = parse_tool_calls(out, ToolFormat::kHermes);
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "get_weather");
  EXPECT_EQ(nlohmann::json::parse(p.calls[0].arguments), nlohmann::json({{"city", "Paris"}}));
  EXPECT_EQ(p.calls[1].name, "get_time");
  EXPECT_EQ(nlohmann::json::parse(p.calls[1].arguments), nlohmann::json({{"tz", "CET"}}));
  EXPECT_EQ(p.content, "Let me check.\n\n");
  // Unterminated at the end of the generation (max_tokens): parsed when its JSON is whole.
  p = parse_tool_calls("<tool_call>{\"name\": \"f\", \"arguments\": {}}", ToolFormat::kHermes);
  ASSERT_EQ(p.calls.size(), 1u);
  EXPECT_EQ(p.calls[0].arguments, "{}");
  // Not JSON, no name, arguments not an object: left as text.
  for (const char* bad : {"<tool_call>{\"name\": \"f\", \"argu</tool_call>", "<tool_call>{\"arguments\": {}}</tool_call>",
                          "<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>", "<tool_call>{\"name\": \"f\""}) {
    p = parse_tool_calls(bad, ToolFormat::kHermes);
    EXPECT_TRUE(p.calls.empty()) << bad;
    EXPECT_EQ(p.content, bad);
  }
  p = parse_tool_calls("No tools needed.", ToolFormat::kHermes);
  EXPECT_TRUE(p.calls.empty());
  EXPECT_EQ(p.content, "No tools needed.");
}

TEST(ToolCalls, JsonObjectsBecomeCalls) {
  ToolParse p = parse_tool_calls(
      " {\"tool_calls\": [{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", \"parameters\": {}}],"
      " \"content\": \"ok\"}\n",
      ToolFormat::kJson);
  ASSERT_EQ(p.calls.size(), 2u);
  EXPECT_EQ(p.calls[0].name, "a");
  EXPECT_EQ(p.calls[1].name, "b");
  EXPECT_EQ(p.content, "ok");
  p = parse_tool_calls("{\"tool_call\": {\"name\": \"a\", \"arguments\": {}}}", ToolFormat::kJson);
  ASSERT_EQ(p.calls.size(), 1u);
  for (const char* text : {"{\"answer\": 42}", "Plain text.", "{\"tool_calls\": [{\"arguments\": {}}]}", "{\"tool_calls\": []}"}) {
    p = parse_tool_calls(text, ToolFormat::kJson);
    EXPECT_TRUE(p.calls.empty()) << text;
    EXPECT_EQ(p.content, text);
  }
}

TEST(ToolCalls, BareCallsOfOfferedToolsAreCalls) {
  const std::vector<std::string> offered = {"get_weather"};
  const std::string fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```";
  for (ToolFormat f : {ToolFormat::kHermes, ToolFormat::kJson}) {
    ToolParse p = parse_tool_calls(fenced, f, offered);
    ASSERT_EQ(p.calls.size(), 1u);
    EXPECT_EQ(p.calls[0].name, "get_weather");
    EXPECT_EQ(nlohmann::json::parse(p.calls[0].arguments), nlohmann::json({{"city", "Paris"}}));
    EXPECT_EQ(p.content, "");
    p = parse_tool_calls(R"([{"name": "get_weather", "arguments": {}}, {"name": "get_weather", "arguments": {}}])", f, offered);
    EXPECT_EQ(p.calls.size(), 2u);
    // Not offered, not the whole output, or no tools offered: text.
    for (const std::string& text : {std::string(R"({"name": "rm_rf", "arguments": {}})"),
                                    std::string("Sure: ") + fenced}) {
      p = parse_tool_calls(text, f, offered);
      EXPECT_TRUE(p.calls.empty()) << text;
    }
    EXPECT_TRUE(parse_tool_calls(fenced, f).calls.empty());
  }
}

TEST(ToolCalls, StreamingHoldsBackWhatMayBecomeACall) {
  EXPECT_EQ(tool_safe_prefix("```json\n{", ToolFormat::kHermes), 0u);
  EXPECT_EQ(tool_safe_prefix(" {\"name", ToolFormat::kHermes), 0u);
  EXPECT_EQ(tool_safe_prefix("Hello there", ToolFormat::kHermes), 11u);
  EXPECT_EQ(tool_safe_prefix("Hello <tool", ToolFormat::kHermes), 6u);
  EXPECT_EQ(tool_safe_prefix("Hello <", ToolFormat::kHermes), 6u);
  EXPECT_EQ(tool_safe_prefix("Hello <b>", ToolFormat::kHermes), 9u);
  EXPECT_EQ(tool_safe_prefix("Hi <tool_call>{\"na", ToolFormat::kHermes), 3u);
  EXPECT_EQ(tool_safe_prefix("  ", ToolFormat::kJson), 0u);
  EXPECT_EQ(tool_safe_prefix(" {\"tool", ToolFormat::kJson), 0u);
  EXPECT_EQ(tool_safe_prefix("Sure: {", ToolFormat::kJson), 7u);
  // Monotone as text grows, never past a call's start.
  const std::string out = "ab <tool_call>{\"name\": \"f\"}</tool_call> cd";
  size_t last = 0;
  for (size_t n = 0; n <= out.size(); ++n) {
    const size_t s = tool_safe_prefix(std::string_view(out).substr(0, n), ToolFormat::kHermes);
    EXPECT_GE(s, last);
    EXPECT_LE(s, 3u);
    last = s;
  }
}

TEST(ToolCalls, RequestFields) {
  const std::string msgs = R"("messages": [{"role": "user", "content": "hi"}])";
  const std::string tools = R"("tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])";
  auto r = parse_completion_request("{" + msgs + ", " + tools + "}", true);
  ASSERT_TRUE(r.tools.is_array());
  EXPECT_EQ(r.tools.size(), 1u);
  EXPECT_TRUE(parse_completion_request("{" + msgs + ", " + tools + R"(, "tool_choice": "none"})", true).tools.is_null());
  EXPECT_FALSE(parse_completion_request("{" + msgs + ", " + tools + R"(, "tool_choice": "auto"})", true).tools.is_null());
  auto status = [&](const std::string& extra) {
    try {
      parse_completion_request("{" + msgs + ", " + extra + "}", true);
      return 200;
    } catch (const ApiError& e) {
      return e.status;
    }
  };
  EXPECT_EQ(status(tools + R"(, "tool_choice": "required")"), 400);
  EXPECT_EQ(status(tools + R"(, "tool_choice": {"type": "function", "function": {"name": "f"}})"), 400);
  EXPECT_EQ(status(R"("tools": {"type": "function"})"), 400);
  EXPECT_EQ(status(R"("tools": [{"type": "code"}])"), 400);
  EXPECT_EQ(status(R"("tools": [{"type": "function", "function": {"name": ""}}])"), 400);
  EXPECT_EQ(status(R"("tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}])"), 400);
  EXPECT_EQ(status(R"("tools": [], "parallel_tool_calls": "yes")"), 400);

  // Responses: content null beside calls; a streamed delta's calls carry their index.
  ResponseMeta m{"chatcmpl-1", "model", 1, true};
  const std::vector<ToolCall> calls = {{"f", "{\"x\":1}"}};
  const auto whole = completion_response(m, {{"\n", "tool_calls", nullptr, tool_calls_json(calls, {"call_1"}, false)}}, 3, 4);
  const auto& msg = whole["choices"][0]["message"];
  EXPECT_TRUE(msg["content"].is_null());
  EXPECT_EQ(msg["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(msg["tool_calls"][0]["id"], "call_1");
  EXPECT_FALSE(msg["tool_calls"][0].contains("index"));
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "tool_calls");
  const auto chunk = completion_chunk(m, 0, "", "tool_calls", false, nullptr, tool_calls_json(calls, {"call_1"}, true));
  EXPECT_EQ(chunk["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
  EXPECT_FALSE(chunk["choices"][0]["delta"].contains("content"));
}

}  // namespace
}  // namespace oscar::serve
