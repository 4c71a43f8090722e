#include "model/forward.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "core/error.h"
#include "kernels/cpu/rope.h"
#include "model/rope.h"

namespace oscar::model {

namespace {

void expect_shape(const Tensor& t, std::vector<int64_t> want, const std::string& name) {
  if (t.shape != want || t.numel() != [&] {
        int64_t n = 1;
        for (auto d : want) n *= d;
        return n;
      }()) {
    auto str = [](const std::vector<int64_t>& s) {
      std::string r = "[";
      for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
      return r + "]";
    };
    throw Error(fmt::format("model weights: {} has shape {} ({} values), expected {}", name,
                            str(t.shape), t.numel(), str(want)));
  }
}

}  // namespace

Model::Model(const ModelWeights& w, backend::Backend& backend)
    : Model(w.cfg, backend, w.tok_embd, w.out_norm, w.lm_head,
            [&w](int l) -> const LayerWeights& { return w.layers.at(size_t(l)); },
            int(w.layers.size())) {}

Model::Model(const ModelConfig& cfg, backend::Backend& backend, const Tensor& tok_embd,
             const Tensor& out_norm, const Tensor& lm_head, const LayerSource& layer, int n_layers)
    : be_(backend), cfg_(cfg) {
  const ModelConfig& c = cfg_;
  if (c.hidden <= 0 || c.n_layers <= 0 || c.n_heads <= 0 || c.n_kv_heads <= 0 ||
      c.head_dim <= 0 || c.vocab_size <= 0 || c.intermediate <= 0)
    throw Error(fmt::format("model config '{}': non-positive size", c.name));
  if (c.n_heads % c.n_kv_heads != 0)
    throw Error(fmt::format("model config '{}': {} query heads not a multiple of {} KV heads",
                            c.name, c.n_heads, c.n_kv_heads));
  if (c.head_dim % 2 != 0)
    throw Error(fmt::format("model config '{}': odd head_dim {}", c.name, c.head_dim));
  if (n_layers != c.n_layers)
    throw Error(fmt::format("model weights: {} layers, config says {}", n_layers, c.n_layers));
  const int64_t H = c.hidden, Dq = int64_t(c.n_heads) * c.head_dim,
                Dkv = int64_t(c.n_kv_heads) * c.head_dim, I = c.intermediate, V = c.vocab_size;

  expect_shape(tok_embd, {V, H}, "tok_embd");
  expect_shape(out_norm, {H}, "out_norm");
  embd_ = be_.prepare_embedding(tok_embd);
  out_norm_ = be_.prepare_vector(out_norm);
  if (c.tied_embeddings) {
    lm_head_ = be_.prepare_linear({&tok_embd}, {});
  } else {
    expect_shape(lm_head, {V, H}, "lm_head");
    lm_head_ = be_.prepare_linear({&lm_head}, {});
  }
  step_bytes_ = lm_head_->bytes + out_norm_->bytes;

  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& lw = layer(l);
    auto nm = [l](const char* s) { return fmt::format("layers.{}.{}", l, s); };
    expect_shape(lw.attn_norm, {H}, nm("attn_norm"));
    expect_shape(lw.wq, {Dq, H}, nm("wq"));
    expect_shape(lw.wk, {Dkv, H}, nm("wk"));
    expect_shape(lw.wv, {Dkv, H}, nm("wv"));
    expect_shape(lw.wo, {H, Dq}, nm("wo"));
    expect_shape(lw.ffn_norm, {H}, nm("ffn_norm"));
    expect_shape(lw.w_gate, {I, H}, nm("w_gate"));
    expect_shape(lw.w_up, {I, H}, nm("w_up"));
    expect_shape(lw.w_down, {H, I}, nm("w_down"));
    if (c.qkv_bias) {
      expect_shape(lw.bq, {Dq}, nm("bq"));
      expect_shape(lw.bk, {Dkv}, nm("bk"));
      expect_shape(lw.bv, {Dkv}, nm("bv"));
    }
    if (c.qk_norm) {
      expect_shape(lw.q_norm, {c.head_dim}, nm("q_norm"));
      expect_shape(lw.k_norm, {c.head_dim}, nm("k_norm"));
    }
    layers_.push_back(prepare_layer(be_, c, lw));
    step_bytes_ += layers_.back().bytes();
  }
  inv_freq_ = rope_inv_freq(c);
}

