// A model's OSCAR calibration: per-layer key/value rotations, eigen-spectra and
// clip ratios, plus the settings and the model fingerprint they belong to.
// Stored as safetensors (DESIGN §9):
//   layers.{i}.k_rotation     [n_rot, d, d] f32   x̃ = x·R  (n_rot = 1 or n_kv_heads)
//   layers.{i}.v_rotation     [n_rot, d, d] f32
//   layers.{i}.k_eigenvalues  [n_rot, d]    f32   descending (absent for data-free)
//   layers.{i}.v_eigenvalues  [n_rot, d]    f32
//   layers.{i}.k_clip         [n_rot]       f32   clip ratio c (index floor(c·d))
//   layers.{i}.v_clip         [n_rot]       f32
//   layers.{i}.k_mean         [n_kv_heads, d] f32  optional (format_version 2): key centering
//   layers.{i}.k_scale        [n_kv_heads, d] f32  optional (format_version 2): key smoothing
//   layers.{i}.k_rope_mean    [n_kv_heads, d] f32  optional (format_version 3): page centering
//   rope_freq                 [d/2]           f32  with any k_rope_mean: RoPE rad per position
// __metadata__ (all strings): format=oscar-calibration, format_version=1,
//   method, composition, key_target, value_target, granularity, bits,
//   group_size, scale_dtype, sink, recent, clip_search,
//   model.architecture, model.n_layers, model.n_q_heads, model.n_kv_heads,
//   model.head_dim, model.weights_hash, calib.tokens, calib.text_hash, calib.source,
//   key_transform (version 2: "off", "center", "center+scale", "auto" or "offset-heads").
//
// The key transform (docs/core.md "Key transform") is exact: with μ_h = k_mean[h] and s_h = k_scale[h]
// (absent: μ = 0, s = 1), the stored key of KV head h is k̃ = (k − μ_h)·diag(1/s_h)·R_h and
// the query is q̃ = q·diag(s_h)·R_h, so q̃·k̃ = q·k − q·μ_h: every logit of one query row
// moves by the same amount, which softmax ignores. It removes what a per-token 2-bit range
// cannot afford to spend on: a large constant key offset (Qwen2's k_proj bias) and channels
// whose key range dwarfs their query weight. core/key_transform.h prepares it for the kernels.
//
// Page centering (docs/core.md "Page centering", format version 3) follows a key offset that
// RoPE turns with the position (Qwen2's bias over a long context), which no fixed μ can: with
// ν_h = k_rope_mean[h], the pre-RoPE key mean of head h on the slow RoPE pairs (zero on the
// others), each quantized middle page is stored around RoPE_t(ν_h) at its centre position t
// instead of μ_h, and the attention adds q·(RoPE_t(ν_h) − μ_h) to that page's logits, so every
// logit is again q·k − q·μ_h: exact, at no memory cost (kernels/paged_kv.h, MidCenter).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/quant_format.h"
#include "core/rotation.h"

namespace oscar {

enum class KeyTarget { kQuery, kRaw };
enum class ValueTarget { kAttnOutput, kKeyWeighted, kRaw };
enum class Granularity { kLayer, kHead };
// Key transform at calibration (docs/core.md "Key transform"): none, centering, or centering +
// channel smoothing on every KV head; auto = centering + smoothing on every head of a model in
// which some KV head's mean holds at least CalibConfig::key_offset_share of its key energy (a
// k_proj bias, as in Qwen2 / Qwen2.5), none otherwise; offset-heads = centering + smoothing on
// exactly those heads.
enum class KeyTransformMode { kOff, kCenter, kCenterScale, kAuto, kOffsetHeads };

const char* key_target_name(KeyTarget);      // "query", "raw"
const char* value_target_name(ValueTarget);  // "attn-output", "key-weighted", "raw"
const char* granularity_name(Granularity);   // "layer", "head"
KeyTarget parse_key_target(const std::string&);
ValueTarget parse_value_target(const std::string&);
Granularity parse_granularity(const std::string&);
const char* key_transform_name(KeyTransformMode);  // "off", "center", "center+scale", "auto", "offset-heads"
KeyTransformMode parse_key_transform(const std::string&);

// What a calibration belongs to. Empty strings / zeros mean "unknown".
struct ModelFingerprint {
  std::string architecture;  // e.g. "qwen3"
  int n_layers = 0;
  int n_q_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  std::string weights_hash;  // model::ModelWeights::fingerprint
};

struct LayerCalibration {
  int n_rot = 1;                      // 1 (one rotation per layer) or n_kv_heads
  std::vector<float> k_rotation;      // [n_rot][d][d]
  std::vector<float> v_rotation;      // [n_rot][d][d]
  std::vector<float> k_eigenvalues;   // [n_rot][d] or empty
  std::vector<float> v_eigenvalues;   // [n_rot][d] or empty
  std::vector<float> k_clip, v_clip;  // [n_rot]
  // Key transform, per KV head (any granularity): empty = none.
  std::vector<float> k_mean;   // [n_kv_heads][d] μ, post-RoPE, original basis
  std::vector<float> k_scale;  // [n_kv_heads][d] s > 0, tied over each RoPE pair (c, c + d/2)
  // Page centering, per KV head: empty = none. Pre-RoPE basis; zero outside the slow pairs.
  std::vector<float> k_rope_mean;  // [n_kv_heads][d] ν
  bool has_key_transform() const { return !k_mean.empty() || !k_scale.empty(); }
  bool has_page_center() const { return !k_rope_mean.empty(); }
  // KV heads of this layer with page centering (ν ≠ 0), for head_dim d.
  int page_center_heads(int d) const {
    int n = 0;
    for (size_t h = 0; d > 0 && (h + 1) * size_t(d) <= k_rope_mean.size(); ++h) {
      bool any = false;
      for (int i = 0; i < d; ++i) any = any || k_rope_mean[h * size_t(d) + i] != 0.0f;
      n += any;
    }
    return n;
  }
  // Not stored (reports): per KV head, the share of the key energy in its mean, Σμ² / Σ E[k²].
  std::vector<float> key_offset_share;

