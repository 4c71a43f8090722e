// CUDA cache-write kernels for the paged three-region KV cache (kernels/paged_kv.h):
// fused rotate -> clip -> quantize -> pack of new tokens into INT2 page slots,
// rotate -> round of new tokens into the BF16 windows, and demotion of full
// BF16 pages into INT2 pages (clip -> quantize -> pack; rows are already
// rotated). Specification: kernels/cpu/cache_write.h (*_ref); the
// quantization is bit-exact with core/quantizer.h (same fp32 arithmetic,
// IEEE division), rotation accumulates in fp32 in a different order than the
// CPU, so rotated rows agree to fp32 rounding only.
//
// INT2 rows: one block per row (token, KV head, K or V), the rotation split
// over its warps, then one warp clips (bitonic sort of |x|), quantizes and
// packs. BF16 rows: up to d/32 blocks per (token, KV head), 32 or more
// output channels of K and V each.
// Works for prefill chunks (n = chunk length) and decode steps (n = batch).
// All pointers are device pointers; launchers return cudaError_t (never
// throw) and reject bad shapes with cudaErrorInvalidValue. This header
// compiles without nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cpu/cache_write.h"
#include "kernels/paged_kv.h"

namespace oscar::kernels::cuda {

using cpu::ClipRatios;

// Rotation inputs: rot_k (rot_v) is [r_heads][d][d] f32 row-major (out = x R),
// 16-byte aligned, or nullptr for none; r_heads is 1 (one rotation per layer)
// or Hkv. Keys are
// rotated after RoPE here; values usually arrive rotated (R_V folded into W_v)
// and pass rot_v = nullptr.
// k_mean ([Hkv][d] f32 or nullptr) is the key transform's centering (core/key_transform.h):
// key rows are written as (k − k_mean[h])·R (R may then be M_K = diag(1/s)·R_K, which
// need not be orthogonal), exactly as the CPU's kernels::cpu::transform_keys.
struct WriteRotation {
  const float* k = nullptr;
  const float* v = nullptr;
  int r_heads = 1;
  const float* k_mean = nullptr;
};

// n tokens -> quantized page slots (kv.bits must be 2 or 4... only 2 here).
//   pages, slots: [n] int32;  k, v: [n][Hkv][d] f32 (post-RoPE, not yet rotated)
cudaError_t write_quant_tokens(const kv::PagedKvView& kv, int n, const int32_t* pages,
                               const int32_t* slots, const float* k, const float* v,
                               WriteRotation rot, ClipRatios clip, cudaStream_t stream);

// n tokens -> BF16 page slots (rotation, then round to nearest even; no clip).
cudaError_t write_bf16_tokens(const kv::PagedKvView& kv, int n, const int32_t* pages,
                              const int32_t* slots, const float* k, const float* v,
                              WriteRotation rot, cudaStream_t stream);

// As write_bf16_tokens; with `programmatic`, launched as a programmatic
// dependent of the previous launch on the stream: it may run concurrently
// with that launch (which must neither read nor write what it touches) and
// its grid completes only after that launch's. decode_attention uses it for
// DecodeParams::write. Each row is written by `parts` blocks (a divisor of
// d/32; 0 means d/32) of d / parts channels each; with `both`, one block
// writes its channels of a token's K and V rows (half the blocks). Blocks
// per (token i, KV head h): F = parts (both) or 2 parts (K's, then V's).
// `done` (optional, device, n * Hkv * F words): block (i * Hkv + h) * F + f
// release-stores `epoch` in its word once its channels are written, so that
// a launch running at the same time can wait for one token's rows without
// waiting for this grid to complete.
cudaError_t write_bf16_tokens_dependent(const kv::PagedKvView& kv, int n, const int32_t* pages,
                                        const int32_t* slots, const float* k, const float* v,
                                        WriteRotation rot, bool programmatic, cudaStream_t stream,
                                        uint32_t* done = nullptr, uint32_t epoch = 0, int parts = 0,
                                        bool both = false);

// Demotes BF16 pages bf16_pages[i] -> quantized pages quant_pages[i] (all KV
// heads, K and V, slots [0, num_tokens); num_tokens < 0 means full pages).
//   bf16_pages, quant_pages: [num_pages] int32 device arrays
//   key_offset: [num_pages][Hkv][d] f32 device or nullptr: subtracted from the key rows
//               before the clip (page centering, kernels/paged_kv.h; CPU demote_page)
//   head_clips: [Hkv] host array or nullptr (`clip` for every head): per-head clip ratios, as
//               calibrations searched per head have them (CPU demote_page's head_clips);
//               at most kMaxClipHeads KV heads
inline constexpr int kMaxClipHeads = 128;
cudaError_t demote_pages(const kv::PagedKvView& kv, int num_pages, const int32_t* bf16_pages,
                         const int32_t* quant_pages, ClipRatios clip, int num_tokens,
                         cudaStream_t stream, const float* key_offset = nullptr,
                         const ClipRatios* head_clips = nullptr);

// Page centering of demoted pages (kernels/paged_kv.h center_angles and center_offset are the
// specification): for every layer l whose u is not null, page i and KV head h,
//   key_offset[l][i][h][0..d) = δ_h(first_pos[i] + (page_size − 1) / 2)
// from the layer's u / w [Hkv][S][d] and mu [Hkv][d] (or null) and the pairs' frequencies
// freq [S]: the angles in fp64 rounded to f32, the sums in fp64 (the host's order), so the
// centres agree with the host's to fp64 rounding before the f32 store. One launch for all
// layers; the rows of layers without a centre are not written. What the CUDA page store
// computed on the host per page and layer (~0.3 ms a page for a 28-layer model) before.
//   layers: [num_layers] device array; freq, first_pos, key_offset: device arrays,
//   key_offset [num_layers][num_pages][Hkv][head_dim]; S <= head_dim / 2.
struct PageCentreLayer {
  const float* u = nullptr;
  const float* w = nullptr;
  const float* mu = nullptr;
};
cudaError_t page_centres(const PageCentreLayer* layers, int num_layers, const float* freq, int pairs,
                         int num_kv_heads, int head_dim, int num_pages, const int64_t* first_pos,
                         int page_size, float* key_offset, cudaStream_t stream);

// As demote_pages; `programmatic` as for write_bf16_tokens_dependent.
// decode_attention uses it for DecodeParams::demote.
cudaError_t demote_pages_dependent(const kv::PagedKvView& kv, int num_pages, const int32_t* bf16_pages,
                                   const int32_t* quant_pages, ClipRatios clip, int num_tokens,
                                   bool programmatic, cudaStream_t stream, const float* key_offset = nullptr,
                                   const ClipRatios* head_clips = nullptr);

}  // namespace oscar::kernels::cuda
