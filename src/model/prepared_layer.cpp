#include "model/prepared_layer.h"
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

}  // namespace oscar::model
