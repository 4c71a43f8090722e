// CPU attention over the paged three-region KV cache (kernels/paged_kv.h).
//
// The *_ref functions are the specification (DESIGN §5.3, STYLE "the CPU
// reference is the specification"): scalar, fp64 accumulation, one softmax
// partial per region (sink BF16, middle quantized, recent BF16) merged by
// log-sum-exp. Middle rows are dequantized exactly as stored:
// x_hat = min + code * scale with the fp16 (scale, min) of each group (per
// row; for per-channel keys, kv.key_axis == kChannel, per channel and span of
// 32 slots, paged_kv.h).
// The optimized functions (same signatures) dispatch at run time to AVX-512,
// AVX2 or a scalar fallback and must match the reference to float tolerance
// (tests/kernels).
//
// Shapes: d = kv.head_dim, Hq = num_q_heads, Hkv = kv.num_kv_heads,
// Hq % Hkv == 0; query head g reads KV head g / (Hq / Hkv).
// Bad views or shapes throw oscar::Error (never crash).
#pragma once

#include "kernels/paged_kv.h"

namespace oscar::kernels::cpu {

// Decode: one query token per sequence; every cached token of sequence b
// (kv.total_len(b), the new token's K/V already written) is attended.
//   q   [batch][Hq][d] f32, already rotated by R_K (and pre-RoPE'd)
//   o   [batch][Hq][d] f32, in the R_V basis
//   lse [batch][Hq] f32 = log sum_j exp(sm_scale * q.k_j), or nullptr.
// A sequence with no tokens gets o = 0 and lse = -inf.
void decode_attention_ref(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                          float sm_scale, float* o, float* lse);
void decode_attention(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                      float sm_scale, float* o, float* lse);

// Prefill chunk of sequence b: n new tokens at positions cached_len .. cached_len+n-1.
//   q            [n][Hq][d] f32 (rotated)
//   k_new, v_new [n][Hkv][d] f32 (rotated), the chunk's own keys/values
//   o            [n][Hq][d] f32
// Token i attends to cached positions [0, cached_len) as stored in the view
// (BF16 / dequantized; cached_len <= kv.total_len(b), later positions in the
// view are ignored) plus k_new/v_new rows 0..i at full precision (causal).
void prefill_attention_ref(const kv::PagedKvView& kv, int b, int cached_len, const float* q,
                           const float* k_new, const float* v_new, int n, int num_q_heads,
                           float sm_scale, float* o);
void prefill_attention(const kv::PagedKvView& kv, int b, int cached_len, const float* q,
                       const float* k_new, const float* v_new, int n, int num_q_heads,
                       float sm_scale, float* o);

// Which code path decode_attention / prefill_attention take on this CPU:
// "avx512vnni", "avx512", "avx2" or "scalar". OSCAR_CPU_ISA=avx512|avx2|scalar
// (environment) caps it. "avx512vnni" (default where the CPU has AVX512_VNNI and
// AVX512_VBMI) runs the INT2 middle with integer dot products: the query
// quantized per group and the value weights per span of <= 128 rows, each to two
// int8 digits (16 / 15 bits), a bounded extra error (docs/kernels-cpu.md,
// "approximate tier"); OSCAR_CPU_ATTN=exact selects the float kernels (error
// tier: f32 rounding only). INT4 rows and per-channel keys (kivi2) always use
// the float kernels.
const char* attention_isa();

// Threads used by the optimized kernels: OSCAR_NUM_THREADS (environment) or
// std::thread::hardware_concurrency(); set_num_threads(n > 0) overrides both.
void set_num_threads(int n);
int num_threads();

}  // namespace oscar::kernels::cpu
