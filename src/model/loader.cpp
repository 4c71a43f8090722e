#include "model/loader.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/error.h"
#include "core/host_memory.h"

namespace oscar::model {

namespace fs = std::filesystem;

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::kLlama: return "llama";
    case Arch::kQwen2: return "qwen2";
    case Arch::kQwen3: return "qwen3";
  }
  return "unknown";
}

ModelWeights load_model(const std::string& path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) return load_hf(path);
  if (!fs::exists(path, ec)) throw Error(fmt::format("{}: no such file or directory", path));
  if (fs::path(path).filename() == "config.json") return load_hf(fs::path(path).parent_path().string());
  return load_gguf(path);
}

namespace {

std::string shape_str(const std::vector<int64_t>& s) { return fmt::format("[{}]", fmt::join(s, ", ")); }

void expect(const Tensor& t, std::vector<int64_t> shape, const std::string& source, const std::string& name,
            bool optional = false) {
  if (t.empty()) {
    if (optional) return;
    throw Error(fmt::format("{}: missing tensor '{}'", source, name));
  }
  if (t.shape != shape)
    throw Error(fmt::format("{}: tensor '{}' has shape {}, expected {}", source, name, shape_str(t.shape),
                            shape_str(shape)));
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  if (t.numel() != n)
    throw Error(fmt::format("{}: tensor '{}' holds {} values for shape {}", source, name, t.numel(),
                            shape_str(shape)));
}

struct Fnv {
  uint64_t a = 0xcbf29ce484222325ull, b = 0x84222325cbf29ce4ull;
  void bytes(const void* p, size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      a = (a ^ c[i]) * 0x100000001b3ull;
      b = (b ^ c[i]) * 0x100000001b3ull;
      b ^= b >> 29;
    }
  }
  void str(const std::string& s) { bytes(s.data(), s.size() + 1); }
  void i64(int64_t v) { bytes(&v, sizeof v); }
};

}  // namespace

uint64_t fp32_weight_bytes(const ModelConfig& c) {
  // Every factor is checked positive and bounded by the caller's config checks
  // (int), so the products fit in double without overflow; saturate anyway.
  const double H = c.hidden, I = c.intermediate, V = c.vocab_size, d = c.head_dim;
  const double q = c.n_heads * d, kv = c.n_kv_heads * d;
  double per_layer = H * (q + 2 * kv) + q * H + 3 * H * I + 2 * H;
  if (c.qkv_bias) per_layer += q + 2 * kv;
  if (c.qk_norm) per_layer += 2 * d;
  const double n = V * H * (c.tied_embeddings ? 1 : 2) + H + c.n_layers * per_layer;
  const double bytes = 4 * n;
  return bytes >= 1.8e19 ? UINT64_MAX : static_cast<uint64_t>(bytes);
}

void check_host_memory(const ModelConfig& c, const std::string& source) {
  if (c.hidden <= 0 || c.intermediate <= 0 || c.vocab_size <= 0 || c.n_layers <= 0 || c.n_heads <= 0 ||
      c.n_kv_heads <= 0 || c.head_dim <= 0)
    return;  // check_weights refuses these with their own message
  const uint64_t need = fp32_weight_bytes(c), have = host_memory_available();
  if (need > have)
    throw Error(fmt::format("{}: the model needs {} of host memory for its fp32 weights; {} is available "
                            "(MemAvailable, cgroup limit or OSCAR_HOST_MEMORY_LIMIT)",
                            source, format_bytes(need), format_bytes(have)));
}

