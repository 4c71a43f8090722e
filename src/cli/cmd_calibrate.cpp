// `oscar calibrate`: activation dump -> calibration file (DESIGN §3, §9).
#include <chrono>
#include <cstdio>
#include <sstream>

#include <fmt/format.h>

#include "cli/registry.h"
#include "core/activation_dump.h"
#include "core/calibrator.h"
#include "core/key_transform.h"
#include "core/error.h"
#include "eval/calibrate_model.h"  // -m MODEL --text FILE route (oscar-eval)

namespace {

std::vector<float> parse_grid(const std::string& s) {
  std::vector<float> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const float v = std::strtof(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !(v > 0.0f && v <= 1.0f))
      throw oscar::Error(fmt::format("--clip-grid: '{}' is not a ratio in (0, 1]", item));
    out.push_back(v);
  }
  if (out.empty()) throw oscar::Error("--clip-grid is empty");
  return out;
}

// One line: which layers got which key transform (docs/core.md "Key transform").
void print_key_transform(const oscar::Calibration& c) {
  std::string center, scale;
  int nc = 0, ns = 0;
  for (size_t l = 0; l < c.layers.size(); ++l) {
    const auto& L = c.layers[l];
    bool any_c = false, any_s = false;
    for (float x : L.k_mean) any_c = any_c || x != 0.0f;
    for (float x : L.k_scale) any_s = any_s || x != 1.0f;
    if (any_c) center += fmt::format("{}{}", nc++ ? "," : "", l);
    if (any_s) scale += fmt::format("{}{}", ns++ ? "," : "", l);
  }
  std::printf("key transform %s: centered layers [%s] (%d of %zu), scaled layers [%s] (%d)\n",
              c.key_transform.c_str(), center.c_str(), nc, c.layers.size(), scale.c_str(), ns);
  // Per layer, the largest share of a head's key energy in its mean (auto's criterion).
  std::string shares;
  for (size_t l = 0; l < c.layers.size(); ++l) {
    float mx = 0;
    for (float x : c.layers[l].key_offset_share) mx = std::max(mx, x);
    shares += fmt::format("{}{:.2f}", l ? " " : "", mx);
  }
  std::printf("  key energy in the mean (max over heads), per layer: [%s]\n", shares.c_str());
  // Page centering (docs/core.md "Page centering"): the heads whose middle pages follow the
  // key offset RoPE turns, and over how many RoPE pairs.
  int heads = 0;
  std::string layers;
  for (size_t l = 0; l < c.layers.size(); ++l) {
    const int n = c.layers[l].page_center_heads(c.head_dim());
    if (n) layers += fmt::format("{}{}", heads ? "," : "", l);
    heads += n;
  }
  if (heads)
    std::printf("  page centering: %d KV heads in layers [%s], %zu RoPE pairs\n", heads, layers.c_str(),
                oscar::page_center_pairs(c).size());
  else
    std::printf("  page centering: none\n");
}

// What was written: the setting, then the key transform per layer.
void print_summary(const oscar::Calibration& c, const std::string& path,
                   std::chrono::steady_clock::time_point t0, const oscar::CalibConfig& cfg) {
  using namespace oscar;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string clips = cfg.clip_search ? std::string("searched per rotation")
                                            : fmt::format("{:.2f} / {:.2f}", cfg.k_clip, cfg.v_clip);
  std::printf("wrote %s: %d layers, %s rotations (%s), key target %s, value target %s, clips %s, %lld tokens, %.1f s\n",
              path.c_str(), c.model.n_layers, composition_name(c.composition), granularity_name(c.granularity),
              key_target_name(c.key_target), value_target_name(c.value_target), clips.c_str(),
              static_cast<long long>(c.calib_tokens), s);
  if (c.calib_positions > 0)
    std::printf("  positions covered: [0, %lld)\n", static_cast<long long>(c.calib_positions));
  print_key_transform(c);
}

