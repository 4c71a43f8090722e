// A dense, teacher-forced, full-sequence forward pass with per-layer
// instrumentation hooks, for calibration (DESIGN §3.1) and the accuracy
// evaluation (§6.2). No KV cache: one call sees all T tokens at positions
// p0..p0+T-1 (p0 = 0 unless given) and runs exact causal attention (or the
// hook's replacement).
//
// Why not Model::forward: calibration needs post-RoPE q/k/v AND the exact
// attention output o of every layer, and the evaluation's prefill simulation
// needs to replace attention by one that mixes BF16 and dequantized rows per
// (query, key) pair. Both are whole-sequence views the paged engine never
// materializes. The ops (embedding, linear, RMSNorm, RoPE, SwiGLU) are the
// engine's backend::Backend ops, so the arithmetic is the engine's.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "model/llama_layer.h"
#include "model/weights.h"

namespace oscar::model {

// Callbacks of one dense forward. Shapes: T tokens, Hq query heads, Hkv KV
// heads, d head_dim; all host fp32 (the CPU backend's buffers).
class DenseHooks {
 public:
  virtual ~DenseHooks() = default;
  // After QK-norm and RoPE, before attention: q [T][Hq][d], k/v [T][Hkv][d].
  // The hook may modify them in place (e.g. rotate keys/queries).
  virtual void on_qkv(int layer, float* q, float* k, float* v, int T) {}
  // Replaces the exact causal attention when it returns true; o [T][Hq][d].
  virtual bool attention(int layer, const float* q, const float* k, const float* v, int T,
                         float* o) {
    return false;
  }
  // The attention output per query head, before o_proj: o [T][Hq][d].
  virtual void on_attn_out(int layer, const float* o, int T) {}
  // Whether layers after `layer` are still needed (calibration stops early).
  virtual bool want_layer(int layer) { return true; }
};

class DenseForward {
 public:
  // Prepares the weights on `be` (which must outlive this object).
  DenseForward(const ModelWeights& w, backend::Backend& be);
  ~DenseForward();

  const ModelConfig& config() const { return cfg_; }

  // Runs tokens [T] at positions first_pos..first_pos+T-1. hidden (optional) gets the
  // final residual stream before the output norm, [T][hidden]. RoPE makes attention depend
  // only on relative positions, so first_pos changes the outputs only by rounding; it
  // changes the post-RoPE q and k the hooks see (calibration places chunks with it).
  void run(std::span<const int32_t> tokens, DenseHooks* hooks, std::vector<float>* hidden,
           int64_t first_pos = 0);

  // Logits of n rows of final hidden states (output norm + LM head).
  //   hidden [n][hidden] -> logits [n][vocab]
  void logits(const float* hidden, int n, std::vector<float>& logits);

  // The attention block's output (o_proj) of one layer for n rows of
  // attention outputs: o [n][Hq*d] -> y [n][hidden] = o W_o^T (the accuracy
  // evaluation's "error after o_proj" view; callable from inside a hook).
  void project_attention(int layer, const float* o, int n, std::vector<float>& y);

 private:
  backend::Backend& be_;
  ModelConfig cfg_;
  backend::WeightPtr embd_, out_norm_, lm_head_;
  std::vector<PreparedLayer> layers_;
  std::vector<float> inv_freq_;
};

// Exact causal attention, fp32 (the blocked GEMM of ops_gemm.h), query rows in blocks:
//   q [T][Hq][d], k, v [T][Hkv][d] -> o [T][Hq][d];  o_t = softmax(q_t K[0..t]^T * scale) V.
void dense_causal_attention(const float* q, const float* k, const float* v, int T, int Hq,
                            int Hkv, int d, float* o);

}  // namespace oscar::model
