// Hugging Face loader on the committed tiny models (F32 sharded Llama, BF16
// tied Qwen2 with biases, F16 Qwen3 with QK-norm), plus broken checkpoints.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/safetensors.h"
#include "model/loader.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace oscar::model;
using oscar::Tensor;

using oscar::test::expect_error;
using oscar::test::tmp_path;

namespace {

const std::string kModels = std::string(OSCAR_TEST_DATA_DIR) + "/model/";


// A fresh copy of a tiny model to break.
std::string copy_model(const std::string& name, const std::string& tag) {
  const fs::path d = fs::temp_directory_path() / ("oscar_test_hf_" + std::to_string(::getpid())) / tag;
  fs::remove_all(d);
  fs::create_directories(d.parent_path());
  fs::copy(kModels + name, d, fs::copy_options::recursive);
  for (const auto& e : fs::directory_iterator(d)) fs::permissions(e.path(), fs::perms::owner_read | fs::perms::owner_write);
  return d.string();
}

nlohmann::json read_json(const std::string& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return nlohmann::json::parse(ss.str());
}

void write_json(const std::string& p, const nlohmann::json& j) { std::ofstream(p) << j.dump(1); }

}  // namespace

TEST(HfLoader, TinyLlamaShardedF32) {
  const ModelWeights w = load_model(kModels + "tiny-llama");
  const ModelConfig& c = w.cfg;
  EXPECT_EQ(c.arch, Arch::kLlama);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.hidden, 128);
  EXPECT_EQ(c.intermediate, 128);
  EXPECT_EQ(c.n_layers, 2);
  EXPECT_EQ(c.n_heads, 2);
  EXPECT_EQ(c.n_kv_heads, 1);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_FALSE(c.tied_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_FLOAT_EQ(c.rms_eps, 1e-5f);
  EXPECT_FLOAT_EQ(c.rope_theta, 10000.0f);
  EXPECT_EQ(c.rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_FLOAT_EQ(c.rope_scaling.factor, 8.0f);
  EXPECT_FLOAT_EQ(c.rope_scaling.low_freq_factor, 1.0f);
  EXPECT_FLOAT_EQ(c.rope_scaling.high_freq_factor, 4.0f);
  EXPECT_EQ(c.rope_scaling.original_max_position, 64);
  EXPECT_EQ(c.max_position, 256);
  EXPECT_EQ(c.bos_token, 3);
  EXPECT_EQ(c.eos_tokens, std::vector<int>{2});
  EXPECT_EQ(c.name, "tiny-llama");
  ASSERT_EQ(w.lm_head.shape, (std::vector<int64_t>{512, 128}));
  // Values are the file's, tensor by tensor (both shards).
  const auto idx = read_json(kModels + "tiny-llama/model.safetensors.index.json");
  int from_second = 0;
  for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
    const oscar::st::File f = oscar::st::File::open(kModels + "tiny-llama/" + it.value().get<std::string>());
    from_second += it.value().get<std::string>().find("00002") != std::string::npos;
    const std::string& n = it.key();
    const Tensor* t = n == "lm_head.weight" ? &w.lm_head
                      : n == "model.embed_tokens.weight" ? &w.tok_embd
                      : n == "model.norm.weight" ? &w.out_norm
                      : n == "model.layers.1.self_attn.q_proj.weight" ? &w.layers[1].wq
                      : n == "model.layers.0.mlp.down_proj.weight" ? &w.layers[0].w_down
                      : n == "model.layers.1.post_attention_layernorm.weight" ? &w.layers[1].ffn_norm
                      : nullptr;
    if (t != nullptr) {
      EXPECT_EQ(t->data, f.read_f32(n)) << n;
    }
  }
  EXPECT_GT(from_second, 0);
}

TEST(HfLoader, TinyQwen2TiedBf16WithBias) {
  const ModelWeights w = load_model(kModels + "tiny-qwen2");
  EXPECT_EQ(w.cfg.arch, Arch::kQwen2);
  EXPECT_TRUE(w.cfg.tied_embeddings);
  EXPECT_TRUE(w.lm_head.empty());
  EXPECT_TRUE(w.cfg.qkv_bias);
  EXPECT_FLOAT_EQ(w.cfg.rope_theta, 1e6f);
  EXPECT_EQ(w.cfg.rope_scaling.type, RopeScaling::Type::kNone);
  ASSERT_EQ(w.layers[1].bk.shape, (std::vector<int64_t>{64}));
  const oscar::st::File f = oscar::st::File::open(kModels + "tiny-qwen2/model.safetensors");
  EXPECT_EQ(f.at("model.layers.1.self_attn.k_proj.bias").dtype, oscar::st::Dtype::BF16);
  EXPECT_EQ(w.layers[1].bk.data, f.read_f32("model.layers.1.self_attn.k_proj.bias"));
  EXPECT_EQ(w.layers[0].wv.data, f.read_f32("model.layers.0.self_attn.v_proj.weight"));
}

