#include "core/activation_dump.h"

#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace oscar {

namespace {
bool is_float(st::Dtype t) {
  return t == st::Dtype::F16 || t == st::Dtype::BF16 || t == st::Dtype::F32 || t == st::Dtype::F64;
}
}  // namespace

ActivationDump ActivationDump::open(const std::string& path) {
  ActivationDump dump(st::File::open(path));
  const st::File& f = dump.f_;
  int L = 0;
  while (f.find(fmt::format("layers.{}.q", L))) ++L;
  if (L == 0) throw Error(fmt::format("{}: not an activation dump (no tensor 'layers.0.q')", path));
  // Anything numbered beyond a gap is a malformed dump, not silently ignored.
  for (const auto& name : f.names()) {
    int idx = -1;
    char kind = 0;
    if (std::sscanf(name.c_str(), "layers.%d.%c", &idx, &kind) == 2 && idx >= L)
      throw Error(fmt::format("{}: tensor '{}' but layers.{}.q is missing (layers must be 0..L-1)",
                              path, name, L));
  }
  int o_count = 0;
  for (int l = 0; l < L; ++l) {
    for (char w : {'q', 'k', 'v', 'o'}) {
      const std::string name = fmt::format("layers.{}.{}", l, w);
      const st::TensorInfo* t = f.find(name);
      if (!t) {
        if (w == 'o') continue;
        throw Error(fmt::format("{}: tensor '{}' is missing", path, name));
      }
      if (!is_float(t->dtype))
        throw Error(fmt::format("{}: tensor '{}' has dtype {}, expected f16/bf16/f32/f64", path,
                                name, st::dtype_name(t->dtype)));
      if (t->shape.size() != 3)
        throw Error(fmt::format("{}: tensor '{}' must be 3-D [T, heads, head_dim], has {} dims",
                                path, name, t->shape.size()));
      if (w == 'o') ++o_count;
      const bool qshape = w == 'q' || w == 'o';
      if (l == 0 && w == 'q') {
        dump.T_ = t->shape[0];
        dump.Hq_ = static_cast<int>(t->shape[1]);
        dump.d_ = static_cast<int>(t->shape[2]);
      }
      if (l == 0 && w == 'k') dump.Hkv_ = static_cast<int>(t->shape[1]);
      const int64_t heads = qshape ? dump.Hq_ : dump.Hkv_;
      if (t->shape[0] != dump.T_ || t->shape[1] != heads || t->shape[2] != dump.d_)
        throw Error(fmt::format("{}: tensor '{}' has shape [{}, {}, {}], expected [{}, {}, {}]",
                                path, name, t->shape[0], t->shape[1], t->shape[2], dump.T_, heads,
                                dump.d_));
    }
  }
  if (dump.T_ <= 0 || dump.Hq_ <= 0 || dump.Hkv_ <= 0 || dump.d_ <= 0)
    throw Error(fmt::format("{}: empty activations (T {}, q heads {}, kv heads {}, head_dim {})",
                            path, dump.T_, dump.Hq_, dump.Hkv_, dump.d_));
  if (dump.Hq_ % dump.Hkv_ != 0)
    throw Error(fmt::format("{}: {} query heads is not a multiple of {} kv heads", path, dump.Hq_,
                            dump.Hkv_));
  if (o_count != 0 && o_count != L)
    throw Error(fmt::format("{}: {} of {} layers have an attention output 'o' (all or none)", path,
                            o_count, L));
  dump.L_ = L;
  dump.has_o_ = o_count == L;
  return dump;
}

ModelFingerprint ActivationDump::fingerprint() const {
  ModelFingerprint m;
  m.architecture = f_.meta("model.architecture");
  m.weights_hash = f_.meta("model.weights_hash");
  m.n_layers = L_;
  m.n_q_heads = Hq_;
  m.n_kv_heads = Hkv_;
  m.head_dim = d_;
  return m;
}

