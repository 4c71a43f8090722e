// `oscar bench`: decode throughput of the engine with the BF16 cache against a 2-bit cache
// in the same run (DESIGN §7), on a real model (-m) or on the shapes of one (--preset, random
// weights), on the CPU or the GPU:
//   equal KV memory  for each context, the most sequences each cache holds in --kv-gib GiB of
//                    pages (kv::sequences_for_bytes) and the decode tokens/s at that batch;
//   equal batch      step time at each batch x context, with the bytes a step streams (weights
//                    + the KV pages in use), the roofline (those bytes at the copy bandwidth
//                    measured in this run) and the share of it reached.
// Contexts are filled by writing random K/V rows through the cache (the forward's write and
// demotion path, without prefill compute); every timed step ends with the chosen ids on the
// host, as a greedy serving step does. Speed only: both caches run on the same weights (a
// calibration's value rotation is not folded into W_v / W_o), so the tokens mean nothing.
// bench/engine_cuda/bench_gpu_engine adds the GPU-only detail (GEMM split, FlashInfer's BF16
// decode, prefill, sampling).
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include <unistd.h>

#include "cli/registry.h"
#include "core/error.h"
#include "engine/session.h"
#include "kv/quant_methods.h"
#include "model/fold_rotation.h"
#include "model/forward.h"
#include "model/forward_random.h"
#include "model/loader.h"
#include "model/rope.h"

