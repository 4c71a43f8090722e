// Linear layers with BF16 weights on Intel AMX tiles (Sapphire Rapids and later): the products of
// many activation rows (a prefill chunk, a large decode batch) at the tile unit's rate instead of
// AVX-512 FMAs. The activations are rounded to BF16 (round to nearest even), the products
// accumulate in fp32: the CUDA backend's cuBLAS path does the same.
//
//   y[t][o] = Σ_k bf16(x[t][k]) · w[o][k]  (+ bias[o]),   w: BF16 bits [out][in]
//
// The weight tiles are read in place (16 output rows × 32 input columns each); the activations are
// packed once per call into the pair-interleaved layout the tile product takes as its second
// operand; each 16 × 16 result tile (outputs × tokens) is transposed into y on the way out.
#pragma once

#include <cstdint>

namespace oscar::backend::cpu {

// True when the CPU has AMX-BF16, the kernel granted this process the tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM), and OSCAR_CPU_AMX is not 0. Decided once.
bool amx_available();

// Shapes the AMX kernel takes: in a multiple of 32, out a multiple of 16.
inline bool amx_shape_ok(int64_t out, int64_t in) { return in % 32 == 0 && out % 16 == 0 && in > 0 && out > 0; }

// The product above (requires amx_available() and amx_shape_ok); threads from the op pool.
void linear_bf16_amx(const uint16_t* w, int64_t out, int64_t in, const float* bias, const float* x, int n,
                     float* y);

// The activation operand as linear_bf16_amx packs it: xp[p][t][j] = f32_to_bf16(x[t][2p + j]) for
// p < in / 2 and t < n, zeros for the tokens up to n rounded up to 16 (xp holds in · that many).
// in a multiple of 2.
void pack_activations_bf16(const float* x, int n, int64_t in, uint16_t* xp);

// Its specification: activations rounded to BF16, then the scalar fp32 loop (tests).
void linear_bf16_amx_ref(const uint16_t* w, int64_t out, int64_t in, const float* bias, const float* x, int n,
                         float* y);

}  // namespace oscar::backend::cpu
