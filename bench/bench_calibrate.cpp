// Calibration time from an activation dump with Qwen3-8B shapes (36 layers,
// 32 q heads, 8 KV heads, d=128) and 16K tokens, including reading the dump.
// Target: under 30 s on the 2-core dev machine.
//
// The dump is synthetic (core/synthetic.h) and is generated on first use
// into --path (default /tmp/oscar-bench/qwen3-8b-shapes-16k.safetensors,
// ~7.2 GB in f16: q is 4x larger than k or v); it is kept for reruns unless
// --remove. Usage:
//   bench_calibrate [--path P] [--tokens N] [--layers L] [--variants] [--remove]
#include <sys/resource.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "core/activation_dump.h"
#include "core/calibrator.h"
#include "core/parallel.h"
#include "core/synthetic.h"

using namespace oscar;

namespace {
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
// User + system CPU seconds of this process (all threads): on a shared
// machine wall time depends on the load, CPU time much less.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}
double load_average() {
  double l[1] = {0};
  return getloadavg(l, 1) == 1 ? l[0] : -1.0;
}
}  // namespace

int main(int argc, char** argv) {
  std::string path = "/tmp/oscar-bench/qwen3-8b-shapes-16k.safetensors";
  SyntheticSpec s;
  s.n_layers = 36;
  s.n_q_heads = 32;
  s.n_kv_heads = 8;
  s.head_dim = 128;
  s.tokens = 16384;
  s.seed = 1;
  bool variants = false, remove = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--path")
      path = next();
    else if (a == "--tokens")
      s.tokens = std::atoll(next().c_str());
    else if (a == "--layers")
      s.n_layers = std::atoi(next().c_str());
    else if (a == "--variants")
      variants = true;
    else if (a == "--remove")
      remove = true;
    else {
      std::fprintf(
          stderr,
          "usage: bench_calibrate [--path P] [--tokens N] [--layers L] [--variants] [--remove]\n");
      return 2;
    }
  }
  // (Re)generate when absent or of other shapes.
  bool ok = false;
  if (std::filesystem::exists(path)) {
    try {
      const ActivationDump d = ActivationDump::open(path);
      ok = d.n_layers() == s.n_layers && d.tokens() == s.tokens && d.n_q_heads() == s.n_q_heads &&
           d.n_kv_heads() == s.n_kv_heads && d.head_dim() == s.head_dim;
    } catch (const std::exception&) {
    }
  }
  if (!ok) {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    const auto t0 = std::chrono::steady_clock::now();
    write_synthetic_dump(path, s, st::Dtype::F16, stderr_progress("generate"));
    std::printf("generated %s in %.1f s\n", path.c_str(), since(t0));
  }
  const double gb = std::filesystem::file_size(path) / 1e9;
  std::printf("dump %s: %d layers x %lld tokens, %d q / %d kv heads, d=%d, f16, %.2f GB\n",
              path.c_str(), s.n_layers, static_cast<long long>(s.tokens), s.n_q_heads, s.n_kv_heads,
              s.head_dim, gb);

  struct Variant {
    const char* name;
    CalibConfig cfg;
  };
  std::vector<Variant> vs;
  vs.push_back({"UHP key-weighted layer (default)", CalibConfig{}});
  if (variants) {
    CalibConfig h;
    h.granularity = Granularity::kHead;
    vs.push_back({"UHP key-weighted head", h});
    CalibConfig raw;
    raw.key_target = KeyTarget::kRaw;
    raw.value_target = ValueTarget::kRaw;
    vs.push_back({"UHP raw targets layer", raw});
    CalibConfig cs;
    cs.clip_search = true;
    vs.push_back({"UHP key-weighted layer +clip-search", cs});
  }
  std::printf("threads %d, load average %.1f at start\n", default_threads(), load_average());
  std::printf("\n%-38s %9s %9s %9s %9s %8s\n", "variant", "wall s", "feed s", "cpu s", "GB/s",
              "<30 s");
  for (const Variant& v : vs) {
    const auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_seconds();
    const ActivationDump dump = ActivationDump::open(path);
    Calibrator cal(v.cfg, dump.n_layers(), dump.n_q_heads(), dump.n_kv_heads(), dump.head_dim());
    feed_dump(dump, cal, 0, 4096, stderr_progress(v.name));
    const double t_feed = since(t0);
    Calibration c = cal.finish(dump.fingerprint());
    const std::string out = path + ".calib.safetensors";
    write_calibration(c, out);
    const double t = since(t0);
    std::printf("%-38s %9.2f %9.2f %9.2f %9.2f %8s\n", v.name, t, t_feed, cpu_seconds() - c0,
                gb / t, t < 30.0 ? "yes" : "NO");
    std::fflush(stdout);
    std::filesystem::remove(out);
  }
  if (remove) std::filesystem::remove(path);
  return 0;
}
