// Rotary position embedding: the inverse frequencies of a model's config. The
// rotation itself (rotate-half convention, channel i pairs with i + d/2, which the
// loaders guarantee, model/config.h) and its cos/sin tables are kernels/cpu/rope.h.
#pragma once

#include <vector>

#include "model/config.h"

namespace oscar::model {

// Inverse frequencies f_i = theta^(-2i/d), i < d/2, with the config's scaling
// (llama3: wavelength-dependent division by `factor`, smoothed between
// low/high_freq_factor; linear: all divided by `factor`), as Hugging Face computes them.
std::vector<float> rope_inv_freq(const ModelConfig& cfg);

}  // namespace oscar::model
