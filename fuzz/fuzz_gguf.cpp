// GGUF files from strangers: header, metadata, tensor infos, data offsets, the
// dequantizers of every block type, then the whole model build (config from
// metadata, every tensor checked against it) and the tokenizer from metadata.
#include <cstddef>
#include <cstdint>

#include "core/error.h"
#include "fuzz_util.h"
#include "model/gguf.h"
#include "model/loader.h"
#include "model/tokenizer.h"

using namespace oscar;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = fuzz::write_input(data, size, "input.gguf");
  try {
    model::gguf::File f = model::gguf::File::open(path);
    for (const auto& [key, v] : f.metadata()) (void)v.array_size();
    for (const auto& t : f.tensors())
      if (model::gguf::can_dequantize(t.type)) (void)f.read_f32(t);
  } catch (const Error&) {
    return 0;
  }
  try {
    (void)model::load_gguf(path);
  } catch (const Error&) {
  }
  try {
    model::Tokenizer tok = model::Tokenizer::from_gguf(path);
    (void)tok.decode(tok.encode("Hello, world! 123 <|im_start|>", true));
  } catch (const Error&) {
  }
  return 0;
}