TEST(HfLoader, TinyQwen3F16QkNormWideHeads) {
  const ModelWeights w = load_model(kModels + "tiny-qwen3");
  EXPECT_EQ(w.cfg.arch, Arch::kQwen3);
  EXPECT_TRUE(w.cfg.qk_norm);
  EXPECT_FALSE(w.cfg.qkv_bias);
  EXPECT_EQ(w.cfg.n_heads, 4);
  EXPECT_EQ(w.cfg.n_kv_heads, 2);
  EXPECT_EQ(w.cfg.head_dim, 64);  // != hidden / heads = 32
  EXPECT_EQ(w.layers[0].wq.shape, (std::vector<int64_t>{256, 128}));
  EXPECT_EQ(w.layers[0].wo.shape, (std::vector<int64_t>{128, 256}));
  const oscar::st::File f = oscar::st::File::open(kModels + "tiny-qwen3/model.safetensors");
  EXPECT_EQ(w.layers[1].k_norm.data, f.read_f32("model.layers.1.self_attn.k_norm.weight"));
}

TEST(HfLoader, GoldenLogitFilesMatchTheModels) {
  // The engine's golden tests read these; check they fit the models.
  for (const char* name : {"tiny-llama", "tiny-qwen2", "tiny-qwen3"}) {
    SCOPED_TRACE(name);
    const ModelWeights w = load_model(kModels + name);
    const oscar::st::File g = oscar::st::File::open(kModels + name + "/golden.safetensors");
    const auto& ids = g.at("input_ids");
    const auto& logits = g.at("logits");
    ASSERT_EQ(ids.shape.size(), 1u);
    EXPECT_EQ(logits.shape, (std::vector<int64_t>{ids.shape[0], w.cfg.vocab_size}));
    EXPECT_EQ(g.at("greedy_ids").shape, std::vector<int64_t>{40});
    for (float x : g.read_f32("logits")) ASSERT_TRUE(std::isfinite(x));
  }
}

TEST(HfLoader, BrokenCheckpointsNameTheProblem) {
  {
    const std::string d = copy_model("tiny-qwen3", "arch");
    auto c = read_json(d + "/config.json");
    c["architectures"] = {"GPTNeoXForCausalLM"};
    write_json(d + "/config.json", c);
    expect_error([&] { load_model(d); }, {"config.json", "GPTNeoXForCausalLM"});
  }
  {
    const std::string d = copy_model("tiny-qwen3", "shape");
    auto c = read_json(d + "/config.json");
    c["intermediate_size"] = 96;
    write_json(d + "/config.json", c);
    expect_error([&] { load_model(d); }, {"model.safetensors", "w_gate", "shape"});
  }
  {
    const std::string d = copy_model("tiny-llama", "missing");
    auto idx = read_json(d + "/model.safetensors.index.json");
    idx["weight_map"].erase("model.layers.1.mlp.up_proj.weight");
    write_json(d + "/model.safetensors.index.json", idx);
    expect_error([&] { load_model(d); }, {"index.json", "model.layers.1.mlp.up_proj.weight"});
  }
  {
    const std::string d = copy_model("tiny-llama", "nohead");
    auto idx = read_json(d + "/model.safetensors.index.json");
    idx["weight_map"].erase("lm_head.weight");
    write_json(d + "/model.safetensors.index.json", idx);
    expect_error([&] { load_model(d); }, {"lm_head.weight"});
  }
  {
    const std::string d = copy_model("tiny-qwen2", "trunc");
    fs::resize_file(d + "/model.safetensors", fs::file_size(d + "/model.safetensors") - 1000);
    expect_error([&] { load_model(d); }, {"model.safetensors"});
  }
  {
    const std::string d = copy_model("tiny-qwen2", "noweights");
    fs::remove(d + "/model.safetensors");
    expect_error([&] { load_model(d); }, {d, "model.safetensors"});
  }
  {
    const std::string d = copy_model("tiny-qwen2", "badjson");
    std::ofstream(d + "/config.json") << "{\"architectures\": [";
    expect_error([&] { load_model(d); }, {"config.json"});
  }
}

TEST(HfLoader, MistralAndTransformers5RopeParameters) {
  const ModelWeights ref = load_model(kModels + "tiny-llama");
  {
    // Mistral (no sliding window) is the Llama graph.
    const std::string d = copy_model("tiny-llama", "mistral");
    auto c = read_json(d + "/config.json");
    c["architectures"] = {"MistralForCausalLM"};
    c["sliding_window"] = nullptr;
    write_json(d + "/config.json", c);
    const ModelWeights w = load_model(d);
    EXPECT_EQ(w.cfg.arch, Arch::kLlama);
    EXPECT_EQ(w.fingerprint, ref.fingerprint);
  }
  {
    // transformers >= 5 writes rope settings as rope_parameters.
    const std::string d = copy_model("tiny-llama", "rope_params");
    auto c = read_json(d + "/config.json");
    nlohmann::json rp = c["rope_scaling"];
    rp["rope_theta"] = 12345.0;  // not the 10000 default, so reading it is visible
    c.erase("rope_scaling");
    c.erase("rope_theta");
    c["rope_parameters"] = rp;
    write_json(d + "/config.json", c);
    const ModelWeights w = load_model(d);
    EXPECT_FLOAT_EQ(w.cfg.rope_theta, 12345.0f);
    EXPECT_EQ(w.cfg.rope_scaling.type, RopeScaling::Type::kLlama3);
    EXPECT_FLOAT_EQ(w.cfg.rope_scaling.factor, ref.cfg.rope_scaling.factor);
    EXPECT_EQ(w.cfg.rope_scaling.original_max_position, ref.cfg.rope_scaling.original_max_position);
  }
  {
    const std::string d = copy_model("tiny-llama", "yarn");
    auto c = read_json(d + "/config.json");
    c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
    write_json(d + "/config.json", c);
    expect_error([&] { load_model(d); }, {"config.json", "yarn"});
  }
}
