#include "model/calib_forward.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>

#include "backend/cpu/ops_gemm.h"
#include "backend/cpu/ops_threads.h"
#include "core/error.h"
#include "kernels/cpu/rope.h"
#include "model/rope.h"

namespace oscar::model {

DenseForward::DenseForward(const ModelWeights& w, backend::Backend& be) : be_(be), cfg_(w.cfg) {
  const ModelConfig& c = cfg_;
  if (int(w.layers.size()) != c.n_layers || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.n_heads % c.n_kv_heads != 0 || c.head_dim <= 0)
    throw Error(fmt::format("dense forward: model '{}' has an inconsistent config", c.name));
  embd_ = be_.prepare_embedding(w.tok_embd);
  out_norm_ = be_.prepare_vector(w.out_norm);
  lm_head_ = be_.prepare_linear({c.tied_embeddings ? &w.tok_embd : &w.lm_head}, {});
  for (const LayerWeights& lw : w.layers) layers_.push_back(prepare_layer(be_, c, lw));
  inv_freq_ = rope_inv_freq(c);
}

DenseForward::~DenseForward() = default;

void DenseForward::run(std::span<const int32_t> tokens, DenseHooks* hooks,
                       std::vector<float>* hidden, int64_t first_pos) {
  const ModelConfig& c = cfg_;
  const int T = static_cast<int>(tokens.size());
  if (T == 0) throw Error("dense forward: no tokens");
  if (first_pos < 0 || first_pos + T > int64_t(INT32_MAX))
    throw Error(fmt::format("dense forward: positions {}..{} out of range", first_pos, first_pos + T));
  for (int32_t t : tokens)
    if (t < 0 || t >= c.vocab_size)
      throw Error(fmt::format("dense forward: token id {} outside the vocabulary [0, {})", t,
                              c.vocab_size));
  const int Hq = c.n_heads, Hkv = c.n_kv_heads, d = c.head_dim, H = c.hidden;
  ActivationBuffers bufs;
  bufs.ensure(be_, c, T);
  const LayerActivations& a = bufs.get();
  std::vector<int32_t> pos(T);
  for (int i = 0; i < T; ++i) pos[i] = int32_t(first_pos + i);
  std::vector<float> cos(size_t(T) * d / 2), sin(size_t(T) * d / 2);
  kernels::cpu::rope_tables(inv_freq_, pos.data(), T, cos.data(), sin.data());

  be_.embed(*embd_, tokens.data(), T, a.x);
  for (int l = 0; l < c.n_layers; ++l) {
    if (hooks && l > 0 && !hooks->want_layer(l)) return;
    const bool go_on = run_layer(be_, c, layers_[l], T, a, cos.data(), sin.data(),
                                 [&](float* q, float* k, float* v, float* o) {
      if (hooks) hooks->on_qkv(l, q, k, v, T);
      if (!hooks || !hooks->attention(l, q, k, v, T, o)) dense_causal_attention(q, k, v, T, Hq, Hkv, d, o);
      if (hooks) hooks->on_attn_out(l, o, T);
      return !(hooks && !hooks->want_layer(l + 1) && l + 1 < c.n_layers);
    });
    if (!go_on) return;
  }
  if (hidden) {
    hidden->resize(size_t(T) * H);
    be_.to_host(a.x, hidden->data(), hidden->size());
  }
}

void DenseForward::logits(const float* hidden, int n, std::vector<float>& out) {
  const int H = cfg_.hidden, V = cfg_.vocab_size;
  backend::BufferPtr x = be_.alloc(size_t(n) * H), y = be_.alloc(size_t(n) * V);
  be_.from_host(hidden, x->data(), size_t(n) * H);
  be_.rms_norm(x->data(), *out_norm_, n, H, cfg_.rms_eps, x->data());
  be_.linear(*lm_head_, x->data(), n, y->data());
  out.resize(size_t(n) * V);
  be_.to_host(y->data(), out.data(), out.size());
}

void DenseForward::project_attention(int layer, const float* o, int n, std::vector<float>& y) {
  if (layer < 0 || layer >= cfg_.n_layers || n < 0)
    throw Error(fmt::format("dense forward: project_attention(layer {}, {} rows) out of range", layer, n));
  const int H = cfg_.hidden;
  const size_t Dq = size_t(cfg_.n_heads) * cfg_.head_dim;
  y.resize(size_t(n) * H);
  if (n == 0) return;
  backend::BufferPtr x = be_.alloc(size_t(n) * Dq), out = be_.alloc(size_t(n) * H);
  be_.from_host(o, x->data(), size_t(n) * Dq);
  be_.linear(*layers_[layer].wo, x->data(), n, out->data());
  be_.to_host(out->data(), y.data(), y.size());
}

void dense_causal_attention(const float* q, const float* k, const float* v, int T, int Hq,
                            int Hkv, int d, float* o) {
  const int group = Hq / Hkv;
  const int64_t ldq = int64_t(Hq) * d, ldk = int64_t(Hkv) * d;
  // Scores in base 2: s = q·k · scale · log2(e), so the softmax is 2^(s - max).
  const float alpha = float(1.4426950408889634 / std::sqrt(double(d)));
  namespace cpu = backend::cpu;  // the CPU backend's GEMM and op threads
  // Keys and values of each KV head packed once for every query block and head.
  std::unique_ptr<cpu::PackedB[]> kp(new cpu::PackedB[size_t(Hkv)]);
  std::unique_ptr<cpu::PackedB[]> vp(new cpu::PackedB[size_t(Hkv)]);
  for (int h = 0; h < Hkv; ++h) {
    kp[size_t(h)].pack(k + int64_t(h) * d, ldk, /*b_nk=*/true, T, d);
    vp[size_t(h)].pack(v + int64_t(h) * d, ldk, /*b_nk=*/false, d, T);
  }
  // Tasks (query block, head), the longest blocks first, pulled by the op
  // threads. Block b's queries see keys [0, t1) only (causal): S is [n][t1].
  constexpr int kBlock = 112;  // query rows per task: 8 GEMM row tiles
  const int nblk = (T + kBlock - 1) / kBlock;
  const int64_t ntask = int64_t(nblk) * Hq;
  std::atomic<int64_t> next{0};
  cpu::parallel_for(cpu::op_threads(), 1, [&](int64_t, int64_t) {
    thread_local std::vector<float> S;
    thread_local std::vector<float> inv;
    for (int64_t task; (task = next.fetch_add(1)) < ntask;) {
      const int b = nblk - 1 - int(task / Hq), g = int(task % Hq), h = g / group;
      const int t0 = b * kBlock, t1 = std::min(T, t0 + kBlock), n = t1 - t0;
      const int64_t lds = (t1 + 15) / 16 * 16 + 16;  // rows not 4 KiB apart
      S.resize(size_t(n) * lds);
      cpu::gemm_packed(n, t1, d, q + int64_t(t0) * ldq + int64_t(g) * d, ldq, kp[size_t(h)],
                       S.data(), lds, alpha);
      // Unnormalized weights 2^(s - max); each output row is divided by its Σ.
      inv.resize(size_t(n));
      for (int i = 0; i < n; ++i)
        inv[size_t(i)] = float(1.0 / cpu::exp2_row(S.data() + i * lds, t0 + i + 1, t1));
      float* ob = o + int64_t(t0) * ldq + int64_t(g) * d;
      cpu::gemm_packed(n, d, t1, S.data(), lds, vp[size_t(h)], ob, ldq);
      for (int i = 0; i < n; ++i)
        for (int c = 0; c < d; ++c) ob[i * ldq + c] *= inv[size_t(i)];
    }
  });
}

}  // namespace oscar::model
