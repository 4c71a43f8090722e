// Random-weight models for tests and benchmarks (no checkpoint needed).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/weights.h"

namespace oscar::backend {
class Backend;
}

namespace oscar::model {

// A small config of the given architecture: head_dim 64 (the smallest the
// attention kernels take), GQA 2:1, hidden != heads * head_dim on purpose.
ModelConfig tiny_config(Arch arch, bool tied = false);

// Weights drawn from a fixed-seed normal distribution, scaled like an
// initialization (matrices N(0, 1/in), norms 1 + N(0, 0.1^2)) so activations stay O(1).
ModelWeights random_weights(const ModelConfig& cfg, uint64_t seed);

// The shapes of real models, for speed benchmarks without their checkpoints:
// qwen3-8b (36 layers, 32 / 8 heads, d 128, hidden 4096, FFN 12288, QK-norm),
// llama3-8b (32 layers, 32 / 8, d 128, hidden 4096, FFN 14336) and
// qwen25-1.5b (Qwen2.5(-Coder)-1.5B: 28 layers, 12 / 2, d 128, hidden 1536, FFN 8960,
// QKV bias). Throws oscar::Error for another name.
ModelConfig preset_config(const std::string& name);
std::vector<std::string> preset_names();

// t = shape, Uniform(-a, a) values of variance `var`: blocks of 1M values, each from its own
// xorshift stream seeded by `seed` and the block (the same values on any machine), filled on
// all cores.
void fill_uniform(Tensor& t, std::vector<int64_t> shape, double var, uint64_t seed);

class Model;
// A model of cfg's shapes on `be` with uniform random weights (matrices of variance 1/in,
// embeddings of variance 1, norms 1, biases of variance 1), made on the host one layer at a
// time with all cores, so the host never holds more than one layer (an 8B model's weights are
// 16 GB in BF16). Speed only: the weights mean nothing. progress(l, n) after each layer.
std::unique_ptr<Model> random_model(const ModelConfig& cfg, backend::Backend& be,
                                    const std::function<void(int, int)>& progress = {});

}  // namespace oscar::model
