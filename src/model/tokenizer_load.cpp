// Tokenizer loaders: GGUF metadata (tokenizer.ggml.*) and Hugging Face
// tokenizer.json (+ tokenizer_config.json, config.json, generation_config.json).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_file.h"
#include "model/gguf.h"
#include "model/tokenizer_impl.h"

namespace oscar::model {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Token ids above this are refused: the largest vocabularies in use hold ~256K
// entries, and an id sizes the token table (a hostile 2^31 would allocate GBs).
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;

void add_unique(std::vector<int>& v, int id) {
  if (id >= 0 && std::find(v.begin(), v.end(), id) == v.end()) v.push_back(id);
}

json read_json(const fs::path& p) { return oscar::read_json_file(p.string()); }

// Escapes a literal for use inside a PCRE2 pattern.
std::string regex_quote(const std::string& s) { return "\\Q" + s + "\\E"; }

// Appends the regexes of one tokenizer.json pre_tokenizer node.
void collect_pre(const json& node, const std::string& src, std::vector<std::string>& out,
                 bool& add_prefix_space) {
  if (node.is_null()) return;
  const std::string type = node.value("type", "");
  if (type == "Sequence") {
    for (const json& p : node.at("pretokenizers")) collect_pre(p, src, out, add_prefix_space);
  } else if (type == "ByteLevel") {
    if (node.value("add_prefix_space", false)) add_prefix_space = true;
    if (node.value("use_regex", true)) out.push_back(pre_regexes_for("gpt2")[0]);
  } else if (type == "Split") {
    const std::string behavior = node.value("behavior", "Isolated");
    if (behavior != "Isolated" || node.value("invert", false))
      throw Error(fmt::format("{}: unsupported Split pre-tokenizer (behavior {}, invert {})", src,
                              behavior, node.value("invert", false)));
    const json& pat = node.at("pattern");
    if (pat.contains("Regex")) out.push_back(pat.at("Regex").get<std::string>());
    else out.push_back(regex_quote(pat.at("String").get<std::string>()));
  } else if (type == "Digits") {
    out.push_back(node.value("individual_digits", false) ? R"(\p{N})" : R"(\p{N}+)");
  } else {
    throw Error(fmt::format("{}: unsupported pre-tokenizer type '{}'", src, type));
  }
}

// Ids a TemplateProcessing post-processor puts before a single sequence.
void collect_prefix(const json& node, std::vector<int>& ids) {
  if (node.is_null()) return;
  const std::string type = node.value("type", "");
  if (type == "Sequence") {
    for (const json& p : node.at("processors")) collect_prefix(p, ids);
  } else if (type == "TemplateProcessing") {
    for (const json& item : node.at("single")) {
      if (!item.contains("SpecialToken")) break;
      const std::string name = item.at("SpecialToken").at("id").get<std::string>();
      const json& st = node.at("special_tokens").at(name);
      for (const json& id : st.at("ids"))
        ids.push_back(static_cast<int>(json_int(id, 0, kMaxTokenId, "post_processor special token id")));
    }
  }
}

// "eos_token": "<|im_end|>" or {"content": "<|im_end|>", ...}.
std::string token_content(const json& j) {
  if (j.is_string()) return j.get<std::string>();
  if (j.is_object() && j.contains("content")) return j.at("content").get<std::string>();
  return {};
}

void collect_ids(const json& j, std::vector<int>& out) {
  if (j.is_number_integer()) add_unique(out, static_cast<int>(json_int(j, 0, kMaxTokenId, "eos_token_id")));
  else if (j.is_array())
    for (const json& e : j)
      if (e.is_number_integer()) add_unique(out, static_cast<int>(json_int(e, 0, kMaxTokenId, "eos_token_id")));
}

}  // namespace

