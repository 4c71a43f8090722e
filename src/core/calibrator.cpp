#include "core/calibrator.h"

#include <fmt/format.h>
#include <immintrin.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <random>

#include "core/eigen_sym.h"
#include "core/error.h"
#include "core/key_transform.h"
#include "core/linalg.h"
#include "core/parallel.h"
#include "core/quant_error.h"

namespace oscar {

namespace {

constexpr int64_t kChunkTokens = 1024;
constexpr int64_t kTaskTokens = 512;  // tokens per accumulate() task

struct LayerAcc {
  int64_t tokens = 0;
  bool done = false;
  std::vector<double> sum_qq, sum_kk, sum_vv, sum_oo;  // [H][d][d], upper triangles
  std::vector<double> sum_k, sum_k2;                  // [H][d] key sums (key transform)
  std::vector<double> sum_kpre;                       // [H][d] pre-RoPE key sums (page centering)
  int64_t pre_tokens = 0;                             // tokens in sum_kpre (all, or it is unused)
  // key-weighted: the K and V rows of every add() call, [T_i][H][d] each
  // (one block per call: no reallocation/copy as the layer grows).
  std::vector<std::vector<float>> kblocks, vblocks;
  std::vector<float> sample_k, sample_v;  // clip search reservoir: [S][H][d]
  int64_t sample_filled = 0;
  std::mt19937_64 rng;
  LayerCalibration result;
  LayerTargets kept;
};

// Converts `rows` rows of `width` floats (row r at src + r*stride) to doubles.
__attribute__((target("avx512f"))) void gather_rows_avx512(const float* src, int64_t rows,
                                                           int64_t width, int64_t stride,
                                                           double* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * stride;
    double* o = dst + r * width;
    int64_t c = 0;
    for (; c + 8 <= width; c += 8)
      _mm512_storeu_pd(o + c, _mm512_maskz_cvtps_pd(0xFF, _mm256_loadu_ps(s + c)));
    for (; c < width; ++c) o[c] = s[c];
  }
}
void gather_rows(const float* src, int64_t rows, int64_t width, int64_t stride, double* dst) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  if (avx512) return gather_rows_avx512(src, rows, width, stride, dst);
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * stride;
    double* o = dst + r * width;
    for (int64_t c = 0; c < width; ++c) o[c] = s[c];
  }
}

}  // namespace

struct Calibrator::Impl {
  CalibConfig cfg;
  int L, Hq, H, d, g;
  bool need_kk, need_vv, need_oo, need_kw;
  std::vector<LayerAcc> layers;
  std::vector<std::vector<double>> dbuf;  // per-worker conversion scratch
  std::vector<double> partial;            // per-task sums of accumulate()
  bool keep = false;

  Impl(CalibConfig c, int nl, int nq, int nkv, int hd)
      : cfg(std::move(c)), L(nl), Hq(nq), H(nkv), d(hd) {
    if (nl <= 0 || nq <= 0 || nkv <= 0 || hd <= 0 || nq % nkv != 0)
      throw Error(fmt::format(
          "calibrator: bad shape (layers {}, q heads {}, kv heads {}, head_dim {}); q heads must "
          "be a multiple of kv heads",
          nl, nq, nkv, hd));
    // A group cannot exceed the head: the default 128 becomes d for d = 32/64.
    if (cfg.quant.group_size > hd) cfg.quant.group_size = hd;
    validate_spec(cfg.quant, hd);
    if (composition_uses_data(cfg.composition) || cfg.composition == Composition::kHadamard)
      log2_check();
    if (cfg.clip_search && cfg.clip_grid.empty())
      throw Error("calibrator: clip search with an empty grid");
    for (float c : cfg.clip_grid)
      if (!(c > 0.0f && c <= 1.0f))
        throw Error(fmt::format("calibrator: clip ratio {} outside (0, 1]", c));
    if (!(cfg.key_offset_share >= 0.0f) || !std::isfinite(cfg.key_offset_share))
      throw Error(fmt::format("calibrator: key offset share {} must be a finite number >= 0",
                              cfg.key_offset_share));
    for (float c : {cfg.k_clip, cfg.v_clip})
      if (!(c > 0.0f && c <= 1.0f))
        throw Error(fmt::format("calibrator: clip ratio {} outside (0, 1]", c));
    if (!cfg.rope_freq.empty()) {
      if (hd % 2 != 0 || cfg.rope_freq.size() != size_t(hd / 2))
        throw Error(fmt::format("calibrator: {} RoPE frequencies for head_dim {}", cfg.rope_freq.size(), hd));
      for (float f : cfg.rope_freq)
        if (!(f >= 0.0f && f <= 4.0f))
          throw Error(fmt::format("calibrator: RoPE frequency {} outside [0, 4]", f));
      if (cfg.center_page <= 0)
        throw Error(fmt::format("calibrator: page centering span {} must be positive", cfg.center_page));
    }
    g = nq / nkv;
    need_kk = cfg.key_target == KeyTarget::kRaw;
    need_vv = cfg.value_target == ValueTarget::kRaw;
    need_oo = cfg.value_target == ValueTarget::kAttnOutput;
    need_kw = cfg.value_target == ValueTarget::kKeyWeighted;
    layers.resize(static_cast<size_t>(L));
    const size_t mat = static_cast<size_t>(H) * d * d;
    for (int l = 0; l < L; ++l) {
      LayerAcc& a = layers[static_cast<size_t>(l)];
      a.sum_qq.assign(mat, 0.0);
      if (need_kk) a.sum_kk.assign(mat, 0.0);
      if (need_vv) a.sum_vv.assign(mat, 0.0);
      if (need_oo) a.sum_oo.assign(mat, 0.0);
      if (cfg.key_transform != KeyTransformMode::kOff) {
        a.sum_k.assign(static_cast<size_t>(H) * d, 0.0);
        a.sum_k2.assign(static_cast<size_t>(H) * d, 0.0);
        if (center_on()) a.sum_kpre.assign(static_cast<size_t>(H) * d, 0.0);
      }
      a.rng.seed(cfg.seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(l) + 1);
    }
  }

