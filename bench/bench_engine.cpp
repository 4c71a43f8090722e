// Prefill and decode throughput of the CPU engine on a real model, beside the
// memory-bandwidth floor for decode and (when installed) llama.cpp on the same
// GGUF in the same run (scripts/bench_llamacpp.py).
//
//   bench_engine [--model PATH] [--prompt N] [--gen N] [--weights bf16,q8,f32]
//                [--threads N] [--batch B] [--reps R] [--no-llamacpp]
//
// Decode floor: every decode step streams all matrix weights once (the LM head
// included) plus the KV rows read; floor = bytes / measured copy bandwidth.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backend/cpu/backend_cpu.h"
#include "backend/cpu/ops_gemv.h"
#include "backend/cpu/ops_threads.h"
#include "kv/bf16_cache.h"
#include "model/forward.h"
#include "model/loader.h"

using namespace oscar;
using Clock = std::chrono::steady_clock;

namespace {

double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

struct Args {
  std::string model = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
  int prompt = 256, gen = 64, threads = 0, batch = 1, reps = 3;
  std::string weights = "bf16,q8";  // comma-separated: f32, bf16, q8
  bool llamacpp = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_engine: %s needs a value\n", s.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (s == "--model") a.model = next();
    else if (s == "--prompt") a.prompt = std::stoi(next());
    else if (s == "--gen") a.gen = std::stoi(next());
    else if (s == "--weights") a.weights = next();
    else if (s == "--threads") a.threads = std::stoi(next());
    else if (s == "--batch") a.batch = std::stoi(next());
    else if (s == "--reps") a.reps = std::stoi(next());
    else if (s == "--no-llamacpp") a.llamacpp = false;
    else {
      std::fprintf(stderr, "bench_engine: unknown argument %s\n", s.c_str());
      std::exit(2);
    }
  }
  return a;
}

struct LlamaCpp {
  bool ok = false;
  double prefill = 0, decode = 0;
  std::string note;
};