// Recorded step graphs read this model's weights and activations.
Model::~Model() { be_.clear_graphs(); }

kv::KvCacheShape Model::cache_shape(int page_size) const {
  return {cfg_.n_layers, cfg_.n_kv_heads, cfg_.head_dim, page_size};
}

void Model::ensure_workspace(int T, int R) {
  if (T > acts_.tokens() || R > ws_rows_) be_.clear_graphs();  // the buffers move
  acts_.ensure(be_, cfg_, T);
  if (R <= ws_rows_) return;
  ws_rows_ = R;
  sel_ = be_.alloc(size_t(R) * cfg_.hidden);
  logits_ = be_.alloc(size_t(R) * cfg_.vocab_size);
}

void Model::forward(std::span<const SeqStep> steps, kv::KvCache& cache, std::vector<float>& logits) {
  const int R = out_rows_ = run(steps, cache);
  if (R == 0 || !logits_to_host_) {
    logits.clear();
    return;
  }
  logits.resize(size_t(R) * cfg_.vocab_size);
  be_.to_host(logits_->data(), logits.data(), logits.size());
}

void Model::forward_argmax(std::span<const SeqStep> steps, kv::KvCache& cache, std::vector<int32_t>& tokens) {
  const int R = out_rows_ = run(steps, cache);
  tokens.resize(size_t(R));
  if (R > 0) be_.argmax_rows(logits_->data(), R, cfg_.vocab_size, tokens.data());
}

void Model::forward_sample(std::span<const SeqStep> steps, kv::KvCache& cache,
                           std::span<const backend::RowDraw> draws, std::span<const int32_t> hist,
                           std::vector<int32_t>& tokens) {
  int R = 0;
  for (const SeqStep& s : steps) R += s.all_logits ? static_cast<int>(s.tokens.size()) : 1;
  if (static_cast<int>(draws.size()) != R)
    throw Error(fmt::format("forward_sample: {} draws for {} output rows", draws.size(), R));
  const int slots = be_.penalty_slots();
  slot_seen_.clear();
  for (const backend::RowDraw& d : draws) {
    if (d.hist_off < 0 || d.hist_len < 0 || int64_t(d.hist_off) + d.hist_len > int64_t(hist.size()))
      throw Error(fmt::format("forward_sample: penalty ids [{}, +{}) outside the {} given", d.hist_off, d.hist_len,
                              hist.size()));
    if (d.cnt_off < 0 || d.cnt_len < 0 || int64_t(d.cnt_off) + 2 * int64_t(d.cnt_len) > int64_t(hist.size()))
      throw Error(fmt::format("forward_sample: generated-id counts [{}, +2·{}) outside the {} given", d.cnt_off,
                              d.cnt_len, hist.size()));
    if (d.pen_slot == -1) continue;
    if (d.pen_slot < 0 || d.pen_slot >= slots)
      throw Error(fmt::format("forward_sample: penalty slot {} (the backend keeps {})", d.pen_slot, slots));
    slot_seen_.push_back(d.pen_slot);
  }
  std::sort(slot_seen_.begin(), slot_seen_.end());
  if (std::adjacent_find(slot_seen_.begin(), slot_seen_.end()) != slot_seen_.end())
    throw Error(fmt::format("forward_sample: penalty slot {} named by two rows",
                            *std::adjacent_find(slot_seen_.begin(), slot_seen_.end())));
  R = run(steps, cache);
  out_rows_ = R;
  tokens.resize(size_t(R));
  if (R > 0)
    be_.sample_rows(logits_->data(), R, cfg_.vocab_size, draws.data(), hist.data(), int64_t(hist.size()),
                    tokens.data());
}

int Model::penalty_slots() const { return be_.penalty_slots(); }

