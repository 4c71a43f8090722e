// One decoder layer's weights as a backend holds them (model/forward.cpp and
// model/calib_forward.cpp share it).
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
};

// Prepares one layer's weights on `be` (shapes must already be checked).
PreparedLayer prepare_layer(backend::Backend& be, const ModelConfig& c, const LayerWeights& lw);

}  // namespace oscar::model