const oscar::cli::Registrar reg({"calibrate", "Calibrate OSCAR rotations and clip ratios from a model and a text, or from an activation dump",
                                 [](CLI::App& app) {
  struct Opts {
    std::string dump, out, preset = "recommended", composition, key_target, value_target, granularity,
                           scale_dtype = "f16", grid, arch, weights_hash, key_transform;
    int group = 128, bits = 2, sample_tokens = 256, sink = 64, recent = 256;
    int64_t max_tokens = 0;
    float k_clip = 0, v_clip = 0, key_offset_share = 0.85f;
    bool clip_search = false, quiet = false;
    std::string page_center = "on", sample = "first";
    uint64_t seed = 0;
    // The options a preset sets; one given on the command line overrides it.
    CLI::Option *o_composition, *o_key_target, *o_value_target, *o_granularity, *o_k_clip, *o_v_clip,
        *o_key_transform;
  };
  auto o = std::make_shared<Opts>();
  app.add_option("--activations,-a", o->dump, "Activation dump (safetensors, DESIGN §9)");
  // Second route (eval/calibrate_model.h): run a model over a calibration text.
  auto mo = std::make_shared<oscar::eval::ModelCalibOptions>();
  auto model_path = std::make_shared<std::string>(), text_path = std::make_shared<std::string>();
  app.add_option("-m,--model", *model_path, "Model (.gguf or HF directory): calibrate from the model itself");
  app.add_option("--text", *text_path, "Calibration text for -m");
  app.add_option("--tokens", mo->tokens, "Calibration tokens for -m")->capture_default_str();
  app.add_option("--chunk", mo->chunk, "Tokens per forward pass for -m")->capture_default_str();
  app.add_option("--positions", mo->positions,
                 "For -m: spread the chunks' RoPE positions over [0, N) so the key statistics cover "
                 "a long context's positions (-1: the model's context length; 0: every chunk at 0)")
      ->capture_default_str();
  app.add_option("--sample", o->sample,
                 "For -m: which tokens of the text: first (the first --tokens) | spread (--tokens / --chunk "
                 "windows at evenly spaced offsets over the whole text)")
      ->check(CLI::IsMember({"first", "spread"}))
      ->capture_default_str();
  app.add_option("-o,--output", o->out, "Calibration file to write (safetensors)")->required();
  app.add_option("--preset", o->preset,
                 "recommended (U·H·P per KV head, raw targets, clips 0.88/0.84, key transform auto) | "
                 "paper (U·H·P per layer, C_Q / key-weighted targets, clips 0.96/0.92, no key transform); "
                 "the options below override it")
      ->capture_default_str();
  o->o_composition = app.add_option("--composition", o->composition, "none|hadamard|random|U|UH|UHP (preset: UHP)");
  o->o_key_target = app.add_option("--key-target", o->key_target, "query (C_Q) | raw (KᵀK) (preset)");
  o->o_value_target =
      app.add_option("--value-target", o->value_target, "attn-output | key-weighted | raw (preset)");
  o->o_granularity =
      app.add_option("--granularity", o->granularity, "layer (pooled over KV heads) | head (preset)");
  app.add_option("--group-size", o->group, "Quantization group: 32, 64 or 128 (capped at head_dim)")
      ->capture_default_str();
  app.add_option("--bits", o->bits, "Code bits: 2 or 4 (at 4 the presets' clips are 1.0 / 1.0)")->capture_default_str();
  app.add_option("--scale-dtype", o->scale_dtype, "f16 | f32 (scale/min storage)")->capture_default_str();
  o->o_key_transform = app.add_option(
      "--key-transform", o->key_transform,
      "off | center | center+scale (every KV head) | auto (center+scale every head when some KV head's "
      "key mean holds >= --key-offset-share of its key energy, as a k_proj bias does; else off) | "
      "offset-heads (center+scale only those heads) (preset: recommended auto, paper off)");
  app.add_option("--key-offset-share", o->key_offset_share, "Threshold of --key-transform auto / offset-heads")
      ->capture_default_str();
  app.add_option("--page-center", o->page_center,
                 "on | off | offset: with -m, the heads the key transform centres get per-page centres "
                 "that follow the offset RoPE turns (exact; what keeps Qwen2's biased keys right at long "
                 "context, docs/accuracy.md); offset: only those whose mean holds >= --key-offset-share "
                 "of their key energy")
      ->capture_default_str();
  app.add_flag("--clip-search", o->clip_search, "Search clip ratios per layer (attention-aware error)");
  app.add_option("--clip-grid", o->grid, "Comma-separated ratios for --clip-search (default 0.80..1.0)");
  o->o_k_clip = app.add_option("--k-clip", o->k_clip, "Key clip ratio when not searching (preset: 0.88 / paper 0.96; 1.0 at --bits 4)");
  o->o_v_clip = app.add_option("--v-clip", o->v_clip, "Value clip ratio when not searching (preset: 0.84 / paper 0.92; 1.0 at --bits 4)");
  app.add_option("--sample-tokens", o->sample_tokens, "Tokens sampled per layer for --clip-search")
      ->capture_default_str();
  app.add_option("--max-tokens", o->max_tokens, "Use only the first N tokens of the dump (0 = all)");
  app.add_option("--seed", o->seed, "Seed (random composition, clip-search sampling)")->capture_default_str();
  app.add_option("--sink", o->sink, "Sink window recorded in the file")->capture_default_str();
  app.add_option("--recent", o->recent, "Recent window recorded in the file")->capture_default_str();
  app.add_option("--arch", o->arch, "Model architecture for the fingerprint (overrides the dump's metadata)");
  app.add_option("--weights-hash", o->weights_hash, "Model weights hash for the fingerprint (overrides the dump's)");
  app.add_flag("-q,--quiet", o->quiet, "No progress display");
  return [o, mo, model_path, text_path]() -> int {
    using namespace oscar;
    const auto t0 = std::chrono::steady_clock::now();
    if (o->dump.empty() == model_path->empty())
      throw Error("calibrate: give either --activations DUMP or -m MODEL --text FILE");
    if (!model_path->empty() && text_path->empty()) throw Error("calibrate: -m MODEL needs --text FILE");
    mo->spread_text = o->sample == "spread";
    CalibConfig cfg = calib_preset(o->preset, o->bits);
    if (o->o_composition->count()) cfg.composition = parse_composition(o->composition);
    if (o->o_key_target->count()) cfg.key_target = parse_key_target(o->key_target);
    if (o->o_value_target->count()) cfg.value_target = parse_value_target(o->value_target);
    if (o->o_granularity->count()) cfg.granularity = parse_granularity(o->granularity);
    cfg.quant.group_size = o->group;
    if (o->scale_dtype != "f16" && o->scale_dtype != "f32")
      throw Error(fmt::format("--scale-dtype '{}': expected f16 or f32", o->scale_dtype));
    cfg.quant.scale_dtype = o->scale_dtype == "f16" ? ScaleDtype::kF16 : ScaleDtype::kF32;
    cfg.clip_search = o->clip_search;
    if (o->o_key_transform->count()) cfg.key_transform = parse_key_transform(o->key_transform);
    cfg.key_offset_share = o->key_offset_share;
    if (o->page_center != "on" && o->page_center != "off" && o->page_center != "offset")
      throw Error(fmt::format("--page-center '{}': expected on, off or offset", o->page_center));
    cfg.page_center = o->page_center != "off";
    cfg.page_center_offset_only = o->page_center == "offset";
    if (!o->grid.empty()) cfg.clip_grid = parse_grid(o->grid);
    if (o->o_k_clip->count()) cfg.k_clip = o->k_clip;
    if (o->o_v_clip->count()) cfg.v_clip = o->v_clip;
    cfg.sample_tokens = o->sample_tokens;
    cfg.seed = o->seed;
    cfg.sink = o->sink;
    cfg.recent = o->recent;
    if (!model_path->empty()) {  // model + text route
      Calibration c = eval::calibrate_model_file(*model_path, *text_path, cfg, *mo, o->quiet);
      write_calibration(c, o->out);
      print_summary(c, o->out, t0, cfg);
      return 0;
    }
    const ActivationDump dump = ActivationDump::open(o->dump);
    if (!o->quiet)
      std::fprintf(stderr, "%s: %d layers, %lld tokens, %d q heads, %d kv heads, head_dim %d%s\n", o->dump.c_str(),
                   dump.n_layers(), static_cast<long long>(dump.tokens()), dump.n_q_heads(), dump.n_kv_heads(),
                   dump.head_dim(), dump.has_o() ? ", with attention outputs" : "");
    Calibrator cal(cfg, dump.n_layers(), dump.n_q_heads(), dump.n_kv_heads(), dump.head_dim());
    feed_dump(dump, cal, o->max_tokens, 4096, o->quiet ? ProgressFn{} : stderr_progress("calibrate"));
    ModelFingerprint fp = dump.fingerprint();
    if (!o->arch.empty()) fp.architecture = o->arch;
    if (!o->weights_hash.empty()) fp.weights_hash = o->weights_hash;
    Calibration c = cal.finish(fp);
    c.text_hash = dump.text_hash();
    c.source = o->dump;
    write_calibration(c, o->out);
    print_summary(c, o->out, t0, cfg);
    return 0;
  };
}});

}  // namespace
