// Linear layers with 8-bit weights: per row, blocks of 32 channels share one
// fp32 scale (absmax / 127), 1.125 bytes per weight — what lets the decode step
// of a small model stream ~0.56x the bytes of bf16 (and fit in a large L3).
// Activations stay fp32; products accumulate in fp32.
//
//   q     [out][in]      int8, q = round(w / scale)
//   scale [out][in/32]   fp32
#pragma once

#include <cstdint>

namespace oscar::backend::cpu {

inline constexpr int kQ8Block = 32;

// True when this CPU runs the Q8 kernels (AVX-512); the backend falls back to
// bf16 weights otherwise.
bool q8_supported();

void quantize_q8(const float* w, int64_t out, int64_t in, int8_t* q, float* scale);

// y = x W^T + b as linear_f32 (ops_gemv.h); `in` must be a multiple of 32.
void linear_q8(const int8_t* q, const float* scale, int64_t out, int64_t in, const float* bias,
               const float* x, int n, float* y);
void linear_q8_ref(const int8_t* q, const float* scale, int64_t out, int64_t in,
                   const float* bias, const float* x, int n, float* y);

}  // namespace oscar::backend::cpu
