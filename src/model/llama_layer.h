// One Llama-family decoder layer (Llama, Qwen2 with QKV bias, Qwen3 with QK-norm):
// its weights as a backend holds them and its arithmetic, shared by the paged
// forward (model/forward.cpp) and the dense forward of calibration and
// evaluation (model/calib_forward.cpp). The two differ only in the attention
// between the halves: the paged forward reads and writes the KV cache, the
// dense one attends over the whole sequence (or a hook's replacement).
//
//   x -> h = RMSNorm(x) -> qkv = h W_qkv (+b) -> q, k, v (+QK-norm) -> RoPE(q, k)
//     -> [attention: q, k, v -> attn]                      (the caller's)
//     -> x += attn W_o -> x += W_down (SiLU(g) * u), [g u] = RMSNorm(x) W_gate_up
#pragma once

#include "backend/backend.h"
#include "model/weights.h"

namespace oscar::model {

// The weights of one decoder layer as a backend holds them. QKV and gate+up are
// fused so one pass over x serves several products (and GEMV tasks are bigger).
struct PreparedLayer {
  backend::WeightPtr attn_norm;  // [hidden]
  backend::WeightPtr wqkv;       // [(Hq + 2 Hkv) * d][hidden], bias for Qwen2
  backend::WeightPtr q_norm;     // [d] (Qwen3) or null
  backend::WeightPtr k_norm;     // [d] (Qwen3) or null
  backend::WeightPtr wo;         // [hidden][Hq * d]
  backend::WeightPtr ffn_norm;   // [hidden]
  backend::WeightPtr w_gate_up;  // [2 * inter][hidden]: gate rows then up rows
  backend::WeightPtr w_down;     // [hidden][inter]
  // Bytes of the layer's weights (what one step streams).
  int64_t bytes() const;
};

// Prepares one layer's weights on `be` (shapes must already be checked).
PreparedLayer prepare_layer(backend::Backend& be, const ModelConfig& c, const LayerWeights& lw);

// The activations of T tokens in backend memory, row-major:
//   x, h, tmp [T][hidden]; qkv [T][(Hq + 2 Hkv) d]; q, attn [T][Hq d]; k, v [T][Hkv d];
//   gu [T][2 inter]; act [T][inter].
// x is the residual stream, carried from layer to layer.
struct LayerActivations {
  float *x = nullptr, *h = nullptr, *qkv = nullptr, *q = nullptr, *k = nullptr, *v = nullptr,
        *attn = nullptr, *tmp = nullptr, *gu = nullptr, *act = nullptr;
};

// Owns LayerActivations for up to `tokens` rows; grows on demand.
class ActivationBuffers {
 public:
  // Makes room for T rows (keeps the buffers when they are large enough).
  void ensure(backend::Backend& be, const ModelConfig& c, int T);
  const LayerActivations& get() const { return a_; }
  int tokens() const { return tokens_; }

 private:
  backend::BufferPtr x_, h_, qkv_, q_, k_, v_, attn_, tmp_, gu_, act_;
  LayerActivations a_;
  int tokens_ = 0;
};

// The first half of a layer: x -> q, k, v after QK-norm and RoPE (cos / sin: host
// tables [T][d/2] of the T rows' positions, kernels/cpu/rope.h).
void layer_attention_inputs(backend::Backend& be, const ModelConfig& c, const PreparedLayer& L, int T,
                            const LayerActivations& a, const float* cos, const float* sin);
// The same for a step into its cache: q, k, v, then q and k transformed by the store of
// `layer` and the k / v rows written where `rows` places them (Backend::qkv_heads_into_cache;
// one launch on the GPU): what a step over a KV cache runs before its attention.
void layer_attention_inputs_into_cache(backend::Backend& be, const ModelConfig& c, const PreparedLayer& L, int T,
                                       const LayerActivations& a, const float* cos, const float* sin,
                                       backend::PageStore& store, int layer, const backend::RowPlacement& rows);
// The second half: x += attn W_o, then the SwiGLU FFN on RMSNorm(x) added to x.
void layer_attention_output_and_ffn(backend::Backend& be, const ModelConfig& c, const PreparedLayer& L,
                                    int T, const LayerActivations& a);

// One layer, the attention given: attend(q, k, v, attn) -> false stops after the attention
// (the second half is not run; a hook that needs no later layers).
template <class Attend>
bool run_layer(backend::Backend& be, const ModelConfig& c, const PreparedLayer& L, int T,
               const LayerActivations& a, const float* cos, const float* sin, Attend&& attend) {
  layer_attention_inputs(be, c, L, T, a, cos, sin);
  if (!attend(a.q, a.k, a.v, a.attn)) return false;
  layer_attention_output_and_ffn(be, c, L, T, a);
  return true;
}

}  // namespace oscar::model