void check_weights(const ModelWeights& w, const std::string& source) {
  const ModelConfig& c = w.cfg;
  if (c.vocab_size <= 0 || c.hidden <= 0 || c.intermediate <= 0 || c.n_layers <= 0 || c.n_heads <= 0 ||
      c.n_kv_heads <= 0 || c.head_dim <= 0)
    throw Error(fmt::format("{}: invalid model sizes (vocab {}, hidden {}, ffn {}, layers {}, heads {}/{}, "
                            "head_dim {})", source, c.vocab_size, c.hidden, c.intermediate, c.n_layers,
                            c.n_heads, c.n_kv_heads, c.head_dim));
  if (c.n_heads % c.n_kv_heads != 0)
    throw Error(fmt::format("{}: {} query heads are not a multiple of {} KV heads", source, c.n_heads,
                            c.n_kv_heads));
  if (c.head_dim % 2 != 0) throw Error(fmt::format("{}: odd head_dim {}", source, c.head_dim));
  if (!c.rope_freq_factors.empty() && static_cast<int>(c.rope_freq_factors.size()) != c.head_dim / 2)
    throw Error(fmt::format("{}: {} rope frequency factors for head_dim {}", source, c.rope_freq_factors.size(),
                            c.head_dim));
  if (static_cast<int>(w.layers.size()) != c.n_layers)
    throw Error(fmt::format("{}: {} layers loaded, config says {}", source, w.layers.size(), c.n_layers));
  const int64_t H = c.hidden, I = c.intermediate, V = c.vocab_size;
  const int64_t q = int64_t{c.n_heads} * c.head_dim, kv = int64_t{c.n_kv_heads} * c.head_dim;
  expect(w.tok_embd, {V, H}, source, "token embedding");
  expect(w.out_norm, {H}, source, "output norm");
  if (c.tied_embeddings) {
    if (!w.lm_head.empty()) throw Error(fmt::format("{}: tied embeddings but an LM head was loaded", source));
  } else {
    expect(w.lm_head, {V, H}, source, "LM head");
  }
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    auto n = [&](const char* what) { return fmt::format("layer {} {}", l, what); };
    expect(L.attn_norm, {H}, source, n("attn_norm"));
    expect(L.wq, {q, H}, source, n("wq"));
    expect(L.wk, {kv, H}, source, n("wk"));
    expect(L.wv, {kv, H}, source, n("wv"));
    expect(L.wo, {H, q}, source, n("wo"));
    expect(L.ffn_norm, {H}, source, n("ffn_norm"));
    expect(L.w_gate, {I, H}, source, n("w_gate"));
    expect(L.w_up, {I, H}, source, n("w_up"));
    expect(L.w_down, {H, I}, source, n("w_down"));
    if (c.qkv_bias) {
      expect(L.bq, {q}, source, n("bq"));
      expect(L.bk, {kv}, source, n("bk"));
      expect(L.bv, {kv}, source, n("bv"));
    }
    if (c.qk_norm) {
      expect(L.q_norm, {c.head_dim}, source, n("q_norm"));
      expect(L.k_norm, {c.head_dim}, source, n("k_norm"));
    }
  }
  // NaN or Inf in a weight poisons every logit silently: refuse the file instead.
  auto finite = [&](const Tensor& t, const std::string& what) {
    bool bad = false;
    for (float x : t.data) bad |= !(std::fabs(x) <= std::numeric_limits<float>::max());
    if (!bad) return;
    const auto it = std::find_if(t.data.begin(), t.data.end(), [](float x) { return !std::isfinite(x); });
    throw Error(fmt::format("{}: {} holds a non-finite value ({} at index {})", source, what, *it,
                            it - t.data.begin()));
  };
  finite(w.tok_embd, "token embedding");
  finite(w.out_norm, "output norm");
  finite(w.lm_head, "LM head");
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::pair<const Tensor*, const char*> all[] = {
        {&L.attn_norm, "attn_norm"}, {&L.wq, "wq"}, {&L.wk, "wk"}, {&L.wv, "wv"}, {&L.bq, "bq"},
        {&L.bk, "bk"}, {&L.bv, "bv"}, {&L.q_norm, "q_norm"}, {&L.k_norm, "k_norm"}, {&L.wo, "wo"},
        {&L.ffn_norm, "ffn_norm"}, {&L.w_gate, "w_gate"}, {&L.w_up, "w_up"}, {&L.w_down, "w_down"}};
    for (const auto& [t, what] : all) finite(*t, fmt::format("layer {} {}", l, what));
  }
}

std::string weights_fingerprint(const ModelWeights& w) {
  const ModelConfig& c = w.cfg;
  Fnv h;
  h.str(arch_name(c.arch));
  for (int64_t v : {int64_t{c.vocab_size}, int64_t{c.hidden}, int64_t{c.intermediate}, int64_t{c.n_layers},
                    int64_t{c.n_heads}, int64_t{c.n_kv_heads}, int64_t{c.head_dim}})
    h.i64(v);
  h.bytes(&c.rope_theta, sizeof c.rope_theta);
  h.i64(c.tied_embeddings);
  auto tensor = [&](const std::string& name, const Tensor& t) {
    h.str(name);
    for (int64_t d : t.shape) h.i64(d);
    const int64_t n = t.numel();
    if (n == 0) return;
    const int64_t samples = std::min<int64_t>(n, 4096);
    for (int64_t i = 0; i < samples; ++i) {
      const int64_t idx = i * n / samples;
      h.bytes(&t.data[static_cast<size_t>(idx)], sizeof(float));
    }
  };
  tensor("tok_embd", w.tok_embd);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = fmt::format("layers.{}.", l);
    for (auto [name, t] : {std::pair{"attn_norm", &L.attn_norm}, {"wq", &L.wq}, {"wk", &L.wk}, {"wv", &L.wv},
                           {"bq", &L.bq}, {"bk", &L.bk}, {"bv", &L.bv}, {"q_norm", &L.q_norm},
                           {"k_norm", &L.k_norm}, {"wo", &L.wo}, {"ffn_norm", &L.ffn_norm},
                           {"w_gate", &L.w_gate}, {"w_up", &L.w_up}, {"w_down", &L.w_down}})
      tensor(p + name, *t);
  }
  tensor("out_norm", w.out_norm);
  tensor("lm_head", w.lm_head);
  return fmt::format("{:016x}{:016x}", h.a, h.b);
}

}  // namespace oscar::model
