#include "model/forward_random.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "core/parallel.h"
#include "model/forward.h"

namespace oscar::model {

ModelConfig tiny_config(Arch arch, bool tied) {
  ModelConfig c;
  c.arch = arch;
  c.name = "tiny-random";
  c.vocab_size = 101;
  c.hidden = 96;
  c.intermediate = 160;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.rms_eps = 1e-6f;
  c.rope_theta = 10000.0f;
  c.max_position = 4096;
  c.tied_embeddings = tied;
  c.qkv_bias = arch == Arch::kQwen2;
  c.qk_norm = arch == Arch::kQwen3;
  c.bos_token = 1;
  c.eos_tokens = {2};
  return c;
}

ModelWeights random_weights(const ModelConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto mat = [&](int64_t rows, int64_t cols) {
    Tensor t;
    t.shape = {rows, cols};
    t.data.resize(size_t(rows * cols));
    const float s = 1.0f / std::sqrt(float(cols));
    for (float& x : t.data) x = nd(rng) * s;
    return t;
  };
  auto vec = [&](int64_t n, float mean, float sd) {
    Tensor t;
    t.shape = {n};
    t.data.resize(size_t(n));
    for (float& x : t.data) x = mean + sd * nd(rng);
    return t;
  };
  const int64_t H = c.hidden, Dq = int64_t(c.n_heads) * c.head_dim,
                Dkv = int64_t(c.n_kv_heads) * c.head_dim, I = c.intermediate;
  ModelWeights w;
  w.cfg = c;
  w.tok_embd = mat(c.vocab_size, H);
  for (float& x : w.tok_embd.data) x *= std::sqrt(float(H));  // N(0, 1) rows
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights L;
    L.attn_norm = vec(H, 1.f, 0.1f);
    L.wq = mat(Dq, H);
    L.wk = mat(Dkv, H);
    L.wv = mat(Dkv, H);
    if (c.qkv_bias) {
      L.bq = vec(Dq, 0.f, 0.1f);
      L.bk = vec(Dkv, 0.f, 0.1f);
      L.bv = vec(Dkv, 0.f, 0.1f);
    }
    if (c.qk_norm) {
      L.q_norm = vec(c.head_dim, 1.f, 0.1f);
      L.k_norm = vec(c.head_dim, 1.f, 0.1f);
    }
    L.wo = mat(H, Dq);
    L.ffn_norm = vec(H, 1.f, 0.1f);
    L.w_gate = mat(I, H);
    L.w_up = mat(I, H);
    L.w_down = mat(H, I);
    w.layers.push_back(std::move(L));
  }
  w.out_norm = vec(H, 1.f, 0.1f);
  if (!c.tied_embeddings) w.lm_head = mat(c.vocab_size, H);
  w.fingerprint = "random-" + std::to_string(seed);
  return w;
}

std::vector<std::string> preset_names() { return {"qwen3-8b", "llama3-8b", "qwen25-1.5b"}; }

ModelConfig preset_config(const std::string& name) {
  ModelConfig c;
  c.name = name;
  c.rms_eps = 1e-6f;
  c.max_position = 1 << 20;
  if (name == "qwen3-8b") {
    c.arch = Arch::kQwen3;
    c.n_layers = 36, c.n_heads = 32, c.n_kv_heads = 8, c.head_dim = 128;
    c.hidden = 4096, c.intermediate = 12288, c.vocab_size = 151936;
    c.rope_theta = 1e6f;
    c.qk_norm = true;
  } else if (name == "llama3-8b") {
    c.arch = Arch::kLlama;
    c.n_layers = 32, c.n_heads = 32, c.n_kv_heads = 8, c.head_dim = 128;
    c.hidden = 4096, c.intermediate = 14336, c.vocab_size = 128256;
    c.rope_theta = 5e5f;
  } else if (name == "qwen25-1.5b") {
    c.arch = Arch::kQwen2;
    c.n_layers = 28, c.n_heads = 12, c.n_kv_heads = 2, c.head_dim = 128;
    c.hidden = 1536, c.intermediate = 8960, c.vocab_size = 151936;
    c.rope_theta = 1e6f;
    c.qkv_bias = true;
  } else {
    throw Error(fmt::format("unknown model shape preset '{}' ({})", name, fmt::join(preset_names(), ", ")));
  }
  return c;
}

void fill_uniform(Tensor& t, std::vector<int64_t> shape, double var, uint64_t seed) {
  t.shape = std::move(shape);
  size_t n = 1;
  for (auto d : t.shape) n *= size_t(d);
  t.data.resize(n);
  const float a = float(std::sqrt(3.0 * var));
  constexpr size_t kBlock = size_t(1) << 20;
  const int blocks = static_cast<int>((n + kBlock - 1) / kBlock);
  parallel_for(blocks, [&](int b, int) {
    uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull + uint64_t(b) * 0xD1B54A32D192ED03ull + 1;
    for (size_t i = size_t(b) * kBlock, e = std::min(n, i + kBlock); i < e; ++i) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      t.data[i] = a * (float(x >> 40) * (2.0f / 16777216.0f) - 1.0f);
    }
  });
}

namespace {

void fill_ones(Tensor& t, int64_t n) {
  t.shape = {n};
  t.data.assign(size_t(n), 1.0f);
}

}  // namespace

std::unique_ptr<Model> random_model(const ModelConfig& c, backend::Backend& be,
                                    const std::function<void(int, int)>& progress) {
  const int64_t H = c.hidden, Dq = int64_t(c.n_heads) * c.head_dim, Dkv = int64_t(c.n_kv_heads) * c.head_dim,
                I = c.intermediate;
  Tensor embd, onorm, lm;
  fill_uniform(embd, {c.vocab_size, H}, 1.0, 1);
  fill_ones(onorm, H);
  if (!c.tied_embeddings) fill_uniform(lm, {c.vocab_size, H}, 1.0 / double(H), 2);
  LayerWeights lw;
  return std::make_unique<Model>(
      c, be, embd, onorm, lm,
      [&](int l) -> const LayerWeights& {
        const uint64_t s = 100 + 10 * uint64_t(l);
        fill_ones(lw.attn_norm, H);
        fill_ones(lw.ffn_norm, H);
        fill_uniform(lw.wq, {Dq, H}, 1.0 / double(H), s);
        fill_uniform(lw.wk, {Dkv, H}, 1.0 / double(H), s + 1);
        fill_uniform(lw.wv, {Dkv, H}, 1.0 / double(H), s + 2);
        fill_uniform(lw.wo, {H, Dq}, 1.0 / double(Dq), s + 3);
        fill_uniform(lw.w_gate, {I, H}, 1.0 / double(H), s + 4);
        fill_uniform(lw.w_up, {I, H}, 1.0 / double(H), s + 5);
        fill_uniform(lw.w_down, {H, I}, 1.0 / double(I), s + 6);
        if (c.qkv_bias) {
          fill_uniform(lw.bq, {Dq}, 1.0, s + 7);
          fill_uniform(lw.bk, {Dkv}, 1.0, s + 8);
          fill_uniform(lw.bv, {Dkv}, 1.0, s + 9);
        }
        if (c.qk_norm) {
          fill_ones(lw.q_norm, c.head_dim);
          fill_ones(lw.k_norm, c.head_dim);
        }
        if (progress) progress(l + 1, c.n_layers);
        return lw;
      },
      c.n_layers);
}

}  // namespace oscar::model
