// The small-batch linear layers of a decode step on the CUDA backend: our GEMV on the
// tensor cores, our GEMV on the CUDA cores and cuBLAS, at 1-8 activation rows, on the
// four matrices of a Qwen3-8B layer (BF16 weights), against the device-to-device copy
// bandwidth measured in the same run (DESIGN §7: decode is weight-bandwidth bound).
//
//   bench_gemv [--rows 1,2,4,8] [--copies 4] [--reps 20] [--json FILE]
//
// Each matrix exists in --copies copies (raised so that every shape's copies hold at least 128 MiB: the 50 MB
// L2 cannot serve a repeat); one timed pass runs every copy of every matrix in layer
// order, recorded once as a CUDA graph and replayed --reps times. Bytes are the weight
// bytes read once per pass (activations and outputs are < 1 % of them at 8 rows).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "backend/cuda/backend_cuda.h"
#include "core/error.h"
#include "core/tensor.h"

using namespace oscar;

namespace {

std::vector<int> ints(const std::string& s) {
  std::vector<int> v;
  size_t p = 0;
  while (p < s.size()) {
    const size_t q = s.find(',', p);
    v.push_back(std::atoi(s.substr(p, q - p).c_str()));
    if (q == std::string::npos) break;
    p = q + 1;
  }
  return v;
}

// Wall time per call of fn (which enqueues work on any stream), the device drained
// before and after: the backend runs on its own stream, which events on the legacy
// default stream would not wait for.
double time_ms(int reps, const std::function<void()>& fn) {
  fn();  // warm-up (and graph recording)
  cudaDeviceSynchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) fn();
  cudaDeviceSynchronize();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
}

double copy_bandwidth() {
  const size_t bytes = size_t(2) << 30;
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess)
    throw Error("bench_gemv: cannot allocate the bandwidth buffers");
  cudaMemset(a, 1, bytes);
  const double ms = time_ms(5, [&] { cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice); });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (ms * 1e-3);  // read + write bytes per second
}

// A [rows][cols] f32 tensor of small pseudo-random values (a cheap xorshift: the
// numbers do not matter for the timing, only that they are finite).
Tensor filled(int64_t rows, int64_t cols, uint64_t seed) {
  Tensor t;
  t.shape = {rows, cols};
  t.data.resize(size_t(rows * cols));
  uint64_t x = 0x9E3779B97F4A7C15ull ^ seed;
  for (float& v : t.data) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = float(int64_t(x >> 40) - (int64_t(1) << 23)) * (1.0f / float(1 << 23)) * 0.05f;
  }
  return t;
}

struct Mat {
  const char* name;
  int out, in;
};

}  // namespace

