// The key transform of one layer (core/calibration.h, docs/core.md "Key transform"), prepared as the
// matrices the cache write and the query rotation apply:
//
//   stored key    k̃ = (k − μ_h)·M_K[h]    M_K = diag(1/s_h)·R_h
//   query         q̃ = q·M_Q[h]            M_Q = diag(s_h)·R_h    (h = the query's KV head)
//
// so q̃·k̃ = q·diag(s)·R·Rᵀ·diag(1/s)·(k − μ)ᵀ = q·k − q·μ_h: the same shift for every key
// a query sees (BF16 windows and INT2 middle alike), which softmax ignores. Without a
// transform M_K = M_Q = R and there is no offset. R is the calibration's orthogonal
// rotation (one per layer or per KV head); with per-head means or scales the prepared
// matrices are per KV head even when R is shared. The mean is subtracted before the
// matrix (in the original basis) on every backend: CPU (kernels/cpu/key_transform.h) and CUDA
// (kernels/cuda/cache_write.h, WriteRotation::k_mean) compute the same thing.
#pragma once

#include <cstdint>
#include <vector>

#include "core/calibration.h"

namespace oscar {

struct KeyTransform {
  int d = 0;
  int n = 1;                  // matrices: 1 (shared by every KV head) or n_kv_heads
  std::vector<float> key;     // [n][d][d] M_K
  std::vector<float> query;   // [n][d][d] M_Q (equal to key when there is no scale)
  std::vector<float> mean;    // [n_kv_heads][d] μ (original basis), or empty (no centering)
  const float* key_matrix(int h) const { return key.data() + size_t(n == 1 ? 0 : h) * d * d; }
  const float* query_matrix(int h) const { return query.data() + size_t(n == 1 ? 0 : h) * d * d; }
};

// Throws oscar::Error when the layer's mean / scale sizes do not match n_kv_heads x d.
KeyTransform prepare_key_transform(const LayerCalibration& L, int n_kv_heads, int d);

// A layer's page centering (core/calibration.h) prepared for the kernels, in the storage basis:
// with ν_h the head's pre-RoPE mean and RoPE pairs s = 0..S-1 (channels j_s, j_s + d/2,
// frequency θ_s), the centre of a middle page whose centre position is t is
//
//   δ_h(t) = (RoPE_t(ν_h) − μ_h|S)·M_K = Σ_s cos(θ_s t)·u[h][s] + sin(θ_s t)·w[h][s] − mu[h]
//   u[h][s] = (ν_j e_j + ν_j' e_j')·M_K,  w[h][s] = (ν_j e_j' − ν_j' e_j)·M_K  (j = j_s, j' = j + d/2)
//
// with μ_h|S the fixed mean μ_h on the channels of the S pairs only. The page stores
// (k − μ)·M_K − δ: on the S slow pairs k − RoPE_t(ν), on the others k − μ as before; and a
// query adds q̃·δ_h(t) back to the page's logits (q̃·(x·M_K) = q·x). S counts the pairs where some head of the calibration
// has ν ≠ 0 (the same pairs in every layer, so a batch's angle table serves all layers). A head
// with ν = 0 has u = w = mu = 0: δ = 0, its pages keep the fixed μ of the key transform.
struct PageCenter {
  std::vector<int> pair;    // [S] j_s
  std::vector<float> freq;  // [S] θ_s, rad per position
  std::vector<float> u, w;  // [n_kv_heads][S][d]
  std::vector<float> mu;    // [n_kv_heads][d] μ·M_K
  std::vector<uint8_t> active;  // [n_kv_heads] 1 where the head has ν (else u = w = mu = 0)
  int pairs() const { return static_cast<int>(pair.size()); }
  bool empty() const { return pair.empty(); }
};

// The RoPE pairs with page centering anywhere in the calibration (ascending), and their
// frequencies. Empty without page centering.
std::vector<int> page_center_pairs(const Calibration& c);
// Layer `layer`'s page centering over `pairs` (page_center_pairs(c)); an empty PageCenter when
// `pairs` is empty or the layer has no ν. Throws oscar::Error on sizes that do not match.
PageCenter prepare_page_center(const Calibration& c, int layer, const KeyTransform& xf,
                               const std::vector<int>& pairs, int n_kv_heads, int d);

// Reference application, fp64 accumulation (tests and small inputs):
//   k [T][Hkv][d] -> k̃;  q [T][Hq][d] -> q̃ (query head g uses KV head g / (Hq / Hkv)).
void apply_key_transform_ref(const KeyTransform& t, float* k, int64_t T, int Hkv);
void apply_query_transform_ref(const KeyTransform& t, float* q, int64_t T, int Hq, int Hkv);

// Channel scales of one KV head from its statistics (docs/core.md "Key transform"): s_c = (a_c / b_c)^(1/4)
// with a = the centered key variance, b = the query second moment, both summed over the
// RoPE pair (c, c + d/2) so that s commutes with RoPE; normalized to geometric mean 1,
// clamped to [1/64, 64]. Channels without signal (a or b ~ 0) get 1.
//   key_var, query_ms: [d]  ->  s: [d]
std::vector<float> smoothing_scales(const double* key_var, const double* query_ms, int d);

}  // namespace oscar
