#include "serve/chat_template.h"

#include <cctype>
#include <exception>
#include <mutex>
#include <utility>

#include <fmt/format.h>
#include <minja/chat-template.hpp>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/tokenizer.h"

namespace oscar::serve {
namespace {

using ojson = nlohmann::ordered_json;

// minja's strftime_now calls std::localtime (one static buffer per process).
std::mutex& localtime_mutex() {
  static std::mutex m;
  return m;
}

// minja appends " at row R, column C:\n<source lines>\n  ^\n" to an error at
// every level of the template tree it passes through. A client gets the
// template's own message and the first (innermost) position only.
std::string template_message(const std::string& what) {
  static const std::string kAt = " at row ";
  for (size_t pos = what.find(kAt); pos != std::string::npos; pos = what.find(kAt, pos + 1)) {
    size_t i = pos + kAt.size(), row_end = i;
    while (row_end < what.size() && std::isdigit(static_cast<unsigned char>(what[row_end]))) ++row_end;
    if (row_end == i || what.compare(row_end, 9, ", column ") != 0) continue;
    size_t col = row_end + 9, col_end = col;
    while (col_end < what.size() && std::isdigit(static_cast<unsigned char>(what[col_end]))) ++col_end;
    if (col_end == col || col_end >= what.size() || what[col_end] != ':') continue;
    return fmt::format("{} (chat template row {}, column {})", what.substr(0, pos), what.substr(i, row_end - i),
                       what.substr(col, col_end - col));
  }
  return what;
}

const char* type_name(const ojson& j) {
  return j.type_name();  // "null", "number", "object", ...
}

// An assistant message's tool_calls in OpenAI's form: [{"id"?, "type": "function", "function": {"name",
// "arguments": JSON text (or an object)}}]. Returned as given (minja converts the arguments for
// templates that want objects).
ojson normalize_tool_calls(const ojson& calls, size_t i) {
  if (!calls.is_array()) throw Error(fmt::format("messages[{}].tool_calls must be an array", i));
  for (size_t j = 0; j < calls.size(); ++j) {
    const ojson& c = calls[j];
    const auto where = fmt::format("messages[{}].tool_calls[{}]", i, j);
    if (!c.is_object()) throw Error(where + " must be an object");
    if (const auto t = c.find("type"); t != c.end() && *t != "function")
      throw Error(where + ".type must be \"function\"");
    if (const auto id = c.find("id"); id != c.end() && !id->is_string()) throw Error(where + ".id must be a string");
    const auto f = c.find("function");
    if (f == c.end() || !f->is_object()) throw Error(where + ".function must be an object");
    const auto name = f->find("name");
    if (name == f->end() || !name->is_string()) throw Error(where + ".function.name must be a string");
    const auto args = f->find("arguments");
    if (args == f->end() || !(args->is_string() || args->is_object()))
      throw Error(where + ".function.arguments must be a JSON string");
    if (args->is_string() && !ojson::accept(args->get<std::string>()))
      throw Error(where + ".function.arguments is not valid JSON");
  }
  ojson out = calls;
  for (ojson& c : out) c["type"] = "function";
  return out;
}

// Validates one message and returns the form given to the template:
// {"role", "content" (a string; null for an assistant message with only tool calls), ["name"],
// ["tool_calls"], ["tool_call_id"]}.
ojson normalize_message(const ojson& m, size_t i) {
  if (!m.is_object())
    throw Error(fmt::format("messages[{}] must be an object with 'role' and 'content' (got {})", i, type_name(m)));
  const auto role = m.find("role");
  if (role == m.end()) throw Error(fmt::format("messages[{}] has no 'role'", i));
  if (!role->is_string() || role->get_ref<const std::string&>().empty())
    throw Error(fmt::format("messages[{}].role must be a non-empty string (got {})", i,
                            role->is_string() ? "an empty string" : type_name(*role)));
  const auto content = m.find("content");
  const auto calls = m.find("tool_calls");
  const bool has_calls = calls != m.end() && !calls->is_null();
  if (has_calls && *role != "assistant")
    throw Error(fmt::format("messages[{}]: only assistant messages carry tool_calls", i));
  if (content == m.end() || (content->is_null() && has_calls)) {
    if (!has_calls) throw Error(fmt::format("messages[{}] has no 'content'", i));
    return {{"role", *role}, {"content", nullptr}, {"tool_calls", normalize_tool_calls(*calls, i)}};
  }
  std::string text;
  if (content->is_string()) {
    text = content->get<std::string>();
  } else if (content->is_array()) {
    for (size_t j = 0; j < content->size(); ++j) {
      const ojson& part = (*content)[j];
      if (!part.is_object())
        throw Error(fmt::format("messages[{}].content[{}] must be an object {{\"type\": \"text\", \"text\": ...}} (got {})",
                                i, j, type_name(part)));
      const auto type = part.find("type");
      if (type == part.end() || !type->is_string())
        throw Error(fmt::format("messages[{}].content[{}] has no string 'type'", i, j));
      if (*type != "text")
        throw Error(fmt::format("messages[{}].content[{}]: content parts of type '{}' are not supported (text only)", i,
                                j, type->get<std::string>()));
      const auto t = part.find("text");
      if (t == part.end() || !t->is_string())
        throw Error(fmt::format("messages[{}].content[{}].text must be a string", i, j));
      if (j > 0) text += '\n';
      text += t->get<std::string>();
    }
  } else {
    throw Error(fmt::format("messages[{}].content must be a string or an array of text parts (got {})", i,
                            type_name(*content)));
  }
  ojson out = {{"role", *role}, {"content", std::move(text)}};
  if (const auto name = m.find("name"); name != m.end() && name->is_string()) out["name"] = *name;
  if (has_calls) out["tool_calls"] = normalize_tool_calls(*calls, i);
  if (const auto id = m.find("tool_call_id"); id != m.end() && !id->is_null()) {
    if (!id->is_string()) throw Error(fmt::format("messages[{}].tool_call_id must be a string", i));
    out["tool_call_id"] = *id;
  }
  return out;
}

}  // namespace

const std::string& ChatTemplate::chatml_source() {
  static const std::string kChatML =
      "{%- for message in messages %}"
      "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
      "{%- endfor %}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";
  return kChatML;
}

ChatTemplate::ChatTemplate(const std::string& source, const std::string& bos_token, const std::string& eos_token)
    : serialize_(source.find("strftime_now") != std::string::npos) {
  try {
    // The constructor parses and then probes the template's capabilities by
    // rendering dummy conversations (which may call strftime_now).
    std::lock_guard<std::mutex> lock(localtime_mutex());
    impl_ = std::make_shared<const minja::chat_template>(source, bos_token, eos_token);
  } catch (const std::exception& e) {
    throw Error(fmt::format("chat template does not parse: {}", e.what()));
  }
}

ChatTemplate ChatTemplate::from_tokenizer(const model::Tokenizer& tok) {
  const std::string bos = tok.bos() >= 0 ? tok.token_str(tok.bos()) : std::string();
  const std::string eos = tok.eos().empty() ? std::string() : tok.token_str(tok.eos().front());
  if (tok.chat_template().empty()) {
    ChatTemplate t(chatml_source(), bos, eos);
    t.fallback_ = true;
    return t;
  }
  return ChatTemplate(tok.chat_template(), bos, eos);
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                 const nlohmann::ordered_json& tools) const {
  if (!messages.is_array())
    throw Error(fmt::format("'messages' must be an array of message objects (got {})", type_name(messages)));
  if (messages.empty()) throw Error("'messages' must contain at least one message");
  minja::chat_template_inputs inputs;
  inputs.messages = ojson::array();
  for (size_t i = 0; i < messages.size(); ++i) inputs.messages.push_back(normalize_message(messages[i], i));
  inputs.add_generation_prompt = add_generation_prompt;
  if (tools.is_array() && !tools.empty()) inputs.tools = tools;

  // bos_token, eos_token, strftime_now defined; minja's polyfills for what the template lacks: a
  // system role (merged into the next user message), tools (described in the system message, with
  // an example call), tool calls and tool responses (as JSON in the message text), and object
  // arguments for templates that take them so.
  minja::chat_template_options opts;
  opts.apply_polyfills = true;
  try {
    if (serialize_) {
      std::lock_guard<std::mutex> lock(localtime_mutex());
      return impl_->apply(inputs, opts);
    }
    return impl_->apply(inputs, opts);
  } catch (const std::exception& e) {
    throw Error(fmt::format("chat template: {}", template_message(e.what())));
  }
}

const std::string& ChatTemplate::source() const { return impl_->source(); }
const std::string& ChatTemplate::bos_token() const { return impl_->bos_token(); }
const std::string& ChatTemplate::eos_token() const { return impl_->eos_token(); }
bool ChatTemplate::supports_system_role() const { return impl_->original_caps().supports_system_role; }
bool ChatTemplate::supports_tools() const { return impl_->original_caps().supports_tools; }

}  // namespace oscar::serve