Tokenizer Tokenizer::from_gguf(const std::string& path) {
  const gguf::File f = gguf::File::open(path);
  const std::string model = f.get_string("tokenizer.ggml.model");
  if (model != "gpt2")
    throw Error(fmt::format("{}: tokenizer.ggml.model is '{}'; only byte-level BPE ('gpt2') is supported",
                            path, model));
  Tokenizer t;
  Impl& im = *t.impl_;
  im.source = path;
  const gguf::Value* toks = f.find_kv("tokenizer.ggml.tokens");
  if (toks == nullptr || !toks->is_array() || toks->array_type != gguf::ValueType::kString)
    throw Error(fmt::format("{}: missing or malformed tokenizer.ggml.tokens", path));
  im.tokens = toks->strs;
  const size_t n = im.tokens.size();
  im.added.assign(n, 0);
  im.special.assign(n, 0);
  if (const gguf::Value* tt = f.find_kv("tokenizer.ggml.token_type")) {
    if (!tt->is_array() || tt->ints.size() != n)
      throw Error(fmt::format("{}: tokenizer.ggml.token_type has {} entries for {} tokens", path,
                              tt->array_size(), n));
    for (size_t i = 0; i < n; ++i) {
      // 3 = control, 4 = user-defined: both matched verbatim before BPE.
      const int64_t ty = tt->ints[i];
      im.added[i] = (ty == 3 || ty == 4) ? 1 : 0;
      im.special[i] = ty == 3 ? 1 : 0;
    }
  }
  const gguf::Value* merges = f.find_kv("tokenizer.ggml.merges");
  if (merges == nullptr || !merges->is_array() || merges->array_type != gguf::ValueType::kString)
    throw Error(fmt::format("{}: missing or malformed tokenizer.ggml.merges", path));
  im.merge_rank.reserve(merges->strs.size());
  for (size_t r = 0; r < merges->strs.size(); ++r) im.merge_rank.emplace(merges->strs[r], static_cast<int>(r));
  t.pre_type_ = f.get_string("tokenizer.ggml.pre", "default");
  im.regexes = pre_regexes_for(t.pre_type_);
  // llama.cpp applies Llama-3's ignore_merges for its pre-tokenizer only.
  im.ignore_merges = t.pre_type_ == "llama-bpe" || t.pre_type_ == "llama3" || t.pre_type_ == "llama-v3";
  im.add_prefix_space = f.get_bool("tokenizer.ggml.add_space_prefix", false);
  im.unk = static_cast<int>(f.get_int("tokenizer.ggml.unknown_token_id", -1));
  t.bos_ = static_cast<int>(f.get_int("tokenizer.ggml.bos_token_id", -1));
  add_unique(t.eos_, static_cast<int>(f.get_int("tokenizer.ggml.eos_token_id", -1)));
  add_unique(t.eos_, static_cast<int>(f.get_int("tokenizer.ggml.eot_token_id", -1)));
  add_unique(t.eos_, static_cast<int>(f.get_int("tokenizer.ggml.eom_token_id", -1)));
  t.add_bos_ = f.get_bool("tokenizer.ggml.add_bos_token", false);
  t.chat_template_ = f.get_string("tokenizer.chat_template", "");
  for (int id : t.eos_)
    if (id >= static_cast<int>(n)) throw Error(fmt::format("{}: eos token id {} out of range", path, id));
  if (t.bos_ >= static_cast<int>(n)) throw Error(fmt::format("{}: bos token id {} out of range", path, t.bos_));
  t.build();
  return t;
}