  // Σμ² / Σ E[k²] of KV head h in layer a (0 without key sums or tokens).
  double offset_share(const LayerAcc& a, int h) const {
    if (a.sum_k.empty() || a.tokens <= 0) return 0.0;
    const double n_tok = static_cast<double>(a.tokens);
    double m2 = 0, e2 = 0;
    for (int c = 0; c < d; ++c) {
      const size_t i = static_cast<size_t>(h) * d + c;
      const double mu = a.sum_k[i] / n_tok;
      m2 += mu * mu;
      e2 += std::max(0.0, a.sum_k2[i] / n_tok - mu * mu) + mu * mu;
    }
    return e2 > 0 ? m2 / e2 : 0.0;
  }
  // kAuto: whether some KV head of some layer carries at least key_offset_share of its key
  // energy in its mean (then every head is transformed). Decided once, at the first
  // finish_layer, from every layer's sums (finish() comes after all of them are fed).
  int model_offset = -1;
  bool model_has_offset() {
    if (model_offset < 0) {
      model_offset = 0;
      for (const LayerAcc& a : layers)
        for (int h = 0; h < H; ++h)
          if (offset_share(a, h) >= cfg.key_offset_share) model_offset = 1;
    }
    return model_offset == 1;
  }

  bool center_on() const {
    return cfg.page_center && !cfg.rope_freq.empty() && cfg.key_transform != KeyTransformMode::kOff;
  }
  // Pairs page centering follows: freq · center_page <= 1 rad.
  bool slow_pair(int j) const { return double(cfg.rope_freq[size_t(j)]) * cfg.center_page <= 1.0; }

  void log2_check() const {
    if (d <= 0 || (d & (d - 1)) != 0)
      throw Error(fmt::format(
          "calibrator: head_dim {} must be a power of two for Hadamard-based rotations", d));
  }

  LayerAcc& layer(int l, const char* op) {
    if (l < 0 || l >= L)
      throw Error(fmt::format("calibrator: {}: layer {} out of range [0, {})", op, l, L));
    return layers[static_cast<size_t>(l)];
  }

