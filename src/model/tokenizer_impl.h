// Internal state of Tokenizer, shared by tokenizer.cpp (algorithm) and
// tokenizer_load.cpp (GGUF / tokenizer.json readers). Not a public header.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/tokenizer.h"

namespace oscar::model {

namespace detail {
// GPT-2's reversible byte <-> printable-unicode table.
struct ByteTable {
  std::array<std::string, 256> byte_to_utf8;  // byte -> UTF-8 of its code point
  std::vector<int> cp_to_byte;                // code point (< 512) -> byte, -1 if none
};
const ByteTable& byte_table();
std::string utf8_encode(uint32_t cp);
size_t utf8_len(std::string_view s, size_t i);
}  // namespace detail

struct Tokenizer::Impl {
  std::string source;                    // file name for error messages
  std::vector<std::string> tokens;       // id -> vocabulary string
  std::vector<char> added;               // id -> matched verbatim before BPE
  std::vector<char> special;             // id -> control/special (skippable in decode)
  std::unordered_map<std::string, int> vocab;       // built by build()
  std::unordered_map<std::string, int> merge_rank;  // "a b" -> rank
  std::vector<std::vector<int>> added_by_byte;      // built by build()
  std::vector<std::string> regexes;
  std::vector<void*> compiled;           // pcre2_code*, owned
  bool ignore_merges = false;            // Llama-3: whole pieces found in vocab skip BPE
  bool add_prefix_space = false;
  int unk = -1;
  ~Impl();
};

}  // namespace oscar::model
