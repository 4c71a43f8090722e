// GGUF model loading: the tiny HF models are written as GGUF files the way
// llama.cpp's converter writes them (llama.cpp names, Q/K rows permuted for
// arch "llama"); load_gguf must give back exactly the HF weights. Plus broken
// models and the real default model when scripts/fetch_model.sh fetched it.
#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <string>

#include "core/error.h"
#include "core/safetensors.h"
#include "model/gguf.h"
#include "model/loader.h"
#include "test_gguf_writer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace oscar::model;
using oscar::Tensor;

using oscar::test::expect_error;
using oscar::test::tmp_path;

namespace {

const std::string kModels = std::string(OSCAR_TEST_DATA_DIR) + "/model/";
const std::string kDefaultGguf = std::string(OSCAR_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";



// llama.cpp's permute(): HF rows [h][2][d/2] -> GGUF rows [h][d/2][2].
std::vector<float> permute_rows(const std::vector<float>& w, int64_t rows, int64_t cols, int heads) {
  std::vector<float> out(w.size());
  const int64_t d = rows / heads, half = d / 2;
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t i = 0; i < half; ++i)
        for (int64_t c = 0; c < cols; ++c)
          out[size_t((h * d + 2 * i + j) * cols + c)] = w[size_t((h * d + j * half + i) * cols + c)];
  return out;
}

// Options to break the conversion on purpose.
struct Convert {
  std::string skip;                    // tensor name not written
  std::string reshape;                 // tensor written with its first dim - 1 rows
  std::string arch_override;
  std::vector<float> rope_freqs;       // written as rope_freqs.weight when non-empty
};

Convert skip(const std::string& n) { Convert c; c.skip = n; return c; }
Convert reshape(const std::string& n) { Convert c; c.reshape = n; return c; }
Convert arch(const std::string& a) { Convert c; c.arch_override = a; return c; }

// Writes a GGUF equivalent of the HF checkpoint in `dir` (F32 tensors).
std::string hf_to_gguf(const std::string& name, const ModelWeights& hf, const std::string& out,
                       const Convert& cv = {}) {
  const ModelConfig& c = hf.cfg;
  const std::string arch = cv.arch_override.empty() ? arch_name(c.arch) : cv.arch_override;
  oscar::test::GgufWriter w;
  w.kv_str("general.architecture", arch);
  w.kv_str("general.name", name);
  const std::string p = std::string(arch_name(c.arch)) + ".";
  w.kv_u32(p + "block_count", uint32_t(c.n_layers));
  w.kv_u32(p + "context_length", uint32_t(c.max_position));
  w.kv_u32(p + "embedding_length", uint32_t(c.hidden));
  w.kv_u32(p + "feed_forward_length", uint32_t(c.intermediate));
  w.kv_u32(p + "attention.head_count", uint32_t(c.n_heads));
  w.kv_u32(p + "attention.head_count_kv", uint32_t(c.n_kv_heads));
  w.kv_u32(p + "attention.key_length", uint32_t(c.head_dim));
  w.kv_u32(p + "attention.value_length", uint32_t(c.head_dim));
  w.kv_f32(p + "rope.freq_base", c.rope_theta);
  w.kv_f32(p + "attention.layer_norm_rms_epsilon", c.rms_eps);
  w.kv_u32("tokenizer.ggml.bos_token_id", 3);
  w.kv_u32("tokenizer.ggml.eos_token_id", 2);
  const bool llama = c.arch == Arch::kLlama;
  auto put = [&](const std::string& n, const Tensor& t, int permute_heads = 0) {
    if (t.empty() || n == cv.skip) return;
    std::vector<int64_t> shape = t.shape;
    std::vector<float> data = t.data;
    if (permute_heads > 0 && llama)
      data = permute_rows(data, shape[0], shape.size() > 1 ? shape[1] : 1, permute_heads);
    if (n == cv.reshape) {
      const int64_t row = data.size() / size_t(shape[0]);
      shape[0] -= 1;
      data.resize(size_t(shape[0] * row));
    }
    w.tensor_f32(n, shape, data);
  };
  put("token_embd.weight", hf.tok_embd);
  put("output_norm.weight", hf.out_norm);
  put("output.weight", hf.lm_head);
  if (!cv.rope_freqs.empty()) w.tensor_f32("rope_freqs.weight", {int64_t(cv.rope_freqs.size())}, cv.rope_freqs);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = hf.layers[size_t(l)];
    const std::string b = "blk." + std::to_string(l) + ".";
    put(b + "attn_norm.weight", L.attn_norm);
    put(b + "attn_q.weight", L.wq, c.n_heads);
    put(b + "attn_k.weight", L.wk, c.n_kv_heads);
    put(b + "attn_v.weight", L.wv);
    put(b + "attn_q.bias", L.bq, c.n_heads);
    put(b + "attn_k.bias", L.bk, c.n_kv_heads);
    put(b + "attn_v.bias", L.bv);
    put(b + "attn_q_norm.weight", L.q_norm);
    put(b + "attn_k_norm.weight", L.k_norm);
    put(b + "attn_output.weight", L.wo);
    put(b + "ffn_norm.weight", L.ffn_norm);
    put(b + "ffn_gate.weight", L.w_gate);
    put(b + "ffn_up.weight", L.w_up);
    put(b + "ffn_down.weight", L.w_down);
  }
  w.write(out);
  return out;
}

