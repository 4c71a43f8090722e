#include "model/forward_random.h"

#include <cmath>
#include <random>

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

}  // namespace oscar::model
