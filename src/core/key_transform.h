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
