// Hugging Face checkpoint -> ModelWeights: config.json + model.safetensors or
// model.safetensors.index.json with shards. Tensor names are the transformers
// ones (model.layers.N.self_attn.q_proj.weight, ...), already [out][in].
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <climits>
#include <memory>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_file.h"
#include "core/safetensors.h"
#include "model/loader.h"

namespace oscar::model {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json read_json(const fs::path& p) { return oscar::read_json_file(p.string()); }

// The shards of a checkpoint, opened once; finds which file holds a tensor.
class Shards {
 public:
  explicit Shards(const fs::path& dir) : dir_(dir) {
    const fs::path index = dir / "model.safetensors.index.json";
    if (fs::exists(index)) {
      const json j = read_json(index);
      if (!j.contains("weight_map") || !j.at("weight_map").is_object())
        throw Error(fmt::format("{}: no weight_map", index.string()));
      for (auto it = j.at("weight_map").begin(); it != j.at("weight_map").end(); ++it) {
        if (!it.value().is_string()) throw Error(fmt::format("{}: bad entry for '{}'", index.string(), it.key()));
        const std::string file = it.value().get<std::string>();
        if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
          throw Error(fmt::format("{}: shard name '{}' leaves the directory", index.string(), file));
        where_[it.key()] = file;
      }
      source_ = index.string();
    } else if (fs::exists(dir / "model.safetensors")) {
      auto f = std::make_unique<st::File>(st::File::open((dir / "model.safetensors").string()));
      for (const std::string& n : f->names()) where_[n] = "model.safetensors";
      files_["model.safetensors"] = std::move(f);
      source_ = (dir / "model.safetensors").string();
    } else {
      throw Error(fmt::format("{}: neither model.safetensors nor model.safetensors.index.json", dir.string()));
    }
  }

  const std::string& source() const { return source_; }
  bool has(const std::string& name) const { return where_.count(name) != 0; }

  Tensor read(const std::string& name, bool optional = false) {
    Tensor t;
    auto it = where_.find(name);
    if (it == where_.end()) {
      if (optional) return t;
      throw Error(fmt::format("{}: missing tensor '{}'", source_, name));
    }
    st::File& f = file(it->second);
    const st::TensorInfo* info = f.find(name);
    if (info == nullptr)
      throw Error(fmt::format("{}: missing tensor '{}' (the index points here)", f.path(), name));
    switch (info->dtype) {
      case st::Dtype::F32: case st::Dtype::F16: case st::Dtype::BF16: case st::Dtype::F64: break;
      default:
        throw Error(fmt::format("{}: tensor '{}' has dtype {}, expected a float type", f.path(), name,
                                st::dtype_name(info->dtype)));
    }
    t.shape = info->shape;
    t.data = f.read_f32(name);
    return t;
  }

