// Tokenizer vs reference ids (tests/data/model/tokenizer_golden.json, made by
// scripts/golden_tokenizer.py with HF `tokenizers`, and for SmolLM2 also
// checked against llama.cpp's tokenizer), round trips, GGUF vs tokenizer.json.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/tokenizer.h"
#include "test_gguf_writer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;
using oscar::model::Tokenizer;

using oscar::test::expect_error;
using oscar::test::tmp_path;

namespace {

const std::string kModels = std::string(OSCAR_TEST_DATA_DIR) + "/model/";
const std::string kDefaultGguf = std::string(OSCAR_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string kQwenGguf =
    std::string(OSCAR_SOURCE_DIR) + "/models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf";

json load_json(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

const json& golden() {
  static const json j = load_json(kModels + "tokenizer_golden.json");
  return j;
}



void check_texts(const Tokenizer& tok, const std::string& key, const json& texts, const json& ids) {
  ASSERT_EQ(texts.size(), ids.size());
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::string text = texts[i].get<std::string>();
    const std::vector<int> want = ids[i].get<std::vector<int>>();
    const std::vector<int> got = tok.encode(text);
    EXPECT_EQ(got, want) << key << " text " << i << ": " << text;
    EXPECT_EQ(tok.decode(got), text) << key << " round trip " << i;
  }
}

void check_golden(const Tokenizer& tok, const std::string& key) {
  ASSERT_GE(golden().at("texts").size(), 15u);
  check_texts(tok, key, golden().at("texts"), golden().at("ids").at(key));
}

// A GGUF holding only the tokenizer of an HF tokenizer.json (as llama.cpp's
// converter stores it): tokens by id, token types, "a b" merges, pre name.
std::string tokenizer_json_to_gguf(const std::string& tj_path, const std::string& pre, const std::string& out) {
  const json j = load_json(tj_path);
  std::vector<std::string> tokens;
  const json& vocab = j.at("model").at("vocab");
  size_t n = vocab.size();
  for (const json& a : j.at("added_tokens")) n = std::max(n, a.at("id").get<size_t>() + 1);
  tokens.resize(n);
  std::vector<int32_t> types(n, 1);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) tokens[it.value().get<size_t>()] = it.key();
  for (const json& a : j.at("added_tokens")) {
    tokens[a.at("id").get<size_t>()] = a.at("content").get<std::string>();
    types[a.at("id").get<size_t>()] = 3;
  }
  std::vector<std::string> merges;
  for (const json& m : j.at("model").at("merges"))
    merges.push_back(m.is_string() ? m.get<std::string>() : m[0].get<std::string>() + " " + m[1].get<std::string>());
  oscar::test::GgufWriter w;
  w.kv_str("general.architecture", "qwen2");
  w.kv_str("tokenizer.ggml.model", "gpt2");
  w.kv_str("tokenizer.ggml.pre", pre);
  w.kv_strs("tokenizer.ggml.tokens", tokens);
  w.kv_i32s("tokenizer.ggml.token_type", types);
  w.kv_strs("tokenizer.ggml.merges", merges);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  w.kv_u32("tokenizer.ggml.bos_token_id", 0);
  w.kv_bool("tokenizer.ggml.add_bos_token", false);
  w.kv_str("tokenizer.chat_template", "{{ messages }}");
  w.write(out);
  return out;
}

}  // namespace

TEST(Tokenizer, TinyModelsMatchHfTokenizers) {
  for (const char* name : {"tiny-llama", "tiny-qwen2", "tiny-qwen3"}) {
    SCOPED_TRACE(name);
    const Tokenizer tok = Tokenizer::from_hf(kModels + name);
    EXPECT_EQ(tok.vocab_size(), 512);
    check_golden(tok, name);
  }
}

