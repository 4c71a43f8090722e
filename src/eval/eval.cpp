#include "eval/eval.h"
#include "eval/scoring.h"

#include <cblas.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cpu/backend_cpu.h"
#include "backend/cpu/ops_threads.h"
#include "core/error.h"
#include "core/half.h"
#include "core/key_transform.h"
#include "core/quantizer.h"
#include "kernels/cpu/cache_write.h"
#include "kernels/cpu/key_transform.h"
#include "kernels/paged_kv.h"
#include "model/fold_rotation.h"

namespace oscar::eval {

namespace {

constexpr int kKiviGroup = 32;

void round_bf16(float* x, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

// Dequantized copies of the rows of one layer, as the method stores its middle.
//   hi [T][H][d] (BF16-rounded, rotated) -> lo [T][H][d]
// Keys under page centering (kernels/paged_kv.h) are quantized around their page's centre δ
// and read back as x̂ + δ: `center` (empty: none), the page size and the RoPE position of
// row 0 place each middle row's page as the cache does.
void quantize_rows(const kv::KvMethod& m, const float* hi, int T, int H, int d, bool value,
                   int layer, float* lo, const PageCenter* center = nullptr, int page_size = 0,
                   int64_t first_position = 0) {
  std::copy(hi, hi + size_t(T) * H * d, lo);
  if (m.kind == kv::KvMethod::Kind::kKivi) {
    const QuantSpec spec{2, kKiviGroup, ScaleDtype::kF16};
    if (value) {  // per token, groups of 32 channels
      fake_quantize_rows(lo, int64_t(T) * H, d, spec, lo);
      return;
    }
    // Keys per channel over spans of 32 tokens, aligned like the cache's
    // pages (the middle starts at m.sink and is made of whole pages, whose
    // size is a multiple of 32): complete spans only, since only those can be
    // in a query's quantized range (quantized_range).
    float col[kKiviGroup];
    for (int b = m.sink; b + kKiviGroup <= T; b += kKiviGroup)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < d; ++c) {
          for (int i = 0; i < kKiviGroup; ++i) col[i] = hi[(size_t(b + i) * H + h) * d + c];
          fake_quantize_rows(col, 1, kKiviGroup, spec, col);
          for (int i = 0; i < kKiviGroup; ++i) lo[(size_t(b + i) * H + h) * d + c] = col[i];
        }
    return;
  }
  const LayerCalibration& lc = m.calib->layers.at(layer);
  const QuantSpec spec{m.bits, std::min(m.group_size, d), ScaleDtype::kF16};
  const bool centered = !value && center && !center->empty();
  std::vector<float> cs, delta;
  kv::MidCenter mc;
  if (centered) {
    cs.resize(size_t(center->pairs()) * 2);
    delta.resize(size_t(H) * d);
    mc.pairs = center->pairs();
    mc.u = center->u.data();
    mc.w = center->w.data();
    mc.mu = center->mu.data();
  }
  int delta_page = -1;
  for (int t = 0; t < T; ++t) {
    const bool shift = centered && t >= m.sink;
    if (shift && (t - m.sink) / page_size != delta_page) {
      delta_page = (t - m.sink) / page_size;
      kv::center_angles(center->freq.data(), mc.pairs,
                        double(first_position) + kv::mid_page_center(m.sink, delta_page, page_size), cs.data());
      for (int h = 0; h < H; ++h) kv::center_offset(mc, d, h, cs.data(), delta.data() + size_t(h) * d);
    }
    for (int h = 0; h < H; ++h) {
      float* row = lo + (size_t(t) * H + h) * d;
      const float* off = shift ? delta.data() + size_t(h) * d : nullptr;
      if (off)
        for (int c = 0; c < d; ++c) row[c] -= off[c];
      const float c = value ? lc.v_clip_of(h) : lc.k_clip_of(h);
      if (c < 1.0f) clip_row(row, d, c);
      fake_quantize_rows(row, 1, d, spec, row);
      if (off)
        for (int c = 0; c < d; ++c) row[c] += off[c];
    }
  }
}

class SimHook : public model::DenseHooks {
 public:
  SimHook(model::DenseForward& fwd, const kv::KvMethod& m, int page_size, int score_from,
          LocalErrorSums* sums, int64_t first_position)
      : fwd_(fwd), m_(m), c_(fwd.config()), page_(page_size), score_from_(score_from), sums_(sums),
        first_position_(first_position) {
    if (m_.kind == kv::KvMethod::Kind::kRow) pairs_ = page_center_pairs(*m_.calib);
  }

