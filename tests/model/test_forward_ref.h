// A deliberately naive dense forward (fp64, one sequence, no cache, no backend)
// that the paged/batched Model is tested against. It emulates the BF16 cache:
// the key/value of position j seen by the query at position p is rounded to
// bf16 when j was cached before p's chunk (j < chunk_start[p]) and exact when j
// is in the same chunk (the prefill kernel reads the chunk's own rows in f32 with
// f32 weights; with reduced-precision weights own_rows_bf16 rounds them too).
// A decode step (chunk of one token, read back from the cache) is written as
// chunk_start[p] = p + 1.
#pragma once

#include <cmath>
#include <vector>

#include "backend/cpu/ops_gemv_q8.h"
#include "core/half.h"
#include "model/weights.h"

namespace oscar::model::testing {

inline double bf16r(double x) { return bf16_to_f32(f32_to_bf16(static_cast<float>(x))); }

// Returns logits [T][vocab] for every position. own_rows_bf16: the chunk's own rows are rounded
// to bf16 too (the CPU backend with reduced-precision weights reads them as the cache stores them).
inline std::vector<double> ref_forward(const ModelWeights& w, const std::vector<int>& tokens,
                                       const std::vector<int>& chunk_start, bool own_rows_bf16 = false) {
  const ModelConfig& c = w.cfg;
  const int T = static_cast<int>(tokens.size());
  const int H = c.hidden, Hq = c.n_heads, Hkv = c.n_kv_heads, d = c.head_dim, I = c.intermediate;
  const int V = c.vocab_size, grp = Hq / Hkv;
  using Vec = std::vector<double>;
  auto matvec = [](const Tensor& W, const Vec& x, const Tensor* b) {
    const int64_t rows = W.shape[0], cols = W.shape[1];
    Vec y(rows);
    for (int64_t r = 0; r < rows; ++r) {
      double s = 0;
      for (int64_t k = 0; k < cols; ++k) s += double(W.data[r * cols + k]) * x[k];
      y[r] = s + (b && !b->empty() ? b->data[r] : 0.0);
    }
    return y;
  };
  auto rms = [&](const double* x, int n, const Tensor& g, double* y) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const double inv = 1.0 / std::sqrt(ss / n + c.rms_eps);
    for (int i = 0; i < n; ++i) y[i] = x[i] * inv * g.data[i];
  };
  auto rope = [&](double* v, int p) {
    for (int i = 0; i < d / 2; ++i) {
      const double f = std::pow(double(c.rope_theta), -2.0 * i / d);
      const double a = p * f, cs = std::cos(a), sn = std::sin(a);
      const double x1 = v[i], x2 = v[i + d / 2];
      v[i] = x1 * cs - x2 * sn;
      v[i + d / 2] = x2 * cs + x1 * sn;
    }
  };
  std::vector<Vec> x(T, Vec(H));
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < H; ++i) x[t][i] = w.tok_embd.data[int64_t(tokens[t]) * H + i];
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    std::vector<Vec> q(T), k(T), v(T);
    for (int t = 0; t < T; ++t) {
      Vec h(H);
      rms(x[t].data(), H, L.attn_norm, h.data());
      q[t] = matvec(L.wq, h, &L.bq);
      k[t] = matvec(L.wk, h, &L.bk);
      v[t] = matvec(L.wv, h, &L.bv);
      for (int g = 0; g < Hq; ++g) {
        if (c.qk_norm) rms(&q[t][g * d], d, L.q_norm, &q[t][g * d]);
        rope(&q[t][g * d], t);
      }
      for (int g = 0; g < Hkv; ++g) {
        if (c.qk_norm) rms(&k[t][g * d], d, L.k_norm, &k[t][g * d]);
        rope(&k[t][g * d], t);
      }
    }
    for (int t = 0; t < T; ++t) {
      Vec o(size_t(Hq) * d, 0.0);
      for (int g = 0; g < Hq; ++g) {
        const int hk = g / grp;
        std::vector<double> s(t + 1);
        double mx = -1e300;
        for (int j = 0; j <= t; ++j) {
          const bool cached = own_rows_bf16 || j < chunk_start[t];
          double dot = 0;
          for (int i = 0; i < d; ++i) {
            const double kv = k[j][hk * d + i];
            dot += q[t][g * d + i] * (cached ? bf16r(kv) : kv);
          }
          s[j] = dot / std::sqrt(double(d));
          mx = std::max(mx, s[j]);
        }
        double den = 0;
        for (int j = 0; j <= t; ++j) den += (s[j] = std::exp(s[j] - mx));
        for (int j = 0; j <= t; ++j) {
          const bool cached = own_rows_bf16 || j < chunk_start[t];
          for (int i = 0; i < d; ++i) {
            const double vv = v[j][hk * d + i];
            o[g * d + i] += s[j] / den * (cached ? bf16r(vv) : vv);
          }
        }
      }
      Vec a = matvec(L.wo, o, nullptr);
      for (int i = 0; i < H; ++i) x[t][i] += a[i];
    }
    for (int t = 0; t < T; ++t) {
      Vec h(H);
      rms(x[t].data(), H, L.ffn_norm, h.data());
      Vec gt = matvec(L.w_gate, h, nullptr), up = matvec(L.w_up, h, nullptr);
      Vec act(I);
      for (int i = 0; i < I; ++i) act[i] = gt[i] / (1.0 + std::exp(-gt[i])) * up[i];
      Vec dn = matvec(L.w_down, act, nullptr);
      for (int i = 0; i < H; ++i) x[t][i] += dn[i];
    }
  }
  const Tensor& head = c.tied_embeddings ? w.tok_embd : w.lm_head;
  std::vector<double> logits(size_t(T) * V);
  for (int t = 0; t < T; ++t) {
    Vec h(H);
    rms(x[t].data(), H, w.out_norm, h.data());
    Vec lg = matvec(head, h, nullptr);
    for (int i = 0; i < V; ++i) logits[size_t(t) * V + i] = lg[i];
  }
  return logits;
}