void expect_same(const Tensor& a, const Tensor& b, const std::string& what) {
  EXPECT_EQ(a.shape, b.shape) << what;
  ASSERT_EQ(a.data.size(), b.data.size()) << what;
  for (size_t i = 0; i < a.data.size(); ++i) ASSERT_EQ(a.data[i], b.data[i]) << what << " elem " << i;
}

void expect_same_model(const ModelWeights& g, const ModelWeights& h) {
  EXPECT_EQ(g.cfg.arch, h.cfg.arch);
  EXPECT_EQ(g.cfg.vocab_size, h.cfg.vocab_size);
  EXPECT_EQ(g.cfg.hidden, h.cfg.hidden);
  EXPECT_EQ(g.cfg.intermediate, h.cfg.intermediate);
  EXPECT_EQ(g.cfg.n_layers, h.cfg.n_layers);
  EXPECT_EQ(g.cfg.n_heads, h.cfg.n_heads);
  EXPECT_EQ(g.cfg.n_kv_heads, h.cfg.n_kv_heads);
  EXPECT_EQ(g.cfg.head_dim, h.cfg.head_dim);
  EXPECT_EQ(g.cfg.tied_embeddings, h.cfg.tied_embeddings);
  EXPECT_EQ(g.cfg.qkv_bias, h.cfg.qkv_bias);
  EXPECT_EQ(g.cfg.qk_norm, h.cfg.qk_norm);
  EXPECT_FLOAT_EQ(g.cfg.rope_theta, h.cfg.rope_theta);
  EXPECT_FLOAT_EQ(g.cfg.rms_eps, h.cfg.rms_eps);
  expect_same(g.tok_embd, h.tok_embd, "tok_embd");
  expect_same(g.out_norm, h.out_norm, "out_norm");
  expect_same(g.lm_head, h.lm_head, "lm_head");
  for (size_t l = 0; l < h.layers.size(); ++l) {
    const LayerWeights &a = g.layers[l], &b = h.layers[l];
    const std::string p = "layer " + std::to_string(l) + " ";
    expect_same(a.attn_norm, b.attn_norm, p + "attn_norm");
    expect_same(a.wq, b.wq, p + "wq");
    expect_same(a.wk, b.wk, p + "wk");
    expect_same(a.wv, b.wv, p + "wv");
    expect_same(a.bq, b.bq, p + "bq");
    expect_same(a.bk, b.bk, p + "bk");
    expect_same(a.bv, b.bv, p + "bv");
    expect_same(a.q_norm, b.q_norm, p + "q_norm");
    expect_same(a.k_norm, b.k_norm, p + "k_norm");
    expect_same(a.wo, b.wo, p + "wo");
    expect_same(a.ffn_norm, b.ffn_norm, p + "ffn_norm");
    expect_same(a.w_gate, b.w_gate, p + "w_gate");
    expect_same(a.w_up, b.w_up, p + "w_up");
    expect_same(a.w_down, b.w_down, p + "w_down");
  }
  EXPECT_EQ(g.fingerprint, h.fingerprint);  // same values -> same digest
}

}  // namespace

TEST(GgufModel, ConvertedTinyModelsLoadToTheHfWeights) {
  for (const char* name : {"tiny-llama", "tiny-qwen2", "tiny-qwen3"}) {
    SCOPED_TRACE(name);
    const ModelWeights hf = load_hf(kModels + name);
    const std::string p = hf_to_gguf(name, hf, tmp_path(std::string(name) + ".gguf"));
    const ModelWeights g = load_model(p);
    expect_same_model(g, hf);
    EXPECT_EQ(g.cfg.name, name);
    EXPECT_EQ(g.cfg.bos_token, 3);
    EXPECT_EQ(g.cfg.eos_tokens, std::vector<int>{2});
  }
}

