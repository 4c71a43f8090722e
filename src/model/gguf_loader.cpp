// GGUF -> ModelWeights. Names follow llama.cpp (token_embd, blk.N.attn_q, ...);
// shapes are ggml's ne[] reversed, i.e. already [out][in] row-major.
#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "model/gguf.h"
#include "model/loader.h"

namespace oscar::model {

namespace {

Tensor read(const gguf::File& f, const std::string& name, bool optional = false) {
  Tensor t;
  const gguf::TensorInfo* info = f.find(name);
  if (info == nullptr) {
    if (optional) return t;
    throw Error(fmt::format("{}: missing tensor '{}'", f.path(), name));
  }
  t.shape = info->shape;
  t.data = f.read_f32(*info);
  return t;
}

// llama.cpp's converter reorders each head's rows of Q and K from HF's
// [2][d/2] (rotate-half pairs i, i+d/2) to [d/2][2] (interleaved pairs 2i, 2i+1).
// Undo it: HF row (h, j*d/2 + i) = GGUF row (h, 2i + j).
void unpermute_rows(Tensor& t, int heads, const std::string& what, const std::string& path) {
  if (t.empty()) return;
  const int64_t rows = t.shape[0];
  const int64_t cols = t.shape.size() > 1 ? t.shape[1] : 1;
  if (heads <= 0 || rows % (2 * heads) != 0)
    throw Error(fmt::format("{}: tensor '{}' has {} rows, not divisible into {} heads of pairs", path, what,
                            rows, heads));
  const int64_t d = rows / heads, half = d / 2;
  std::vector<float> out(t.data.size());
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t j = 0; j < 2; ++j)
      for (int64_t i = 0; i < half; ++i) {
        const float* src = t.data.data() + (h * d + 2 * i + j) * cols;
        std::copy(src, src + cols, out.data() + (h * d + j * half + i) * cols);
      }
  t.data = std::move(out);
}

}  // namespace

