// Synthetic activations with planted structure, for tests and benchmarks
// (no model needed). Per (layer, KV head), with a random orthogonal basis B:
//   queries  q = z·diag(√λ)·Bᵀ,   λ_i = q_decay^i          (anisotropic C_Q = B Λ Bᵀ)
//   keys     k = z·diag(√μ)·Bᵀ + outliers,  μ_i = k_decay^i, and `outlier_channels`
//            fixed channels with a large offset and scale (massive activations)
//   values   v = z·diag(√ν)·B_vᵀ,  ν_i = v_decay^i
//   o        optional causal softmax attention output (O(T²): keep T small)
// z has i.i.d. approximately standard normal entries (sum of uniforms).
// Deterministic in `seed`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/activation_dump.h"

namespace oscar {

struct SyntheticSpec {
  int n_layers = 2, n_q_heads = 4, n_kv_heads = 2, head_dim = 64;
  int64_t tokens = 1024;
  double q_decay = 0.90, k_decay = 0.93, v_decay = 0.95;
  int outlier_channels = 2;
  float outlier_offset = 12.0f, outlier_scale = 4.0f;
  bool with_o = false;
  uint64_t seed = 1;
};

// One layer's activations (fp32): q [T][Hq][d], k,v [T][Hkv][d], o [T][Hq][d] (if with_o).
struct SyntheticLayer {
  std::vector<float> q, k, v, o;
};
SyntheticLayer synthetic_layer(const SyntheticSpec& s, int layer);

// Writes a dump (f16 or bf16 or f32) layer by layer, streaming (bounded
// memory). metadata gets model.architecture = "synthetic".
void write_synthetic_dump(const std::string& path, const SyntheticSpec& s, st::Dtype dtype,
                          const ProgressFn& progress = nullptr);

}  // namespace oscar