  void on_qkv(int layer, float* q, float* k, float* v, int T) override {
    if (m_.kind != kv::KvMethod::Kind::kRow) return;
    const LayerCalibration& lc = m_.calib->layers.at(layer);
    if (m_.calib->composition == Composition::kNone && !lc.has_key_transform()) {
      center_ = prepare_page_center(*m_.calib, layer, prepare_key_transform(lc, c_.n_kv_heads, c_.head_dim),
                                    pairs_, c_.n_kv_heads, c_.head_dim);
      return;
    }
    xf_ = prepare_key_transform(lc, c_.n_kv_heads, c_.head_dim);
    center_ = prepare_page_center(*m_.calib, layer, xf_, pairs_, c_.n_kv_heads, c_.head_dim);
    const KeyTransform& xf = xf_;
    if (sums_ && lc.has_key_transform()) {
      // The cache error is reported in the original basis: keep the keys and the
      // inverse map, x = k̃·Rᵀ·diag(s) + μ (see attention()).
      k_orig_.assign(k, k + size_t(T) * c_.n_kv_heads * c_.head_dim);
      layer_ = layer;
    }
    kernels::cpu::transform_keys(xf, k, T, c_.n_kv_heads);
    kernels::cpu::transform_queries(xf, q, T, c_.n_heads, c_.n_kv_heads);
  }

  bool attention(int layer, const float* q, const float* k, const float* v, int T,
                 float* o) override;

