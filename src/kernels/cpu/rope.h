// Rotary position embedding, rotate-half (NeoX / Hugging Face) convention:
// channel i pairs with i + d/2.
//   out[i]       = x[i] cos(p f_i) - x[i+d/2] sin(p f_i)
//   out[i + d/2] = x[i+d/2] cos(p f_i) + x[i] sin(p f_i),   i < d/2
// The inverse frequencies f_i come from the model's config (model/rope.h).
#pragma once

#include <cstdint>
#include <vector>

namespace oscar::kernels::cpu {

// cos/sin tables for n tokens at positions pos: cos, sin [n][d/2] with d = 2*inv_freq.size().
void rope_tables(const std::vector<float>& inv_freq, const int32_t* pos, int n, float* cos,
                 float* sin);

// Applies the rotation in place: x [n][heads][d], cos/sin [n][d/2].
void rope_apply(float* x, int n, int heads, int d, const float* cos, const float* sin);

}  // namespace oscar::kernels::cpu