// The weights a bf16-weight backend effectively computes with: matrices rounded
// to bf16 (a tied LM head too, but not the embedding rows it gathers).
inline ModelWeights round_matrices_bf16(const ModelWeights& w) {
  ModelWeights r = w;
  auto rnd = [](Tensor& t) {
    for (float& x : t.data) x = bf16_to_f32(f32_to_bf16(x));
  };
  for (auto& L : r.layers) {
    rnd(L.wq), rnd(L.wk), rnd(L.wv), rnd(L.wo), rnd(L.w_gate), rnd(L.w_up), rnd(L.w_down);
  }
  if (r.cfg.tied_embeddings) {
    r.cfg.tied_embeddings = false;
    r.lm_head = r.tok_embd;
  }
  rnd(r.lm_head);
  return r;
}

// The same for q8 weights (int8, scale per 32 channels; backend/cpu/ops_gemv_q8.h).
inline ModelWeights round_matrices_q8(const ModelWeights& w) {
  ModelWeights r = w;
  auto rnd = [](Tensor& t) {
    const int64_t out = t.shape[0], in = t.shape[1];
    std::vector<int8_t> q(t.data.size());
    std::vector<float> s(t.data.size() / backend::cpu::kQ8Block);
    backend::cpu::quantize_q8(t.data.data(), out, in, q.data(), s.data());
    for (size_t i = 0; i < q.size(); ++i) t.data[i] = q[i] * s[i / backend::cpu::kQ8Block];
  };
  for (auto& L : r.layers) {
    rnd(L.wq), rnd(L.wk), rnd(L.wv), rnd(L.wo), rnd(L.w_gate), rnd(L.w_up), rnd(L.w_down);
  }
  if (r.cfg.tied_embeddings) {
    r.cfg.tied_embeddings = false;
    r.lm_head = r.tok_embd;
  }
  rnd(r.lm_head);
  return r;
}

}  // namespace oscar::model::testing