 private:
  st::File& file(const std::string& name) {
    auto it = files_.find(name);
    if (it == files_.end())
      it = files_.emplace(name, std::make_unique<st::File>(st::File::open((dir_ / name).string()))).first;
    return *it->second;
  }
  fs::path dir_;
  std::string source_;
  std::map<std::string, std::string> where_;
  std::map<std::string, std::unique_ptr<st::File>> files_;
};

// Sizes in config.json: integers in [0, INT32_MAX] (a larger one would wrap when
// narrowed to int and pass the later checks with a wrong value).
int get_int(const json& j, const char* key, const std::string& src) {
  if (!j.contains(key)) throw Error(fmt::format("{}: missing '{}'", src, key));
  return static_cast<int>(json_int(j.at(key), 0, INT32_MAX, fmt::format("{}: '{}'", src, key)));
}

int get_int(const json& j, const char* key, int dflt) {
  if (!j.contains(key) || !j.at(key).is_number_integer()) return dflt;
  return static_cast<int>(json_int(j.at(key), 0, INT32_MAX, fmt::format("config.json: '{}'", key)));
}

double get_num(const json& j, const char* key, double dflt) {
  return j.contains(key) && j.at(key).is_number() ? j.at(key).get<double>() : dflt;
}

void parse_config(const json& j, const std::string& src, ModelConfig& c) {
  std::string arch;
  if (j.contains("architectures") && j.at("architectures").is_array() && !j.at("architectures").empty())
    arch = j.at("architectures").at(0).get<std::string>();
  if (arch == "LlamaForCausalLM" || arch == "MistralForCausalLM") c.arch = Arch::kLlama;
  else if (arch == "Qwen2ForCausalLM") c.arch = Arch::kQwen2;
  else if (arch == "Qwen3ForCausalLM") c.arch = Arch::kQwen3;
  else
    throw Error(fmt::format("{}: unsupported architecture '{}' (Llama, Mistral, Qwen2, Qwen3 are)", src, arch));
  c.name = j.value("_name_or_path", "");
  c.vocab_size = get_int(j, "vocab_size", src);
  c.hidden = get_int(j, "hidden_size", src);
  c.intermediate = get_int(j, "intermediate_size", src);
  c.n_layers = get_int(j, "num_hidden_layers", src);
  c.n_heads = get_int(j, "num_attention_heads", src);
  c.n_kv_heads = get_int(j, "num_key_value_heads", c.n_heads);
  c.head_dim = get_int(j, "head_dim", c.n_heads > 0 ? c.hidden / c.n_heads : 0);
  c.rms_eps = static_cast<float>(get_num(j, "rms_norm_eps", 1e-6));
  c.max_position = get_int(j, "max_position_embeddings", 2048);
  c.tied_embeddings = j.contains("tie_word_embeddings") && j.at("tie_word_embeddings").is_boolean() &&
                      j.at("tie_word_embeddings").get<bool>();
  c.qkv_bias = c.arch == Arch::kQwen2;
  c.qk_norm = c.arch == Arch::kQwen3;
  if (c.arch != Arch::kQwen2 && j.contains("attention_bias") && j.at("attention_bias").is_boolean() &&
      j.at("attention_bias").get<bool>())
    throw Error(fmt::format("{}: attention_bias (bias on q/k/v/o) is not supported for {}", src, arch));
  if (j.contains("mlp_bias") && j.at("mlp_bias").is_boolean() && j.at("mlp_bias").get<bool>())
    throw Error(fmt::format("{}: mlp_bias is not supported", src));
  if (j.contains("hidden_act") && j.at("hidden_act").is_string() && j.at("hidden_act").get<std::string>() != "silu")
    throw Error(fmt::format("{}: hidden_act '{}' is not supported (silu is)", src,
                            j.at("hidden_act").get<std::string>()));
  // Newer transformers configs move rope_theta/rope_scaling into rope_parameters.
  json rope = j.contains("rope_scaling") && j.at("rope_scaling").is_object() ? j.at("rope_scaling") : json();
  if (j.contains("rope_parameters") && j.at("rope_parameters").is_object()) {
    const json& rp = j.at("rope_parameters");
    c.rope_theta = static_cast<float>(get_num(rp, "rope_theta", 10000.0));
    if (rope.is_null()) rope = rp;
  }
  c.rope_theta = static_cast<float>(get_num(j, "rope_theta", c.rope_theta));
  if (rope.is_object()) {
    std::string type = rope.value("rope_type", rope.value("type", "default"));
    if (type == "llama3") {
      c.rope_scaling.type = RopeScaling::Type::kLlama3;
      c.rope_scaling.factor = static_cast<float>(get_num(rope, "factor", 8.0));
      c.rope_scaling.low_freq_factor = static_cast<float>(get_num(rope, "low_freq_factor", 1.0));
      c.rope_scaling.high_freq_factor = static_cast<float>(get_num(rope, "high_freq_factor", 4.0));
      c.rope_scaling.original_max_position = get_int(rope, "original_max_position_embeddings", 8192);
    } else if (type == "linear") {
      c.rope_scaling.type = RopeScaling::Type::kLinear;
      c.rope_scaling.factor = static_cast<float>(get_num(rope, "factor", 1.0));
    } else if (type != "default") {
      throw Error(fmt::format("{}: rope scaling '{}' is not supported", src, type));
    }
  }
  if (j.contains("bos_token_id") && j.at("bos_token_id").is_number_integer())
    c.bos_token = static_cast<int>(json_int(j.at("bos_token_id"), -1, INT32_MAX, src + ": 'bos_token_id'"));
  if (j.contains("eos_token_id")) {
    const json& e = j.at("eos_token_id");
    if (e.is_number_integer()) c.eos_tokens.push_back(static_cast<int>(json_int(e, 0, INT32_MAX, src + ": 'eos_token_id'")));
    else if (e.is_array())
      for (const json& x : e)
        if (x.is_number_integer())
          c.eos_tokens.push_back(static_cast<int>(json_int(x, 0, INT32_MAX, src + ": 'eos_token_id'")));
  }
}

}  // namespace