 private:
  model::DenseForward& fwd_;
  const kv::KvMethod& m_;
  const model::ModelConfig& c_;
  int page_, score_from_;
  LocalErrorSums* sums_;
  int64_t first_position_;     // RoPE position of token 0
  std::vector<int> pairs_;     // page centering: the calibration's pairs (empty: none)
  PageCenter center_;          // the layer's page centering (set by on_qkv)
  KeyTransform xf_;            // the layer's prepared key transform
  std::vector<float> k_orig_;  // keys before the key transform (when it has one)
  int layer_ = -1;             // the layer k_orig_ belongs to
};

bool SimHook::attention(int layer, const float* q, const float* k, const float* v, int T,
                        float* o) {
  const int d = c_.head_dim, Hq = c_.n_heads, Hkv = c_.n_kv_heads, group = Hq / Hkv;
  const size_t nkv = size_t(T) * Hkv * d;
  std::vector<float> khi(k, k + nkv), vhi(v, v + nkv);
  round_bf16(khi.data(), nkv);
  round_bf16(vhi.data(), nkv);
  // BF16 methods, and the layers a method keeps in BF16 (+bf16L; q and k already carry the
  // key transform, which leaves the scores' softmax unchanged).
  if (m_.kind == kv::KvMethod::Kind::kBf16 || m_.bf16_layer(layer)) {
    model::dense_causal_attention(q, khi.data(), vhi.data(), T, Hq, Hkv, d, o);
    return true;
  }
  std::vector<float> klo(nkv), vlo(nkv);
  quantize_rows(m_, khi.data(), T, Hkv, d, false, layer, klo.data(), &center_, page_, first_position_);
  quantize_rows(m_, vhi.data(), T, Hkv, d, true, layer, vlo.data());

  std::vector<LoRange> lo(T);
  for (int t = 0; t < T; ++t) lo[t] = quantized_range(m_, t, page_);
  if (sums_) {
    // Cache error over the rows quantized at the end of the sequence, against
    // the unrounded rows (orthogonal rotations keep the relative MSE).
    const LoRange r = lo[T - 1];
    const bool back = layer_ == layer && !k_orig_.empty();
    if (back) {
      // Keys with a key transform: k − μ = k̃·M_Qᵀ (M_Q = diag(s)·R, M_K⁻¹ = Rᵀ·diag(s)),
      // so the error of a stored key maps back by the same product.
      for (int t = r.begin; t < r.end; ++t)
        for (int h = 0; h < Hkv; ++h) {
          const size_t base = (size_t(t) * Hkv + h) * d;
          const float* M = xf_.query_matrix(h);
          for (int j = 0; j < d; ++j) {
            double e = 0;
            for (int i = 0; i < d; ++i) e += double(klo[base + i] - k[base + i]) * M[size_t(j) * d + i];
            sums_->k_num += e * e;
            sums_->k_den += double(k_orig_[base + j]) * k_orig_[base + j];
          }
        }
    }
    for (int t = r.begin; t < r.end; ++t)
      for (size_t i = size_t(t) * Hkv * d; i < size_t(t + 1) * Hkv * d; ++i) {
        if (!back) {
          sums_->k_num += double(klo[i] - k[i]) * (klo[i] - k[i]);
          sums_->k_den += double(k[i]) * k[i];
        }
        sums_->v_num += double(vlo[i] - v[i]) * (vlo[i] - v[i]);
        sums_->v_den += double(v[i]) * v[i];
      }
  }

  const int ldq = Hq * d, ldk = Hkv * d;
  const float scale = 1.0f / std::sqrt(float(d));
  constexpr int kBlock = 128;
  // BF16 attention outputs of the scored rows, all heads: [T][Hq][d] (rows
  // before score_from stay 0), for o_err and, after o_proj, proj_err.
  const bool any_scored = sums_ && score_from_ < T;
  std::vector<float> Oref(any_scored ? size_t(T) * ldq : 0, 0.0f);
  // Query heads in parallel (op threads); each chunk of heads accumulates its
  // own sums, merged in head order (deterministic for a fixed thread count).
  std::vector<LocalErrorSums> part(Hq);
  backend::cpu::parallel_for(Hq, 1, [&](int64_t gb, int64_t ge) {
  std::vector<float> Shi(size_t(kBlock) * T), Slo(size_t(kBlock) * T), Ph(size_t(kBlock) * T),
      B(size_t(kBlock) * T);
  LocalErrorSums& acc = part[size_t(gb)];
  for (int g = int(gb); g < int(ge); ++g) {
    const int h = g / group;
    for (int t0 = 0; t0 < T; t0 += kBlock) {
      const int t1 = std::min(T, t0 + kBlock), n = t1 - t0;
      int L = 0;  // columns that are quantized for some row of the block
      for (int t = t0; t < t1; ++t) L = std::max(L, lo[t].end);
      const bool metrics = sums_ && t1 - 1 >= score_from_;
      const float* qb = q + size_t(t0) * ldq + size_t(g) * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, t1, d, scale, qb, ldq,
                  khi.data() + size_t(h) * d, ldk, 0.0f, Shi.data(), t1);
      if (L > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, L, d, scale, qb, ldq,
                    klo.data() + size_t(h) * d, ldk, 0.0f, Slo.data(), L);
      for (int i = 0; i < n; ++i) {
        const int t = t0 + i, len = t + 1;
        float* shi = Shi.data() + size_t(i) * t1;
        float* b = B.data() + size_t(i) * std::max(L, 1);
        const LoRange r = lo[t];
        const bool scored = metrics && t >= score_from_;
        // Mixed logits in place of shi; the BF16 ones kept in ph for metrics.
        float* ph = Ph.data() + size_t(i) * t1;
        if (scored) std::copy(shi, shi + len, ph);
        for (int j = r.begin; j < r.end; ++j) shi[j] = Slo[size_t(i) * L + j];
        auto softmax = [len](float* s) {
          float mx = -std::numeric_limits<float>::infinity();
          for (int j = 0; j < len; ++j) mx = std::max(mx, s[j]);
          double sum = 0;
          for (int j = 0; j < len; ++j) sum += std::exp(double(s[j] - mx));
          return double(mx) + std::log(sum);  // log-sum-exp
        };
        const double lse_mix = softmax(shi);
        if (scored) {
          const double lse_hi = softmax(ph);
          double ln = 0, ld = 0, kl = 0;
          for (int j = 0; j < len; ++j) {
            const double e = double(shi[j]) - ph[j];
            ln += e * e;
            ld += double(ph[j]) * ph[j];
            const double lp = ph[j] - lse_hi, lq = shi[j] - lse_mix;
            kl += std::exp(lp) * (lp - lq);
          }
          acc.logit_num += ln;
          acc.logit_den += ld;
          acc.attn_kl += std::max(0.0, kl);
          acc.attn_rows += 1;
          for (int j = 0; j < len; ++j) ph[j] = float(std::exp(ph[j] - lse_hi));
          for (int j = len; j < t1; ++j) ph[j] = 0.0f;
        }
        for (int j = 0; j < len; ++j) shi[j] = float(std::exp(shi[j] - lse_mix));
        for (int j = len; j < t1; ++j) shi[j] = 0.0f;
        // Split the probabilities: quantized columns go to b (for V_lo).
        if (L > 0) {
          std::fill(b, b + L, 0.0f);
          for (int j = r.begin; j < r.end; ++j) b[j] = shi[j], shi[j] = 0.0f;
        }
      }
      float* ob = o + size_t(t0) * ldq + size_t(g) * d;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, t1, 1.0f, Shi.data(), t1,
                  vhi.data() + size_t(h) * d, ldk, 0.0f, ob, ldq);
      if (L > 0)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, L, 1.0f, B.data(), L,
                    vlo.data() + size_t(h) * d, ldk, 1.0f, ob, ldq);
      if (metrics) {
        float* oh = Oref.data() + size_t(t0) * ldq + size_t(g) * d;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, d, t1, 1.0f, Ph.data(), t1,
                    vhi.data() + size_t(h) * d, ldk, 0.0f, oh, ldq);
        for (int i = std::max(0, score_from_ - t0); i < n; ++i)
          for (int c = 0; c < d; ++c) {
            const double ref = oh[size_t(i) * ldq + c], e = ob[size_t(i) * ldq + c] - ref;
            acc.o_num += e * e;
            acc.o_den += ref * ref;
          }
      }
    }
  }
  });
  if (sums_)
    for (const LocalErrorSums& p : part) {
      sums_->logit_num += p.logit_num;
      sums_->logit_den += p.logit_den;
      sums_->attn_kl += p.attn_kl;
      sums_->attn_rows += p.attn_rows;
      sums_->o_num += p.o_num;
      sums_->o_den += p.o_den;
    }
  if (any_scored) {
    // The attention block's output after o_proj, quantized vs BF16 attention.
    const int n = T - score_from_;
    std::vector<float> yq, yr;
    fwd_.project_attention(layer, o + size_t(score_from_) * ldq, n, yq);
    fwd_.project_attention(layer, Oref.data() + size_t(score_from_) * ldq, n, yr);
    for (size_t i = 0; i < yq.size(); ++i) {
      const double e = double(yq[i]) - yr[i];
      sums_->proj_num += e * e;
      sums_->proj_den += double(yr[i]) * yr[i];
    }
  }
  return true;
}

