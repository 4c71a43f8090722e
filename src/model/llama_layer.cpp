#include "model/llama_layer.h"

#include <algorithm>

#include "backend/backend.h"

namespace oscar::model {

PreparedLayer prepare_layer(backend::Backend& be, const ModelConfig& c, const LayerWeights& lw) {
  PreparedLayer L;
  L.attn_norm = be.prepare_vector(lw.attn_norm);
  if (c.qkv_bias)
    L.wqkv = be.prepare_linear({&lw.wq, &lw.wk, &lw.wv}, {&lw.bq, &lw.bk, &lw.bv});
  else
    L.wqkv = be.prepare_linear({&lw.wq, &lw.wk, &lw.wv}, {});
  if (c.qk_norm) {
    L.q_norm = be.prepare_vector(lw.q_norm);
    L.k_norm = be.prepare_vector(lw.k_norm);
  }
  L.wo = be.prepare_linear({&lw.wo}, {});
  L.ffn_norm = be.prepare_vector(lw.ffn_norm);
  L.w_gate_up = be.prepare_linear({&lw.w_gate, &lw.w_up}, {});
  L.w_down = be.prepare_linear({&lw.w_down}, {});
  return L;
}

int64_t PreparedLayer::bytes() const {
  return attn_norm->bytes + wqkv->bytes + wo->bytes + ffn_norm->bytes + w_gate_up->bytes + w_down->bytes +
         (q_norm ? q_norm->bytes : 0) + (k_norm ? k_norm->bytes : 0);
}

void ActivationBuffers::ensure(backend::Backend& be, const ModelConfig& c, int T) {
  if (T <= tokens_) return;
  const size_t n = size_t(T), H = c.hidden, Dq = size_t(c.n_heads) * c.head_dim,
               Dkv = size_t(c.n_kv_heads) * c.head_dim, I = c.intermediate;
  x_ = be.alloc(n * H);
  h_ = be.alloc(n * H);
  qkv_ = be.alloc(n * (Dq + 2 * Dkv));
  q_ = be.alloc(n * Dq);
  k_ = be.alloc(n * Dkv);
  v_ = be.alloc(n * Dkv);
  attn_ = be.alloc(n * Dq);
  tmp_ = be.alloc(n * H);
  gu_ = be.alloc(n * 2 * I);
  act_ = be.alloc(n * I);
  a_ = {x_->data(), h_->data(), qkv_->data(), q_->data(), k_->data(), v_->data(),
        attn_->data(), tmp_->data(), gu_->data(), act_->data()};
  tokens_ = T;
}

void layer_attention_inputs(backend::Backend& be, const ModelConfig& c, const PreparedLayer& L, int T,
                            const LayerActivations& a, const float* cos, const float* sin) {
  be.rms_norm_linear(a.x, *L.attn_norm, c.rms_eps, *L.wqkv, T, a.h, a.qkv);
  be.qkv_heads(a.qkv, T, c.n_heads, c.n_kv_heads, c.head_dim, c.qk_norm ? L.q_norm.get() : nullptr,
               c.qk_norm ? L.k_norm.get() : nullptr, c.rms_eps, cos, sin, a.q, a.k, a.v);
}

void layer_attention_inputs_into_cache(backend::Backend& be, const ModelConfig& c, const PreparedLayer& L, int T,
                                       const LayerActivations& a, const float* cos, const float* sin,
                                       backend::PageStore& store, int layer, const backend::RowPlacement& rows) {
  be.rms_norm_linear(a.x, *L.attn_norm, c.rms_eps, *L.wqkv, T, a.h, a.qkv);
  be.qkv_heads_into_cache(a.qkv, T, c.n_heads, c.n_kv_heads, c.head_dim, c.qk_norm ? L.q_norm.get() : nullptr,
                          c.qk_norm ? L.k_norm.get() : nullptr, c.rms_eps, cos, sin, a.q, a.k, a.v, store, layer,
                          rows);
}

void layer_attention_output_and_ffn(backend::Backend& be, const ModelConfig& c, const PreparedLayer& L,
                                    int T, const LayerActivations& a) {
  const int I = c.intermediate;
  be.linear_add(*L.wo, a.attn, T, a.x, a.tmp);
  be.rms_norm_linear(a.x, *L.ffn_norm, c.rms_eps, *L.w_gate_up, T, a.h, a.gu);
  be.silu_mul_linear_add(a.gu, T, I, *L.w_down, a.act, a.x, a.tmp);
}

}  // namespace oscar::model