ModelWeights load_gguf(const std::string& path) {
  const gguf::File f = gguf::File::open(path);
  const std::string arch = f.get_string("general.architecture");
  ModelWeights w;
  ModelConfig& c = w.cfg;
  if (arch == "llama") c.arch = Arch::kLlama;
  else if (arch == "qwen2") c.arch = Arch::kQwen2;
  else if (arch == "qwen3") c.arch = Arch::kQwen3;
  else
    throw Error(fmt::format("{}: unsupported architecture '{}' (llama, qwen2, qwen3 are)", path, arch));
  const std::string p = arch + ".";
  c.name = f.get_string("general.name", "");
  c.n_layers = static_cast<int>(f.get_int(p + "block_count"));
  c.hidden = static_cast<int>(f.get_int(p + "embedding_length"));
  c.intermediate = static_cast<int>(f.get_int(p + "feed_forward_length"));
  c.n_heads = static_cast<int>(f.get_int(p + "attention.head_count"));
  c.n_kv_heads = static_cast<int>(f.get_int(p + "attention.head_count_kv", c.n_heads));
  c.head_dim = static_cast<int>(f.get_int(p + "attention.key_length", c.n_heads > 0 ? c.hidden / c.n_heads : 0));
  if (f.get_int(p + "attention.value_length", c.head_dim) != c.head_dim)
    throw Error(fmt::format("{}: key_length {} != value_length {} is not supported", path, c.head_dim,
                            f.get_int(p + "attention.value_length")));
  c.rms_eps = static_cast<float>(f.get_float(p + "attention.layer_norm_rms_epsilon", 1e-5));
  c.rope_theta = static_cast<float>(f.get_float(p + "rope.freq_base", 10000.0));
  c.max_position = static_cast<int>(f.get_int(p + "context_length", 2048));
  const std::string scaling = f.get_string(p + "rope.scaling.type", "none");
  if (scaling == "linear") {
    c.rope_scaling.type = RopeScaling::Type::kLinear;
    c.rope_scaling.factor = static_cast<float>(f.get_float(p + "rope.scaling.factor", 1.0));
  } else if (scaling != "none") {
    throw Error(fmt::format("{}: rope scaling '{}' is not supported", path, scaling));
  }
  if (f.get_int(p + "rope.dimension_count", c.head_dim) != c.head_dim)
    throw Error(fmt::format("{}: partial rotary embeddings ({} of {} dims) are not supported", path,
                            f.get_int(p + "rope.dimension_count"), c.head_dim));
  c.bos_token = static_cast<int>(f.get_int("tokenizer.ggml.bos_token_id", -1));
  for (const char* k : {"tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    const int id = static_cast<int>(f.get_int(k, -1));
    if (id >= 0 && std::find(c.eos_tokens.begin(), c.eos_tokens.end(), id) == c.eos_tokens.end())
      c.eos_tokens.push_back(id);
  }

  if (c.n_layers <= 0 || c.n_layers > 4096) throw Error(fmt::format("{}: invalid block_count {}", path, c.n_layers));
  if (const gguf::TensorInfo* te = f.find("token_embd.weight"); te != nullptr && !te->shape.empty() &&
                                                                te->shape[0] <= INT32_MAX) {
    ModelConfig probe = c;
    probe.vocab_size = static_cast<int>(te->shape[0]);
    probe.tied_embeddings = f.find("output.weight") == nullptr;
    check_host_memory(probe, path);
  }
  w.tok_embd = read(f, "token_embd.weight");
  c.vocab_size = static_cast<int>(w.tok_embd.shape.empty() ? 0 : w.tok_embd.shape[0]);
  if (const gguf::Value* v = f.find_kv(p + "vocab_size"); v != nullptr && v->is_integer() &&
                                                          v->i != c.vocab_size)
    throw Error(fmt::format("{}: {}vocab_size {} but token_embd.weight has {} rows", path, p, v->i,
                            c.vocab_size));
  w.out_norm = read(f, "output_norm.weight");
  w.lm_head = read(f, "output.weight", /*optional=*/true);
  c.tied_embeddings = w.lm_head.empty();
  if (const gguf::TensorInfo* rf = f.find("rope_freqs.weight")) c.rope_freq_factors = f.read_f32(*rf);

  c.qkv_bias = f.find("blk.0.attn_q.bias") != nullptr;
  c.qk_norm = f.find("blk.0.attn_q_norm.weight") != nullptr;
  if (c.arch == Arch::kQwen3 && !c.qk_norm)
    throw Error(fmt::format("{}: qwen3 model without blk.0.attn_q_norm.weight", path));
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::string b = fmt::format("blk.{}.", l);
    L.attn_norm = read(f, b + "attn_norm.weight");
    L.wq = read(f, b + "attn_q.weight");
    L.wk = read(f, b + "attn_k.weight");
    L.wv = read(f, b + "attn_v.weight");
    L.wo = read(f, b + "attn_output.weight");
    L.ffn_norm = read(f, b + "ffn_norm.weight");
    L.w_gate = read(f, b + "ffn_gate.weight");
    L.w_up = read(f, b + "ffn_up.weight");
    L.w_down = read(f, b + "ffn_down.weight");
    if (c.qkv_bias) {
      L.bq = read(f, b + "attn_q.bias");
      L.bk = read(f, b + "attn_k.bias");
      L.bv = read(f, b + "attn_v.bias");
    }
    if (c.qk_norm) {
      L.q_norm = read(f, b + "attn_q_norm.weight");
      L.k_norm = read(f, b + "attn_k_norm.weight");
    }
    if (c.arch == Arch::kLlama) {
      unpermute_rows(L.wq, c.n_heads, b + "attn_q.weight", path);
      unpermute_rows(L.wk, c.n_kv_heads, b + "attn_k.weight", path);
      unpermute_rows(L.bq, c.n_heads, b + "attn_q.bias", path);
      unpermute_rows(L.bk, c.n_kv_heads, b + "attn_k.bias", path);
    }
  }
  check_weights(w, path);
  w.fingerprint = weights_fingerprint(w);
  return w;
}

}  // namespace oscar::model
