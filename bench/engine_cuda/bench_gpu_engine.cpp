// End-to-end decode throughput of the CUDA engine (backend/cuda + Model::forward
// + a paged cache in device memory), BF16 cache against the 2-bit cache in the
// same run, on a model of a real shape with random BF16 weights (made on the
// host one layer at a time, DESIGN §7).
//
//   bench_gpu_engine [--preset qwen3-8b|llama3-8b|qwen25-1.5b] [--kv-gib 100] [--ctx 32768,65536]
//                    [--batch 1,8,32] [--steps 8] [--graphs both|on|off] [--json FILE]
//
// Decode steps replay their layers from CUDA graphs (Model::set_graphs); with
// --graphs both (the default) every equal-batch row is also timed eagerly on
// the same cache, so the graphs' gain is measured in the same run. Each batch
// also gets the time of its linear layers alone (cuBLAS on one layer's shapes,
// replayed for every layer from one graph, plus the LM head): the step splits
// into GEMM / other (the weights-only step minus GEMM) / attention + cache
// (the step minus the weights-only step).
//
// Two tables:
//   equal memory: for each context, the most sequences each cache holds in
//     --kv-gib GiB of pages, and decode tokens/s at that batch;
//   equal batch: step time at each (batch, context) with the bytes a step
//     streams (weights + KV pages in use), the roofline (those bytes / the
//     device-to-device copy bandwidth measured in this run) and the share of
//     the step that is not the weights-only step (attention + cache writes).
// The contexts are filled by writing random K/V rows straight into the cache
// (the same write and demotion path as a forward, without prefill compute).
// The 2-bit cache uses the OSCAR layout with a Hadamard rotation (data-free:
// the decode cost of a calibrated OSCAR rotation is the same d x d product).
// --methods bf16-flashinfer / bf16-flashinfer-tc add the BF16 cache decoded by
// FlashInfer's CUDA-core / tensor-core kernel (builds with scripts/fetch_flashinfer.sh's
// headers): the check that the BF16 baseline is not handicapped by our kernel.
// --prefill-kernels default,ours,gemm,flashinfer-fa2,flashinfer-fa3 times the prefill rows
// with each BF16 prefill attention kernel (the same gathered rows; default: the backend's).
// --mixed B:C:P times serving-like steps: B decode rows at context C with one P-token prefill
// chunk of a new sequence, against the two alone.
#include <cublas_v2.h>
#include <cuda_profiler_api.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "backend/cuda/backend_cuda.h"
#include "core/calibration.h"
#include "core/error.h"
#include "kv/quant_methods.h"
#include "model/fold_rotation.h"
#include "model/forward.h"
#include "model/forward_random.h"
#include "model/loader.h"
#include "engine/sampler.h"
#include "engine/step_draw.h"

using namespace oscar;