  // sum[h] += Σ rows of head h: src is [T][nheads_src][d] where head h owns the
  // `per` consecutive source heads [h*per, (h+1)*per).
  // Tasks are (head, span of kTaskTokens tokens), so 2 threads stay busy with 3
  // heads; each task sums into its own fp64 partial, and the partials are added
  // to `sum` in task order (the result does not depend on the thread count).
  void accumulate(std::vector<double>& sum, const float* src, int64_t T, int nheads_src, int per) {
    const int64_t spans = (T + kTaskTokens - 1) / kTaskTokens;
    const int64_t dd = int64_t(d) * d;
    const int tasks = static_cast<int>(H * spans);
    dbuf.resize(static_cast<size_t>(std::max(1, default_threads())));
    partial.assign(static_cast<size_t>(tasks * dd), 0.0);
    parallel_for(tasks, [&](int task, int w) {
      const int h = static_cast<int>(task / spans);
      const int64_t s0 = (task % spans) * kTaskTokens, s1 = std::min(T, s0 + kTaskTokens);
      std::vector<double>& buf = dbuf[static_cast<size_t>(w)];
      buf.resize(static_cast<size_t>(kTaskTokens * per * d));
      // Token t's `per` rows of head h are contiguous: one (per*d)-wide row.
      gather_rows(src + (s0 * nheads_src + static_cast<int64_t>(h) * per) * d, s1 - s0,
                  int64_t(per) * d, int64_t(nheads_src) * d, buf.data());
      la::syrk_upper_acc(buf.data(), (s1 - s0) * per, d, d, partial.data() + task * dd);
    });
    for (int task = 0; task < tasks; ++task) {
      double* dst = sum.data() + static_cast<size_t>(task / spans) * dd;
      const double* p = partial.data() + task * dd;
      for (int64_t i = 0; i < dd; ++i) dst[i] += p[i];
    }
  }

