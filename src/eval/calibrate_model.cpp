#include "eval/calibrate_model.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include "backend/cpu/backend_cpu.h"
#include "core/error.h"
#include "model/calib_forward.h"
#include "model/fold_rotation.h"
#include "model/loader.h"
#include "model/rope.h"
#include "model/tokenizer.h"

namespace oscar::eval {

namespace {

// Feeds each layer's q/k/v (post-RoPE) and exact o to the calibrator.
class CalibHook : public model::DenseHooks {
 public:
  explicit CalibHook(Calibrator& cal) : cal_(cal) {}
  void on_qkv(int layer, float* q, float* k, float* v, int T) override {
    q_ = q, k_ = k, v_ = v;
  }
  void on_attn_out(int layer, const float* o, int T) override {
    cal_.add(layer, q_, k_, v_, o, T, first_pos_);
  }
  void set_first_pos(int64_t p) { first_pos_ = p; }
  // The last layer's MLP and the LM head are not needed.
  bool want_layer(int layer) override { return layer < cal_.n_layers(); }

 private:
  Calibrator& cal_;
  const float *q_ = nullptr, *k_ = nullptr, *v_ = nullptr;
  int64_t first_pos_ = 0;
};

}  // namespace

std::string read_text_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Error(fmt::format("{}: cannot open the text file", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string token_hash(const std::vector<int32_t>& tokens) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : tokens)
    for (int b = 0; b < 4; ++b) {
      h ^= (uint32_t(t) >> (8 * b)) & 0xffu;
      h *= 1099511628211ull;
    }
  return fmt::format("{:016x}", h);
}

std::vector<int64_t> chunk_positions(const ModelCalibOptions& opts, int64_t max_position) {
  if (opts.tokens <= 0 || opts.chunk <= 0) throw Error("calibrate: tokens and chunk must be positive");
  if (opts.positions < -1)
    throw Error(fmt::format("calibrate: --positions {}: expected -1 (the model's context length), 0 or a "
                            "positive count", opts.positions));
  const int64_t n = (opts.tokens + opts.chunk - 1) / opts.chunk;
  const int64_t P = opts.positions < 0 ? max_position : opts.positions;
  std::vector<int64_t> starts(size_t(n), 0);
  if (P <= opts.chunk || n == 1) return starts;
  for (int64_t i = 0; i < n; ++i) starts[size_t(i)] = i * (P - opts.chunk) / (n - 1);
  return starts;
}

std::vector<int32_t> sample_windows(const std::vector<int32_t>& text, const ModelCalibOptions& opts) {
  if (opts.tokens <= 0 || opts.chunk <= 0) throw Error("calibrate: tokens and chunk must be positive");
  const int64_t N = int64_t(text.size());
  if (N < opts.tokens)
    throw Error(fmt::format("calibrate: the text has {} tokens, {} requested (--tokens)", N, opts.tokens));
  if (!opts.spread_text) return std::vector<int32_t>(text.begin(), text.begin() + opts.tokens);
  const int64_t n = (opts.tokens + opts.chunk - 1) / opts.chunk;
  std::vector<int32_t> out;
  out.reserve(size_t(opts.tokens));
  const int64_t spare = N - opts.tokens;  // text left out, shared evenly between the n - 1 gaps
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = std::min<int64_t>(opts.chunk, opts.tokens - i * opts.chunk);
    // The first window at 0, the last one ending at the text's end, none overlapping.
    const int64_t start = i * opts.chunk + (n == 1 ? 0 : i * spare / (n - 1));
    out.insert(out.end(), text.begin() + start, text.begin() + start + len);
  }
  return out;
}

