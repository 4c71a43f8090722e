// Causal prefill attention of one prompt chunk on the GPU, fused (FlashAttention-2
// scheme: scores and probabilities stay on chip; one pass over the keys with an online
// softmax). The caller gathers the sequence's keys and values, cached rows first and
// the chunk's own rows after them, into contiguous BF16 rows per KV head (INT2 pages
// dequantized by the gather), so one kernel serves every cache method.
//
//   o[t][h] = sum_{j <= L + t} softmax_j(sm_scale * q[t][h] . K[g][j]) V[g][j],
//   g = h / (Hq / Hkv), for chunk rows t < n (absolute position L + t).
//
//   q: [n][Hq][d] f32 (rounded to BF16 on load); K, V: [Hkv][Lt][d] BF16, Lt >= L + n;
//   o: [n][Hq][d] f32. d = 64 or 128; Hq a multiple of Hkv. BF16 products with fp32
//   accumulation, the probabilities rounded to BF16 for the value product (as
//   FlashAttention and FlashInfer do).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace oscar::kernels::cuda {

// Whether prefill_attention_bf16 takes this head_dim.
bool prefill_attention_supported(int head_dim);

cudaError_t prefill_attention_bf16(const float* q, const uint16_t* K, const uint16_t* V, int n, int L, int Lt,
                                   int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, float* o,
                                   cudaStream_t stream, int warps = 4);  // warps: 4 or 8 per CTA (16 rows each)

}  // namespace oscar::kernels::cuda
