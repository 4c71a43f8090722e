// The Llama-family forward pass (DESIGN §4) over a paged KV cache, batched over
// sequences of different lengths: one call runs prefill chunks and single decode
// tokens together.
//
//   x = embed(tokens)
//   per layer: h = RMSNorm(x); q,k,v = h W_qkv^T (+b, Qwen2); RMSNorm(q), RMSNorm(k)
//              per head (Qwen3); RoPE(q, k); rotate into the cache basis; store k,v;
//              o = attention(q, cache); x += o W_o^T;
//              h = RMSNorm(x); x += (silu(h W_gate^T) * h W_up^T) W_down^T
//   logits = RMSNorm(x) W_lm^T  (W_lm = embedding when tied)
//
// All ops go through a backend::Backend (backend/backend.h); this file never touches
// activation memory directly. The cache hooks (rotate_*, write) receive the
// backend's buffers as they are, so a device backend pairs with a cache whose
// pages live on the same device.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "kv/kv_cache.h"
#include "backend/backend.h"
#include "model/llama_layer.h"
#include "model/weights.h"

namespace oscar::model {

// New tokens for one sequence in a step; they go to positions
// cache.length(seq) .. cache.length(seq) + tokens.size() - 1.
struct SeqStep {
  kv::SeqId seq = 0;
  std::span<const int32_t> tokens;
  bool all_logits = false;  // logits for every token (teacher forcing), else the last only
};

class Model {
 public:
  // Prepares the weights on `backend` (the backend must outlive the model); the
  // ModelWeights may be freed afterwards. Throws oscar::Error naming the tensor on
  // a shape mismatch.
  Model(const ModelWeights& w, backend::Backend& backend);
  // The same from parts, one layer at a time: layer(l) is called once per layer,
  // in order, and its result may be freed after the next call (benchmarks make
  // 8B-shaped random models this way without holding all fp32 weights).
  using LayerSource = std::function<const LayerWeights&(int layer)>;
  Model(const ModelConfig& cfg, backend::Backend& backend, const Tensor& tok_embd, const Tensor& out_norm,
        const Tensor& lm_head, const LayerSource& layer, int n_layers);
  ~Model();

  const ModelConfig& config() const { return cfg_; }
  // The cache shape this model needs (page size from the cache options).
  kv::KvCacheShape cache_shape(int page_size = 64) const;
  // Bytes of weights a decode step streams (all matrices + norms; the embedding
  // is gathered, except when tied it is the LM head and is read whole).
  int64_t weight_bytes_per_step() const { return step_bytes_; }

  // Runs one step and commits the new tokens to the cache. logits (host) gets
  // [rows][vocab], rows in step order: tokens.size() rows for all_logits steps,
  // else 1 (the last token). Empty steps are not allowed; a sequence may appear once.
  void forward(std::span<const SeqStep> steps, kv::KvCache& cache, std::vector<float>& logits);
  // The same step, returning each output row's argmax (greedy decoding; ties: the
  // lowest id) instead of its logits: computed on the backend, so a GPU returns R
  // ids, not R x vocab floats.
  void forward_argmax(std::span<const SeqStep> steps, kv::KvCache& cache, std::vector<int32_t>& tokens);
  // The same step, each output row's token drawn by the backend as draws[r] asks
  // (backend/sample.h; one entry per output row, in step order): tokens[r] is the token or
  // kDrawHost / kDrawNaN / kDrawSkipped. A kDrawHost row's logits stay readable through
  // output_logits until the next step.
  // `hist`: the penalized rows' ids (RowDraw::hist_off / hist_len index it); a row with a
  // penalty slot (RowDraw::pen_slot, at most penalty_slots()) lists only the ids new to it.
  void forward_sample(std::span<const SeqStep> steps, kv::KvCache& cache, std::span<const backend::RowDraw> draws,
                      std::span<const int32_t> hist, std::vector<int32_t>& tokens);
  // Penalty slots of the backend (Backend::penalty_slots; 0: the ids come whole every step).
  int penalty_slots() const;
  // Output row r's logits [vocab] of the last step (forward, forward_argmax, forward_sample).
  void output_logits(int r, std::span<float> out) const;
  // Benchmarks: compute the logits but leave them on the backend (forward then
  // returns `logits` empty). Default on.
  void set_logits_to_host(bool on) { logits_to_host_ = on; }
  // Steps of single tokens (decode) replay their layers from graphs where the
  // backend records them (Backend::run_graph; CUDA). Default on; off runs
  // every op eagerly (A/B runs, debugging). Results are the same either way.
  void set_graphs(bool on) { graphs_ = on; }
  bool graphs() const { return graphs_; }
  // Graph replays (and first recordings) so far: tests check graphs really ran.
  int64_t graph_runs() const { return graph_runs_; }
  // Decode steps of at most this many sequences use graphs.
  static constexpr int kMaxGraphRows = 512;

 private:
  void ensure_workspace(int tokens, int out_rows);
  int run(std::span<const SeqStep> steps, kv::KvCache& cache);  // the step; its R output rows' logits in logits_

  backend::Backend& be_;
  ModelConfig cfg_;
  backend::WeightPtr embd_, out_norm_, lm_head_;  // lm_head_ also when tied (a copy in matrix form)
  std::vector<PreparedLayer> layers_;
  std::vector<float> inv_freq_;
  int64_t step_bytes_ = 0;
  bool logits_to_host_ = true;
  bool graphs_ = true;
  int64_t graph_runs_ = 0;

  // Workspace, grown on demand.
  int ws_rows_ = 0;
  int out_rows_ = 0;            // output rows of the last step (output_logits)
  std::vector<int32_t> slot_seen_;  // forward_sample: the step's penalty slots (each once)
  backend::RowPlacement rows_;  // the step's row placement
  ActivationBuffers acts_;                // the step's activations (model/llama_layer.h)
  backend::BufferPtr sel_, logits_;       // rows whose logits are wanted; their logits
};

}  // namespace oscar::model