namespace {

// The BF16 cache decoded by FlashInfer's CUDA-core or tensor-core kernel instead of ours
// (--methods bf16-flashinfer, bf16-flashinfer-tc).
const char* const kFiLabel = "bf16 (flashinfer)";
const char* const kFiTcLabel = "bf16 (flashinfer-tc)";

struct Args {
  std::string preset = "qwen3-8b";
  std::string model;  // a GGUF / HF checkpoint instead of the preset's random weights
  double kv_gib = 100;
  std::vector<int> ctx = {32768, 65536, 131072};
  std::vector<int> batch = {1, 8, 32, 64};
  std::vector<int> batch_ctx = {32768};
  int long_ctx = 100000;  // batch 1 at this context too (0 = skip)
  int steps = 8;
  std::string json;
  std::string methods = "bf16,int2";
  std::string calib;  // --calib: the int2 cache uses this calibration (else a data-free Hadamard one)
  std::string graphs = "both";
  std::vector<int> prefill = {8192, 32768};  // prompt lengths timed (0: none)
  int prefill_chunk = 8192;
  std::string prefill_kernels = "default";  // BF16 prefill attention kernels timed (set_cuda_prefill; default: the backend's)
  // Sampled decode steps (the engine's StepDrawer: draws on the device) against greedy ones and
  // against drawing on the host, at these batches (none: skipped), BF16 cache of sample_ctx tokens.
  std::vector<int> sample_batch;
  int sample_ctx = 1024;
  float sample_temp = 0.25f, sample_top_p = 0.95f;
  // A repetition penalty on every sampled row, over sample_history distinct ids per row (1: none).
  float sample_penalty = 1.0f;
  int sample_history = 1024;
  // Mixed steps, as a serving step that admits a request: B decode rows at context C plus one
  // P-token prefill chunk of a new sequence (--mixed B:C:P,...), against the decode rows alone
  // and the chunk alone in the same run.
  std::vector<std::array<int, 3>> mixed;
};

// The non-empty items of a comma-separated list.
std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> v;
  size_t b = 0;
  while (b < s.size()) {
    size_t e = s.find(',', b);
    if (e == std::string::npos) e = s.size();
    if (e > b) v.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return v;
}

std::vector<int> ints(const std::string& s) {
  std::vector<int> v;
  if (s == "none") return v;  // e.g. --ctx none: no equal-memory rows
  for (const std::string& w : words(s)) v.push_back(std::stoi(w));
  return v;
}

// Milliseconds `reps` calls of fn take on the GPU (CUDA events on the legacy stream, after
// one untimed call).
template <class F>
float event_ms(int reps, F&& fn) {
  fn();
  cudaDeviceSynchronize();
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  for (int i = 0; i < reps; ++i) fn();
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}

// The bf16 tensor-core peak as our prefill uses it (bf16 x bf16, fp32 accumulation and
// output), on an 8192^3 product of random data.
double gemm_peak_flops() {
  const int n = 8192;
  void *a = nullptr, *b = nullptr, *c = nullptr;
  if (cudaMalloc(&a, size_t(n) * n * 2) != cudaSuccess || cudaMalloc(&b, size_t(n) * n * 2) != cudaSuccess ||
      cudaMalloc(&c, size_t(n) * n * 4) != cudaSuccess)
    throw Error("bench: cannot allocate the GEMM peak buffers");
  {
    std::vector<uint16_t> h(size_t(n) * n);
    uint64_t x = 88172645463325252ull;
    for (auto& v : h) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      v = uint16_t(0x3c00 | (x & 0x3ff)) ^ uint16_t((x >> 20) & 0x8000);  // bf16 in [-2, -1] u [1, 2]
    }
    cudaMemcpy(a, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
    cudaMemcpy(b, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
  }
  cublasHandle_t hb;
  cublasCreate(&hb);
  const float one = 1, zero = 0;
  const float ms = event_ms(10, [&] {
    cublasGemmEx(hb, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n, &zero, c,
                 CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  });
  cublasDestroy(hb);
  cudaFree(a);
  cudaFree(b);
  cudaFree(c);
  return 2.0 * n * double(n) * n * 10 / (ms * 1e-3);
}

struct Row {
  std::string method;
  int batch = 0, ctx = 0;
  double step_ms = 0, tok_s = 0, weights_ms = 0, bytes = 0, roofline_ms = 0;
  double eager_ms = 0, gemm_ms = 0;  // the same step without graphs; the linear layers alone
  double gemm_cublas_ms = 0;         // the linear layers alone with cuBLAS at every batch
  double gemm_cores_ms = 0;          // ... with the CUDA-core GEMV where the tensor-core one runs (0: n/a)
  int fit = 0;  // equal-memory rows: sequences that fit
};

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Error("bench_gpu_engine: " + s + " needs a value");
      return argv[++i];
    };
    if (s == "--preset") a.preset = next();
    else if (s == "--model") a.model = next();
    else if (s == "--kv-gib") a.kv_gib = std::stod(next());
    else if (s == "--ctx") a.ctx = ints(next());
    else if (s == "--batch") a.batch = ints(next());
    else if (s == "--batch-ctx") a.batch_ctx = ints(next());
    else if (s == "--long-ctx") a.long_ctx = std::stoi(next());
    else if (s == "--steps") a.steps = std::stoi(next());
    else if (s == "--json") a.json = next();
    else if (s == "--methods") a.methods = next();
    else if (s == "--calib") a.calib = next();
    else if (s == "--graphs") a.graphs = next();
    else if (s == "--prefill") a.prefill = ints(next());
    else if (s == "--prefill-chunk") a.prefill_chunk = std::stoi(next());
    else if (s == "--prefill-kernels") a.prefill_kernels = next();
    else if (s == "--sample-batch") a.sample_batch = ints(next());
    else if (s == "--sample-ctx") a.sample_ctx = std::stoi(next());
    else if (s == "--sample-temp") a.sample_temp = std::stof(next());
    else if (s == "--sample-top-p") a.sample_top_p = std::stof(next());
    else if (s == "--sample-penalty") a.sample_penalty = std::stof(next());
    else if (s == "--sample-history") a.sample_history = std::stoi(next());
    else if (s == "--mixed") {
      for (const std::string& w : words(next())) {
        std::array<int, 3> v{};
        if (std::sscanf(w.c_str(), "%d:%d:%d", &v[0], &v[1], &v[2]) != 3 || v[0] < 1 || v[1] < 1 || v[2] < 2)
        {
          std::fprintf(stderr, "bench_gpu_engine: --mixed takes B:C:P (decode rows, their context, prefill tokens >= 2), got '%s'\n",
                       w.c_str());
          return 2;
        }
        a.mixed.push_back(v);
      }
    } else {
      std::fprintf(stderr, "usage: bench_gpu_engine [--preset qwen3-8b|llama3-8b|qwen25-1.5b | --model PATH] [--kv-gib G] "
                           "[--ctx a,b] [--batch a,b] [--batch-ctx c] [--long-ctx n] [--steps n] "
                           "[--methods bf16,bf16-flashinfer,bf16-flashinfer-tc,int2,int2-nocenter] [--calib FILE] [--graphs both|on|off] [--prefill 8192,32768] [--prefill-chunk n] [--prefill-kernels default,ours,gemm,flashinfer-fa2,flashinfer-fa3] "
                           "[--sample-batch 1,8,32] [--sample-ctx n] [--sample-temp t] [--sample-top-p p] [--sample-penalty r] [--sample-history n] [--mixed B:C:P,...] [--json FILE]\n");
      return 2;
    }
  }
  if (a.graphs != "both" && a.graphs != "on" && a.graphs != "off") {
    std::fprintf(stderr, "bench_gpu_engine: --graphs takes both, on or off\n");
    return 2;
  }
  try {
    model::ModelWeights loaded;  // --model: its weights until the model holds them
    if (!a.model.empty()) loaded = model::load_model(a.model);
    const model::ModelConfig cfg = a.model.empty() ? model::preset_config(a.preset) : loaded.cfg;
    auto be = backend::make_cuda_backend({backend::WeightDtype::kBf16, 0});
    std::printf("device: %s\n", be->name().c_str());
    const double bw = be->copy_bandwidth();
    std::printf("device-to-device copy: %.0f GB/s (read + write)\n", bw / 1e9);
    const double peak = gemm_peak_flops();
    std::printf("bf16 GEMM (8192^3, fp32 out): %.0f TFLOP/s\n", peak / 1e12);

    const auto t0 = std::chrono::steady_clock::now();
    const int64_t H = cfg.hidden, Dq = int64_t(cfg.n_heads) * cfg.head_dim,
                  Dkv = int64_t(cfg.n_kv_heads) * cfg.head_dim, I = cfg.intermediate;
    std::unique_ptr<model::Model> mp;
    ModelFingerprint fp{model::arch_name(cfg.arch), cfg.n_layers,
                        cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, ""};
    if (!a.model.empty()) {
      fp = model::model_fingerprint(loaded);
      mp = std::make_unique<model::Model>(loaded, *be);
      loaded = {};
    } else {
      mp = model::random_model(cfg, *be, [](int l, int n) { std::fprintf(stderr, "\rweights: layer %d/%d", l, n); });
      std::fprintf(stderr, "\n");
    }
    model::Model& m = *mp;
    std::printf("model: %s, %.2f GB streamed per step, made in %.0f s\n",
                a.model.empty() ? (a.preset + " shapes, random BF16 weights").c_str() : a.model.c_str(),
                m.weight_bytes_per_step() / 1e9,
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    m.set_logits_to_host(false);

    // bf16; int2: the OSCAR layout with --calib's calibration (real rotations, key transform and
    // page centering, as `oscar calibrate` wrote them) or a data-free Hadamard one; int2-nocenter:
    // the same calibration without its page centering (an A/B of that cost).
    std::vector<kv::KvMethod> methods;
    std::shared_ptr<Calibration> calib;
    if (!a.calib.empty()) {
      calib = std::make_shared<Calibration>(read_calibration(a.calib));
      check_calibration_matches(*calib, fp, a.calib);
    }
    {
      for (const std::string& name : words(a.methods)) {
        kv::KvMethod km;
        if (name == "int2" || name == "int2-nocenter") {
          km.kind = kv::KvMethod::Kind::kRow;
          km.bits = 2;
          km.group_size = 128;
          if (calib) {
            km.calib = calib;
            km.group_size = calib->group_size;
            km.sink = calib->sink;
            km.recent = calib->recent;
            km.label = name == "int2" ? "int2 (calib)" : "int2 (calib, no page centre)";
            if (name == "int2-nocenter") {
              auto flat = std::make_shared<Calibration>(*calib);
              for (LayerCalibration& L : flat->layers) L.k_rope_mean.clear();
              flat->rope_freq.clear();
              km.calib = flat;
            }
          } else {
            if (name == "int2-nocenter") throw Error("bench_gpu_engine: int2-nocenter needs --calib");
            km.label = "int2 (oscar layout)";
            km.calib = std::make_shared<Calibration>(
                data_free_calibration(Composition::kHadamard, fp, 0.96f, 0.92f, 2, 128));
          }
        } else if (name == "bf16-flashinfer" || name == "bf16-flashinfer-tc") {
          if (!backend::cuda_has_flashinfer())
            throw Error("bench_gpu_engine: " + name + ": this build has no FlashInfer "
                        "(bash scripts/fetch_flashinfer.sh, then build again)");
          km.label = name == "bf16-flashinfer" ? kFiLabel : kFiTcLabel;
        } else if (name != "bf16") {
          throw Error("bench_gpu_engine: --methods: unknown '" + name +
                      "' (bf16, bf16-flashinfer, bf16-flashinfer-tc, int2, int2-nocenter)");
        }
        methods.push_back(km);
      }
      if (methods.empty()) throw Error("bench_gpu_engine: --methods lists nothing");
    }
    // A method's name in the tables; select() puts the BF16 decode on the kernel it names.
    auto name_of = [](const kv::KvMethod& km) -> std::string {
      if (km.kind != kv::KvMethod::Kind::kBf16) return km.label;
      return km.label.empty() ? std::string("bf16") : km.label;
    };
    auto select = [&](const kv::KvMethod& km) {
      const bool bf = km.kind == kv::KvMethod::Kind::kBf16;
      backend::set_cuda_bf16_decode(*be, bf && km.label == kFiLabel     ? "flashinfer"
                                         : bf && km.label == kFiTcLabel ? "flashinfer-tc"
                                                                        : "ours");
    };
    const auto shape = m.cache_shape(64);
    const int chunk = 2048;
    auto kbuf = be->alloc(size_t(chunk) * Dkv), vbuf = be->alloc(size_t(chunk) * Dkv);
    {
      oscar::Tensor r;
      model::fill_uniform(r, {chunk, Dkv}, 1.0, 7);
      be->from_host(r.data.data(), kbuf->data(), r.data.size());
      be->from_host(r.data.data(), vbuf->data(), r.data.size());
    }
    const int64_t bytes = int64_t(a.kv_gib * double(1ull << 30));

    // Times `steps` decode steps over seqs (one token each); returns ms per step.
    m.set_graphs(a.graphs != "off");
    // OSCAR_BENCH_PROFILE=1: each timed configuration also runs one step inside a
    // profiler range, for a per-kernel trace of one step under Nsight Compute.
    const bool profile_step = std::getenv("OSCAR_BENCH_PROFILE") != nullptr;
    auto time_steps = [&](kv::KvCache& cache, const std::vector<kv::SeqId>& seqs) {
      std::vector<int32_t> tok(seqs.size(), 11);
      std::vector<model::SeqStep> st;
      for (size_t i = 0; i < seqs.size(); ++i) st.push_back({seqs[i], {&tok[i], 1}, false});
      // Each step ends as a greedy serving step does: the chosen ids on the host
      // (forward_argmax), so the host waits for every step before the next.
      std::vector<int32_t> lg;
      m.forward_argmax(st, cache, lg);  // warm-up (plans, workspaces, graphs)
      m.forward_argmax(st, cache, lg);
      cudaDeviceSynchronize();
      if (profile_step) {  // one step between cudaProfilerStart/Stop (ncu --profile-from-start off)
        cudaProfilerStart();
        m.forward_argmax(st, cache, lg);
        cudaDeviceSynchronize();
        cudaProfilerStop();
      }
      const auto s0 = std::chrono::steady_clock::now();
      for (int i = 0; i < a.steps; ++i) m.forward_argmax(st, cache, lg);
      cudaDeviceSynchronize();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count() /
             a.steps;
    };
    // The linear layers of a step alone at batch B: one layer's shapes (its
    // weights are ~8x the L2, so every replay streams them from memory again)
    // for every layer, and the LM head, from one graph.
    backend::WeightPtr gq, go, ggu, gd, glm;
    {
      oscar::Tensor wq, wk, wv, wo, wg, wu, wd, lmh;
      model::fill_uniform(wq, {Dq, H}, 1.0 / H, 901);
      model::fill_uniform(wk, {Dkv, H}, 1.0 / H, 902);
      model::fill_uniform(wv, {Dkv, H}, 1.0 / H, 903);
      model::fill_uniform(wo, {H, Dq}, 1.0 / Dq, 904);
      model::fill_uniform(wg, {I, H}, 1.0 / H, 905);
      model::fill_uniform(wu, {I, H}, 1.0 / H, 906);
      model::fill_uniform(wd, {H, I}, 1.0 / I, 907);
      model::fill_uniform(lmh, {cfg.vocab_size, H}, 1.0 / H, 908);
      gq = be->prepare_linear({&wq, &wk, &wv}, {});
      go = be->prepare_linear({&wo}, {});
      ggu = be->prepare_linear({&wg, &wu}, {});
      gd = be->prepare_linear({&wd}, {});
      glm = be->prepare_linear({&lmh}, {});
    }
    const int64_t gemm_bytes = int64_t(cfg.n_layers) * (gq->bytes + go->bytes + ggu->bytes + gd->bytes) + glm->bytes;
    std::vector<std::pair<int, double>> gemm_only, gemm_cublas, gemm_cores;
    const int gemv_rows = backend::cuda_gemv_rows(*be);  // restored after the cuBLAS timing
    auto cublas_ms = [&](int B) {
      for (auto& [b, ms] : gemm_cublas)
        if (b == B) return ms;
      return 0.0;
    };
    auto cores_ms = [&](int B) {
      for (auto& [b, ms] : gemm_cores)
        if (b == B) return ms;
      return 0.0;
    };
    auto gemm_ms = [&](int B) {
      for (auto& [b, ms] : gemm_only)
        if (b == B) return ms;
      auto x = be->alloc(size_t(B) * std::max<int64_t>(I, std::max(H, Dq))),
           y = be->alloc(size_t(B) * std::max<int64_t>(2 * I, std::max<int64_t>(cfg.vocab_size, Dq + 2 * Dkv)));
      auto all = [&] {
        for (int l = 0; l < cfg.n_layers; ++l) {
          be->linear(*gq, x->data(), B, y->data());
          be->linear(*go, x->data(), B, y->data());
          be->linear(*ggu, x->data(), B, y->data());
          be->linear(*gd, x->data(), B, y->data());
        }
        be->linear(*glm, x->data(), B, y->data());
      };
      auto timed = [&](uint64_t key) {
        be->run_graph(key, all);  // records (or runs eagerly without graphs)
        cudaDeviceSynchronize();
        const auto s0 = std::chrono::steady_clock::now();
        for (int i = 0; i < a.steps; ++i) be->run_graph(key, all);
        cudaDeviceSynchronize();
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count() / a.steps;
      };
      const double ms = timed(0xB0000000ull + uint64_t(B));
      backend::set_cuda_gemv_rows(*be, 0);
      const double cublas = timed(0xB1000000ull + uint64_t(B));
      backend::set_cuda_gemv_rows(*be, gemv_rows);
      // Where the tensor-core GEMV runs, the same with the CUDA-core one (A/B).
      const int mma_from = backend::cuda_gemv_mma_min_rows(*be);
      if (B <= gemv_rows && B >= mma_from) {
        backend::set_cuda_gemv_mma_min_rows(*be, backend::kCudaGemvNever);
        gemm_cores.push_back({B, timed(0xB2000000ull + uint64_t(B))});
        backend::set_cuda_gemv_mma_min_rows(*be, mma_from);
      }
      be->clear_graphs();  // x and y go
      gemm_only.push_back({B, ms});
      gemm_cublas.push_back({B, cublas});
      return ms;
    };
    // The weights-only step at each batch: a context of 64 tokens.
    std::vector<std::pair<int, double>> wonly;
    auto weights_ms = [&](int B) {
      for (auto& [b, ms] : wonly)
        if (b == B) return ms;
      select(methods[0]);
      auto cache = kv::make_method_cache(methods[0], shape, int64_t(B) * 256, false,
                                         be->page_store_factory());
      std::vector<kv::SeqId> seqs;
      for (int i = 0; i < B; ++i) {
        seqs.push_back(cache->create());
        cache->fill_with_rows(seqs.back(), 64, kbuf->data(), vbuf->data(), chunk);
        cache->store().sync();
      }
      const double ms = time_steps(*cache, seqs);
      wonly.push_back({B, ms});
      return ms;
    };

    std::vector<Row> rows_eq, rows_b;
    // ---- equal memory
    for (int C : a.ctx) {
      for (const kv::KvMethod& km : methods) {
        select(km);
        // The most sequences of C tokens (+ the decode steps) the budget holds.
        const int lo = kv::sequences_for_bytes(km, shape, bytes, C + a.steps + 2, chunk);
        Row r;
        r.method = name_of(km);
        r.ctx = C;
        r.fit = lo;
        r.batch = lo;
        if (lo > 0) {
          std::fprintf(stderr, "equal memory: %s, %d x %d tokens: filling\n", r.method.c_str(), lo, C);
          auto cache = kv::make_method_cache_for_bytes(km, shape, bytes, lo, chunk, false,
                                                       be->page_store_factory());
          std::vector<kv::SeqId> seqs;
          for (int i = 0; i < lo; ++i) {
            seqs.push_back(cache->create());
            cache->fill_with_rows(seqs.back(), C, kbuf->data(), vbuf->data(), chunk);
            cache->store().sync();
          }
          r.step_ms = time_steps(*cache, seqs);
          r.tok_s = lo / (r.step_ms * 1e-3);
          r.bytes = double(m.weight_bytes_per_step()) + double(cache->bytes_in_use());
          r.roofline_ms = r.bytes / bw * 1e3;
        }
        std::printf("equal memory %5.0f GiB | ctx %6d | %-20s | fits %4d | step %8.2f ms | %9.0f tok/s\n",
                    a.kv_gib, C, r.method.c_str(), r.fit, r.step_ms, r.tok_s);
        std::fflush(stdout);
        rows_eq.push_back(r);
      }
    }
    // ---- equal batch
    std::vector<std::pair<int, int>> shapes;
    for (int C : a.batch_ctx)
      for (int B : a.batch) shapes.push_back({B, C});
    if (a.long_ctx > 0) shapes.push_back({1, a.long_ctx});
    for (auto [B, C] : shapes) {
      const double wms = weights_ms(B);
      for (const kv::KvMethod& km : methods) {
        select(km);
        Row r;
        r.method = name_of(km);
        r.batch = B;
        r.ctx = C;
        std::unique_ptr<kv::KvCache> cache;
        try {
          // Pools sized for this batch (kv::bytes_for_sequences): every page BF16 for bf16; for the
          // 2-bit cache the windows of B sequences + one chunk in BF16, the rest INT2. Tokens: the
          // context and the steps of both timings (graphs and eager, warm-ups, the profiled one).
          const int64_t T = int64_t(C) + 2 * a.steps + 8;
          cache = kv::make_method_cache_for_bytes(km, shape, kv::bytes_for_sequences(km, shape, B, T, chunk), B, chunk,
                                                  false, be->page_store_factory());
        } catch (const Error& e) {
          std::printf("batch %3d x ctx %6d | %-20s | does not fit in device memory (%s)\n", B, C,
                      r.method.c_str(), e.what());
          cudaGetLastError();
          rows_b.push_back(r);
          continue;
        }
        std::vector<kv::SeqId> seqs;
        for (int i = 0; i < B; ++i) {
          seqs.push_back(cache->create());
          cache->fill_with_rows(seqs.back(), C, kbuf->data(), vbuf->data(), chunk);
          cache->store().sync();
        }
        r.step_ms = time_steps(*cache, seqs);
        if (a.graphs == "both") {
          m.set_graphs(false);
          r.eager_ms = time_steps(*cache, seqs);
          m.set_graphs(true);
        }
        r.gemm_ms = gemm_ms(B);
        r.gemm_cublas_ms = cublas_ms(B);
        r.gemm_cores_ms = cores_ms(B);
        r.tok_s = B / (r.step_ms * 1e-3);
        r.weights_ms = wms;
        r.bytes = double(m.weight_bytes_per_step()) + double(cache->bytes_in_use());
        r.roofline_ms = r.bytes / bw * 1e3;
        std::printf("batch %3d x ctx %6d | %-20s | step %8.2f ms | weights-only %6.2f ms | "
                    "streamed %6.2f GB | roofline %6.2f ms (%3.0f %%) | %8.0f tok/s\n",
                    B, C, r.method.c_str(), r.step_ms, wms, r.bytes / 1e9, r.roofline_ms,
                    100 * r.roofline_ms / r.step_ms, r.tok_s);
        std::printf("    split: GEMM %6.2f ms (%4.0f GB/s, %3.0f %% of copy; cuBLAS alone %6.2f ms; CUDA-core GEMV %6.2f ms) | "
                    "other %6.2f ms | attention+cache %6.2f ms | eager step %8.2f ms (graphs %.2fx)\n",
                    r.gemm_ms, gemm_bytes / (r.gemm_ms * 1e-3) / 1e9, 100 * gemm_bytes / (r.gemm_ms * 1e-3) / bw,
                    r.gemm_cublas_ms, r.gemm_cores_ms, wms - r.gemm_ms, r.step_ms - wms, r.eager_ms,
                    r.eager_ms > 0 ? r.eager_ms / r.step_ms : 0.0);
        std::fflush(stdout);
        rows_b.push_back(r);
      }
    }
    // ---- mixed steps: B decode rows at context C and one P-token prefill chunk of a new sequence
    // (what a serving step that admits a request runs; graphs are off for such a step), against
    // the B rows alone (graphs on, as the engine runs them) and the chunk alone.
    struct Mix {
      std::string method;
      int batch = 0, ctx = 0, prefill = 0;
      double decode_ms = 0, prefill_ms = 0, mixed_ms = 0;
    };
    std::vector<Mix> mix;
    for (const auto& [B, C, P] : a.mixed) {
      for (const kv::KvMethod& km : methods) {
        select(km);
        Mix r;
        r.method = name_of(km);
        r.batch = B, r.ctx = C, r.prefill = P;
        // B decode sequences of C tokens and their steps (decode-only and mixed timings, warm-ups,
        // the profiled one), and the prompt of P tokens (a sequence more, a chunk of P).
        const int64_t T = std::max<int64_t>(int64_t(C) + 2 * a.steps + 8, P);
        auto cache = kv::make_method_cache_for_bytes(km, shape, kv::bytes_for_sequences(km, shape, B + 1, T, P), B + 1,
                                                     P, false, be->page_store_factory());
        std::vector<kv::SeqId> seqs;
        for (int i = 0; i < B; ++i) {
          seqs.push_back(cache->create());
          cache->fill_with_rows(seqs.back(), C, kbuf->data(), vbuf->data(), chunk);
          cache->store().sync();
        }
        std::vector<int32_t> dtok(static_cast<size_t>(B), 11), ptok(static_cast<size_t>(P));
        for (int i = 0; i < P; ++i) ptok[size_t(i)] = int32_t((i * 7919) % cfg.vocab_size);
        std::vector<int32_t> ids;
        // One step of the B decode rows (with_decode) and / or the chunk of a fresh sequence,
        // released after the step.
        auto one = [&](bool with_decode, bool with_prefill) {
          std::vector<model::SeqStep> st;
          if (with_decode)
            for (int i = 0; i < B; ++i) st.push_back({seqs[size_t(i)], {&dtok[size_t(i)], 1}, false});
          kv::SeqId p = -1;
          if (with_prefill) {
            p = cache->create();
            st.push_back({p, {ptok.data(), size_t(P)}, false});
          }
          m.forward_argmax(st, *cache, ids);
          if (with_prefill) cache->release(p);
        };
        auto time_ms = [&](bool d, bool p) {
          one(d, p);
          one(d, p);
          cudaDeviceSynchronize();
          const auto s0 = std::chrono::steady_clock::now();
          for (int i = 0; i < a.steps; ++i) one(d, p);
          cudaDeviceSynchronize();
          return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count() / a.steps;
        };
        r.decode_ms = time_ms(true, false);
        r.prefill_ms = time_ms(false, true);
        r.mixed_ms = time_ms(true, true);
        if (profile_step) {  // (OSCAR_BENCH_PROFILE: one mixed step under ncu)
          cudaProfilerStart();
          one(true, true);
          cudaDeviceSynchronize();
          cudaProfilerStop();
        }
        std::printf("mixed step %3d x ctx %6d + prefill %5d | %-20s | decode alone %7.2f ms | prefill alone %7.2f ms "
                    "(%7.0f tok/s) | mixed %7.2f ms (+%.2f over the two; prompt %7.0f tok/s beside the decode)\n",
                    B, C, P, r.method.c_str(), r.decode_ms, r.prefill_ms, P / (r.prefill_ms * 1e-3), r.mixed_ms,
                    r.mixed_ms - r.decode_ms - r.prefill_ms, P / ((r.mixed_ms - r.decode_ms) * 1e-3));
        std::fflush(stdout);
        mix.push_back(r);
      }
    }
    // ---- sampled decode steps: the engine's step (StepDrawer: draws on the device, kDrawHost rows
    // on the host) against greedy steps (forward_argmax) and against every row drawn on the host
    // (logits copied, the host sampler over its threads), same batch and cache.
    struct Samp {
      int batch = 0;
      double greedy_ms = 0, device_ms = 0, host_ms = 0;
      int64_t rows = 0, host_rows = 0;
    };
    std::vector<Samp> samp;
    // Distinct history ids per penalized row (0 without a penalty).
    const int hist_ids = a.sample_penalty != 1.0f ? std::min(a.sample_history, cfg.vocab_size) : 0;
    for (int B : a.sample_batch) {
      if (B <= 0) continue;
      Samp sr;
      sr.batch = B;
      const int C = a.sample_ctx, steps = a.steps;
      auto cache = kv::make_method_cache(kv::KvMethod{}, shape, int64_t(B) * (C + 3 * steps + 200), false,
                                         be->page_store_factory());
      std::vector<kv::SeqId> seqs;
      for (int i = 0; i < B; ++i) {
        seqs.push_back(cache->create());
        cache->fill_with_rows(seqs.back(), C, kbuf->data(), vbuf->data(), chunk);
        cache->store().sync();
      }
      std::vector<int32_t> tok(size_t(B), 11);
      std::vector<model::SeqStep> st;
      for (int i = 0; i < B; ++i) st.push_back({seqs[size_t(i)], {&tok[size_t(i)], 1}, false});
      std::vector<engine::Sampler> samplers;
      for (int i = 0; i < B; ++i)
        samplers.emplace_back(engine::SamplingParams{a.sample_temp, 0, a.sample_top_p, a.sample_penalty, uint64_t(i)});
      // With a penalty, each row's history: hist_ids distinct ids (a request's prompt and output so far).
      std::vector<std::vector<int>> hist(static_cast<size_t>(B));
      for (int i = 0; i < B; ++i)
        for (int j = 0; j < hist_ids; ++j) hist[size_t(i)].push_back(int((int64_t(j) * 7919 + i) % cfg.vocab_size));
      std::vector<engine::SampleJob> jobs(static_cast<size_t>(B));
      engine::StepDrawer drawer;
      auto time_ms = [&](auto&& one_step) {
        one_step();
        one_step();
        cudaDeviceSynchronize();
        const auto s0 = std::chrono::steady_clock::now();
        for (int i = 0; i < steps; ++i) one_step();
        cudaDeviceSynchronize();
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count() / steps;
      };
      std::vector<int32_t> ids;
      sr.greedy_ms = time_ms([&] { m.forward_argmax(st, *cache, ids); });
      sr.device_ms = time_ms([&] {
        for (int i = 0; i < B; ++i) jobs[size_t(i)] = {&samplers[size_t(i)], {}, hist[size_t(i)], -1, {}, i};
        drawer.run(m, st, *cache, jobs);
        sr.rows += B;
        sr.host_rows += drawer.host_rows();
      });
      m.set_logits_to_host(true);
      std::vector<float> lg;
      sr.host_ms = time_ms([&] {
        m.forward(st, *cache, lg);
        for (int i = 0; i < B; ++i)
          jobs[size_t(i)] = {&samplers[size_t(i)], {lg.data() + size_t(i) * cfg.vocab_size, size_t(cfg.vocab_size)},
                             hist[size_t(i)], -1, {}, i};
        engine::sample_rows(jobs);
      });
      m.set_logits_to_host(false);
      std::printf("sampled step, batch %3d x ctx %d (T %.2f, top_p %.2f, penalty %.2f over %d ids) | greedy %7.2f ms | "
                  "drawn on the device %7.2f ms (+%.2f; %lld of %lld rows left to the host) | drawn on the host %7.2f ms "
                  "(+%.2f)\n",
                  B, C, a.sample_temp, a.sample_top_p, a.sample_penalty, hist_ids, sr.greedy_ms, sr.device_ms, sr.device_ms - sr.greedy_ms,
                  (long long)sr.host_rows, (long long)sr.rows, sr.host_ms, sr.host_ms - sr.greedy_ms);
      std::fflush(stdout);
      samp.push_back(sr);
    }
    // ---- prefill: one prompt in chunks, against the bf16 GEMM peak of this run.
    struct Pre {
      std::string method;
      int tokens = 0;
      double ms = 0, flops = 0;
    };
    std::vector<Pre> pre;
    const double lin_params = double(gemm_bytes) / 2 - double(cfg.vocab_size) * H;  // LM head: last rows only
    const std::vector<std::string> pkernels = words(a.prefill_kernels);
    const std::string pdefault = backend::cuda_prefill(*be);  // what "default" names
    for (int P : a.prefill) {
      if (P <= 0) continue;
      for (const std::string& pk : pkernels)
      for (const kv::KvMethod& km : methods) {
        select(km);
        backend::set_cuda_prefill(*be, pk == "default" ? pdefault : pk);
        Pre p;
        p.method = name_of(km) + " [" + backend::cuda_prefill(*be) + "]";
        p.tokens = P;
        auto cache = kv::make_method_cache(km, shape, int64_t(P) + 2 * a.prefill_chunk + 1024, false,
                                           be->page_store_factory());
        std::vector<int32_t> toks(static_cast<size_t>(P));
        for (int i = 0; i < P; ++i) toks[size_t(i)] = int32_t((i * 7919) % cfg.vocab_size);
        std::vector<float> lg;
        auto prompt = [&](kv::SeqId s, int n) {
          for (int t = 0; t < n; t += a.prefill_chunk) {
            const int c = std::min(a.prefill_chunk, n - t);
            const model::SeqStep st{s, {toks.data() + t, size_t(c)}, false};
            m.forward({&st, 1}, *cache, lg);
          }
        };
        {  // warm-up: buffers, cuBLAS heuristics
          const kv::SeqId w = cache->create();
          prompt(w, std::min(P, a.prefill_chunk));
          cache->release(w);
        }
        cudaDeviceSynchronize();
        const kv::SeqId s = cache->create();
        if (profile_step) cudaProfilerStart();  // (OSCAR_BENCH_PROFILE: the timed prompt under ncu)
        const auto s0 = std::chrono::steady_clock::now();
        prompt(s, P);
        cudaDeviceSynchronize();
        if (profile_step) cudaProfilerStop();
        p.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
        // Linear layers 2 x params per token; causal attention 2 x 2 x Hq x d x P^2 / 2 per layer.
        p.flops = 2.0 * lin_params * P + 2.0 * double(cfg.n_layers) * cfg.n_heads * cfg.head_dim * double(P) * P;
        std::printf("prefill %6d tokens (chunks of %d) | %-20s | %9.1f ms | %8.0f tok/s | %6.1f TFLOP/s (%3.0f %% of "
                    "the GEMM peak)\n",
                    P, a.prefill_chunk, p.method.c_str(), p.ms, P / (p.ms * 1e-3), p.flops / (p.ms * 1e-3) / 1e12,
                    100 * p.flops / (p.ms * 1e-3) / peak);
        std::fflush(stdout);
        pre.push_back(p);
      }
    }
    if (backend::cuda_has_flashinfer())
      std::printf("FlashInfer decoded %lld layer-steps in this run\n",
                  static_cast<long long>(backend::cuda_flashinfer_calls(*be)));
    if (!a.json.empty()) {
      std::ofstream f(a.json);
      f << "{\"preset\": \"" << (a.model.empty() ? a.preset : a.model) << "\", \"device\": \"" << be->name()
        << "\", \"copy_gbps\": " << bw / 1e9 << ", \"kv_gib\": " << a.kv_gib
        << ", \"weight_bytes\": " << m.weight_bytes_per_step() << ", \"graphs\": \"" << a.graphs
        << "\", \"gemm_bytes\": " << gemm_bytes << ", \"equal_memory\": [";
      for (size_t i = 0; i < rows_eq.size(); ++i)
        f << (i ? ", " : "") << "{\"method\": \"" << rows_eq[i].method << "\", \"ctx\": " << rows_eq[i].ctx
          << ", \"fits\": " << rows_eq[i].fit << ", \"step_ms\": " << rows_eq[i].step_ms
          << ", \"tok_s\": " << rows_eq[i].tok_s << "}";
      f << "], \"equal_batch\": [";
      for (size_t i = 0; i < rows_b.size(); ++i)
        f << (i ? ", " : "") << "{\"method\": \"" << rows_b[i].method << "\", \"batch\": " << rows_b[i].batch
          << ", \"ctx\": " << rows_b[i].ctx << ", \"step_ms\": " << rows_b[i].step_ms
          << ", \"weights_only_ms\": " << rows_b[i].weights_ms << ", \"bytes\": " << rows_b[i].bytes
          << ", \"roofline_ms\": " << rows_b[i].roofline_ms << ", \"tok_s\": " << rows_b[i].tok_s
          << ", \"eager_step_ms\": " << rows_b[i].eager_ms << ", \"gemm_ms\": " << rows_b[i].gemm_ms
          << ", \"gemm_cublas_ms\": " << rows_b[i].gemm_cublas_ms
          << ", \"gemm_cuda_core_gemv_ms\": " << rows_b[i].gemm_cores_ms << "}";
      f << "], \"gemm_peak_tflops\": " << peak / 1e12 << ", \"prefill_chunk\": " << a.prefill_chunk
        << ", \"prefill\": [";
      for (size_t i = 0; i < pre.size(); ++i)
        f << (i ? ", " : "") << "{\"method\": \"" << pre[i].method << "\", \"tokens\": " << pre[i].tokens
          << ", \"ms\": " << pre[i].ms << ", \"tflops\": " << pre[i].flops / (pre[i].ms * 1e-3) / 1e12 << "}";
      f << "], \"mixed_steps\": [";
      for (size_t i = 0; i < mix.size(); ++i)
        f << (i ? ", " : "") << "{\"method\": \"" << mix[i].method << "\", \"batch\": " << mix[i].batch
          << ", \"ctx\": " << mix[i].ctx << ", \"prefill\": " << mix[i].prefill << ", \"decode_ms\": " << mix[i].decode_ms
          << ", \"prefill_ms\": " << mix[i].prefill_ms << ", \"mixed_ms\": " << mix[i].mixed_ms << "}";
      f << "], \"sample_temp\": " << a.sample_temp << ", \"sample_top_p\": " << a.sample_top_p << ", \"sample_penalty\": " << a.sample_penalty
        << ", \"sample_history\": " << hist_ids
        << ", \"sample_ctx\": " << a.sample_ctx << ", \"sampled_steps\": [";
      for (size_t i = 0; i < samp.size(); ++i)
        f << (i ? ", " : "") << "{\"batch\": " << samp[i].batch << ", \"greedy_ms\": " << samp[i].greedy_ms
          << ", \"device_draw_ms\": " << samp[i].device_ms << ", \"host_draw_ms\": " << samp[i].host_ms
          << ", \"rows\": " << samp[i].rows << ", \"rows_left_to_host\": " << samp[i].host_rows << "}";
      f << "]}\n";
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_gpu_engine: %s\n", e.what());
    return 1;
  }
  return 0;
}
