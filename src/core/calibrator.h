// Streaming OSCAR calibration (DESIGN §3): feed per-layer activations from a
// model forward or an activation dump, get a Calibration.
//
//   Calibrator cal(cfg, n_layers, n_q_heads, n_kv_heads, d);
//   for each chunk of calibration tokens, for each layer:
//     cal.add(layer, q, k, v, o_or_null, T);   // post-RoPE (post-QK-norm) q, k
//   Calibration c = cal.finish(fingerprint);
//
// Statistics, per (layer, KV head h), accumulated in fp64 with BLAS rank-k
// updates (rows converted to fp64 first, so every product and sum is fp64):
//   query  C_Q = mean over tokens t and query heads g∈G(h) of q_{t,g}ᵀ q_{t,g}
//   key target    = C_Q ("query", DESIGN §3.1) or mean k kᵀ ("raw")
//   value target  = mean o oᵀ over t, g∈G(h)                ("attn-output", needs o)
//                 | Σ_t w_t v vᵀ / Σ_t w_t, w_t = k_t C_Q kᵀ ("key-weighted", ref default)
//                 | mean v vᵀ                                ("raw")
// Key-weighted needs the final C_Q, so K and V rows of a layer are buffered
// (fp32, 8·T·H_kv·d bytes per layer) until the layer is finished: call
// finish_layer(l) once a layer has seen all its tokens to free them early.
// With granularity "layer" the per-head targets are averaged (each head's
// target is already a mean, so this is the pooled mean); with "head" every KV
// head gets its own rotation.
//
// Key transform (cfg.key_transform, docs/core.md "Key transform"): per KV head the
// post-RoPE key mean μ and the key variance / query second moment per channel are
// accumulated too; a transformed head's keys are (k − μ)·diag(1/s), whose query target is
// diag(s)·C_Q·diag(s) (raw: diag(1/s)·(E[k kᵀ] − μ μᵀ)·diag(1/s)), and the rotation
// diagonalizes that. kAuto transforms (center + scale) every head of every layer when some head
// of some layer has a mean carrying at least cfg.key_offset_share of its key energy Σμ² / Σ E[k²]
// (a model with key offsets), and none otherwise; kOffsetHeads transforms exactly those heads.
//
// Clip ratios are cfg.k_clip / cfg.v_clip unless cfg.clip_search: then, per
// rotation, the ratio in cfg.clip_grid minimizing the attention-aware error
// (quant_error.h; keys weighted by C_Q, values by the value target) on a
// reservoir sample of cfg.sample_tokens tokens (deterministic in cfg.seed and
// the feeding order).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/calibration.h"
#include "core/quantizer.h"
#include "core/rotation.h"

