// Hugging Face tokenizer.json: vocab, merges, added tokens, pre-tokenizer
// regexes (compiled with PCRE2), post-processor; then a fixed text is
// encoded and decoded with the loaded tokenizer.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz_util.h"
#include "model/tokenizer.h"

using namespace oscar;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "tokenizer.json");
  try {
    model::Tokenizer tok = model::Tokenizer::from_hf(path);
    const std::vector<int> ids = tok.encode("Hello, world!\n  def f(x): return x**2  # 123 \xc3\xa9\xe4\xb8\xad", true);
    (void)tok.decode(ids);
    for (int id : ids) (void)tok.token_str(id);
  } catch (const Error&) {
  }
  return 0;
}
