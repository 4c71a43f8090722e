// `oscar eval`: accuracy of KV cache methods against BF16 (DESIGN §6).
//   oscar eval -m MODEL --calib CALIB --text FILE --methods LIST --ctx LIST [--json OUT] [--plot OUT.png]
//   oscar eval passkey -m MODEL --calib CALIB [--haystack FILE] --methods LIST --ctx LIST
//   oscar eval agreement -m MODEL --calib CALIB --text FILE --methods LIST --ctx LIST
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <unistd.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "backend/cpu/ops_threads.h"
#include "cli/registry.h"
#include "core/error.h"
#include "eval/calibrate_model.h"
#include "eval/eval.h"
#include "eval/passkey.h"
#include "kv/quant_methods.h"
#include "model/fold_rotation.h"
#include "model/loader.h"
#include "model/rope.h"
#include "model/tokenizer.h"

namespace {

std::vector<int> parse_ints(const std::string& s, const char* what) {
  std::vector<int> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int mult = 1;
    if (!item.empty() && (item.back() == 'K' || item.back() == 'k')) mult = 1024, item.pop_back();
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v <= 0)
      throw oscar::Error(fmt::format("{}: '{}' is not a positive integer", what, item));
    out.push_back(int(v * mult));
  }
  if (out.empty()) throw oscar::Error(fmt::format("{} is empty", what));
  return out;
}

std::vector<double> parse_doubles(const std::string& s, const char* what) {
  std::vector<double> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const double v = std::strtod(item.c_str(), &end);
    if (item.empty() || *end != '\0' || !(v >= 0 && v <= 1))
      throw oscar::Error(fmt::format("{}: '{}' is not in [0, 1]", what, item));
    out.push_back(v);
  }
  return out;
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  if (!f) throw oscar::Error(fmt::format("{}: cannot write", path));
  f << text;
}

struct Opts {
  std::string model, calib, text, methods = "bf16,int2-naive,int2-hadamard,kivi2,oscar",
                                   ctx = "2048", json, plot, weights = "f32";
  std::string haystack = "data/haystack.txt", depths = "0.1,0.3,0.5,0.7,0.9", device = "cpu",
              prompt_bf16 = "on";
  int windows = 1, page = 64, sink = 64, recent = 256, group = 128, threads = 0, trials = 2,
      prompts = 2, new_tokens = 32, score_from = -1, chunk = 512;
  int64_t first_position = 0;
  bool quiet = false;
};

void add_common(CLI::App& app, Opts& o) {
  // Not ->required(): the parent's options would then be demanded of the subcommands.
  app.add_option("-m,--model", o.model, "Model (.gguf or HF directory)");
  app.add_option("--calib", o.calib, "Calibration file for the calibrated methods (oscar, ...)");
  app.add_option("--methods", o.methods,
                 "Comma-separated: bf16, int2-naive, int2-hadamard, int4-hadamard, kivi2, oscar, "
                 "oscar-U, oscar-UH, oscar-UHP, oscar-noclip, int2-raw-pca=FILE, NAME=CALIB")
      ->capture_default_str();
  app.add_option("--ctx", o.ctx, "Comma-separated context lengths (e.g. 1024,2K,4K)")->capture_default_str();
  app.add_option("--sink", o.sink, "BF16 sink tokens (S0)")->capture_default_str();
  app.add_option("--recent", o.recent, "BF16 recent window (W)")->capture_default_str();
  app.add_option("--page", o.page, "Cache page size (demotion granularity)")->capture_default_str();
  app.add_option("--group-size", o.group, "Quantization group for data-free methods (capped at head_dim)")
      ->capture_default_str();
  app.add_option("--threads", o.threads, "CPU threads (0 = OSCAR_NUM_THREADS or all cores)");
  app.add_option("--json", o.json, "Write the results as JSON");
  app.add_flag("-q,--quiet", o.quiet, "No progress display");
}

struct Loaded {
  oscar::model::ModelWeights w;
  std::vector<oscar::kv::KvMethod> methods;
};

Loaded load(const Opts& o) {
  using namespace oscar;
  if (o.model.empty()) throw Error("eval: -m MODEL is required");
  if (o.threads > 0) backend::cpu::set_op_threads(o.threads);
  Loaded L;
  L.w = model::load_model(o.model);
  kv::KvMethodOptions mo;
  mo.calib_path = o.calib;
  mo.model = model::model_fingerprint(L.w);
  mo.rope_freq = model::rope_inv_freq(L.w.cfg);
  mo.sink = o.sink;
  mo.recent = o.recent;
  mo.group_size = o.group;
  L.methods = kv::resolve_kv_methods(o.methods, mo);
  return L;
}

