// Activation dumps (DESIGN §9): safetensors with, for every layer i,
//   layers.{i}.q  [T, H_q, d]   post-RoPE (and post-QK-norm) queries
//   layers.{i}.k  [T, H_kv, d]  post-RoPE keys
//   layers.{i}.v  [T, H_kv, d]  values
//   layers.{i}.o  [T, H_q, d]   optional: attention output per query head, before o_proj
// in f16, bf16, f32 or f64. Optional metadata: model.architecture,
// model.weights_hash, calib.text_hash (copied into the calibration file).
// Layers must be numbered 0..L-1 without gaps and agree on T, H_q, H_kv, d.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/calibration.h"
#include "core/calibrator.h"
#include "core/safetensors.h"

namespace oscar {

class ActivationDump {
 public:
  static ActivationDump open(const std::string& path);  // validates, throws oscar::Error

  int n_layers() const { return L_; }
  int64_t tokens() const { return T_; }
  int n_q_heads() const { return Hq_; }
  int n_kv_heads() const { return Hkv_; }
  int head_dim() const { return d_; }
  bool has_o() const { return has_o_; }
  const st::File& file() const { return f_; }
  ModelFingerprint fingerprint() const;  // shapes + metadata
  std::string text_hash() const { return f_.meta("calib.text_hash"); }

  // Converts tokens [t0, t0+n) of layers.{layer}.{which} (which: 'q','k','v','o')
  // to fp32.   out: [n][heads][d]
  void read(int layer, char which, int64_t t0, int64_t n, float* out) const;

 private:
  explicit ActivationDump(st::File f) : f_(std::move(f)) {}
  st::File f_;
  int L_ = 0, Hq_ = 0, Hkv_ = 0, d_ = 0;
  int64_t T_ = 0;
  bool has_o_ = false;
};

// Progress of a long run: (layers done, layers total, bytes read so far).
using ProgressFn = std::function<void(int done, int total, uint64_t bytes)>;

// Feeds every layer of the dump into `cal` (in chunks of `chunk_tokens`),
// finishing each layer after its last chunk so buffers stay bounded.
// max_tokens > 0 uses only the first max_tokens tokens.
void feed_dump(const ActivationDump& dump, Calibrator& cal, int64_t max_tokens = 0,
               int64_t chunk_tokens = 4096, const ProgressFn& progress = nullptr);

// Prints "\r[label] layer i/L  X.X GB  Y.Y s" to stderr when stderr is a
// terminal, or one line per ~10% otherwise. Returns a ProgressFn.
ProgressFn stderr_progress(const std::string& label);

}  // namespace oscar