namespace oscar {

// The fields' defaults are the method as the paper defines it (U·H·P, per layer, C_Q /
// key-weighted targets, clips 0.96 / 0.92) plus the key transform; what `oscar calibrate`
// uses without flags is calib_preset("recommended") below.
struct CalibConfig {
  Composition composition = Composition::kUHP;
  KeyTarget key_target = KeyTarget::kQuery;
  ValueTarget value_target = ValueTarget::kKeyWeighted;
  Granularity granularity = Granularity::kLayer;
  QuantSpec quant;  // bits / group / scale dtype: clip search and file metadata
                    // (group_size > d is lowered to d)
  float k_clip = 0.96f, v_clip = 0.92f;
  bool clip_search = false;
  KeyTransformMode key_transform = KeyTransformMode::kAuto;
  // kAuto's / kOffsetHeads' threshold on Σμ² / Σ E[k²] (docs/accuracy.md: Qwen2.5's bias heads
  // 0.94-1.00, every other head of Qwen2.5-Coder-1.5B and SmolLM2-135M 0.24-0.72).
  float key_offset_share = 0.85f;
  std::vector<float> clip_grid = {0.80f, 0.84f, 0.88f, 0.90f, 0.92f, 0.94f, 0.96f, 0.98f, 1.0f};
  // Page centering (core/calibration.h, docs/core.md "Page centering"): every head the key
  // transform centres also gets its pre-RoPE key mean ν on the RoPE pairs that turn by at most
  // 1 rad over a page of center_page tokens (freq · center_page <= 1). Needs rope_freq (the
  // model's, [d/2]) and the position of every add(); off when either is missing.
  bool page_center = true;
  // ... restricted to the centred heads whose mean holds at least key_offset_share of their key
  // energy (the heads `auto` would transform): the others keep the fixed mean μ. With the key
  // transform on every head, page centering (and its decode cost) stays where the offset is.
  bool page_center_offset_only = false;
  int center_page = 64;
  std::vector<float> rope_freq;
  int sample_tokens = 256;      // per layer, for the clip search
  uint64_t seed = 0;            // random composition and reservoir sampling
  int sink = 64, recent = 256;  // recorded in the file
};

// The named settings of `oscar calibrate --preset` (docs/accuracy.md, "Defaults"):
//   "recommended" (the default): U·H·P per KV head, raw targets E[k kᵀ] / E[v vᵀ], clips
//       0.88 / 0.84, key transform auto (every head on a model with key offsets, none on the
//       others): the best setting measured on both models (SmolLM2-135M and Qwen2.5-Coder-1.5B;
//       on the latter the best from 8K to 32K, docs/accuracy.md).
//   "paper": the paper's and its reference implementation's setting: U·H·P per layer, C_Q /
//       key-weighted targets, clips 0.96 / 0.92, no key transform.
// `bits` (2 or 4) is the code width; both presets' clip ratios are 2-bit settings, so at 4 bits
// they become 1.0 / 1.0 (no clipping): on Qwen2.5-Coder-1.5B at 2K the recommended setting's
// 0.88 / 0.84 gave KL 0.034 at 4 bits, no clipping 0.0004 (docs/accuracy.md, "INT4 with the key
// transform").
// Throws on any other name or width.
CalibConfig calib_preset(const std::string& name, int bits = 2);

// Per-head target covariances of one layer (fp64, row-major, symmetric).
struct LayerTargets {
  int n_kv_heads = 0, d = 0;
  int64_t tokens = 0;
  std::vector<double> query;  // [H_kv][d][d]
  std::vector<double> key;    // [H_kv][d][d] the key target (same as query unless raw)
  std::vector<double> value;  // [H_kv][d][d] the value target
  const double* q(int h) const { return query.data() + static_cast<size_t>(h) * d * d; }
  const double* k(int h) const { return key.data() + static_cast<size_t>(h) * d * d; }
  const double* v(int h) const { return value.data() + static_cast<size_t>(h) * d * d; }
};

class Calibrator {
 public:
  Calibrator(CalibConfig cfg, int n_layers, int n_q_heads, int n_kv_heads, int d);
  ~Calibrator();
  Calibrator(Calibrator&&) noexcept;
  Calibrator& operator=(Calibrator&&) noexcept;

  // q: [T][Hq][d], k: [T][Hkv][d], v: [T][Hkv][d], o: [T][Hq][d] (attention
  // output per query head, before o_proj) or nullptr. Required: o for the
  // attn-output target. T may be 0.
  // first_pos: the RoPE position of row 0 (rows are consecutive), or -1 when unknown (then
  // the calibration gets no page centering).
  void add(int layer, const float* q, const float* k, const float* v, const float* o, int64_t T,
           int64_t first_pos = -1);

  // The layer's targets from everything added so far (before finish_layer).
  LayerTargets targets(int layer) const;

  // Computes the layer's rotations/clips now and frees its buffers; later
  // add() calls for it are an error. finish() does this for remaining layers.
  void finish_layer(int layer);
  // Optionally keep each finished layer's targets (for reports/tests).
  void keep_targets(bool on);
  const LayerTargets& kept_targets(int layer) const;

  // Every layer must have seen at least one token. Shape fields of `model`
  // that are zero are filled in; non-zero ones must agree.
  Calibration finish(ModelFingerprint model = {});

  const CalibConfig& config() const;
  int n_layers() const;
  int64_t tokens(int layer) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace oscar