Calibration calibrate_model(const model::ModelWeights& w, const std::vector<int32_t>& tokens,
                            const CalibConfig& cfg_in, const ModelCalibOptions& opts,
                            const CalibProgress& progress) {
  const model::ModelConfig& c = w.cfg;
  if (opts.tokens <= 0 || opts.chunk <= 0)
    throw Error(fmt::format("calibrate: --tokens {} and chunk {} must be positive", opts.tokens, opts.chunk));
  if (int64_t(tokens.size()) < opts.tokens)
    throw Error(fmt::format("calibrate: the text has {} tokens, {} requested (--tokens)",
                            tokens.size(), opts.tokens));
  CalibConfig cfg = cfg_in;
  cfg.quant.group_size = std::min(cfg.quant.group_size, c.head_dim);
  if (cfg.rope_freq.empty()) cfg.rope_freq = model::rope_inv_freq(c);  // for page centering
  backend::CpuBackendOptions bo;
  bo.weight_dtype = backend::WeightDtype::kF32;
  bo.threads = opts.threads;
  auto be = backend::make_cpu_backend(bo);
  model::DenseForward fwd(w, *be);
  Calibrator cal(cfg, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim);
  CalibHook hook(cal);
  const std::vector<int64_t> starts = chunk_positions(opts, c.max_position);
  for (int64_t t0 = 0, i = 0; t0 < opts.tokens; t0 += opts.chunk, ++i) {
    const int64_t n = std::min<int64_t>(opts.chunk, opts.tokens - t0);
    hook.set_first_pos(starts[size_t(i)]);
    fwd.run(std::span<const int32_t>(tokens.data() + t0, size_t(n)), &hook, nullptr, starts[size_t(i)]);
    if (progress) progress(t0 + n, opts.tokens);
  }
  Calibration out = cal.finish(model::model_fingerprint(w));
  for (size_t i = 0; i < starts.size(); ++i)  // the positions the statistics cover
    out.calib_positions = std::max(out.calib_positions,
                                   starts[i] + std::min<int64_t>(opts.chunk, opts.tokens - int64_t(i) * opts.chunk));
  out.text_hash = token_hash(std::vector<int32_t>(tokens.begin(), tokens.begin() + opts.tokens));
  return out;
}

Calibration calibrate_model_file(const std::string& model_path, const std::string& text_path,
                                 const CalibConfig& cfg, const ModelCalibOptions& opts, bool quiet) {
  const auto t0 = std::chrono::steady_clock::now();
  auto secs = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  model::ModelWeights w = model::load_model(model_path);
  model::Tokenizer tok = model::load_tokenizer(model_path);
  const std::string text = read_text_file(text_path);
  // Tokenize only as much text as needed (about 3 bytes per token, with slack); all of it when
  // the windows are spread over the text.
  const size_t want = opts.spread_text ? text.size() : std::min(text.size(), size_t(opts.tokens) * 8 + 4096);
  std::vector<int> ids = tok.encode(std::string_view(text).substr(0, want));
  if (int64_t(ids.size()) < opts.tokens && want < text.size()) ids = tok.encode(text);
  const std::vector<int32_t> tokens = sample_windows(std::vector<int32_t>(ids.begin(), ids.end()), opts);
  if (!quiet)
    std::fprintf(stderr, "calibrate: %s (%d layers, %d q / %d kv heads, head_dim %d), %s: %zu tokens%s (%.1f s)\n",
                 model_path.c_str(), w.cfg.n_layers, w.cfg.n_heads, w.cfg.n_kv_heads, w.cfg.head_dim,
                 text_path.c_str(), tokens.size(),
                 opts.spread_text ? fmt::format(" in {} windows spread over its {}", (opts.tokens + opts.chunk - 1) / opts.chunk, ids.size()).c_str() : "",
                 secs());
  const bool tty = isatty(fileno(stderr));
  Calibration c = calibrate_model(w, tokens, cfg, opts, [&](int64_t done, int64_t total) {
    if (quiet) return;
    const int width = 30, filled = int(width * done / std::max<int64_t>(1, total));
    std::fprintf(stderr, "%scalibrate [%s%s] %lld/%lld tokens  %.1f s%s", tty ? "\r" : "",
                 std::string(filled, '#').c_str(), std::string(width - filled, '.').c_str(),
                 (long long)done, (long long)total, secs(), tty ? "" : "\n");
    std::fflush(stderr);
  });
  if (!quiet && tty) std::fprintf(stderr, "\n");
  c.source = model_path + " + " + text_path;
  return c;
}

}  // namespace oscar::eval
