// Random-weight models for tests and benchmarks (no checkpoint needed).
#pragma once

#include <cstdint>

#include "model/weights.h"

namespace oscar::model {

// A small config of the given architecture: head_dim 64 (the smallest the
// attention kernels take), GQA 2:1, hidden != heads * head_dim on purpose.
ModelConfig tiny_config(Arch arch, bool tied = false);

// Weights drawn from a fixed-seed normal distribution, scaled like an
// initialization (matrices N(0, 1/in), norms 1 + N(0, 0.1^2)) so activations stay O(1).
ModelWeights random_weights(const ModelConfig& cfg, uint64_t seed);

}  // namespace oscar::model