namespace {

using namespace oscar;

struct Opts {
  std::string model, preset, device = "cpu", weights = "bf16", kv, calib, json;
  double kv_gib = 1.0;
  std::vector<int> ctx, batch = {1, 8}, batch_ctx;
  int steps = 8, threads = 0, page_size = 64;
};

struct Row {
  std::string cache;
  int batch = 0, ctx = 0;
  double step_ms = 0, tok_s = 0, bytes = 0, roofline_ms = 0;
  std::string error;  // why the row has no time (its cache did not fit, or its steps failed)
};

const cli::Registrar reg({"bench", "Decode throughput, BF16 cache vs 2-bit cache: equal KV memory and equal batch (DESIGN §7)",
                          [](CLI::App& app) {
  auto o = std::make_shared<Opts>();
  app.add_option("-m,--model", o->model, "GGUF file or Hugging Face directory (default: the default model, "
                                         "unless --preset)");
  app.add_option("--preset", o->preset, "The shapes of a model, with random weights: qwen3-8b, llama3-8b, qwen25-1.5b");
  app.add_option("--device", o->device, "cpu, cuda or cuda:N")->capture_default_str();
  app.add_option("--weights", o->weights, "Weight storage: bf16, q8 or f32")->capture_default_str();
  app.add_option("--kv", o->kv, "The caches compared, the first is the baseline (default: bf16,oscar with --calib, "
                                "else bf16,int2-hadamard: a calibrated rotation's decode cost without its page centering)");
  app.add_option("--calib", o->calib, "Calibration file for oscar (oscar calibrate)");
  app.add_option("--kv-gib", o->kv_gib, "KV page memory of the equal-memory table, GiB")->capture_default_str();
  app.add_option("--ctx", o->ctx, "Contexts of the equal-memory table (default: half the model's context "
                                  "and nearly all of it, at most 32K and 128K)")
      ->delimiter(',');
  app.add_option("--batch", o->batch, "Batches of the equal-batch table (0: no such table)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--batch-ctx", o->batch_ctx, "Contexts of the equal-batch table (default: the first --ctx)")
      ->delimiter(',');
  app.add_option("--steps", o->steps, "Decode steps timed per row")->capture_default_str();
  app.add_option("--page-size", o->page_size, "KV page size in tokens")->capture_default_str();
  app.add_option("-t,--threads", o->threads, "CPU threads (0 = all cores)");
  app.add_option("--json", o->json, "Also write the results here");
  return [o]() -> int {
    if (o->steps < 1) throw Error("--steps must be >= 1");
    if (o->kv_gib <= 0) throw Error("--kv-gib must be > 0");
    if (!o->model.empty() && !o->preset.empty()) throw Error("give -m or --preset, not both");
    if (o->model.empty() && o->preset.empty()) o->model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!o->model.empty() && !std::filesystem::exists(o->model))
      throw Error(o->model + ": no such model (scripts/fetch_model.sh fetches the default)");
    if (o->kv.empty()) o->kv = o->calib.empty() ? "bf16,int2-hadamard" : "bf16,oscar";
    if (!o->preset.empty()) model::preset_config(o->preset);  // an unknown name fails before any work

    auto be = engine::make_backend(o->device, backend::weight_dtype_from_string(o->weights), o->threads);
    std::printf("backend: %s\n", be->name().c_str());
    const double bw = be->copy_bandwidth();
    std::printf("copy bandwidth (read + write, measured): %.1f GB/s\n", bw / 1e9);
    std::fflush(stdout);

    const auto t0 = std::chrono::steady_clock::now();
    std::unique_ptr<model::Model> mp;
    model::ModelConfig cfg;
    ModelFingerprint fp;
    if (!o->model.empty()) {
      model::ModelWeights w = model::load_model(o->model);
      cfg = w.cfg;
      fp = model::model_fingerprint(w);
      mp = std::make_unique<model::Model>(w, *be);
    } else {
      cfg = model::preset_config(o->preset);
      fp = {model::arch_name(cfg.arch), cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ""};
      mp = model::random_model(cfg, *be, [](int l, int n) { std::fprintf(stderr, "\rweights: layer %d/%d", l, n); });
      std::fprintf(stderr, "\n");
    }
    model::Model& m = *mp;
    m.set_logits_to_host(false);
    std::printf("model: %s (%s), %.3f GB of weights streamed per step, ready in %.1f s\n",
                o->model.empty() ? (o->preset + " shapes, random weights").c_str() : o->model.c_str(),
                cfg.name.c_str(), double(m.weight_bytes_per_step()) / 1e9,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    std::fflush(stdout);

    kv::KvMethodOptions mo;
    mo.calib_path = o->calib;
    mo.model = fp;
    mo.rope_freq = model::rope_inv_freq(cfg);
    const std::vector<kv::KvMethod> methods = kv::resolve_kv_methods(o->kv, mo);
    if (methods.empty()) throw Error("--kv lists no cache");
    auto label = [](const kv::KvMethod& km) { return km.kind == kv::KvMethod::Kind::kBf16 ? std::string("bf16") : km.label; };

    // Contexts: each leaves room for the warm-up and timed steps within the model's positions.
    const int margin = 2 * o->steps + 8;
    if (o->ctx.empty()) {
      const int most = cfg.max_position - margin;
      o->ctx = {std::min(32768, cfg.max_position / 2), std::min(131072, most)};
      if (o->ctx[0] >= o->ctx[1]) o->ctx.pop_back();
    }
    if (o->batch_ctx.empty()) o->batch_ctx = {o->ctx.front()};
    for (const std::vector<int>* list : {&o->ctx, &o->batch_ctx})
      for (int c : *list)
        if (c < 1 || int64_t(c) + margin > cfg.max_position)
          throw Error(fmt::format("context {}: the model's positions end at {} ({} steps need {} more)", c,
                                  cfg.max_position, o->steps, margin));
    for (int b : o->batch)
      if (b < 0) throw Error("--batch: batches must be >= 0 (0: no equal-batch table)");
    std::erase(o->batch, 0);

    const kv::KvCacheShape shape = m.cache_shape(o->page_size);
    const int chunk = 2048;
    const int64_t Dkv = int64_t(cfg.n_kv_heads) * cfg.head_dim;
    auto kbuf = be->alloc(size_t(chunk) * Dkv), vbuf = be->alloc(size_t(chunk) * Dkv);
    {
      // Unit-variance rows (their values do not change the step's cost).
      std::vector<float> r(size_t(chunk) * Dkv);
      uint64_t x = 0x2545F4914F6CDD1Dull;
      for (float& f : r) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        f = 1.7320508f * (float(x >> 40) * (2.0f / 16777216.0f) - 1.0f);
      }
      be->from_host(r.data(), kbuf->data(), r.size());
      be->from_host(r.data(), vbuf->data(), r.size());
    }

    const bool tty = isatty(fileno(stderr)) != 0;
    // Decode steps of B sequences of C tokens in `cache` (B <= 0: none), ms per step.
    auto run = [&](kv::KvCache& cache, const kv::KvMethod& km, int B, int C, Row& r) {
      r.cache = label(km);
      r.batch = B;
      r.ctx = C;
      if (B <= 0) return;
      std::vector<kv::SeqId> seqs;
      const auto f0 = std::chrono::steady_clock::now();
      for (int i = 0; i < B; ++i) {
        seqs.push_back(cache.create());
        cache.fill_with_rows(seqs.back(), C, kbuf->data(), vbuf->data(), chunk);
        if (tty) std::fprintf(stderr, "\r%s: filling %d x %d tokens: %d done", r.cache.c_str(), B, C, i + 1);
      }
      cache.store().sync();
      std::fprintf(stderr, "%s%s: %d x %d tokens filled in %.1f s, timing %d steps\n", tty ? "\r" : "", r.cache.c_str(),
                   B, C, std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count(), o->steps);
      std::vector<int32_t> tok(size_t(B), 11), ids;
      std::vector<model::SeqStep> st;
      for (int i = 0; i < B; ++i) st.push_back({seqs[size_t(i)], {&tok[size_t(i)], 1}, false});
      m.forward_argmax(st, cache, ids);  // warm-up: demotion of the filled prompt, workspaces, plans, graphs
      m.forward_argmax(st, cache, ids);
      const auto s0 = std::chrono::steady_clock::now();
      for (int i = 0; i < o->steps; ++i) m.forward_argmax(st, cache, ids);
      r.step_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count() / o->steps;
      r.tok_s = B / (r.step_ms * 1e-3);
      r.bytes = double(m.weight_bytes_per_step()) + double(cache.bytes_in_use());
      r.roofline_ms = r.bytes / bw * 1e3;
    };
    // A row's tokens/s over the baseline's (the first --kv cache) at the same context (and batch).
    auto vs_base = [&](const std::vector<Row>& rows, const Row& r, bool same_batch) -> std::string {
      const std::string base = label(methods.front());
      for (const Row& b : rows)
        if (&b != &r && b.cache == base && b.ctx == r.ctx && (!same_batch || b.batch == r.batch) && b.tok_s > 0)
          return fmt::format("{:.2f}x", r.tok_s / b.tok_s);
      return "";
    };

    // One row: its cache made by `make`, then its steps. A cache that cannot be allocated (more
    // pages than the device or host has, or than a pool indexes) makes a row that says so, and
    // the other rows still run; any other failure is reported the same way and fails the command.
    bool failed = false;
    auto measure = [&](Row& r, const kv::KvMethod& km, int B, int C, auto make) {
      r.cache = label(km), r.batch = B, r.ctx = C;
      std::unique_ptr<kv::KvCache> cache;
      try {
        cache = make();
      } catch (const std::exception& e) {
        const bool memory = dynamic_cast<const OutOfMemory*>(&e) || dynamic_cast<const std::bad_alloc*>(&e);
        r.error = fmt::format("{} ({})", memory ? "does not fit" : "failed", e.what());
        failed = failed || !memory;
        std::fprintf(stderr, "%s: %d x %d tokens: %s\n", r.cache.c_str(), B, C, r.error.c_str());
        return;
      }
      try {
        run(*cache, km, B, C, r);
      } catch (const std::exception& e) {
        r.error = fmt::format("failed ({})", e.what());
        r.step_ms = r.tok_s = 0;
        failed = true;
        std::fprintf(stderr, "%s: %d x %d tokens: %s\n", r.cache.c_str(), B, C, r.error.c_str());
      }
    };
    const int64_t bytes = int64_t(o->kv_gib * double(int64_t(1) << 30));
    std::vector<Row> eq, eb;
    for (int C : o->ctx) {
      for (const kv::KvMethod& km : methods) {
        Row r;
        const int B = kv::sequences_for_bytes(km, shape, bytes, int64_t(C) + margin, chunk);
        if (B > 0) {
          measure(r, km, B, C, [&] {
            return kv::make_method_cache_for_bytes(km, shape, bytes, B, chunk, false, be->page_store_factory());
          });
        } else {
          r.cache = label(km), r.ctx = C;
        }
        eq.push_back(r);
      }
    }
    for (int C : o->batch_ctx)
      for (int B : o->batch)
        for (const kv::KvMethod& km : methods) {
          Row r;
          measure(r, km, B, C, [&] {
            return kv::make_method_cache_for_bytes(
                km, shape, kv::bytes_for_sequences(km, shape, B, int64_t(C) + margin, chunk), B, chunk, false,
                be->page_store_factory());
          });
          eb.push_back(r);
        }

    std::printf("\nequal KV memory: %.2f GiB of pages, decode at the largest batch that fits\n\n", o->kv_gib);
    std::printf("| context | cache | sequences | step ms | streamed GB | of roofline | tokens/s | vs %s |\n"
                "|---|---|---|---|---|---|---|---|\n",
                label(methods.front()).c_str());
    for (const Row& r : eq) {
      if (!r.error.empty()) {
        std::printf("| %d | %s | %d | %s | | | | |\n", r.ctx, r.cache.c_str(), r.batch, r.error.c_str());
        continue;
      }
      if (r.batch == 0) {
        std::printf("| %d | %s | 0 | | | | | |\n", r.ctx, r.cache.c_str());
        continue;
      }
      std::printf("| %d | %s | %d | %.2f | %.3f | %.0f %% | %.1f | %s |\n", r.ctx, r.cache.c_str(), r.batch, r.step_ms,
                  r.bytes / 1e9, 100 * r.roofline_ms / r.step_ms, r.tok_s, vs_base(eq, r, false).c_str());
    }
    if (!eb.empty()) {
      std::printf("\nequal batch: the step against its roofline (weights + KV pages in use, at %.1f GB/s)\n\n", bw / 1e9);
      std::printf("| batch x context | cache | step ms | streamed GB | roofline ms | of roofline | tokens/s | vs %s |\n"
                  "|---|---|---|---|---|---|---|---|\n",
                  label(methods.front()).c_str());
      for (const Row& r : eb) {
        if (!r.error.empty()) {
          std::printf("| %d x %d | %s | %s | | | | | |\n", r.batch, r.ctx, r.cache.c_str(), r.error.c_str());
          continue;
        }
        const std::string vs = vs_base(eb, r, true);
        std::printf("| %d x %d | %s | %.2f | %.3f | %.2f | %.0f %% | %.1f | %s |\n", r.batch, r.ctx, r.cache.c_str(),
                    r.step_ms, r.bytes / 1e9, r.roofline_ms, 100 * r.roofline_ms / r.step_ms, r.tok_s, vs.c_str());
      }
    }
    if (!o->json.empty()) {
      nlohmann::json j;
      j["backend"] = be->name();
      j["model"] = o->model.empty() ? o->preset + " (random weights)" : o->model;
      j["copy_gbps"] = bw / 1e9;
      j["kv_gib"] = o->kv_gib;
      j["weight_bytes"] = m.weight_bytes_per_step();
      j["steps"] = o->steps;
      auto rows = [](const std::vector<Row>& v) {
        nlohmann::json a = nlohmann::json::array();
        for (const Row& r : v) {
          a.push_back({{"cache", r.cache}, {"batch", r.batch}, {"ctx", r.ctx}, {"step_ms", r.step_ms},
                       {"tok_s", r.tok_s}, {"bytes", r.bytes}, {"roofline_ms", r.roofline_ms}});
          if (!r.error.empty()) a.back()["error"] = r.error;
        }
        return a;
      };
      j["equal_memory"] = rows(eq);
      j["equal_batch"] = rows(eb);
      std::ofstream f(o->json);
      if (!f) throw Error(o->json + ": cannot write");
      f << j.dump(1) << "\n";
    }
    return failed ? 1 : 0;
  };
}});

}  // namespace