int main(int argc, char** argv) try {
  std::vector<int> rows = {1, 2, 4, 8};
  int copies = 4, reps = 20;
  std::string json;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw Error("bench_gemv: " + s + " needs a value");
      return argv[++i];
    };
    if (s == "--rows") rows = ints(next());
    else if (s == "--copies") copies = std::max(1, std::atoi(next().c_str()));
    else if (s == "--reps") reps = std::max(1, std::atoi(next().c_str()));
    else if (s == "--json") json = next();
    else throw Error("usage: bench_gemv [--rows 1,2,4,8] [--copies 4] [--reps 20] [--json FILE]");
  }
  for (int n : rows)
    if (n < 1 || n > 8) throw Error("bench_gemv: --rows takes 1..8");
  if (!backend::cuda_device_available()) throw Error("bench_gemv: no CUDA device");

  const double bw = copy_bandwidth();
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", bw / 1e9);
  auto be = backend::make_cuda_backend({backend::WeightDtype::kBf16, 0});
  const std::vector<Mat> mats = {
      {"qkv", 4096 + 2 * 1024, 4096}, {"o", 4096, 4096}, {"gate_up", 2 * 12288, 4096}, {"down", 4096, 12288}};
  // The same number of copies of every matrix (enough that the smallest one's copies
  // exceed 128 MiB), so that a pass over the layer is `copies` passes over one copy each.
  for (const Mat& mt : mats) copies = std::max(copies, int(128.0 / (double(mt.out) * mt.in * 2 / (1 << 20)) + 0.999));
  std::vector<std::vector<backend::WeightPtr>> w(mats.size());
  for (size_t m = 0; m < mats.size(); ++m) {
    for (int k = 0; k < copies; ++k) {
      const Tensor t = filled(mats[m].out, mats[m].in, 17 * m + k);
      w[m].push_back(be->prepare_linear({&t}, {}));
    }
  }
  const int max_in = 12288, max_out = 2 * 12288;
  auto x = be->alloc(size_t(8) * max_in), y = be->alloc(size_t(8) * max_out);
  {
    const Tensor xt = filled(8, max_in, 99);
    be->from_host(xt.data.data(), x->data(), xt.data.size());
  }

  struct Mode {
    const char* name;
    int gemv_rows, mma_from;
  };
  const std::vector<Mode> modes = {
      {"gemv-tensor-core", 8, 1}, {"gemv-cuda-core", 8, backend::kCudaGemvNever}, {"cublas", 0, 1}};
  const int keep_rows = backend::cuda_gemv_rows(*be), keep_mma = backend::cuda_gemv_mma_min_rows(*be);
  std::printf("\n%-9s %4s | %-17s | %9s | %9s | %8s | %6s\n", "matrix", "rows", "kernel", "bytes", "time", "GB/s",
              "% copy");
  std::ofstream jf;
  if (!json.empty()) jf.open(json), jf << "{\"copy_bandwidth\": " << bw << ", \"rows\": [";
  bool first = true;
  uint64_t key = 0xC0000000ull;
  for (int n : rows) {
    for (size_t m = 0; m <= mats.size(); ++m) {  // m == size: the whole layer
      double bytes = 0;
      std::vector<std::pair<const backend::PreparedWeight*, int>> seq;  // weight, out
      for (size_t k = 0; k < mats.size(); ++k) {
        if (m < mats.size() && k != m) continue;
        for (const auto& p : w[k]) {
          seq.push_back({p.get(), mats[k].out});
          bytes += double(mats[k].out) * mats[k].in * 2;
        }
      }
      // The whole layer: every copy of each matrix.
      const char* name = m < mats.size() ? mats[m].name : "layer";
      for (const Mode& md : modes) {
        backend::set_cuda_gemv_rows(*be, md.gemv_rows);
        backend::set_cuda_gemv_mma_min_rows(*be, md.mma_from);
        auto pass = [&] {
          for (auto& [pw, out] : seq) be->linear(*pw, x->data(), n, y->data());
        };
        const uint64_t k = ++key;
        const double ms = time_ms(reps, [&] { be->run_graph(k, pass); });
        const double gbs = bytes / (ms * 1e-3) / 1e9;
        std::printf("%-9s %4d | %-17s | %6.0f MB | %6.1f us | %8.0f | %5.1f %%\n", name, n, md.name, bytes / 1e6,
                    ms * 1e3 / double(copies), gbs,
                    100 * bytes / (ms * 1e-3) / bw);
        if (jf) {
          jf << (first ? "" : ", ") << "{\"matrix\": \"" << name << "\", \"rows\": " << n << ", \"kernel\": \""
             << md.name << "\", \"bytes\": " << bytes << ", \"ms_per_pass\": " << ms << ", \"gb_s\": " << gbs
             << ", \"pct_copy\": " << 100 * bytes / (ms * 1e-3) / bw << "}";
          first = false;
        }
      }
      be->clear_graphs();
    }
    std::printf("\n");
  }
  backend::set_cuda_gemv_rows(*be, keep_rows);
  backend::set_cuda_gemv_mma_min_rows(*be, keep_mma);
  if (jf) jf << "]}\n";
  std::printf("time: per matrix call (layer: per pass over one copy of each); %% copy: of the bandwidth above\n");
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_gemv: %s\n", e.what());
  return 1;
}