ModelWeights load_hf(const std::string& dir_str) {
  const fs::path dir = dir_str;
  const fs::path cfg_path = dir / "config.json";
  if (!fs::exists(cfg_path)) throw Error(fmt::format("{}: no config.json", dir_str));
  ModelWeights w;
  ModelConfig& c = w.cfg;
  try {
    parse_config(read_json(cfg_path), cfg_path.string(), c);
    if (fs::exists(dir / "generation_config.json")) {
      const json g = read_json(dir / "generation_config.json");
      if (g.contains("eos_token_id")) {
        const json& e = g.at("eos_token_id");
        std::vector<int> ids;
        if (e.is_number_integer()) ids.push_back(static_cast<int>(json_int(e, 0, INT32_MAX, "generation_config.json: 'eos_token_id'")));
        else if (e.is_array())
          for (const json& x : e)
            if (x.is_number_integer())
              ids.push_back(static_cast<int>(json_int(x, 0, INT32_MAX, "generation_config.json: 'eos_token_id'")));
        for (int id : ids)
          if (std::find(c.eos_tokens.begin(), c.eos_tokens.end(), id) == c.eos_tokens.end()) c.eos_tokens.push_back(id);
      }
    }
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed config: {}", cfg_path.string(), e.what()));
  }
  if (c.name.empty()) c.name = fs::absolute(dir).lexically_normal().filename().string();
  if (c.n_layers <= 0 || c.n_layers > 4096)
    throw Error(fmt::format("{}: invalid num_hidden_layers {}", cfg_path.string(), c.n_layers));

  check_host_memory(c, cfg_path.string());
  Shards s(dir);
  w.tok_embd = s.read("model.embed_tokens.weight");
  w.out_norm = s.read("model.norm.weight");
  // Tied checkpoints may still store lm_head.weight (a copy): the config's
  // word decides. An untied config without the head is an error (transformers
  // would silently use a random head).
  if (!c.tied_embeddings) w.lm_head = s.read("lm_head.weight");
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::string p = fmt::format("model.layers.{}.", l);
    L.attn_norm = s.read(p + "input_layernorm.weight");
    L.wq = s.read(p + "self_attn.q_proj.weight");
    L.wk = s.read(p + "self_attn.k_proj.weight");
    L.wv = s.read(p + "self_attn.v_proj.weight");
    L.wo = s.read(p + "self_attn.o_proj.weight");
    if (c.qkv_bias) {
      L.bq = s.read(p + "self_attn.q_proj.bias");
      L.bk = s.read(p + "self_attn.k_proj.bias");
      L.bv = s.read(p + "self_attn.v_proj.bias");
    }
    if (c.qk_norm) {
      L.q_norm = s.read(p + "self_attn.q_norm.weight");
      L.k_norm = s.read(p + "self_attn.k_norm.weight");
    }
    L.ffn_norm = s.read(p + "post_attention_layernorm.weight");
    L.w_gate = s.read(p + "mlp.gate_proj.weight");
    L.w_up = s.read(p + "mlp.up_proj.weight");
    L.w_down = s.read(p + "mlp.down_proj.weight");
  }
  check_weights(w, s.source());
  w.fingerprint = weights_fingerprint(w);
  return w;
}

}  // namespace oscar::model
