// Calibration from a model (DESIGN §3.1): run the model in full precision over
// a calibration text (dense, teacher-forced, model/calib_forward.h) and feed
// every layer's post-RoPE q/k/v and exact attention output o to the core
// Calibrator. The `oscar calibrate -m MODEL --text FILE` route.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/calibrator.h"
#include "model/weights.h"

namespace oscar::eval {

struct ModelCalibOptions {
  // Calibration tokens (the text must have them). 8192: more measured no better on SmolLM2 at 2K
  // (KL 0.0341 / 0.0375 / 0.0379 with 8K / 16K / 32K tokens; docs/accuracy.md, "Defaults").
  int64_t tokens = 8192;
  int chunk = 2048;        // tokens per forward
  // Chunk i of n starts at position i * (positions - chunk) / (n - 1): the post-RoPE key and
  // query statistics then cover the positions a long context's cache holds (attention itself
  // depends only on relative positions). -1: the model's context length; 0 (the default):
  // every chunk at 0 (docs/accuracy.md: spreading helped Qwen2.5 at 32K, cost SmolLM2 at 4K).
  int64_t positions = 0;
  // Where in the text the calibration tokens come from: false, the first `tokens` tokens; true,
  // `tokens / chunk` windows of `chunk` tokens at evenly spaced offsets over the whole text (so a
  // text of several parts, e.g. prose then code, is sampled in all of them). See sample_windows.
  bool spread_text = false;
  int threads = 0;
};

// The calibration tokens taken from a tokenized text: the first opts.tokens, or (spread_text)
// n = ceil(tokens / chunk) windows, window i (of length min(chunk, tokens - i chunk)) starting at
// i chunk + i (text - tokens) / (n - 1) (the first at 0, the last ending at the text's end, the
// text left out split evenly between them), concatenated. Throws when the text is shorter than
// opts.tokens.
std::vector<int32_t> sample_windows(const std::vector<int32_t>& text, const ModelCalibOptions& opts);

// progress(tokens done, tokens total)
using CalibProgress = std::function<void(int64_t done, int64_t total)>;

// tokens: the tokenized calibration text. Returns the calibration with the
// model fingerprint and the text hash filled in.
// The first position of each chunk (ModelCalibOptions::positions).
std::vector<int64_t> chunk_positions(const ModelCalibOptions& opts, int64_t max_position);

Calibration calibrate_model(const model::ModelWeights& w, const std::vector<int32_t>& tokens,
                            const CalibConfig& cfg, const ModelCalibOptions& opts,
                            const CalibProgress& progress = nullptr);

// Loads the model and tokenizer, reads and tokenizes the text, calibrates.
// Prints progress to stderr unless quiet.
Calibration calibrate_model_file(const std::string& model_path, const std::string& text_path,
                                 const CalibConfig& cfg, const ModelCalibOptions& opts, bool quiet);

// Reads a whole text file; throws oscar::Error naming it.
std::string read_text_file(const std::string& path);
// 16 hex digits (FNV-1a 64) of a token sequence.
std::string token_hash(const std::vector<int32_t>& tokens);

}  // namespace oscar::eval