Tokenizer Tokenizer::from_hf(const std::string& dir_or_file) {
  fs::path file = dir_or_file;
  if (fs::is_directory(file)) file /= "tokenizer.json";
  const fs::path dir = file.parent_path();
  const std::string src = file.string();
  if (!fs::exists(file)) throw Error(fmt::format("{}: no tokenizer.json", src));
  const json j = read_json(file);
  Tokenizer t;
  Impl& im = *t.impl_;
  im.source = src;
  try {
    const json& model = j.at("model");
    if (model.value("type", "BPE") != "BPE")
      throw Error(fmt::format("{}: model type '{}' is not BPE", src, model.value("type", "")));
    if (!j.contains("decoder") || j.at("decoder").is_null() || j.at("decoder").value("type", "") != "ByteLevel")
      throw Error(fmt::format("{}: only byte-level BPE (decoder ByteLevel) is supported", src));
    const json& vocab = model.at("vocab");
    int max_id = -1;
    auto id_of = [&](const json& v, const std::string& tok) {
      return static_cast<int>(json_int(v, 0, kMaxTokenId, fmt::format("{}: token id of '{}'", src, tok)));
    };
    for (auto it = vocab.begin(); it != vocab.end(); ++it) max_id = std::max(max_id, id_of(it.value(), it.key()));
    for (const json& a : j.value("added_tokens", json::array()))
      max_id = std::max(max_id, id_of(a.at("id"), a.value("content", "")));
    if (max_id < 0) throw Error(fmt::format("{}: empty vocabulary", src));
    const size_t n = static_cast<size_t>(max_id) + 1;
    im.tokens.assign(n, std::string());
    im.added.assign(n, 0);
    im.special.assign(n, 0);
    for (auto it = vocab.begin(); it != vocab.end(); ++it) {
      im.tokens[static_cast<size_t>(id_of(it.value(), it.key()))] = it.key();
    }
    for (const json& a : j.value("added_tokens", json::array())) {
      const auto id = static_cast<size_t>(id_of(a.at("id"), a.value("content", "")));
      im.tokens[id] = a.at("content").get<std::string>();
      im.added[id] = 1;
      im.special[id] = a.value("special", false) ? 1 : 0;
    }
    const json& merges = model.at("merges");
    im.merge_rank.reserve(merges.size());
    int rank = 0;
    for (const json& m : merges) {
      // Older files: "a b"; newer: ["a", "b"].
      std::string key = m.is_string() ? m.get<std::string>()
                                      : m.at(0).get<std::string>() + " " + m.at(1).get<std::string>();
      im.merge_rank.emplace(std::move(key), rank++);
    }
    im.ignore_merges = model.value("ignore_merges", false);
    if (model.contains("unk_token") && model.at("unk_token").is_string()) {
      auto it = vocab.find(model.at("unk_token").get<std::string>());
      if (it != vocab.end()) im.unk = id_of(it.value(), it.key());
    }
    const json& norm = j.contains("normalizer") ? j.at("normalizer") : json();
    // Qwen2 declares NFC; we assume NFC input and do not renormalize (see docs/models.md).
    if (!norm.is_null() && norm.value("type", "") != "NFC")
      throw Error(fmt::format("{}: unsupported normalizer '{}'", src, norm.value("type", "")));
    collect_pre(j.contains("pre_tokenizer") ? j.at("pre_tokenizer") : json(), src, im.regexes,
                im.add_prefix_space);
    std::vector<int> prefix;
    collect_prefix(j.contains("post_processor") ? j.at("post_processor") : json(), prefix);
    if (!prefix.empty()) {
      t.add_bos_ = true;
      t.bos_ = prefix[0];
    }
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed tokenizer.json: {}", src, e.what()));
  }
  t.pre_type_ = "tokenizer.json";
  t.build();

  // Special ids and the chat template from the files beside tokenizer.json.
  try {
    if (fs::exists(dir / "tokenizer_config.json")) {
      const json tc = read_json(dir / "tokenizer_config.json");
      if (tc.contains("chat_template") && tc.at("chat_template").is_string())
        t.chat_template_ = tc.at("chat_template").get<std::string>();
      if (tc.contains("bos_token")) {
        const int id = t.token_id(token_content(tc.at("bos_token")));
        if (id >= 0 && t.bos_ < 0) t.bos_ = id;
      }
      if (tc.contains("eos_token")) add_unique(t.eos_, t.token_id(token_content(tc.at("eos_token"))));
      if (tc.contains("add_bos_token") && tc.at("add_bos_token").is_boolean() && t.bos_ >= 0)
        t.add_bos_ = tc.at("add_bos_token").get<bool>();
    }
    for (const char* name : {"generation_config.json", "config.json"}) {
      if (!fs::exists(dir / name)) continue;
      const json c = read_json(dir / name);
      if (c.contains("eos_token_id")) collect_ids(c.at("eos_token_id"), t.eos_);
      if (t.bos_ < 0 && c.contains("bos_token_id") && c.at("bos_token_id").is_number_integer())
        t.bos_ = static_cast<int>(json_int(c.at("bos_token_id"), 0, kMaxTokenId, name + std::string(": bos_token_id")));
    }
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed tokenizer/config JSON: {}", dir.string(), e.what()));
  }
  if (fs::exists(dir / "chat_template.jinja") && t.chat_template_.empty()) {
    std::ifstream in(dir / "chat_template.jinja", std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    t.chat_template_ = ss.str();
  }
  const int nv = t.vocab_size();
  t.eos_.erase(std::remove_if(t.eos_.begin(), t.eos_.end(), [&](int id) { return id < 0 || id >= nv; }),
               t.eos_.end());
  if (t.bos_ >= nv) t.bos_ = -1;
  return t;
}

}  // namespace oscar::model