  void add(int l, const float* q, const float* k, const float* v, const float* o, int64_t T,
           int64_t first_pos) {
    LayerAcc& a = layer(l, "add");
    if (a.done) throw Error(fmt::format("calibrator: layer {} was already finished", l));
    if (T < 0) throw Error("calibrator: negative token count");
    if (T == 0) return;
    if (!q || !k || !v)
      throw Error(fmt::format("calibrator: layer {}: q, k and v are required", l));
    if (need_oo && !o)
      throw Error(fmt::format(
          "calibrator: layer {}: the attn-output value target needs the attention output o "
          "(use --value-target key-weighted or raw, or provide layers.{{i}}.o)",
          l));
    accumulate(a.sum_qq, q, T, Hq, g);
    if (need_kk) accumulate(a.sum_kk, k, T, H, 1);
    if (need_vv) accumulate(a.sum_vv, v, T, H, 1);
    if (need_oo) accumulate(a.sum_oo, o, T, Hq, g);
    const int64_t row = int64_t(H) * d;
    if (need_kw) {
      a.kblocks.emplace_back(k, k + T * row);
      a.vblocks.emplace_back(v, v + T * row);
    }
    if (!a.sum_kpre.empty()) {
      if (first_pos < 0) {
        a.sum_kpre.clear();  // a block without positions: no page centering for this layer
      } else {
        // Undo RoPE on the slow pairs: x_j = k_j cos + k_j' sin, x_j' = k_j' cos − k_j sin.
        const int half = d / 2;
        for (int j = 0; j < half; ++j) {
          if (!slow_pair(j)) continue;
          const double f = cfg.rope_freq[size_t(j)];
          for (int64_t t = 0; t < T; ++t) {
            const double ang = f * double(first_pos + t), c = std::cos(ang), sn = std::sin(ang);
            for (int h = 0; h < H; ++h) {
              const float* kr = k + t * row + int64_t(h) * d;
              a.sum_kpre[size_t(h) * d + j] += kr[j] * c + kr[j + half] * sn;
              a.sum_kpre[size_t(h) * d + j + half] += kr[j + half] * c - kr[j] * sn;
            }
          }
        }
        a.pre_tokens += T;
      }
    }
    if (!a.sum_k.empty())
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < row; ++i) {
          const double x = k[t * row + i];
          a.sum_k[static_cast<size_t>(i)] += x;
          a.sum_k2[static_cast<size_t>(i)] += x * x;
        }
    if (cfg.clip_search && cfg.sample_tokens > 0) {
      const int64_t S = cfg.sample_tokens;
      if (a.sample_k.empty()) {
        a.sample_k.resize(static_cast<size_t>(S * row));
        a.sample_v.resize(static_cast<size_t>(S * row));
      }
      for (int64_t t = 0; t < T; ++t) {
        const int64_t n = a.tokens + t;  // global index of this token in the layer
        int64_t slot = n;
        if (n >= S) {
          slot = static_cast<int64_t>(a.rng() % static_cast<uint64_t>(n + 1));
          if (slot >= S) continue;
        }
        std::copy(k + t * row, k + (t + 1) * row, a.sample_k.begin() + slot * row);
        std::copy(v + t * row, v + (t + 1) * row, a.sample_v.begin() + slot * row);
        a.sample_filled = std::min(S, n + 1);
      }
    }
    a.tokens += T;
  }

  // mean = sum / count with the lower triangle filled.
  std::vector<double> mean_of(const std::vector<double>& sum, double count) const {
    std::vector<double> m(sum);
    for (int h = 0; h < H; ++h) {
      double* c = m.data() + static_cast<size_t>(h) * d * d;
      la::symmetrize_from_upper(c, d);
      for (int i = 0; i < d * d; ++i) c[i] /= count;
    }
    return m;
  }

  std::vector<double> key_weighted(int l, const LayerAcc& a,
                                   const std::vector<double>& query) const {
    std::vector<double> out(static_cast<size_t>(H) * d * d, 0.0);
    const int64_t row = int64_t(H) * d;
    // w_t = k C_Q kᵀ = ‖k L‖² with C_Q + εI = L Lᵀ (Cholesky): a triangular
    // product, half the flops of k·C_Q. ε = 1e-12·tr/d keeps a singular C_Q
    // factorizable and moves w by a relative ~1e-12.
    using RowMat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    std::vector<RowMat> Lf(static_cast<size_t>(H));
    for (int h = 0; h < H; ++h) {
      RowMat Cq = Eigen::Map<const RowMat>(query.data() + static_cast<size_t>(h) * d * d, d, d);
      const double eps = 1e-12 * std::max(Cq.trace() / d, 1e-300);
      Cq.diagonal().array() += eps;
      Eigen::LLT<RowMat> llt(Cq);
      if (llt.info() != Eigen::Success)
        throw Error(fmt::format(
            "calibrator: layer {} kv head {}: query covariance is not positive semi-definite "
            "(non-finite activations?)",
            l, h));
      Lf[static_cast<size_t>(h)] = llt.matrixL();
    }
    // Tasks (head, add() block): each sums into its own numerator / denominator,
    // added per head in block order (independent of the thread count).
    const int nb = static_cast<int>(a.kblocks.size());
    const int64_t dd = int64_t(d) * d;
    std::vector<double> nums(static_cast<size_t>(int64_t(H) * nb * dd), 0.0),
        dens_t(static_cast<size_t>(H) * nb, 0.0);
    parallel_for(H * nb, [&](int task, int) {
      const int h = task / nb, blk = task % nb;
      std::vector<double> K(static_cast<size_t>(kChunkTokens * d)), W(K.size()), V(K.size());
      double den = 0.0;
      double* num = nums.data() + task * dd;
      const int64_t Tb = static_cast<int64_t>(a.kblocks[static_cast<size_t>(blk)].size()) / row;
      for (int64_t t0 = 0; t0 < Tb; t0 += kChunkTokens) {
        const int64_t m = std::min(kChunkTokens, Tb - t0);
        gather_rows(a.kblocks[static_cast<size_t>(blk)].data() + t0 * row + int64_t(h) * d, m, d,
                    row, K.data());
        gather_rows(a.vblocks[static_cast<size_t>(blk)].data() + t0 * row + int64_t(h) * d, m, d,
                    row, V.data());
        la::gemm_lower(K.data(), Lf[static_cast<size_t>(h)].data(), W.data(), m, d);
        for (int64_t t = 0; t < m; ++t) {
          double w = 0.0;
          for (int c = 0; c < d; ++c) w += W[t * d + c] * W[t * d + c];
          den += w;
          const double s = std::sqrt(w);
          for (int c = 0; c < d; ++c) V[t * d + c] *= s;
        }
        la::syrk_upper_acc(V.data(), m, d, d, num);
      }
      dens_t[static_cast<size_t>(task)] = den;
    });
    std::vector<double> dens(static_cast<size_t>(H), 0.0);
    for (int task = 0; task < H * nb; ++task) {
      const int h = task / nb;
      dens[static_cast<size_t>(h)] += dens_t[static_cast<size_t>(task)];
      double* num = out.data() + static_cast<size_t>(h) * dd;
      const double* p = nums.data() + task * dd;
      for (int64_t i = 0; i < dd; ++i) num[i] += p[i];
    }
    for (int h = 0; h < H; ++h) {
      const double den = dens[static_cast<size_t>(h)];
      if (!(den > 0.0) || !std::isfinite(den))
        throw Error(fmt::format(
            "calibrator: layer {} kv head {}: key-weighted weights sum to {} (all-zero keys or "
            "queries, or non-finite activations)",
            l, h, den));
      double* num = out.data() + static_cast<size_t>(h) * d * d;
      la::symmetrize_from_upper(num, d);
      for (int i = 0; i < d * d; ++i) num[i] /= den;
    }
    return out;
  }

  LayerTargets targets(int l) const {
    if (l < 0 || l >= L) throw Error(fmt::format("calibrator: layer {} out of range", l));
    const LayerAcc& a = layers[static_cast<size_t>(l)];
    if (a.done)
      throw Error(fmt::format("calibrator: layer {} is finished; its statistics were freed", l));
    if (a.tokens == 0) throw Error(fmt::format("calibrator: layer {} has seen no tokens", l));
    LayerTargets t;
    t.n_kv_heads = H;
    t.d = d;
    t.tokens = a.tokens;
    const double n = static_cast<double>(a.tokens);
    t.query = mean_of(a.sum_qq, n * g);
    t.key = need_kk ? mean_of(a.sum_kk, n) : t.query;
    switch (cfg.value_target) {
      case ValueTarget::kAttnOutput:
        t.value = mean_of(a.sum_oo, n * g);
        break;
      case ValueTarget::kRaw:
        t.value = mean_of(a.sum_vv, n);
        break;
      case ValueTarget::kKeyWeighted:
        t.value = key_weighted(l, a, t.query);
        break;
    }
    return t;
  }

  // The clip ratio in `grid` minimizing the weighted error summed over `heads`: rows[h]
  // are head h's sample rows ([S][d], already transformed), C[h] its weight (fp64 [d][d]).
  float best_clip(const std::vector<std::vector<float>>& rows,
                                     const std::vector<const double*>& C, int64_t S,
                                     const std::vector<double>& R, const std::vector<int>& heads,
                                     const std::vector<float>& grid) const {
    const int n = static_cast<int>(grid.size());
    std::vector<ErrorSums> total(static_cast<size_t>(n)), part(static_cast<size_t>(n));
    for (int h : heads) {
      quant_error_sweep(rows[static_cast<size_t>(h)].data(), S, d, d, R.data(), grid.data(), n,
                        cfg.quant, C[static_cast<size_t>(h)], part.data());
      for (int i = 0; i < n; ++i) total[static_cast<size_t>(i)] += part[static_cast<size_t>(i)];
    }
    int best = 0;
    for (int i = 1; i < n; ++i)
      if (total[static_cast<size_t>(i)].err_w < total[static_cast<size_t>(best)].err_w) best = i;
    return grid[static_cast<size_t>(best)];
  }

  // Head h's sample rows ([S][d] contiguous), optionally centered by mu and divided by s.
  std::vector<float> sample_rows(const LayerAcc& a, bool keys, int h, const double* mu,
                                 const float* s) const {
    const int64_t S = a.sample_filled, row = int64_t(H) * d;
    std::vector<float> out(static_cast<size_t>(S * d));
    const float* src = (keys ? a.sample_k.data() : a.sample_v.data()) + int64_t(h) * d;
    for (int64_t t = 0; t < S; ++t)
      for (int c = 0; c < d; ++c) {
        double x = src[t * row + c];
        if (mu) x -= mu[c];
        if (s) x /= s[c];
        out[static_cast<size_t>(t * d + c)] = static_cast<float>(x);
      }
    return out;
  }

  void finish_layer(int l) {
    LayerAcc& a = layer(l, "finish_layer");
    if (a.done) return;
    LayerTargets t = targets(l);
    const bool per_head = cfg.granularity == Granularity::kHead;
    const int n_rot = per_head ? H : 1;
    LayerCalibration& out = a.result;
    out.n_rot = n_rot;
    const size_t dd = static_cast<size_t>(d) * d;
    out.k_rotation.resize(n_rot * dd);
    out.v_rotation.resize(n_rot * dd);
    out.k_eigenvalues.resize(static_cast<size_t>(n_rot) * d);
    out.v_eigenvalues.resize(static_cast<size_t>(n_rot) * d);
    out.k_clip.assign(static_cast<size_t>(n_rot), cfg.k_clip);
    out.v_clip.assign(static_cast<size_t>(n_rot), cfg.v_clip);
    const bool sampled = cfg.clip_search && a.sample_filled > 0;

    // Key transform statistics per head: mean, centered variance, query second moment.
    const double n_tok = static_cast<double>(a.tokens);
    std::vector<double> mu(static_cast<size_t>(H) * d, 0.0), var(mu.size(), 0.0);
    std::vector<float> scales(mu.size(), 1.0f);
    if (!a.sum_k.empty()) {
      std::vector<double> qms(static_cast<size_t>(d));
      for (int h = 0; h < H; ++h) {
        for (int c = 0; c < d; ++c) {
          const size_t i = static_cast<size_t>(h) * d + c;
          mu[i] = a.sum_k[i] / n_tok;
          var[i] = std::max(0.0, a.sum_k2[i] / n_tok - mu[i] * mu[i]);
          qms[static_cast<size_t>(c)] = t.q(h)[static_cast<size_t>(c) * d + c];
        }
        const std::vector<float> sh = smoothing_scales(var.data() + size_t(h) * d, qms.data(), d);
        std::copy(sh.begin(), sh.end(), scales.begin() + static_cast<ptrdiff_t>(h) * d);
      }
    }
    // Which heads get the key transform. auto: those whose mean carries at least
    // cfg.key_offset_share of the key energy, Σμ² / Σ E[k²] (an offset dominates the rows).
    std::vector<char> centered(static_cast<size_t>(H), 0), scaled(static_cast<size_t>(H), 0);
    out.key_offset_share.assign(static_cast<size_t>(H), 0.0f);
    const bool auto_on = cfg.key_transform == KeyTransformMode::kAuto && model_has_offset();
    for (int h = 0; h < H && !a.sum_k.empty(); ++h) {
      const double rho = offset_share(a, h);
      out.key_offset_share[static_cast<size_t>(h)] = static_cast<float>(rho);
      const KeyTransformMode m = cfg.key_transform;
      const bool on = m == KeyTransformMode::kCenter || m == KeyTransformMode::kCenterScale || auto_on ||
                      (m == KeyTransformMode::kOffsetHeads && rho >= cfg.key_offset_share);
      centered[static_cast<size_t>(h)] = on;
      scaled[static_cast<size_t>(h)] = on && m != KeyTransformMode::kCenter;
    }
    // Head h's key target in its stored basis (fp64 [d][d]).
    auto key_target = [&](int h, bool center, bool scale) {
      std::vector<double> C(t.k(h), t.k(h) + dd);
      const double* m = mu.data() + static_cast<size_t>(h) * d;
      const float* s = scales.data() + static_cast<size_t>(h) * d;
      const bool raw = cfg.key_target == KeyTarget::kRaw;
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j) {
          double& x = C[static_cast<size_t>(i) * d + j];
          if (raw && center) x -= m[i] * m[j];
          if (scale) x = raw ? x / (double(s[i]) * s[j]) : x * (double(s[i]) * s[j]);
        }
      return C;
    };

    for (int r = 0; r < n_rot; ++r) {
      std::vector<int> heads;
      if (per_head)
        heads = {r};
      else
        for (int h = 0; h < H; ++h) heads.push_back(h);
      for (int kv = 0; kv < 2; ++kv) {
        const bool keys = kv == 0;
        const std::string what =
            fmt::format("layer {} {}{} {} target", l, per_head ? "kv head " : "",
                        per_head ? std::to_string(r) : "", keys ? "key" : "value");
        const uint64_t seed = cfg.seed + 1000003ull * static_cast<uint64_t>(l) +
                              2ull * static_cast<uint64_t>(r) + static_cast<uint64_t>(kv);
        // The pooled target of the rotation's heads (keys: each head in its transformed
        // basis), its eigenbasis and rotation, and the clip ratio (searched when asked).
        struct Result {
          std::vector<double> R;
          SymEig eig;
          float clip;
        };
        auto evaluate = [&]() {
          std::vector<std::vector<double>> Ch(static_cast<size_t>(H));
          std::vector<double> C(dd, 0.0);
          for (int h : heads) {
            Ch[static_cast<size_t>(h)] =
                keys ? key_target(h, centered[size_t(h)], scaled[size_t(h)])
                     : std::vector<double>(t.v(h), t.v(h) + dd);
            for (size_t i = 0; i < dd; ++i) C[i] += Ch[static_cast<size_t>(h)][i];
          }
          for (double& x : C) x /= static_cast<double>(heads.size());
          Result res{{}, sym_eig(C.data(), d, what.c_str()), keys ? cfg.k_clip : cfg.v_clip};
          res.R = compose_rotation(cfg.composition, &res.eig, d, seed);
          if (sampled) {
            std::vector<std::vector<float>> rows(static_cast<size_t>(H));
            std::vector<const double*> W(static_cast<size_t>(H), nullptr);
            for (int h : heads) {
              const bool center = centered[size_t(h)], scale = scaled[size_t(h)];
              rows[static_cast<size_t>(h)] = sample_rows(
                  a, keys, h, keys && center ? mu.data() + size_t(h) * d : nullptr,
                  keys && scale ? scales.data() + size_t(h) * d : nullptr);
              // Keys are weighted by the transformed query covariance diag(s)·C_Q·diag(s)
              // (the logit error, whatever the key target), values by their target.
              if (keys && cfg.key_target == KeyTarget::kRaw) {
                std::vector<double>& c = Ch[static_cast<size_t>(h)];
                const double* q = t.q(h);
                const float* s = scales.data() + size_t(h) * d;
                for (int i = 0; i < d; ++i)
                  for (int j = 0; j < d; ++j)
                    c[size_t(i) * d + j] = q[size_t(i) * d + j] * (scale ? double(s[i]) * s[j] : 1.0);
              }
              W[static_cast<size_t>(h)] = Ch[static_cast<size_t>(h)].data();
            }
            res.clip = best_clip(rows, W, a.sample_filled, res.R, heads, cfg.clip_grid);
          }
          return res;
        };
        const Result best = evaluate();
        float* rot = (keys ? out.k_rotation : out.v_rotation).data() + r * dd;
        float* ev =
            (keys ? out.k_eigenvalues : out.v_eigenvalues).data() + static_cast<size_t>(r) * d;
        for (size_t i = 0; i < dd; ++i) rot[i] = static_cast<float>(best.R[i]);
        for (int i = 0; i < d; ++i) ev[i] = static_cast<float>(best.eig.values[static_cast<size_t>(i)]);
        (keys ? out.k_clip : out.v_clip)[static_cast<size_t>(r)] = best.clip;
      }
    }
    // The key transform's tensors, only when some head uses them.
    out.k_mean.clear();
    out.k_scale.clear();
    if (std::any_of(centered.begin(), centered.end(), [](char c) { return c; })) {
      out.k_mean.assign(static_cast<size_t>(H) * d, 0.0f);
      for (int h = 0; h < H; ++h)
        if (centered[static_cast<size_t>(h)])
          for (int c = 0; c < d; ++c)
            out.k_mean[size_t(h) * d + c] = static_cast<float>(mu[size_t(h) * d + c]);
    }
    // Page centering: ν of the centred heads (with page_center_offset_only, those of them whose
    // offset dominates) on the slow pairs (pre-RoPE, original basis).
    std::vector<char> page_centred(centered);
    if (cfg.page_center_offset_only)
      for (int h = 0; h < H; ++h)
        page_centred[static_cast<size_t>(h)] &= out.key_offset_share[static_cast<size_t>(h)] >= cfg.key_offset_share;
    out.k_rope_mean.clear();
    if (!a.sum_kpre.empty() && a.pre_tokens == a.tokens && a.tokens > 0 &&
        std::any_of(page_centred.begin(), page_centred.end(), [](char c) { return c; })) {
      out.k_rope_mean.assign(static_cast<size_t>(H) * d, 0.0f);
      for (int h = 0; h < H; ++h)
        if (page_centred[static_cast<size_t>(h)])
          for (int j = 0; j < d / 2; ++j)
            if (slow_pair(j))
              for (int c : {j, j + d / 2})
                out.k_rope_mean[size_t(h) * d + c] =
                    static_cast<float>(a.sum_kpre[size_t(h) * d + c] / double(a.tokens));
    }
    if (std::any_of(scaled.begin(), scaled.end(), [](char c) { return c; })) {
      out.k_scale.assign(static_cast<size_t>(H) * d, 1.0f);
      for (int h = 0; h < H; ++h)
        if (scaled[static_cast<size_t>(h)])
          for (int c = 0; c < d; ++c) out.k_scale[size_t(h) * d + c] = scales[size_t(h) * d + c];
    }
    if (keep) a.kept = std::move(t);
    a.done = true;
    // Free the statistics; only the result (and kept targets) remain.
    std::vector<double>().swap(a.sum_qq);
    std::vector<double>().swap(a.sum_kk);
    std::vector<double>().swap(a.sum_vv);
    std::vector<double>().swap(a.sum_oo);
    std::vector<std::vector<float>>().swap(a.kblocks);
    std::vector<std::vector<float>>().swap(a.vblocks);
    std::vector<float>().swap(a.sample_k);
    std::vector<float>().swap(a.sample_v);
    std::vector<double>().swap(a.sum_k);
    std::vector<double>().swap(a.sum_k2);
  }
};

