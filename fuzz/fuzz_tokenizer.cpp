// The tokenizer on arbitrary bytes: encode → decode must give back exactly the
// input (byte-level BPE covers every byte; added tokens decode verbatim), with
// and without special-token handling.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "fuzz_util.h"
#include "model/tokenizer.h"

using namespace oscar;

namespace {
const model::Tokenizer& tokenizer() {
  static const auto tok = std::make_unique<model::Tokenizer>(model::Tokenizer::from_hf(
      fuzz::source_dir() + "/tests/data/model/tiny-llama/tokenizer.json"));
  return *tok;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const model::Tokenizer& tok = tokenizer();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::vector<int> ids = tok.encode(text, false);
  for (int id : ids)
    if (id < 0 || id >= tok.vocab_size()) __builtin_trap();
  if (tok.decode(ids) != text) __builtin_trap();
  std::string streamed;
  for (int id : ids) streamed += tok.token_str(id);
  if (streamed != text) __builtin_trap();
  return 0;
}
