// Chat templates come from model files (GGUF tokenizer.chat_template,
// tokenizer_config.json): the Jinja text is parsed by minja and rendered with
// a fixed conversation, as `oscar serve` does for every chat request.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "serve/chat_template.h"

using namespace oscar;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  static const nlohmann::ordered_json messages = nlohmann::ordered_json::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}])");
  try {
    serve::ChatTemplate t(source, "<s>", "</s>");
    (void)t.render(messages, true);
  } catch (const Error&) {
  }
  return 0;
}