Calibrator::Calibrator(CalibConfig cfg, int n_layers, int n_q_heads, int n_kv_heads, int d)
    : impl_(std::make_unique<Impl>(std::move(cfg), n_layers, n_q_heads, n_kv_heads, d)) {}
Calibrator::~Calibrator() = default;
Calibrator::Calibrator(Calibrator&&) noexcept = default;
Calibrator& Calibrator::operator=(Calibrator&&) noexcept = default;

void Calibrator::add(int layer, const float* q, const float* k, const float* v, const float* o,
                     int64_t T, int64_t first_pos) {
  impl_->add(layer, q, k, v, o, T, first_pos);
}
LayerTargets Calibrator::targets(int layer) const {
  return impl_->targets(layer);
}
void Calibrator::finish_layer(int layer) {
  impl_->finish_layer(layer);
}
void Calibrator::keep_targets(bool on) {
  impl_->keep = on;
}
const LayerTargets& Calibrator::kept_targets(int layer) const {
  if (layer < 0 || layer >= impl_->L || !impl_->layers[static_cast<size_t>(layer)].done ||
      !impl_->keep)
    throw Error(fmt::format(
        "calibrator: no kept targets for layer {} (keep_targets(true) before finishing it)",
        layer));
  return impl_->layers[static_cast<size_t>(layer)].kept;
}
const CalibConfig& Calibrator::config() const {
  return impl_->cfg;
}
int Calibrator::n_layers() const {
  return impl_->L;
}
int64_t Calibrator::tokens(int layer) const {
  return impl_->layer(layer, "tokens").tokens;
}