// Runs scripts/bench_llamacpp.py (llama-cpp-python) on the same GGUF; it prints
// "prefill_tok_s=X decode_tok_s=Y" on its last line.
LlamaCpp run_llamacpp(const Args& a, int threads) {
  LlamaCpp r;
  // The source tree is found from this file's path (CMake compiles it by absolute path).
  const std::string script =
      (std::filesystem::path(__FILE__).parent_path().parent_path() / "scripts" / "bench_llamacpp.py")
          .string();
  if (!std::filesystem::exists(script)) {
    r.note = "scripts/bench_llamacpp.py absent";
    return r;
  }
  const std::string cmd = fmt::format("python3 {} --model {} --prompt {} --gen {} --threads {} --reps {} 2>&1",
                                      script, a.model, a.prompt, a.gen, threads, a.reps);
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) {
    r.note = "popen failed";
    return r;
  }
  char line[4096];
  std::string last;
  while (std::fgets(line, sizeof line, p)) last = line;
  const int rc = pclose(p);
  if (rc == 0 && std::sscanf(last.c_str(), "prefill_tok_s=%lf decode_tok_s=%lf", &r.prefill,
                             &r.decode) == 2) {
    r.ok = true;
  } else {
    while (!last.empty() && (last.back() == '\n' || last.back() == '\r')) last.pop_back();
    r.note = last.empty() ? "failed" : last;
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  try {
    if (a.threads > 0) backend::cpu::set_op_threads(a.threads);
    struct Ratio {
      std::string name;
      double prefill, decode;
    };
    std::vector<Ratio> ratios;
    const int threads = backend::cpu::op_threads();
    // (the CPU backend's copy over its op threads: 256 MiB each way, best of 5)
    const double bw = backend::make_cpu_backend({backend::WeightDtype::kBf16, threads})->copy_bandwidth();

    auto t0 = Clock::now();
    const model::ModelWeights w = model::load_model(a.model);
    const double load_s = secs(t0, Clock::now());
    const model::ModelConfig& cfg = w.cfg;
    std::printf("bench_engine: %s (%s, %d layers, hidden %d, vocab %d), loaded in %.2f s\n",
                a.model.c_str(), cfg.name.c_str(), cfg.n_layers, cfg.hidden, cfg.vocab_size, load_s);
    std::printf("copy bandwidth (measured, %d threads): %.1f GB/s\n", threads, bw / 1e9);
    std::printf("prompt %d tokens, %d decode steps, batch %d, best of %d\n\n", a.prompt, a.gen,
                a.batch, a.reps);
    std::printf("%-30s %10s %10s %10s %8s %8s\n", "", "tokens/s", "ms/step", "MB/step", "GB/s",
                "% floor");

    std::vector<int32_t> prompt(a.prompt);
    for (int i = 0; i < a.prompt; ++i) prompt[i] = int32_t((i * 7919 + 13) % cfg.vocab_size);
    size_t pos = 0;
    while (pos <= a.weights.size()) {
      const size_t comma = std::min(a.weights.find(',', pos), a.weights.size());
      const std::string wname = a.weights.substr(pos, comma - pos);
      pos = comma + 1;
      auto be = backend::make_cpu_backend({backend::weight_dtype_from_string(wname), threads});
      model::Model m(w, *be);
      kv::Bf16KvCache cache(m.cache_shape(64),
                            int32_t(a.batch * ((a.prompt + a.gen + 63) / 64 + 1)));
      double best_prefill = 1e30, best_decode = 1e30;
      std::vector<float> logits;
      for (int r = 0; r < a.reps; ++r) {
        std::vector<kv::SeqId> seqs;
        for (int b = 0; b < a.batch; ++b) seqs.push_back(cache.create());
        // Prefill: each prompt in one call (one sequence's prefill speed).
        auto p0 = Clock::now();
        for (int b = 0; b < a.batch; ++b) {
          model::SeqStep st{seqs[b], prompt, false};
          m.forward({&st, 1}, cache, logits);
        }
        best_prefill = std::min(best_prefill, secs(p0, Clock::now()) / a.batch);
        // Decode: gen steps of one token for every sequence of the batch (greedy).
        std::vector<int32_t> tok(a.batch, 1);
        auto d0 = Clock::now();
        for (int g = 0; g < a.gen; ++g) {
          std::vector<model::SeqStep> steps;
          for (int b = 0; b < a.batch; ++b) steps.push_back({seqs[b], {&tok[b], 1}, false});
          m.forward(steps, cache, logits);
          for (int b = 0; b < a.batch; ++b) {
            auto row = logits.begin() + int64_t(b) * cfg.vocab_size;
            tok[b] = int32_t(std::max_element(row, row + cfg.vocab_size) - row);
          }
        }
        best_decode = std::min(best_decode, secs(d0, Clock::now()) / a.gen);
        for (auto s : seqs) cache.release(s);
      }
      // Bytes of one decode step: weights once + the KV rows of every sequence
      // (bf16 K and V at the average context prompt + gen/2).
      const double ctx = a.prompt + a.gen / 2.0;
      const double kv_bytes =
          a.batch * ctx * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * 2.0 * 2.0;
      const double step_bytes = double(m.weight_bytes_per_step()) + kv_bytes;
      const double floor_s = step_bytes / bw;
      const double prefill_tps = a.prompt / best_prefill, decode_tps = a.batch / best_decode;
      std::printf("%-30s %10.1f %10.2f %10s %8s %8s\n", ("prefill, " + wname + " weights").c_str(),
                  prefill_tps, best_prefill * 1e3, "-", "-", "-");
      std::printf("%-30s %10.1f %10.2f %10.1f %8.1f %7.0f%%\n",
                  ("decode, " + wname + " weights").c_str(), decode_tps, best_decode * 1e3,
                  step_bytes / 1e6, step_bytes / best_decode / 1e9, 100.0 * floor_s / best_decode);
      std::printf("%-30s %10.1f %10.2f %10.1f %8.1f %7.0f%%\n", "  decode floor (bytes / bw)",
                  a.batch / floor_s, floor_s * 1e3, step_bytes / 1e6, bw / 1e9, 100.0);
      std::printf("  backend: %s\n", be->name().c_str());
      ratios.push_back({wname, prefill_tps, decode_tps});
    }
    if (a.llamacpp && a.batch == 1) {
      LlamaCpp l = run_llamacpp(a, threads);
      if (l.ok) {
        std::printf("%-30s %10.1f\n", "prefill, llama.cpp (same GGUF)", l.prefill);
        std::printf("%-30s %10.1f\n", "decode, llama.cpp (same GGUF)", l.decode);
        for (const auto& r : ratios)
          std::printf("ratio llama.cpp / oscar (%s weights): prefill %.2fx (target <= 2), decode "
                      "%.2fx (target <= 1.5)\n",
                      r.name.c_str(), l.prefill / r.prefill, l.decode / r.decode);
      } else {
        std::printf("\nllama.cpp: not run (%s)\n", l.note.c_str());
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_engine: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
