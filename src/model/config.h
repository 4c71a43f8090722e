// Model hyper-parameters, filled by the GGUF and Hugging Face loaders.
//
// Conventions the loaders guarantee (so the forward has exactly one code path):
//  * linear weights are [out_features][in_features] row-major (HF layout);
//  * RoPE is the "rotate half" (NeoX / HF) convention: channel i pairs with
//    i + head_dim/2. GGUF files of arch "llama" store Q/K rows permuted for the
//    interleaved convention; the GGUF loader undoes that permutation.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace oscar::model {

enum class Arch { kLlama, kQwen2, kQwen3 };

struct RopeScaling {
  enum class Type { kNone, kLlama3, kLinear } type = Type::kNone;
  float factor = 1.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_position = 8192;
};

struct ModelConfig {
  Arch arch = Arch::kLlama;
  std::string name;          // e.g. "SmolLM2-135M-Instruct"
  int vocab_size = 0;
  int hidden = 0;            // d_model
  int intermediate = 0;      // MLP width
  int n_layers = 0;
  int n_heads = 0;           // query heads
  int n_kv_heads = 0;        // GQA: n_heads % n_kv_heads == 0
  int head_dim = 0;          // usually hidden / n_heads; Qwen3 may differ
  float rms_eps = 1e-5f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;
  // GGUF files of Llama 3.1+ carry their rope scaling as per-frequency divisors
  // (tensor rope_freqs.weight, [head_dim/2]): inv_freq[i] /= rope_freq_factors[i].
  // Empty = none. Applied instead of (never on top of) rope_scaling.
  std::vector<float> rope_freq_factors;
  int max_position = 2048;
  bool tied_embeddings = false;  // lm_head = tok_embd
  bool qkv_bias = false;         // Qwen2
  bool qk_norm = false;          // Qwen3: RMSNorm over head_dim on q and k before RoPE
  int bos_token = -1;
  std::vector<int> eos_tokens;
};

}  // namespace oscar::model
