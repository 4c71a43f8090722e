#include "core/synthetic.h"

#include <cblas.h>
#include <fmt/format.h>

#include <cmath>

#include "core/error.h"
#include "core/half.h"
#include "core/rotation.h"

namespace oscar {

namespace {

// xorshift64* : fast, deterministic.
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {
    if (!s) s = 1;
  }
  uint64_t next() {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    return s * 0x2545F4914F6CDD1Dull;
  }
  // Approximately N(0,1): sum of 4 uniforms, variance-normalized.
  float normal() {
    const uint64_t r = next();
    float acc = 0.0f;
    for (int i = 0; i < 4; ++i)
      acc += static_cast<float>((r >> (16 * i)) & 0xffff) * (1.0f / 65536.0f);
    return (acc - 2.0f) * 1.7320508f;  // sqrt(12/4)
  }
};

// M = diag(√spec)·Bᵀ as row-major floats [d][d], so rows z·M have covariance B·diag(spec)·Bᵀ.
std::vector<float> mixing(const std::vector<double>& B, double decay, int d) {
  std::vector<float> M(static_cast<size_t>(d) * d);
  for (int i = 0; i < d; ++i) {
    const double s = std::sqrt(std::pow(decay, i));
    for (int j = 0; j < d; ++j)
      M[static_cast<size_t>(i) * d + j] = static_cast<float>(s * B[static_cast<size_t>(j) * d + i]);
  }
  return M;
}

// rows [n][row_stride] (head block at offset) = Z[n][d]·M
void mix_rows(Rng& rng, const std::vector<float>& M, int64_t n, int d, float* out,
              int64_t row_stride) {
  std::vector<float> Z(static_cast<size_t>(n) * d);
  for (auto& z : Z) z = rng.normal();
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(n), d, d, 1.0f, Z.data(),
              d, M.data(), d, 0.0f, out, static_cast<int>(row_stride));
}

}  // namespace

SyntheticLayer synthetic_layer(const SyntheticSpec& s, int layer) {
  const int d = s.head_dim, Hq = s.n_q_heads, H = s.n_kv_heads, g = Hq / H;
  const int64_t T = s.tokens;
  if (d <= 0 || H <= 0 || Hq % H != 0 || T <= 0) throw Error("synthetic: bad shape");
  SyntheticLayer out;
  out.q.resize(static_cast<size_t>(T * Hq * d));
  out.k.resize(static_cast<size_t>(T * H * d));
  out.v.resize(static_cast<size_t>(T * H * d));
  Rng rng(s.seed * 7919 + static_cast<uint64_t>(layer) * 104729 + 17);
  for (int h = 0; h < H; ++h) {
    const uint64_t base = s.seed * 1000003ull + static_cast<uint64_t>(layer) * 1009ull +
                          static_cast<uint64_t>(h) * 31ull;
    const auto B = random_orthogonal(d, base);
    const auto Bv = random_orthogonal(d, base + 7);
    const auto Mq = mixing(B, s.q_decay, d), Mk = mixing(B, s.k_decay, d),
               Mv = mixing(Bv, s.v_decay, d);
    for (int j = 0; j < g; ++j)
      mix_rows(rng, Mq, T, d, out.q.data() + static_cast<size_t>(h * g + j) * d, int64_t(Hq) * d);
    mix_rows(rng, Mk, T, d, out.k.data() + static_cast<size_t>(h) * d, int64_t(H) * d);
    mix_rows(rng, Mv, T, d, out.v.data() + static_cast<size_t>(h) * d, int64_t(H) * d);
    // Outlier key channels: fixed per (layer, head), a large offset plus scale.
    for (int c = 0; c < s.outlier_channels; ++c) {
      const int ch = static_cast<int>((base >> (8 * c)) % static_cast<uint64_t>(d));
      for (int64_t t = 0; t < T; ++t) {
        float& x = out.k[static_cast<size_t>((t * H + h) * d + ch)];
        x = s.outlier_offset + s.outlier_scale * x;
      }
    }
  }
  if (s.with_o) {
    // Causal softmax attention per query head, logits q·k/√d.
    out.o.assign(static_cast<size_t>(T * Hq * d), 0.0f);
    std::vector<double> p(static_cast<size_t>(T));
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    for (int hq = 0; hq < Hq; ++hq) {
      const int h = hq / g;
      for (int64_t t = 0; t < T; ++t) {
        const float* qr = out.q.data() + (t * Hq + hq) * d;
        double mx = -INFINITY;
        for (int64_t j = 0; j <= t; ++j) {
          const float* kr = out.k.data() + (j * H + h) * d;
          double dot = 0;
          for (int c = 0; c < d; ++c) dot += double(qr[c]) * kr[c];
          p[static_cast<size_t>(j)] = dot * scale;
          mx = std::max(mx, p[static_cast<size_t>(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= t; ++j)
          sum += (p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - mx));
        float* orow = out.o.data() + (t * Hq + hq) * d;
        for (int64_t j = 0; j <= t; ++j) {
          const float w = static_cast<float>(p[static_cast<size_t>(j)] / sum);
          const float* vr = out.v.data() + (j * H + h) * d;
          for (int c = 0; c < d; ++c) orow[c] += w * vr[c];
        }
      }
    }
  }
  return out;
}

void write_synthetic_dump(const std::string& path, const SyntheticSpec& s, st::Dtype dtype,
                          const ProgressFn& progress) {
  if (dtype != st::Dtype::F16 && dtype != st::Dtype::BF16 && dtype != st::Dtype::F32)
    throw Error("synthetic dump: dtype must be F16, BF16 or F32");
  std::vector<st::StreamWriter::Decl> decls;
  for (int l = 0; l < s.n_layers; ++l) {
    decls.push_back({fmt::format("layers.{}.q", l), dtype, {s.tokens, s.n_q_heads, s.head_dim}});
    decls.push_back({fmt::format("layers.{}.k", l), dtype, {s.tokens, s.n_kv_heads, s.head_dim}});
    decls.push_back({fmt::format("layers.{}.v", l), dtype, {s.tokens, s.n_kv_heads, s.head_dim}});
    if (s.with_o)
      decls.push_back({fmt::format("layers.{}.o", l), dtype, {s.tokens, s.n_q_heads, s.head_dim}});
  }
  std::map<std::string, std::string> meta = {
      {"model.architecture", "synthetic"},
      {"calib.text_hash", fmt::format("synthetic-seed-{}", s.seed)}};
  st::StreamWriter w(path, decls, meta);
  uint64_t bytes = 0;
  std::vector<uint16_t> half;
  auto put = [&](const std::vector<float>& x) {
    if (dtype == st::Dtype::F32) {
      w.append(x.data(), x.size() * 4);
      bytes += x.size() * 4;
      return;
    }
    half.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      half[i] = dtype == st::Dtype::F16 ? f32_to_f16(x[i]) : f32_to_bf16(x[i]);
    w.append(half.data(), half.size() * 2);
    bytes += half.size() * 2;
  };
  for (int l = 0; l < s.n_layers; ++l) {
    const SyntheticLayer a = synthetic_layer(s, l);
    put(a.q);
    put(a.k);
    put(a.v);
    if (s.with_o) put(a.o);
    if (progress) progress(l + 1, s.n_layers, bytes);
  }
  w.finish();
}

}  // namespace oscar
