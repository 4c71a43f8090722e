// Where the time of `oscar calibrate -m MODEL` goes, part by part, at the
// shapes of the default model (SmolLM2-135M: hidden 576, 9 q / 3 kv heads,
// head_dim 64, intermediate 1536, 30 layers), one chunk of T tokens:
//   - the four f32 linears of a layer (backend/cpu/ops_gemv.h, prefill GEMM)
//   - exact causal attention (model::dense_causal_attention)
//   - Calibrator::add of one layer (fp64 covariance accumulation)
// and, with --model/--text, the whole calibration end to end with the time
// of every backend op, the attention and the calibrator (the loop of
// eval::calibrate_model, instrumented).
//
//   bench_calib_model [--tokens T] [--reps R] [--model M.gguf --text F | --random]
//                     [--calib-tokens N]
// --random: the default model's shapes with random weights and tokens (same
// FLOPs; for machines without the model file).
//
// Rates are GFLOP/s of useful work (causal attention counts only the unmasked
// half: 2·T²·d per head for QKᵀ and PV together); "x30" is the per-chunk time
// of that part for all 30 layers.
#include <sys/resource.h>

#include <immintrin.h>

// GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized inside its own
// _mm512_undefined_* helpers (GCC bug 105593); the warning is about the header.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <span>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/backend_cpu.h"
#include "backend/cpu/ops_gemm.h"
#include "backend/cpu/ops_gemv.h"
#include "backend/cpu/ops_threads.h"
#include "core/calibrator.h"
#include "eval/calibrate_model.h"
#include "model/calib_forward.h"
#include "model/fold_rotation.h"
#include "model/forward_random.h"
#include "model/loader.h"
#include "model/tokenizer.h"

using namespace oscar;
using Clock = std::chrono::steady_clock;