double rel(double num, double den) { return den > 0 ? num / den : 0.0; }

}  // namespace

LoRange quantized_range(const kv::KvMethod& m, int t, int page_size) {
  // The cache after committing tokens 0..t-1 (query t is the pending token).
  // Page-granular demotion, kivi2 included (kv/oscar_cache.h).
  if (m.kind == kv::KvMethod::Kind::kBf16) return {};
  if (m.kind == kv::KvMethod::Kind::kKivi && page_size % kKiviGroup != 0)
    throw Error(fmt::format("eval: {} needs a page size that is a multiple of {} (got {})", m.label,
                            kKiviGroup, page_size));
  const int mid = std::max(0, (t - m.sink - m.recent) / page_size) * page_size;
  return {m.sink, m.sink + mid};
}

void simulate(model::DenseForward& fwd, const kv::KvMethod& m, std::span<const int32_t> tokens,
              int page_size, int score_from, std::vector<float>& hidden, LocalErrorSums* sums,
              int64_t first_position) {
  SimHook hook(fwd, m, page_size, score_from, sums, first_position);
  fwd.run(tokens, &hook, &hidden, first_position);
}

std::vector<EvalResult> evaluate(const model::ModelWeights& w,
                                 const std::vector<kv::KvMethod>& methods,
                                 const std::vector<int32_t>& tokens, const EvalOptions& opts,
                                 const EvalProgress& progress) {
  const model::ModelConfig& c = w.cfg;
  const int H = c.hidden, V = c.vocab_size, M = int(methods.size());
  detail::check_windows(opts.ctx, opts.windows, tokens.size());
  const int score_from = detail::first_scored(methods, opts.score_from, opts.page_size);
  backend::CpuBackendOptions bo;
  bo.weight_dtype = opts.weights;
  bo.threads = opts.threads;
  auto be = backend::make_cpu_backend(bo);
  model::DenseForward ref_fwd(w, *be);
  kv::KvMethod bf16;
  bf16.label = "bf16";

  // Work items: (ctx, window). Hidden states are small ([T][hidden]), so every
  // method runs over all items with its (folded) weights prepared once.
  struct Item {
    int ctx, ci, win;
    std::span<const int32_t> seq;
  };
  std::vector<Item> items;
  for (size_t ci = 0; ci < opts.ctx.size(); ++ci)
    for (int win = 0; win < opts.windows; ++win)
      items.push_back({opts.ctx[ci], int(ci), win,
                       std::span<const int32_t>(tokens.data() + int64_t(win) * opts.ctx[ci],
                                                size_t(opts.ctx[ci]))});
  const size_t C = opts.ctx.size();
  std::vector<std::vector<float>> href(items.size());
  for (size_t it = 0; it < items.size(); ++it) {
    if (progress) progress(fmt::format("ctx {} window {}: bf16 reference", items[it].ctx, items[it].win + 1));
    simulate(ref_fwd, bf16, items[it].seq, opts.page_size, items[it].ctx, href[it], nullptr,
             opts.first_position);
  }
  std::vector<std::vector<std::vector<float>>> hm(M, std::vector<std::vector<float>>(items.size()));
  std::vector<std::vector<LocalErrorSums>> loc(M, std::vector<LocalErrorSums>(C));
  for (int mi = 0; mi < M; ++mi) {
    const kv::KvMethod& m = methods[mi];
    std::unique_ptr<backend::Backend> mbe;
    std::unique_ptr<model::DenseForward> mf;
    if (m.folds_values()) {
      model::ModelWeights fw = w;
      model::fold_value_rotation(fw, *m.calib);
      mbe = backend::make_cpu_backend(bo);
      mf = std::make_unique<model::DenseForward>(fw, *mbe);
    }
    model::DenseForward& f = mf ? *mf : ref_fwd;
    for (size_t it = 0; it < items.size(); ++it) {
      if (progress) progress(fmt::format("ctx {} window {}: {}", items[it].ctx, items[it].win + 1, m.label));
      simulate(f, m, items[it].seq, opts.page_size, score_from, hm[mi][it], &loc[mi][items[it].ci],
               opts.first_position);
    }
  }

  // Next-token metrics over the scored positions, in blocks of rows.
  detail::TokenScores ts(M, C);
  std::vector<std::vector<double>> hn(M, std::vector<double>(C)), hd(M, std::vector<double>(C));
  constexpr int kRows = 64;
  std::vector<float> lr, lm;
  std::vector<double> logp_ref(size_t(kRows) * V);
  for (size_t it = 0; it < items.size(); ++it) {
    const Item& I = items[it];
    if (progress) progress(fmt::format("ctx {} window {}: next-token metrics", I.ctx, I.win + 1));
    for (int t0 = std::min(score_from, I.ctx - 1); t0 < I.ctx - 1; t0 += kRows) {
      const int n = std::min(kRows, I.ctx - 1 - t0);
      ref_fwd.logits(href[it].data() + size_t(t0) * H, n, lr);
      std::vector<int> ref_top(n);
      for (int i = 0; i < n; ++i) {
        ref_top[i] = detail::ref_log_probs(lr.data() + size_t(i) * V, V, logp_ref.data() + size_t(i) * V);
        ts.ref_nll[I.ci] -= logp_ref[size_t(i) * V + I.seq[t0 + i + 1]];
      }
      ts.npos[I.ci] += n;
      for (int mi = 0; mi < M; ++mi) {
        const float* hmv = hm[mi][it].data() + size_t(t0) * H;
        const float* hrv = href[it].data() + size_t(t0) * H;
        for (size_t i = 0; i < size_t(n) * H; ++i) {
          hn[mi][I.ci] += double(hmv[i] - hrv[i]) * (hmv[i] - hrv[i]);
          hd[mi][I.ci] += double(hrv[i]) * hrv[i];
        }
        ref_fwd.logits(hmv, n, lm);
        for (int i = 0; i < n; ++i)
          detail::score_row(logp_ref.data() + size_t(i) * V, ref_top[i], lm.data() + size_t(i) * V, V,
                            I.seq[t0 + i + 1], ts.nll[mi][I.ci], ts.kl[mi][I.ci], ts.top1[mi][I.ci]);
      }
    }
  }
  return detail::result_rows(ts, methods, opts.ctx, opts.windows, c.head_dim, opts.page_size,
                             [&](EvalResult& e, int mi, size_t ci) {
                               const LocalErrorSums& L = loc[mi][ci];
                               e.k_err = rel(L.k_num, L.k_den);
                               e.v_err = rel(L.v_num, L.v_den);
                               e.logit_err = rel(L.logit_num, L.logit_den);
                               e.attn_kl = L.attn_rows ? L.attn_kl / double(L.attn_rows) : 0.0;
                               e.o_err = rel(L.o_num, L.o_den);
                               e.proj_err = rel(L.proj_num, L.proj_den);
                               e.hidden_err = rel(hn[mi][ci], hd[mi][ci]);
                             });
}