TEST(Tokenizer, HfSpecialsBosEosAndTemplate) {
  const Tokenizer llama = Tokenizer::from_hf(kModels + "tiny-llama");
  EXPECT_EQ(llama.bos(), llama.token_id("<|begin_of_text|>"));
  EXPECT_TRUE(llama.add_bos());
  const std::vector<int> plain = llama.encode("hello");
  const std::vector<int> with = llama.encode("hello", /*add_special=*/true);
  ASSERT_EQ(with.size(), plain.size() + 1);
  EXPECT_EQ(with[0], llama.bos());
  EXPECT_TRUE(llama.is_eos(llama.token_id("<|im_end|>")));
  EXPECT_TRUE(llama.is_special(llama.token_id("<|im_end|>")));
  EXPECT_FALSE(llama.is_special(plain[0]));
  EXPECT_NE(llama.chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(llama.decode(llama.encode("a<|im_end|>b"), /*skip_special=*/true), "ab");

  const Tokenizer qwen = Tokenizer::from_hf(kModels + "tiny-qwen2");
  EXPECT_FALSE(qwen.add_bos());
  EXPECT_EQ(qwen.encode("hello", true), qwen.encode("hello"));
}

TEST(Tokenizer, GgufMetadataTokenizerMatchesTokenizerJson) {
  // Same vocabulary and merges through the GGUF path, pre-tokenizer chosen by
  // its llama.cpp name: must reproduce the HF reference ids.
  const std::string p = tokenizer_json_to_gguf(kModels + "tiny-qwen2/tokenizer.json", "qwen2", tmp_path("tok.gguf"));
  const Tokenizer tok = Tokenizer::from_gguf(p);
  EXPECT_EQ(tok.pre_type(), "qwen2");
  EXPECT_EQ(tok.eos(), std::vector<int>{2});
  EXPECT_EQ(tok.chat_template(), "{{ messages }}");
  check_golden(tok, "tiny-qwen2");
  EXPECT_EQ(oscar::model::load_tokenizer(p).encode("Hello world"), tok.encode("Hello world"));
  // Llama-3's pre-tokenizer by its llama.cpp name (which also turns on
  // ignore_merges; every whole piece the tiny vocabulary holds is reachable by
  // merges too, so the ids must still match).
  const std::string pl = tokenizer_json_to_gguf(kModels + "tiny-llama/tokenizer.json", "llama-bpe", tmp_path("tokl.gguf"));
  check_golden(Tokenizer::from_gguf(pl), "tiny-llama");
  EXPECT_EQ(oscar::model::load_tokenizer(kModels + "tiny-qwen2").encode("Hello world"), tok.encode("Hello world"));
}

TEST(Tokenizer, PreTokenizerRegexesSplitAsTheFamiliesDo) {
  // Llama-3 groups digits by three, Qwen2 splits every digit: visible in the ids.
  const Tokenizer llama = Tokenizer::from_hf(kModels + "tiny-llama");
  const Tokenizer qwen = Tokenizer::from_hf(kModels + "tiny-qwen2");
  EXPECT_EQ(qwen.encode("12345").size(), 5u);
  EXPECT_LE(llama.encode("12345").size(), 4u);
  EXPECT_EQ(oscar::model::pre_regexes_for("smollm").size(), 2u);
  expect_error([] { oscar::model::pre_regexes_for("no-such-pre"); }, {"no-such-pre"});
}

TEST(Tokenizer, ArbitraryBytesRoundTrip) {
  const Tokenizer tok = Tokenizer::from_hf(kModels + "tiny-llama");
  std::string bytes;
  for (int i = 0; i < 256; ++i) bytes += char(i);
  bytes += "\xff\xfe abc \xc3";  // invalid UTF-8, truncated sequence at the end
  EXPECT_EQ(tok.decode(tok.encode(bytes)), bytes);
  const std::string spaces(5000, ' ');
  EXPECT_EQ(tok.decode(tok.encode(spaces + "x" + spaces)), spaces + "x" + spaces);
  // One 200 KB pre-token (no spaces): BPE must stay near-linear, not quadratic.
  std::string run;
  for (int i = 0; i < 20000; ++i) run += "abcdefghij";
  EXPECT_EQ(tok.decode(tok.encode(run)), run);
  std::string streamed;
  for (int id : tok.encode("naïve 東京 🙂")) streamed += tok.token_str(id);
  EXPECT_EQ(streamed, "naïve 東京 🙂");
  expect_error([&] { tok.token_text(100000); }, {"100000"});
}

TEST(Tokenizer, BadFilesNameTheFile) {
  const std::string dir = tmp_path("empty_dir");
  fs::create_directories(dir);
  expect_error([&] { Tokenizer::from_hf(dir); }, {dir});
  const std::string bad = tmp_path("bad_dir");
  fs::create_directories(bad);
  std::ofstream(bad + "/tokenizer.json") << "{ not json";
  expect_error([&] { Tokenizer::from_hf(bad); }, {"tokenizer.json"});
  std::ofstream(bad + "/tokenizer.json") << R"({"model": {"type": "Unigram", "vocab": []}, "decoder": null})";
  expect_error([&] { Tokenizer::from_hf(bad); }, {"tokenizer.json"});
  // Token ids that are not integers in range (a float beyond int's range was undefined
  // behaviour; a huge id sized a multi-GB token table) are refused by name.
  for (const char* id : {"3.1e107", "1.5", "-1", "16777216", "\"7\""}) {
    std::ofstream(bad + "/tokenizer.json")
        << R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": )" << id
        << R"(}, "merges": []}, "decoder": {"type": "ByteLevel"}})";
    expect_error([&] { Tokenizer::from_hf(bad); }, {"tokenizer.json", "token id of 'b'"});
  }
  // A GGUF with a SentencePiece ("llama") tokenizer is refused by name.
  oscar::test::GgufWriter w;
  w.kv_str("tokenizer.ggml.model", "llama");
  const std::string g = tmp_path("spm.gguf");
  w.write(g);
  expect_error([&] { Tokenizer::from_gguf(g); }, {g, "llama"});
}

TEST(Tokenizer, DefaultModelSmolLM2MatchesReference) {
  if (!fs::exists(kDefaultGguf)) GTEST_SKIP() << kDefaultGguf << " not present: run scripts/fetch_model.sh";
  if (!golden().at("ids").contains("smollm2")) GTEST_SKIP() << "tokenizer_golden.json has no smollm2 ids";
  const Tokenizer tok = oscar::model::load_tokenizer(kDefaultGguf);
  EXPECT_EQ(tok.vocab_size(), 49152);
  EXPECT_EQ(tok.pre_type(), "smollm");
  EXPECT_EQ(tok.bos(), 1);
  EXPECT_TRUE(tok.is_eos(2));
  EXPECT_EQ(tok.token_text(2), "<|im_end|>");
  EXPECT_NE(tok.chat_template().find("<|im_start|>"), std::string::npos);
  check_golden(tok, "smollm2");
}

TEST(Tokenizer, QwenCoderMatchesReference) {
  // Qwen2.5-Coder-1.5B-Instruct: ids from HF tokenizers on a tokenizer.json
  // rebuilt from the GGUF with Qwen2's pre-tokenizer, identical to
  // transformers' own GGUF tokenizer (scripts/golden_tokenizer.py): the 20
  // shared texts plus 16 Qwen-only ones (FIM/tool/repo tokens, code, digits of
  // other scripts, Unicode spaces, near-miss special tokens).
  if (!fs::exists(kQwenGguf)) GTEST_SKIP() << kQwenGguf << " not present: run scripts/fetch_qwen.sh";
  if (!golden().at("ids").contains("qwen2.5-coder"))
    GTEST_SKIP() << "tokenizer_golden.json has no qwen2.5-coder ids";
  const Tokenizer tok = oscar::model::load_tokenizer(kQwenGguf);
  EXPECT_EQ(tok.vocab_size(), 151936);
  EXPECT_EQ(tok.pre_type(), "qwen2");
  EXPECT_EQ(tok.bos(), 151643);
  EXPECT_FALSE(tok.add_bos());
  EXPECT_TRUE(tok.is_eos(151645));
  EXPECT_EQ(tok.token_text(151644), "<|im_start|>");
  EXPECT_EQ(tok.token_text(151645), "<|im_end|>");
  EXPECT_EQ(tok.token_id("<|fim_prefix|>"), 151659);
  EXPECT_EQ(tok.token_id("<tool_call>"), 151657);
  EXPECT_NE(tok.chat_template().find("<|im_start|>"), std::string::npos);
  EXPECT_EQ(tok.encode("<|im_start|>user\n"), (std::vector<int>{151644, 872, 198}));
  check_golden(tok, "qwen2.5-coder");
  const json& extra = golden().at("extra_texts").at("qwen2.5-coder");
  EXPECT_GE(extra.size(), 10u);
  check_texts(tok, "qwen2.5-coder extra", extra, golden().at("extra_ids").at("qwen2.5-coder"));
  // skip_special drops the added tokens (control and user-defined) only.
  EXPECT_EQ(tok.decode(tok.encode("<|im_start|>hi<|im_end|>"), /*skip_special=*/true), "hi");
}