namespace {
double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}
double load_average() {
  double l[1] = {0};
  return getloadavg(l, 1) == 1 ? l[0] : -1.0;
}
std::vector<float> randv(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(g);
  return v;
}
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}
double g_cpu = 0;  // CPU seconds of the best rep of the last best_of
template <typename F>
double best_of(int reps, F&& f) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    const double c0 = cpu_seconds();
    f();
    const double s = since(t0);
    if (s < best) best = s, g_cpu = cpu_seconds() - c0;
  }
  return best;
}
// fp32 FMA peak of one core: 28 independent zmm FMA chains (no memory).
__attribute__((target("avx512f,fma"))) float fma_loop(int64_t iters) {
  __m512 acc[28];
  for (int i = 0; i < 28; ++i) acc[i] = _mm512_set1_ps(float(i) * 1e-9f);
  const __m512 a = _mm512_set1_ps(1.0000001f), b = _mm512_set1_ps(0.9999999f);
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 28
    for (int i = 0; i < 28; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < 28; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// Per-op wall time of a backend (decorator over the CPU backend).
struct Timed {
  double s = 0;
  int64_t calls = 0;
};
class ProfilingBackend : public backend::Backend {
 public:
  explicit ProfilingBackend(std::unique_ptr<backend::Backend> be) : be_(std::move(be)) {}
  std::map<std::string, Timed> t;
  template <typename F>
  void timed(const char* name, F&& f) {
    const auto t0 = Clock::now();
    f();
    Timed& x = t[name];
    x.s += since(t0);
    ++x.calls;
  }
  std::string name() const override { return be_->name(); }
  backend::BufferPtr alloc(size_t n) override { return be_->alloc(n); }
  void to_host(const float* s, float* d, size_t n) override { be_->to_host(s, d, n); }
  void from_host(const float* s, float* d, size_t n) override { be_->from_host(s, d, n); }
  double copy_bandwidth() override { return be_->copy_bandwidth(); }
  backend::WeightPtr prepare_linear(std::initializer_list<const oscar::Tensor*> ws,
                                  std::initializer_list<const oscar::Tensor*> bs) override {
    return be_->prepare_linear(ws, bs);
  }
  backend::WeightPtr prepare_vector(const oscar::Tensor& v) override { return be_->prepare_vector(v); }
  backend::WeightPtr prepare_embedding(const oscar::Tensor& e) override {
    return be_->prepare_embedding(e);
  }
  void embed(const backend::PreparedWeight& e, const int32_t* tok, int n, float* x) override {
    timed("embed", [&] { be_->embed(e, tok, n, x); });
  }
  void linear(const backend::PreparedWeight& w, const float* x, int n, float* y) override {
    timed("linear", [&] { be_->linear(w, x, n, y); });
  }
  void rms_norm(const float* x, const backend::PreparedWeight& w, int rows, int dim, float eps,
                float* y) override {
    timed("rms_norm", [&] { be_->rms_norm(x, w, rows, dim, eps, y); });
  }
  void rope(float* x, int n, int heads, int hd, const float* c, const float* sn) override {
    timed("rope", [&] { be_->rope(x, n, heads, hd, c, sn); });
  }
  void silu_mul(const float* gu, int n, int inter, float* out) override {
    timed("silu_mul", [&] { be_->silu_mul(gu, n, inter, out); });
  }
  void add(float* x, const float* y, size_t n) override { timed("add", [&] { be_->add(x, y, n); }); }
  void copy_cols(const float* src, int n, int sc, int c0, int w, float* dst) override {
    timed("copy_cols", [&] { be_->copy_cols(src, n, sc, c0, w, dst); });
  }
  void decode_attention(const kv::PagedKvView& kv, const float* q, int nq, float sc,
                        float* o) override {
    be_->decode_attention(kv, q, nq, sc, o);
  }
  void prefill_attention(const kv::PagedKvView& kv, int b, int cl, const float* q,
                         const float* k, const float* v, int n, int nq, float sc,
                         float* o) override {
    be_->prefill_attention(kv, b, cl, q, k, v, n, nq, sc, o);
  }

 private:
  std::unique_ptr<backend::Backend> be_;
};

// The calibration hook of eval/calibrate_model.cpp, with timers around the
// attention (run here instead of by the forward) and Calibrator::add.
class TimedCalibHook : public model::DenseHooks {
 public:
  TimedCalibHook(Calibrator& cal, ProfilingBackend& pb, const model::ModelConfig& c)
      : cal_(cal), pb_(pb), c_(c) {}
  void on_qkv(int, float* q, float* k, float* v, int) override { q_ = q, k_ = k, v_ = v; }
  bool attention(int, const float* q, const float* k, const float* v, int T, float* o) override {
    pb_.timed("attention (dense causal)", [&] {
      model::dense_causal_attention(q, k, v, T, c_.n_heads, c_.n_kv_heads, c_.head_dim, o);
    });
    return true;
  }
  void on_attn_out(int layer, const float* o, int T) override {
    pb_.timed("calibrator add", [&] { cal_.add(layer, q_, k_, v_, o, T); });
  }
  bool want_layer(int layer) override { return layer < cal_.n_layers(); }

 private:
  Calibrator& cal_;
  ProfilingBackend& pb_;
  const model::ModelConfig& c_;
  const float *q_ = nullptr, *k_ = nullptr, *v_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) {
  int T = 2048, reps = 3;
  int64_t calib_tokens = 16384;
  std::string model_path, text_path;
  bool random_model = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--tokens")
      T = std::atoi(next().c_str());
    else if (a == "--reps")
      reps = std::atoi(next().c_str());
    else if (a == "--model")
      model_path = next();
    else if (a == "--text")
      text_path = next();
    else if (a == "--calib-tokens")
      calib_tokens = std::atoll(next().c_str());
    else if (a == "--random")
      random_model = true;
    else {
      std::fprintf(stderr,
                   "usage: bench_calib_model [--tokens T] [--reps R] [--model M --text F | --random] "
                   "[--calib-tokens N]\n");
      return 2;
    }
  }
  const int H = 576, I = 1536, Hq = 9, Hkv = 3, d = 64, L = 30;
  std::printf("SmolLM2-135M shapes, T = %d tokens per chunk, %d threads, gemv isa %s, load %.1f\n",
              T, backend::cpu::op_threads(), backend::cpu::gemv_isa(), load_average());
  std::printf("\n%-34s %10s %10s %10s %10s\n", "part (one layer, one chunk)", "ms", "cpu ms",
              "GFLOP/s", "x30 s");
  auto row = [&](const char* name, double s, double flop) {
    std::printf("%-34s %10.2f %10.2f %10.1f %10.2f\n", name, s * 1e3, g_cpu * 1e3,
                flop / s * 1e-9, s * L);
    std::fflush(stdout);
  };
  if (backend::cpu::gemm_avx512()) {
    const int64_t iters = 4000000;
    volatile float sink = 0;
    const double s = best_of(reps, [&] { sink = sink + fma_loop(iters); });
    std::printf("%-34s %10.2f %10.2f %10.1f %10s\n", "fp32 FMA peak, 1 core (reference)",
                s * 1e3, g_cpu * 1e3, 28.0 * 32.0 * iters / s * 1e-9, "-");
  }
  const std::vector<float> x = randv(size_t(T) * I, 1);
  std::vector<float> y(size_t(T) * 2 * I);
  struct Lin {
    const char* name;
    int out, in;
  };
  double lin_total = 0, lin_cpu = 0;
  for (const Lin& l : {Lin{"linear qkv  576->960", 960, H}, Lin{"linear o    576->576", H, H},
                       Lin{"linear gate_up 576->3072", 2 * I, H},
                       Lin{"linear down 1536->576", H, I}}) {
    const std::vector<float> w = randv(size_t(l.out) * l.in, 2, 0.05f);
    const double s = best_of(reps, [&] {
      backend::cpu::linear_f32(w.data(), l.out, l.in, nullptr, x.data(), T, y.data());
    });
    row(l.name, s, 2.0 * l.out * l.in * T);
    lin_total += s;
    lin_cpu += g_cpu;
  }
  g_cpu = lin_cpu;
  row("linears, sum", lin_total, 2.0 * 6144 * H * T);

  const std::vector<float> q = randv(size_t(T) * Hq * d, 3), k = randv(size_t(T) * Hkv * d, 4),
                           v = randv(size_t(T) * Hkv * d, 5);
  std::vector<float> o(size_t(T) * Hq * d);
  const double s_att = best_of(reps, [&] {
    model::dense_causal_attention(q.data(), k.data(), v.data(), T, Hq, Hkv, d, o.data());
  });
  row("causal attention 9/3 heads d64", s_att, 2.0 * double(T) * T * d * Hq);

  {
    // Calibrator::add of one layer (fresh calibrator each rep: 1 layer).
    const double s = best_of(reps, [&] {
      Calibrator cal(CalibConfig{}, 1, Hq, Hkv, d);
      cal.add(0, q.data(), k.data(), v.data(), o.data(), T);
    });
    // q: T·g rows per kv head, d² (upper half) fp64 multiply-adds each.
    row("calibrator add (key-weighted)", s, 2.0 * double(T) * Hq * d * d / 2);
    Calibrator cal(CalibConfig{}, 1, Hq, Hkv, d);
    cal.add(0, q.data(), k.data(), v.data(), o.data(), T);
    const auto t0 = Clock::now();
    cal.finish();
    const double s_fin = since(t0);
    std::printf("%-34s %10.2f %10s %10s %10s\n", "calibrator finish, 1 layer", s_fin * 1e3, "-",
                "-", "-");
  }

  if (!model_path.empty() || random_model) {
    if (!random_model && text_path.empty()) {
      std::fprintf(stderr, "--model needs --text\n");
      return 2;
    }
    const auto t0 = Clock::now();
    const double c0 = cpu_seconds();
    model::ModelWeights w;
    std::vector<int32_t> tokens;
    if (random_model) {
      // The default model's shapes with random weights and tokens: same FLOPs,
      // no model file (machines without the GGUF).
      model::ModelConfig c = model::tiny_config(model::Arch::kLlama, /*tied=*/true);
      c.name = "random-SmolLM2-135M-shapes";
      c.vocab_size = 49152, c.hidden = H, c.intermediate = I, c.n_layers = L;
      c.n_heads = Hq, c.n_kv_heads = Hkv, c.head_dim = d, c.max_position = 8192;
      w = model::random_weights(c, 1);
      model_path = c.name;
      std::mt19937_64 g(2);
      for (int64_t i = 0; i < calib_tokens; ++i) tokens.push_back(int32_t(g() % c.vocab_size));
    } else {
      w = model::load_model(model_path);
      const model::Tokenizer tok = model::load_tokenizer(model_path);
      const std::string text = eval::read_text_file(text_path);
      const std::vector<int> ids = tok.encode(
          std::string_view(text).substr(0, std::min(text.size(), size_t(calib_tokens) * 8)));
      if (int64_t(ids.size()) < calib_tokens) {
        std::fprintf(stderr, "the text has only %zu tokens\n", ids.size());
        return 1;
      }
      tokens.assign(ids.begin(), ids.begin() + calib_tokens);
    }
    const double t_load = since(t0);
    backend::CpuBackendOptions bo;
    bo.weight_dtype = backend::WeightDtype::kF32;
    ProfilingBackend pb(backend::make_cpu_backend(bo));
    const auto t1 = Clock::now();
    model::DenseForward fwd(w, pb);
    const double t_prep = since(t1);
    const model::ModelConfig& mc = w.cfg;
    Calibrator cal(CalibConfig{}, mc.n_layers, mc.n_heads, mc.n_kv_heads, mc.head_dim);
    TimedCalibHook hook(cal, pb, mc);
    const auto t2 = Clock::now();
    for (int64_t a = 0; a < calib_tokens; a += T) {
      const int64_t n = std::min<int64_t>(T, calib_tokens - a);
      fwd.run(std::span<const int32_t>(tokens.data() + a, size_t(n)), &hook, nullptr);
    }
    const double t_fwd = since(t2);
    const auto t3 = Clock::now();
    cal.finish(model::model_fingerprint(w));
    const double t_fin = since(t3), total = since(t0);
    std::printf("\nend to end (the calibrate_model loop): %s, %lld tokens, chunk %d\n",
                model_path.c_str(), static_cast<long long>(calib_tokens), T);
    std::printf("%-34s %10s %10s\n", "part", "s", "calls");
    std::printf("%-34s %10.2f %10s\n", random_model ? "random weights + tokens" : "load model + tokenize", t_load, "-");
    std::printf("%-34s %10.2f %10s\n", "prepare weights", t_prep, "-");
    double ops = 0;
    for (const auto& [name, x] : pb.t) {
      std::printf("  %-32s %10.2f %10lld\n", name.c_str(), x.s, static_cast<long long>(x.calls));
      ops += x.s;
    }
    std::printf("  %-32s %10.2f %10s\n", "other (forward glue)", t_fwd - ops, "-");
    std::printf("%-34s %10.2f %10s\n", "forward + calibrator add", t_fwd, "-");
    std::printf("%-34s %10.2f %10s\n", "calibrator finish", t_fin, "-");
    std::printf("%-34s %10.2f %10s   (cpu %.2f s, load %.1f)\n", "total", total, "-",
                cpu_seconds() - c0, load_average());
  }
  return 0;
}