namespace detail {

void check_windows(const std::vector<int>& ctx, int windows, size_t tokens) {
  for (int c : ctx)
    if (c < 2 || int64_t(c) * windows > int64_t(tokens))
      throw Error(fmt::format("eval: the text has {} tokens; {} window(s) of {} tokens need {}", tokens, windows,
                              c, int64_t(c) * windows));
}

int first_scored(const std::vector<kv::KvMethod>& methods, int score_from, int page_size) {
  if (score_from >= 0) return score_from;
  // One scored set for every method: queries past the first demotion of the (first) windowed method.
  for (const kv::KvMethod& m : methods)
    if (m.kind == kv::KvMethod::Kind::kRow) return m.sink + m.recent + page_size;
  return 64 + 256 + page_size;
}

int ref_log_probs(const float* z, int V, double* lp) {
  double mx = *std::max_element(z, z + V), s = 0;
  for (int j = 0; j < V; ++j) s += std::exp(z[j] - mx);
  const double lse = mx + std::log(s);
  for (int j = 0; j < V; ++j) lp[j] = z[j] - lse;
  return int(std::max_element(z, z + V) - z);
}

void score_row(const double* lp, int ref_top, const float* z, int V, int target, double& nll, double& kl,
               double& top1) {
  double mx = *std::max_element(z, z + V), s = 0;
  for (int j = 0; j < V; ++j) s += std::exp(z[j] - mx);
  const double lse = mx + std::log(s);
  double k = 0;
  for (int j = 0; j < V; ++j) k += std::exp(lp[j]) * (lp[j] - (z[j] - lse));
  kl += std::max(0.0, k);
  nll -= z[target] - lse;
  top1 += int(std::max_element(z, z + V) - z) == ref_top;
}

std::vector<EvalResult> result_rows(const TokenScores& s, const std::vector<kv::KvMethod>& methods,
                                    const std::vector<int>& ctx, int windows, int head_dim, int page_size,
                                    const std::function<void(EvalResult&, int, size_t)>& more) {
  bool listed = false;
  for (const kv::KvMethod& m : methods) listed |= m.kind == kv::KvMethod::Kind::kBf16;
  std::vector<EvalResult> out;
  for (size_t ci = 0; ci < ctx.size(); ++ci) {
    const double np = double(std::max<int64_t>(1, s.npos[ci]));
    EvalResult r;
    r.method = "bf16 (reference)";
    r.ctx = ctx[ci];
    r.windows = windows;
    r.positions = s.npos[ci];
    r.bpe = 16.0;
    r.nll = s.ref_nll[ci] / np;
    r.ppl = std::exp(r.nll);
    r.top1 = 1.0;
    if (!listed) out.push_back(r);
    for (size_t mi = 0; mi < methods.size(); ++mi) {
      EvalResult e;
      e.method = methods[mi].label;
      e.ctx = ctx[ci];
      e.windows = windows;
      e.positions = s.npos[ci];
      e.bpe = methods[mi].bits_per_element(e.ctx, head_dim, page_size);
      e.nll = s.nll[mi][ci] / np;
      e.ppl = std::exp(e.nll);
      e.kl = s.kl[mi][ci] / np;
      e.top1 = s.top1[mi][ci] / np;
      if (more) more(e, int(mi), ci);
      out.push_back(e);
    }
  }
  return out;
}

}  // namespace detail

