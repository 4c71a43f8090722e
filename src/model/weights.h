// Model weights after loading: dense fp32, dequantized from whatever the file
// held. Shapes are written beside each field ([rows][cols], row-major).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace oscar::model {

struct LayerWeights {
  Tensor attn_norm;  // [hidden]
  Tensor wq;         // [n_heads*head_dim][hidden]
  Tensor wk;         // [n_kv_heads*head_dim][hidden]
  Tensor wv;         // [n_kv_heads*head_dim][hidden]
  Tensor bq, bk, bv; // [out] (Qwen2 only; empty otherwise)
  Tensor q_norm;     // [head_dim] (Qwen3 only)
  Tensor k_norm;     // [head_dim] (Qwen3 only)
  Tensor wo;         // [hidden][n_heads*head_dim]
  Tensor ffn_norm;   // [hidden]
  Tensor w_gate;     // [intermediate][hidden]
  Tensor w_up;       // [intermediate][hidden]
  Tensor w_down;     // [hidden][intermediate]
};

struct ModelWeights {
  ModelConfig cfg;
  Tensor tok_embd;   // [vocab][hidden]
  std::vector<LayerWeights> layers;
  Tensor out_norm;   // [hidden]
  Tensor lm_head;    // [vocab][hidden]; empty when cfg.tied_embeddings
  // Identifies the weights for calibration files: hex digest over the config
  // and a sample of every tensor's bytes. Stable across GGUF/HF of the same data
  // is NOT promised (different dequantized values).
  std::string fingerprint;
};

}  // namespace oscar::model
