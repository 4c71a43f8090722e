// Throughput of the reference quantizer (core/quantizer.h) for d = 128:
// rows/s and GB/s of fp32 input consumed, for clip+quantize+pack and the
// inverse. This is the CPU *reference* (the specification); the SIMD/CUDA
// kernels have their own benches. Usage: bench_quantize [rows]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/hadamard.h"
#include "core/quantizer.h"

using namespace oscar;

namespace {

template <typename F>
double time_best(F&& f, int reps = 3) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

volatile uint8_t g_sink;

}  // namespace

int main(int argc, char** argv) {
  const int d = 128;
  const int64_t rows = argc > 1 ? std::atoll(argv[1]) : 200000;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(rows * d));
  for (auto& v : x) v = nd(rng);
  std::printf("reference quantizer, d=%d, %lld rows (%.1f MB fp32 input), best of 3, 1 thread\n", d,
              static_cast<long long>(rows), rows * d * 4 / 1e6);
  std::printf("%-34s %12s %10s %10s %8s\n", "op", "rows/s", "in GB/s", "out GB/s", "ns/row");
  struct Case {
    const char* name;
    QuantSpec spec;
    float clip;
  };
  const Case cases[] = {
      {"quantize INT2 G128 f16", {2, 128, ScaleDtype::kF16}, 1.0f},
      {"clip0.96+quantize INT2 G128 f16", {2, 128, ScaleDtype::kF16}, 0.96f},
      {"quantize INT2 G32 f16", {2, 32, ScaleDtype::kF16}, 1.0f},
      {"quantize INT2 G128 f32", {2, 128, ScaleDtype::kF32}, 1.0f},
      {"quantize INT4 G128 f16", {4, 128, ScaleDtype::kF16}, 1.0f},
  };
  for (const Case& c : cases) {
    const int cb = row_code_bytes(d, c.spec), pb = row_param_bytes(d, c.spec);
    std::vector<uint8_t> codes(static_cast<size_t>(rows * cb)),
        params(static_cast<size_t>(rows * pb));
    std::vector<float> tmp(d);
    const double s = time_best([&] {
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = x.data() + r * d;
        if (c.clip < 1.0f) {
          std::copy(src, src + d, tmp.begin());
          clip_row(tmp.data(), d, c.clip);
          src = tmp.data();
        }
        quantize_row(src, d, c.spec, codes.data() + r * cb, params.data() + r * pb);
      }
      g_sink = codes[0];
    });
    std::printf("%-34s %12.3e %10.3f %10.3f %8.1f\n", c.name, rows / s, rows * d * 4.0 / s / 1e9,
                rows * double(cb + pb) / s / 1e9, s / rows * 1e9);
    if (c.clip == 1.0f && c.spec.group_size == 128 && c.spec.bits == 2 &&
        c.spec.scale_dtype == ScaleDtype::kF16) {
      std::vector<float> out(static_cast<size_t>(rows * d));
      const double sd = time_best([&] {
        for (int64_t r = 0; r < rows; ++r)
          dequantize_row(codes.data() + r * cb, params.data() + r * pb, d, c.spec,
                         out.data() + r * d);
        g_sink = static_cast<uint8_t>(out[0]);
      });
      std::printf("%-34s %12.3e %10.3f %10.3f %8.1f\n", "dequantize INT2 G128 f16", rows / sd,
                  rows * double(cb + pb) / sd / 1e9, rows * d * 4.0 / sd / 1e9, sd / rows * 1e9);
    }
  }
  std::vector<float> y = x;
  const double sf = time_best([&] {
    for (int64_t r = 0; r < rows; ++r) fwht(y.data() + r * d, d);
    g_sink = static_cast<uint8_t>(y[0]);
  });
  std::printf("%-34s %12.3e %10.3f %10.3f %8.1f\n", "fwht d=128 (in place)", rows / sf,
              rows * d * 4.0 / sf / 1e9, rows * d * 4.0 / sf / 1e9, sf / rows * 1e9);
  return 0;
}