std::string format_table(const std::vector<EvalResult>& rs) {
  std::string s = fmt::format("{:<22} {:>6} {:>6} {:>9} {:>8} {:>8} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
                              "method", "ctx", "bpe", "ppl", "dppl%", "KL", "top1", "K err", "V err",
                              "logit err", "attn KL", "o err", "proj err", "hidden err");
  double ref_ppl = 0;
  int ref_ctx = -1;
  for (const EvalResult& r : rs) {
    if (r.ctx != ref_ctx) {
      ref_ctx = r.ctx;
      ref_ppl = 0;
      for (const EvalResult& q : rs)
        if (q.ctx == r.ctx && (q.method == "bf16" || q.method == "bf16 (reference)")) ref_ppl = q.ppl;
    }
    const double dp = ref_ppl > 0 ? 100.0 * (r.ppl / ref_ppl - 1.0) : 0.0;
    s += fmt::format("{:<22} {:>6} {:>6.3f} {:>9.4f} {:>+8.2f} {:>8.5f} {:>7.4f} {:>9.3e} {:>9.3e} {:>9.3e} {:>9.3e} {:>9.3e} {:>9.3e} {:>9.3e}\n",
                     r.method, r.ctx, r.bpe, r.ppl, dp, r.kl, r.top1, r.k_err, r.v_err, r.logit_err,
                     r.attn_kl, r.o_err, r.proj_err, r.hidden_err);
  }
  return s;
}

std::string to_json(const std::vector<EvalResult>& rs, const std::string& extra) {
  nlohmann::json j;
  j["results"] = nlohmann::json::array();
  for (const EvalResult& r : rs)
    j["results"].push_back({{"method", r.method}, {"ctx", r.ctx}, {"windows", r.windows},
                            {"positions", r.positions}, {"bpe", r.bpe}, {"ppl", r.ppl},
                            {"nll", r.nll}, {"kl", r.kl}, {"top1", r.top1}, {"k_err", r.k_err},
                            {"v_err", r.v_err}, {"logit_err", r.logit_err},
                            {"attn_kl", r.attn_kl}, {"o_err", r.o_err}, {"proj_err", r.proj_err},
                            {"hidden_err", r.hidden_err}});
  if (!extra.empty()) {
    auto e = nlohmann::json::parse(extra);
    for (auto it = e.begin(); it != e.end(); ++it) j[it.key()] = it.value();
  }
  return j.dump(2);
}

}  // namespace oscar::eval