  // Per KV head accessors (a per-layer rotation serves every head).
  const float* k_rot(int kv_head, int d) const { return k_rotation.data() + idx(kv_head) * d * d; }
  const float* v_rot(int kv_head, int d) const { return v_rotation.data() + idx(kv_head) * d * d; }
  float k_clip_of(int kv_head) const { return k_clip[idx(kv_head)]; }
  float v_clip_of(int kv_head) const { return v_clip[idx(kv_head)]; }

 private:
  size_t idx(int kv_head) const { return n_rot == 1 ? 0 : static_cast<size_t>(kv_head); }
};

struct Calibration {
  ModelFingerprint model;
  std::string method = "oscar";
  Composition composition = Composition::kUHP;
  KeyTarget key_target = KeyTarget::kQuery;
  ValueTarget value_target = ValueTarget::kKeyWeighted;
  Granularity granularity = Granularity::kLayer;
  int bits = 2;
  int group_size = 128;
  ScaleDtype scale_dtype = ScaleDtype::kF16;
  int sink = 64;
  int recent = 256;
  bool clip_search = false;
  std::string key_transform = "off";  // what calibration was asked for (the tensors say what is)
  int64_t calib_tokens = 0;
  // One past the largest RoPE position the statistics saw (0 = not recorded: a dump, or an
  // older file). Post-RoPE key statistics are only representative up to here.
  int64_t calib_positions = 0;
  std::string text_hash;  // of the calibration text / dump
  std::string source;     // e.g. the dump path
  std::vector<LayerCalibration> layers;
  // The model's RoPE frequencies ([d/2], rad per position; pair j = channels j, j + d/2), stored
  // with page centering (which needs them at serving time); empty otherwise.
  std::vector<float> rope_freq;

  int head_dim() const { return model.head_dim; }
  bool has_page_center() const {
    for (const LayerCalibration& L : layers)
      if (L.has_page_center()) return true;
    return false;
  }
};

void write_calibration(const Calibration& c, const std::string& path);
// Reads and validates (shapes vs metadata, finite values, rotations
// orthogonal to 1e-3, clips in (0, 1]). Any problem is an oscar::Error naming
// the file.
Calibration read_calibration(const std::string& path);

// Throws oscar::Error unless the calibration fits `model`: n_layers, n_q_heads,
// n_kv_heads and head_dim must be equal; architecture and weights_hash must be
// equal when both sides know them. `what` names the calibration (its path).
void check_calibration_matches(const Calibration& c, const ModelFingerprint& model,
                               const std::string& what);
// With page centering, the calibration's RoPE frequencies must be the model's (`freq`, [d/2],
// model/rope.h rope_inv_freq) to a relative 1e-5; otherwise oscar::Error naming `what`.
void check_calibration_rope(const Calibration& c, const std::vector<float>& freq,
                            const std::string& what);

// A calibration that needs no data: `none` (identity), `hadamard` or `random`.
// Clip ratios are the given ones for every layer (1.0 = no clipping).
Calibration data_free_calibration(Composition comp, const ModelFingerprint& model, float k_clip,
                                  float v_clip, int bits = 2, int group_size = 128,
                                  uint64_t seed = 0);

}  // namespace oscar