Calibration Calibrator::finish(ModelFingerprint model) {
  Impl& m = *impl_;
  auto fill = [&](int& field, int value, const char* name) {
    if (field == 0)
      field = value;
    else if (field != value)
      throw Error(
          fmt::format("calibrator: model fingerprint says {} = {} but the activations have {}",
                      name, field, value));
  };
  fill(model.n_layers, m.L, "n_layers");
  fill(model.n_q_heads, m.Hq, "n_q_heads");
  fill(model.n_kv_heads, m.H, "n_kv_heads");
  fill(model.head_dim, m.d, "head_dim");
  int64_t tokens = -1;
  for (int l = 0; l < m.L; ++l) {
    const LayerAcc& a = m.layers[static_cast<size_t>(l)];
    if (!a.done && a.tokens == 0)
      throw Error(fmt::format("calibrator: layer {} has seen no tokens", l));
    tokens = tokens < 0 ? a.tokens : std::min(tokens, a.tokens);
  }
  Calibration c;
  c.model = model;
  c.method = "oscar";
  c.composition = m.cfg.composition;
  c.key_target = m.cfg.key_target;
  c.value_target = m.cfg.value_target;
  c.granularity = m.cfg.granularity;
  c.bits = m.cfg.quant.bits;
  c.group_size = m.cfg.quant.group_size;
  c.scale_dtype = m.cfg.quant.scale_dtype;
  c.sink = m.cfg.sink;
  c.recent = m.cfg.recent;
  c.clip_search = m.cfg.clip_search;
  c.key_transform = key_transform_name(m.cfg.key_transform);
  c.calib_tokens = tokens;
  for (int l = 0; l < m.L; ++l) {
    m.finish_layer(l);
    c.layers.push_back(m.layers[static_cast<size_t>(l)].result);
  }
  if (c.has_page_center()) c.rope_freq = m.cfg.rope_freq;
  return c;
}

CalibConfig calib_preset(const std::string& name, int bits) {
  if (bits != 2 && bits != 4)
    throw Error("calibration preset '" + name + "': " + std::to_string(bits) + " bits (expected 2 or 4)");
  CalibConfig c;
  if (name == "paper") {
    c.key_transform = KeyTransformMode::kOff;
  } else if (name == "recommended") {
    c.granularity = Granularity::kHead;
    c.key_target = KeyTarget::kRaw;
    c.value_target = ValueTarget::kRaw;
    c.k_clip = 0.88f;
    c.v_clip = 0.84f;
    c.key_transform = KeyTransformMode::kAuto;
  } else {
    throw Error("calibration preset '" + name + "': expected recommended or paper");
  }
  c.quant.bits = bits;
  if (bits == 4) c.k_clip = c.v_clip = 1.0f;  // the presets' clips are 2-bit settings
  return c;
}

}  // namespace oscar
