#include "serve/tool_calls.h"

#include <nlohmann/json.hpp>

#include <algorithm>

#include "serve/chat_template.h"

namespace oscar::serve {

namespace {

constexpr std::string_view kOpen = "<tool_call>", kClose = "</tool_call>";

std::string_view trim(std::string_view s) {
  const auto ws = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return s;
}

// {"name": string, "arguments" | "parameters": object or JSON text of one} → a call.
bool to_call(const nlohmann::json& j, ToolCall& out) {
  if (!j.is_object()) return false;
  const auto name = j.find("name");
  if (name == j.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return false;
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");
  nlohmann::json a = nlohmann::json::object();
  if (args != j.end() && !args->is_null()) {
    if (args->is_string()) {
      a = nlohmann::json::parse(args->get<std::string>(), nullptr, false);
      if (a.is_discarded()) return false;
    } else {
      a = *args;
    }
  }
  if (!a.is_object()) return false;
  out.name = name->get<std::string>();
  out.arguments = a.dump();
  return true;
}

ToolParse parse_hermes(std::string_view text) {
  ToolParse p;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t open = text.find(kOpen, pos);
    if (open == std::string_view::npos) break;
    const size_t body = open + kOpen.size();
    const size_t close = text.find(kClose, body);
    const size_t end = close == std::string_view::npos ? text.size() : close + kClose.size();
    const std::string_view inner = trim(text.substr(body, (close == std::string_view::npos ? text.size() : close) - body));
    ToolCall c;
    const nlohmann::json j = nlohmann::json::parse(inner, nullptr, false);
    p.content.append(text.substr(pos, open - pos));
    if (!j.is_discarded() && to_call(j, c)) p.calls.push_back(std::move(c));
    else p.content.append(text.substr(open, end - open));  // not a call: keep it as text
    pos = end;
  }
  if (pos < text.size()) p.content.append(text.substr(pos));
  return p;
}

ToolParse parse_json(std::string_view text) {
  ToolParse p;
  const nlohmann::json j = nlohmann::json::parse(trim(text), nullptr, false);
  if (!j.is_discarded() && j.is_object()) {
    std::vector<ToolCall> calls;
    bool ok = false;
    if (const auto tc = j.find("tool_calls"); tc != j.end() && tc->is_array() && !tc->empty()) {
      ok = true;
      for (const auto& c : *tc) {
        ToolCall call;
        if (!to_call(c, call)) ok = false;
        calls.push_back(std::move(call));
      }
    } else if (const auto one = j.find("tool_call"); one != j.end()) {
      ToolCall call;
      ok = to_call(*one, call);
      calls.push_back(std::move(call));
    }
    if (ok) {
      p.calls = std::move(calls);
      if (const auto c = j.find("content"); c != j.end() && c->is_string()) p.content = c->get<std::string>();
      return p;
    }
  }
  p.content = std::string(text);
  return p;
}

// The whole output one call or a list of calls, maybe fenced, every name offered.
ToolParse parse_bare(std::string_view text, const std::vector<std::string>& offered) {
  ToolParse p;
  std::string_view body = trim(text);
  if (body.starts_with("```")) {
    const size_t nl = body.find('\n');
    if (nl == std::string_view::npos || !body.ends_with("```") || body.size() < nl + 4) return p;
    body = trim(body.substr(nl + 1, body.size() - 3 - (nl + 1)));
  }
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, false);
  if (j.is_discarded() || !(j.is_object() || (j.is_array() && !j.empty()))) return p;
  const nlohmann::json list = j.is_array() ? j : nlohmann::json::array({j});
  std::vector<ToolCall> calls;
  for (const auto& c : list) {
    ToolCall call;
    if (!to_call(c, call) || std::find(offered.begin(), offered.end(), call.name) == offered.end()) return p;
    calls.push_back(std::move(call));
  }
  p.calls = std::move(calls);
  return p;
}

}  // namespace

ToolFormat tool_format(const ChatTemplate& t) {
  return t.supports_tools() && t.source().find(kOpen) != std::string::npos ? ToolFormat::kHermes : ToolFormat::kJson;
}

ToolParse parse_tool_calls(std::string_view text, ToolFormat f, const std::vector<std::string>& offered) {
  ToolParse p = f == ToolFormat::kHermes ? parse_hermes(text) : parse_json(text);
  if (p.calls.empty() && !offered.empty()) {
    ToolParse bare = parse_bare(text, offered);
    if (!bare.calls.empty()) return bare;
  }
  return p;
}

size_t tool_safe_prefix(std::string_view text, ToolFormat f) {
  const std::string_view t = trim(text);
  if (t.empty() || t.front() == '{' || t.front() == '`') return 0;
  if (f == ToolFormat::kJson) return text.size();
  const size_t open = text.find(kOpen);
  if (open != std::string_view::npos) return open;
  // A suffix that is a proper prefix of "<tool_call>" may still become one.
  for (size_t k = std::min(text.size(), kOpen.size() - 1); k > 0; --k)
    if (text.substr(text.size() - k) == kOpen.substr(0, k)) return text.size() - k;
  return text.size();
}

}  // namespace oscar::serve