void ActivationDump::read(int layer, char which, int64_t t0, int64_t n, float* out) const {
  if (layer < 0 || layer >= L_)
    throw Error(fmt::format("{}: layer {} out of range", f_.path(), layer));
  if (which == 'o' && !has_o_)
    throw Error(fmt::format("{}: the dump has no attention outputs 'o'", f_.path()));
  const st::TensorInfo& t = f_.at(fmt::format("layers.{}.{}", layer, which));
  const int64_t row = t.shape[1] * t.shape[2];
  // Conversion (and the page faults of the mapping) split over workers.
  const int64_t total = n * row;
  const int parts = total >= (int64_t(1) << 20) ? default_threads() : 1;
  const int64_t step = (total + parts - 1) / parts;
  parallel_for(parts, [&](int p, int) {
    const int64_t b = p * step, e = std::min(total, b + step);
    if (e > b) f_.read_f32_range(t, t0 * row + b, e - b, out + b);
  });
}

void feed_dump(const ActivationDump& dump, Calibrator& cal, int64_t max_tokens,
               int64_t chunk_tokens, const ProgressFn& progress) {
  const int64_t T = max_tokens > 0 ? std::min(max_tokens, dump.tokens()) : dump.tokens();
  const int Hq = dump.n_q_heads(), Hkv = dump.n_kv_heads(), d = dump.head_dim();
  const bool want_o = cal.config().value_target == ValueTarget::kAttnOutput;
  if (want_o && !dump.has_o())
    throw Error(
        fmt::format("{}: the attn-output value target needs 'layers.{{i}}.o' in the dump; use "
                    "--value-target key-weighted (or raw)",
                    dump.file().path()));
  chunk_tokens = std::max<int64_t>(1, std::min(chunk_tokens, T));
  std::vector<float> q(static_cast<size_t>(chunk_tokens * Hq * d)),
      k(static_cast<size_t>(chunk_tokens * Hkv * d)), v(k.size()), o(want_o ? q.size() : 0);
  uint64_t bytes = 0;
  auto elem_bytes = [&](int l, char w) {
    return st::dtype_size(dump.file().at(fmt::format("layers.{}.{}", l, w)).dtype);
  };
  if (progress) progress(0, dump.n_layers(), 0);
  for (int l = 0; l < dump.n_layers(); ++l) {
    for (int64_t t0 = 0; t0 < T; t0 += chunk_tokens) {
      const int64_t n = std::min(chunk_tokens, T - t0);
      dump.read(l, 'q', t0, n, q.data());
      dump.read(l, 'k', t0, n, k.data());
      dump.read(l, 'v', t0, n, v.data());
      if (want_o) dump.read(l, 'o', t0, n, o.data());
      cal.add(l, q.data(), k.data(), v.data(), want_o ? o.data() : nullptr, n);
      bytes += static_cast<uint64_t>(n) * d *
               (Hq * elem_bytes(l, 'q') + Hkv * (elem_bytes(l, 'k') + elem_bytes(l, 'v')) +
                (want_o ? Hq * elem_bytes(l, 'o') : 0));
    }
    cal.finish_layer(l);
    if (progress) progress(l + 1, dump.n_layers(), bytes);
  }
}

ProgressFn stderr_progress(const std::string& label) {
  const bool tty = isatty(STDERR_FILENO) != 0;
  auto start =
      std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  auto last_decile = std::make_shared<int>(-1);
  return [=](int done, int total, uint64_t bytes) {
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - *start).count();
    const std::string line = fmt::format("[{}] layer {}/{}  {:.2f} GB read  {:.1f} s", label, done,
                                         total, bytes / 1e9, s);
    if (tty) {
      std::fprintf(stderr, "\r%s%s", line.c_str(), done == total ? "\n" : "");
    } else {
      const int dec = total > 0 ? done * 10 / total : 10;
      if (dec != *last_decile) {
        *last_decile = dec;
        std::fprintf(stderr, "%s\n", line.c_str());
      }
    }
    std::fflush(stderr);
  };
}

}  // namespace oscar
