// A model's chat template: the Jinja text (GGUF tokenizer.chat_template or HF
// tokenizer_config.json) that turns OpenAI-style messages into the prompt
// string, rendered by minja (third_party/minja, google/minja: the C++ Jinja
// subset llama.cpp uses).
//
// Conventions (those of Hugging Face transformers' apply_chat_template and of
// llama.cpp's OpenAI server):
//   - the template is parsed with trim_blocks and lstrip_blocks, without
//     keep_trailing_newline; it sees `messages`, `add_generation_prompt`,
//     `bos_token`, `eos_token`, `raise_exception(msg)` and `strftime_now(fmt)`;
//   - content given as an array of {"type": "text", "text": ...} parts is
//     joined with "\n" into one string before rendering;
//   - templates that refuse a system role (detected by minja when the
//     template is loaded) get the system text prepended to the next user
//     message instead.
//
// Thread safety: render() is const and may be called from several threads at
// once (each call builds its own minja context; the parsed template is never
// modified). Templates that call strftime_now (which uses std::localtime)
// are rendered one at a time.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

namespace minja {
class chat_template;
}
namespace oscar::model {
class Tokenizer;
}

namespace oscar::serve {

class ChatTemplate {
 public:
  // source: the Jinja text; bos_token / eos_token: the strings the template may
  // reference. Throws oscar::Error with the parser's message when the template
  // does not parse.
  ChatTemplate(const std::string& source, const std::string& bos_token, const std::string& eos_token);

  // The model's own template; when the model has none, ChatML
  // (<|im_start|>role\ncontent<|im_end|>\n ..., generation prompt
  // "<|im_start|>assistant\n"), and is_fallback() says so.
  static ChatTemplate from_tokenizer(const model::Tokenizer& tok);

  // The ChatML template used when a model has none.
  static const std::string& chatml_source();

  // messages: a JSON array of {"role": "system"|"user"|"assistant"|...,
  // "content": string or array of {"type":"text","text":...} parts} (an
  // optional string "name" is passed on; other fields are dropped). Throws
  // oscar::Error with a message a client can read when the messages are
  // malformed (array, non-empty, objects with a non-empty string role and
  // string/parts content), and with the template's own message when the
  // template raises (raise_exception, e.g. for a bad role order).
  //
  // Tool use (OpenAI's form): `tools` (an array of {"type": "function", "function": {...}}, or null),
  // assistant messages with "tool_calls" (content may then be null), "tool" messages with
  // "tool_call_id". Templates without tool support get minja's polyfills (the tools described in
  // the system message, calls and responses as JSON text).
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt = true,
                     const nlohmann::ordered_json& tools = nullptr) const;
  // minja's view: whether the template renders `tools` itself.
  bool supports_tools() const;

  bool is_fallback() const { return fallback_; }
  const std::string& source() const;
  const std::string& bos_token() const;
  const std::string& eos_token() const;
  // minja's view of the template: whether it renders a system message itself
  // (false: system text is merged into the following user message).
  bool supports_system_role() const;

 private:
  std::shared_ptr<const minja::chat_template> impl_;
  bool fallback_ = false;
  bool serialize_ = false;  // the template calls strftime_now (std::localtime is not thread-safe)
};

}  // namespace oscar::serve