std::function<void(const std::string&)> progress_fn(bool quiet) {
  if (quiet) return nullptr;
  auto t0 = std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  const bool tty = isatty(fileno(stderr));
  return [t0, tty](const std::string& m) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - *t0).count();
    std::fprintf(stderr, tty ? "\r\033[K[%7.1f s] %s" : "[%7.1f s] %s\n", s, m.c_str());
    std::fflush(stderr);
  };
}

std::vector<int32_t> tokenize_file(const std::string& model_path, const std::string& path) {
  auto tok = oscar::model::load_tokenizer(model_path);
  auto ids = tok.encode(oscar::eval::read_text_file(path));
  return std::vector<int32_t>(ids.begin(), ids.end());
}

const oscar::cli::Registrar reg({"eval", "Accuracy of KV cache methods vs BF16 (perplexity, KL, errors; passkey; agreement)",
                                 [](CLI::App& app) {
  auto o = std::make_shared<Opts>(), pk = std::make_shared<Opts>(), ag = std::make_shared<Opts>();
  add_common(app, *o);
  app.add_option("--text", o->text, "Held-out evaluation text");
  app.add_option("--windows", o->windows, "Disjoint text windows per context length")->capture_default_str();
  app.add_option("--plot", o->plot, "Write a plot (PNG) through scripts/plot_eval.py");
  app.add_option("--weights", o->weights, "Weight dtype of the simulation (or of the engine with --device): f32 | bf16")
      ->capture_default_str();
  app.add_option("--first-position", o->first_position,
                 "RoPE position of each window's first token (a 4K window at 28672 holds the phases of a "
                 "32K context's end; the BF16 reference does not change)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--score-from", o->score_from,
                 "First scored position (default: sink + recent + page, the first query that "
                 "sees quantized history)");
  auto* o_device = app.add_option(
      "--device", o->device,
      "Evaluate through the real engine on this backend (cpu, cuda, cuda:N): each window prefilled in "
      "--chunk steps with every position's logits (ppl, KL, top-1; no local errors). Without it: the "
      "CPU simulation (all metrics)");
  auto* o_chunk = app.add_option("--chunk", o->chunk, "With --device: prefill tokens per engine step (default 256)");
  CLI::App* passkey = app.add_subcommand("passkey", "Passkey retrieval through the real engine");
  add_common(*passkey, *pk);
  pk->ctx = "1024,2048";
  pk->methods = "bf16,int2-hadamard,oscar";
  passkey->add_option("--haystack", pk->haystack, "Filler prose")->capture_default_str();
  passkey->add_option("--depths", pk->depths, "Needle depths in [0, 1]")->capture_default_str();
  passkey->add_option("--trials", pk->trials, "Prompts per (ctx, depth)")->capture_default_str();
  passkey->add_option("--device", pk->device, "cpu, cuda or cuda:N (the engine's backend)")
      ->capture_default_str();
  passkey->add_option("--prompt-bf16", pk->prompt_bf16,
                      "on | off: prompt chunks read the earlier chunks in BF16, demotion waits for the first "
                      "decode step (the engine's default); off: every chunk reads them as the cache stores them")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  passkey->add_option("--chunk", pk->chunk, "Prefill chunk (tokens per engine step)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  CLI::App* agree = app.add_subcommand("agreement", "Greedy generation agreement with BF16 (real engine)");
  add_common(*agree, *ag);
  ag->ctx = "1024";
  ag->methods = "int2-naive,int2-hadamard,oscar";
  agree->add_option("--text", ag->text, "Prompt text")->required();
  agree->add_option("--prompts", ag->prompts, "Prompts per context")->capture_default_str();
  agree->add_option("--new-tokens", ag->new_tokens, "Greedy tokens generated")->capture_default_str();
  agree->add_option("--device", ag->device, "cpu, cuda or cuda:N (the engine's backend)")
      ->capture_default_str();
  agree->add_option("--chunk", ag->chunk, "Prefill chunk (tokens per engine step)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.require_subcommand(0, 1);

  return [o, pk, ag, passkey, agree, o_device, o_chunk]() -> int {
    using namespace oscar;
    if (passkey->parsed()) {
      Loaded L = load(*pk);
      for (kv::KvMethod& m : L.methods) m.prompt_bf16 = pk->prompt_bf16 == "on";
      eval::PasskeyOptions po;
      po.ctx = parse_ints(pk->ctx, "--ctx");
      po.depths = parse_doubles(pk->depths, "--depths");
      po.trials = pk->trials;
      po.page_size = pk->page;
      po.prefill_chunk = pk->chunk;
      po.device = pk->device;
      auto tok = model::load_tokenizer(pk->model);
      // The JSON is rewritten after each method: a long run that is cut short keeps the
      // methods that finished.
      auto write_json = [&](const std::vector<eval::PasskeyResult>& done) {
        if (pk->json.empty()) return;
        nlohmann::json j = nlohmann::json::array();
        for (auto& x : done) {
          const eval::Interval ci = eval::wilson_interval(x.correct, x.trials);
          j.push_back({{"method", x.method}, {"ctx", x.ctx}, {"depth", x.depth}, {"trials", x.trials},
                       {"correct", x.correct}, {"hits", x.hits}, {"ci95", {ci.lo, ci.hi}}});
        }
        write_file(pk->json, nlohmann::json{{"passkey", j}}.dump(2));
      };
      auto r = eval::run_passkey(L.w, tok, eval::read_text_file(pk->haystack), L.methods, po,
                                 progress_fn(pk->quiet), write_json);
      if (!pk->quiet) std::fprintf(stderr, "\n");
      std::printf("%s", eval::format_passkey(r).c_str());
      return 0;
    }
    if (agree->parsed()) {
      Loaded L = load(*ag);
      eval::PasskeyOptions po;
      po.page_size = ag->page;
      po.prefill_chunk = ag->chunk;
      po.device = ag->device;
      auto r = eval::run_agreement(L.w, tokenize_file(ag->model, ag->text), L.methods,
                                     parse_ints(ag->ctx, "--ctx"), ag->prompts, ag->new_tokens, po,
                                     progress_fn(ag->quiet));
      if (!ag->quiet) std::fprintf(stderr, "\n");
      std::printf("%s", eval::format_agreement(r).c_str());
      if (!ag->json.empty()) {
        nlohmann::json j = nlohmann::json::array();
        for (auto& x : r)
          j.push_back({{"method", x.method}, {"ctx", x.ctx}, {"prompts", x.prompts},
                       {"new_tokens", x.new_tokens}, {"match_rate", x.match_rate},
                       {"prefix_len", x.prefix_len}});
        write_file(ag->json, nlohmann::json{{"agreement", j}}.dump(2));
      }
      return 0;
    }
    if (o->text.empty()) throw Error("eval: --text FILE is required");
    const auto t0 = std::chrono::steady_clock::now();
    // The simulation (default) or, with --device, the real engine (eval.h): the same rows.
    const bool engine = o_device->count() > 0;
    if (engine && o->first_position != 0)
      throw Error("eval: --first-position is a simulation option (the engine's positions start at 0)");
    Loaded L = load(*o);
    const auto tokens = tokenize_file(o->model, o->text);
    std::vector<eval::EvalResult> r;
    nlohmann::json extra = {{"model", o->model}, {"calib", o->calib}, {"text", o->text},
                            {"sink", o->sink}, {"recent", o->recent}, {"page", o->page}};
    std::string mode;
    if (engine) {
      eval::EngineEvalOptions eo;
      eo.ctx = parse_ints(o->ctx, "--ctx");
      eo.windows = o->windows;
      eo.page_size = o->page;
      eo.score_from = o->score_from;
      eo.chunk = o_chunk->count() ? o->chunk : 256;
      eo.device = o->device;
      eo.weights = backend::weight_dtype_from_string(o->weights);
      eo.threads = o->threads;
      r = eval::evaluate_engine(L.w, L.methods, tokens, eo, progress_fn(o->quiet));
      mode = fmt::format("engine on {}, prefill chunks of {}, {} weights; local errors not measured in this mode",
                         o->device, eo.chunk, backend::to_string(eo.weights));
      extra.update({{"mode", "engine"}, {"device", o->device}, {"chunk", eo.chunk}});
    } else {
      eval::EvalOptions eo;
      eo.ctx = parse_ints(o->ctx, "--ctx");
      eo.windows = o->windows;
      eo.page_size = o->page;
      eo.score_from = o->score_from;
      eo.first_position = o->first_position;
      eo.weights = backend::weight_dtype_from_string(o->weights);
      eo.threads = o->threads;
      r = eval::evaluate(L.w, L.methods, tokens, eo, progress_fn(o->quiet));
      mode = fmt::format("first RoPE position {}", o->first_position);
      extra["first_position"] = o->first_position;
    }
    if (!o->quiet) std::fprintf(stderr, "\n");
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    extra["seconds"] = secs;
    std::printf("%s", eval::format_table(r).c_str());
    std::printf("(%s; %s; %d window(s) per context; scored positions >= %s; %s; %.1f s)\n",
                L.w.cfg.name.c_str(), o->text.c_str(), o->windows,
                o->score_from >= 0 ? std::to_string(o->score_from).c_str() : "sink+recent+page", mode.c_str(),
                secs);
    std::string json_path = o->json;
    if (json_path.empty() && !o->plot.empty()) json_path = o->plot + ".json";
    if (!json_path.empty()) write_file(json_path, eval::to_json(r, extra.dump()));
    if (!o->plot.empty()) {
      const std::string cmd = fmt::format("python3 scripts/plot_eval.py '{}' -o '{}'", json_path, o->plot);
      if (std::system(cmd.c_str()) != 0)
        throw Error(fmt::format("--plot: '{}' failed (matplotlib installed?)", cmd));
    }
    return 0;
  };
}});

}  // namespace