void Model::output_logits(int r, std::span<float> out) const {
  if (r < 0 || r >= out_rows_ || static_cast<int>(out.size()) != cfg_.vocab_size)
    throw Error(fmt::format("output_logits: row {} of {} with {} columns (vocab {})", r, out_rows_, out.size(),
                            cfg_.vocab_size));
  be_.to_host(logits_->data() + size_t(r) * size_t(cfg_.vocab_size), out.data(), out.size());
}

int Model::run(std::span<const SeqStep> steps, kv::KvCache& cache) {
  out_rows_ = 0;  // (a step that throws leaves no rows to read)
  const ModelConfig& c = cfg_;
  const int S = static_cast<int>(steps.size());
  const int Hq = c.n_heads, Hkv = c.n_kv_heads, d = c.head_dim;
  const int H = c.hidden;
  const int Dq = Hq * d, Dkv = Hkv * d;
  if (cache.shape().n_layers != c.n_layers || cache.shape().num_kv_heads != Hkv ||
      cache.shape().head_dim != d)
    throw Error(fmt::format("forward: {} kv cache shaped for {} layers x {} heads x {}, model "
                            "needs {} x {} x {}",
                            cache.method(), cache.shape().n_layers, cache.shape().num_kv_heads,
                            cache.shape().head_dim, c.n_layers, Hkv, d));

  std::vector<int> len(S), pos0(S);
  std::unordered_set<kv::SeqId> seen;
  int R = 0;
  for (int s = 0; s < S; ++s) {
    len[s] = static_cast<int>(steps[s].tokens.size());
    if (len[s] == 0)
      throw Error(fmt::format("forward: step {} (sequence {}) has no tokens", s, steps[s].seq));
    if (!seen.insert(steps[s].seq).second)
      throw Error(fmt::format("forward: sequence {} appears twice in one step", steps[s].seq));
    pos0[s] = cache.length(steps[s].seq);
    R += steps[s].all_logits ? len[s] : 1;
  }
  // Token layout: step s owns rows [off[s], off[s] + len[s]) of every
  // activation. Single-token (decode) steps come first, in step order, then the
  // prefill chunks: the decode rows are rows [0, Bd), which the decode kernel
  // reads and writes in place.
  std::vector<int> order, off(S);
  for (int s = 0; s < S; ++s)
    if (len[s] == 1) order.push_back(s);
  for (int s = 0; s < S; ++s)
    if (len[s] > 1) order.push_back(s);
  int T = 0;
  for (int s : order) off[s] = T, T += len[s];
  if (T == 0) return 0;
  for (int s = 0; s < S; ++s) cache.reserve(steps[s].seq, len[s]);
  ensure_workspace(T, R);

  std::vector<int32_t> tokens(T), pos(T);
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < len[s]; ++i) {
      tokens[off[s] + i] = steps[s].tokens[i];
      pos[off[s] + i] = pos0[s] + i;
    }
  std::vector<float> cos(size_t(T) * d / 2), sin(size_t(T) * d / 2);
  kernels::cpu::rope_tables(inv_freq_, pos.data(), T, cos.data(), sin.data());

  // Single tokens go through the decode kernel together (one view, the new
  // row already stored); longer chunks through the prefill kernel one by one.
  std::vector<kv::SeqId> dec_seqs, pre_seqs;
  std::vector<int> dec_lens, pre_lens, pre_step;
  for (int s : order) {
    if (len[s] == 1) {
      dec_seqs.push_back(steps[s].seq);
      dec_lens.push_back(pos0[s] + 1);
    } else {
      pre_seqs.push_back(steps[s].seq);
      pre_lens.push_back(pos0[s]);
      pre_step.push_back(s);
    }
  }
  kv::KvBatch dec_batch, pre_batch;
  cache.make_batch(dec_seqs, dec_lens, dec_batch);
  cache.make_batch(pre_seqs, pre_lens, pre_batch);
  const float sm_scale = 1.0f / std::sqrt(float(d));
  const int Bd = static_cast<int>(dec_seqs.size());
  // Where every new row goes, the same in every layer (one placement a step),
  // in layout order.
  rows_.clear();
  for (int s : order) cache.place(steps[s].seq, pos0[s], len[s], rows_);
  be_.begin_step(dec_batch, pre_batch);

  // Only the rows whose logits are wanted go through the final norm and LM head.
  // When that is every row in step order (decode steps, or all_logits), x
  // already holds them.
  bool all_rows = R == T;
  for (int i = 0; i < S && all_rows; ++i) all_rows = order[i] == i;

  const LayerActivations& a = acts_.get();
  float* x = a.x;
  // A step of single tokens runs its layers from recorded graphs (where the
  // backend has them): everything between two attentions is one graph (the
  // cache write of the new rows included, their placement staged first), keyed
  // by the cache's store (its transforms), the row count and the position in
  // the step; the attention, whose tables change every step, runs eagerly
  // between them (docs/gpu-engine.md, "Step graphs").
  const bool graphs = graphs_ && be_.graphs_supported() && Bd == T && all_rows && T <= kMaxGraphRows;
  if (graphs) {
    const uint64_t sid = cache.store().id();
    auto key = [&](int seg) { return (sid << 40) ^ (uint64_t(T) << 16) ^ uint64_t(seg); };
    be_.stage_rope(cos.data(), sin.data(), T, d);
    cache.store().stage_rows(rows_);  // the writes in the graphs are device work only
    be_.embed(*embd_, tokens.data(), T, x);
    auto inputs = [&](int l) {
      layer_attention_inputs_into_cache(be_, c, layers_[l], T, a, cos.data(), sin.data(), cache.store(), l, rows_);
    };
    graph_runs_ += be_.run_graph(key(0), [&] { inputs(0); });
    for (int l = 0; l < c.n_layers; ++l) {
      be_.decode_attention(dec_batch.layer(l), a.q, Hq, sm_scale, a.attn);
      graph_runs_ += be_.run_graph(key(l + 1), [&] {
        layer_attention_output_and_ffn(be_, c, layers_[l], T, a);
        if (l + 1 < c.n_layers) {
          inputs(l + 1);
        } else {
          be_.rms_norm(x, *out_norm_, T, H, c.rms_eps, x);
          be_.linear(*lm_head_, x, T, logits_->data());
        }
      });
    }
    for (int s = 0; s < S; ++s) cache.commit(steps[s].seq, len[s]);
    return R;
  }

  be_.embed(*embd_, tokens.data(), T, x);
  for (int l = 0; l < c.n_layers; ++l) {
    layer_attention_inputs_into_cache(be_, c, layers_[l], T, a, cos.data(), sin.data(), cache.store(), l, rows_);
    if (Bd > 0) be_.decode_attention(dec_batch.layer(l), a.q, Hq, sm_scale, a.attn);
    if (!pre_seqs.empty()) {
      const kv::PagedKvView pv = pre_batch.layer(l);
      for (size_t b = 0; b < pre_seqs.size(); ++b) {
        const int s = pre_step[b];
        be_.prefill_attention(pv, static_cast<int>(b), pos0[s], a.q + int64_t(off[s]) * Dq,
                              a.k + int64_t(off[s]) * Dkv, a.v + int64_t(off[s]) * Dkv, len[s], Hq, sm_scale,
                              a.attn + int64_t(off[s]) * Dq);
      }
    }
    layer_attention_output_and_ffn(be_, c, layers_[l], T, a);
  }
  for (int s = 0; s < S; ++s) cache.commit(steps[s].seq, len[s]);

  int r = 0;
  for (int s = 0; s < S && !all_rows; ++s) {
    const int n = len[s];
    if (steps[s].all_logits) {
      be_.copy_cols(x + int64_t(off[s]) * H, n, H, 0, H, sel_->data() + int64_t(r) * H);
      r += n;
    } else {
      be_.copy_cols(x + int64_t(off[s] + n - 1) * H, 1, H, 0, H, sel_->data() + int64_t(r) * H);
      r += 1;
    }
  }
  float* sel = all_rows ? x : sel_->data();
  be_.rms_norm(sel, *out_norm_, R, H, c.rms_eps, sel);
  be_.linear(*lm_head_, sel, R, logits_->data());
  return R;
}

}  // namespace oscar::model