TEST(GgufModel, LlamaQkPermutationIsUndone) {
  // The file really holds permuted rows (so the round trip above is not
  // trivially true), and load_gguf restores the HF order.
  const ModelWeights hf = load_hf(kModels + "tiny-llama");
  const std::string p = hf_to_gguf("p", hf, tmp_path("perm.gguf"));
  const gguf::File f = gguf::File::open(p);
  EXPECT_NE(f.read_f32("blk.0.attn_q.weight"), hf.layers[0].wq.data);
  EXPECT_NE(f.read_f32("blk.1.attn_k.weight"), hf.layers[1].wk.data);
  EXPECT_EQ(f.read_f32("blk.0.attn_v.weight"), hf.layers[0].wv.data);
  const ModelWeights g = load_gguf(p);
  expect_same(g.layers[0].wq, hf.layers[0].wq, "wq");
  expect_same(g.layers[1].wk, hf.layers[1].wk, "wk");
  // A qwen2 file (NeoX rope) is stored unpermuted and must be taken as is.
  const ModelWeights q = load_hf(kModels + "tiny-qwen2");
  const std::string pq = hf_to_gguf("q", q, tmp_path("q.gguf"));
  EXPECT_EQ(gguf::File::open(pq).read_f32("blk.1.attn_k.weight"), q.layers[1].wk.data);
  expect_same(load_gguf(pq).layers[1].wk, q.layers[1].wk, "qwen2 wk");
}

TEST(GgufModel, RopeFreqsTensorIsLoaded) {
  const ModelWeights hf = load_hf(kModels + "tiny-llama");
  Convert cv;
  for (int i = 0; i < hf.cfg.head_dim / 2; ++i) cv.rope_freqs.push_back(1.0f + float(i));
  const ModelWeights g = load_gguf(hf_to_gguf("r", hf, tmp_path("rope.gguf"), cv));
  EXPECT_EQ(g.cfg.rope_freq_factors, cv.rope_freqs);
}

TEST(GgufModel, BrokenModelsNameTheFileAndTensor) {
  const ModelWeights hf = load_hf(kModels + "tiny-qwen3");
  {
    const std::string p = hf_to_gguf("m", hf, tmp_path("missing.gguf"), skip("blk.1.ffn_up.weight"));
    expect_error([&] { load_gguf(p); }, {p, "blk.1.ffn_up.weight"});
  }
  {
    const std::string p = hf_to_gguf("s", hf, tmp_path("shape.gguf"), reshape("blk.0.attn_k.weight"));
    expect_error([&] { load_gguf(p); }, {p, "wk", "shape"});
  }
  {
    const std::string p = hf_to_gguf("a", hf, tmp_path("arch.gguf"), arch("gpt2"));
    expect_error([&] { load_gguf(p); }, {p, "gpt2"});
  }
  {
    const std::string p = hf_to_gguf("q", hf, tmp_path("noqk.gguf"), skip("blk.0.attn_q_norm.weight"));
    expect_error([&] { load_gguf(p); }, {p, "q_norm"});
  }
  expect_error([&] { load_model(tmp_path("nothing-here.gguf")); }, {"nothing-here.gguf"});
}

TEST(GgufModel, FingerprintSeesWeightChanges) {
  ModelWeights hf = load_hf(kModels + "tiny-llama");
  const std::string a = hf.fingerprint;
  EXPECT_EQ(a.size(), 32u);
  EXPECT_EQ(weights_fingerprint(hf), a);
  hf.layers[1].w_down.data[0] += 1.0f;  // sampled: index 0 is always in the sample
  EXPECT_NE(weights_fingerprint(hf), a);
  EXPECT_NE(load_hf(kModels + "tiny-qwen2").fingerprint, a);
}

TEST(GgufModel, DefaultModelSmolLM2) {
  if (!fs::exists(kDefaultGguf)) GTEST_SKIP() << kDefaultGguf << " not present: run scripts/fetch_model.sh";
  const auto t0 = std::chrono::steady_clock::now();
  const ModelWeights w = load_model(kDefaultGguf);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const ModelConfig& c = w.cfg;
  EXPECT_EQ(c.arch, Arch::kLlama);
  EXPECT_EQ(c.n_layers, 30);
  EXPECT_EQ(c.hidden, 576);
  EXPECT_EQ(c.intermediate, 1536);
  EXPECT_EQ(c.n_heads, 9);
  EXPECT_EQ(c.n_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_TRUE(c.tied_embeddings);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FLOAT_EQ(c.rope_theta, 100000.0f);
  EXPECT_EQ(c.bos_token, 1);
  EXPECT_EQ(c.eos_tokens, std::vector<int>{2});
  for (const Tensor* t : {&w.tok_embd, &w.layers[0].wq, &w.layers[29].w_down, &w.out_norm})
    for (float x : t->data) ASSERT_TRUE(std::isfinite(x));
  std::printf("loaded %s in %.2f s, fingerprint %s\n", kDefaultGguf.c_str(), s, w.fingerprint.c_str());
}
