// Byte-level BPE tokenizer (GPT-2 / Llama-3 / Qwen2 / SmolLM2 family), loaded
// from GGUF metadata (tokenizer.ggml.*) or from a Hugging Face tokenizer.json.
//
// encode(): added/special tokens are matched first (longest match), the rest
//   is split by the family's pre-tokenizer regexes (PCRE2, UTF + UCP), each
//   piece is mapped byte -> printable unicode (GPT-2's table) and merged by
//   BPE merge rank.
// decode(): token strings are concatenated; normal tokens map back to bytes
//   through the inverse table, added tokens are emitted verbatim.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace oscar::model {

class Tokenizer {
 public:
  // From a .gguf file's metadata (tokenizer.ggml.model must be "gpt2").
  static Tokenizer from_gguf(const std::string& path);
  // From a directory holding tokenizer.json (a tokenizer.json path works too);
  // tokenizer_config.json / config.json / generation_config.json next to it
  // supply bos/eos ids and the chat template when present.
  static Tokenizer from_hf(const std::string& dir);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // add_special: prepend BOS when the model's tokenizer asks for it
  // (GGUF tokenizer.ggml.add_bos_token / tokenizer.json's post-processor).
  std::vector<int> encode(std::string_view text, bool add_special = false) const;
  std::string decode(const std::vector<int>& ids, bool skip_special = false) const;
  // Bytes of one token (may be a partial UTF-8 sequence; for streaming).
  std::string token_str(int id) const;
  // The vocabulary entry as stored (byte-level mapped form for normal tokens).
  const std::string& token_text(int id) const;
  int token_id(std::string_view text) const;  // -1 when absent

  int vocab_size() const;
  int bos() const { return bos_; }
  const std::vector<int>& eos() const { return eos_; }
  bool is_eos(int id) const;
  bool is_special(int id) const;
  bool add_bos() const { return add_bos_; }
  const std::string& chat_template() const { return chat_template_; }
  const std::string& pre_type() const { return pre_type_; }  // e.g. "smollm", "llama-bpe"

  // Regexes the pre-tokenizer applies in order (each splits the pieces of the
  // previous one, keeping unmatched gaps as pieces) — exposed for tests.
  const std::vector<std::string>& pre_regexes() const;

 private:
  Tokenizer();
  struct Impl;
  std::unique_ptr<Impl> impl_;
  int bos_ = -1;
  std::vector<int> eos_;
  bool add_bos_ = false;
  std::string chat_template_;
  std::string pre_type_;
  void build();  // compiles regexes and derived tables after loading
  void bpe(std::string_view piece, std::vector<int>& out) const;
};

// Picks the tokenizer for a model path: a .gguf file or an HF directory.
Tokenizer load_tokenizer(const std::string& model_path);

// The pre-tokenizer regexes of llama.cpp's `tokenizer.ggml.pre` names we know
// ("gpt2"/"default", "llama-bpe"/"llama3", "qwen2", "smollm", ...). Throws for
// unknown names.
std::vector<std::string> pre_regexes_for(const std::string& pre);

}  // namespace oscar::model
