// CPU cache-write kernels for the paged three-region KV cache (kernels/paged_kv.h):
// rotation of rows by a d x d matrix, writing rotated rows into BF16 page
// slots, clip -> quantize -> pack into quantized page slots, and demotion of
// one full BF16 page into one quantized page (DESIGN §3.3-3.5, §5.1-5.2).
//
// The *_ref functions are the specification (they call core/quantizer.h row
// by row); the unsuffixed ones are the fast paths and are bit-exact with the
// reference (tests/kernels). The kv/ layer decides which (page, slot) a token
// goes to; these kernels only move bytes. Bad arguments throw oscar::Error.
//
// Layout reminders: a BF16 page holds [Hkv][page_size][d] bf16 for K and the
// same for V; a quantized page holds [Hkv][page_size][d*bits/8] code bytes and
// [Hkv][page_size][d/group_size][2] fp16 (scale, min) params, K and V apart.
// Per-channel keys (kv.key_axis == KeyAxis::kChannel, kivi2): the key params
// are [Hkv][page_size/32][d][2] instead, one (scale, min) per channel per span
// of 32 slots; such keys can only be written by demote_page (whole spans, no
// key clipping: clip.k must be >= 1), write_quant_tokens throws for them.
#pragma once

#include <cstdint>

#include "kernels/paged_kv.h"

namespace oscar::kernels::cpu {

// Per-layer clipping ratios (DESIGN §3.3): tau = the floor(c*d)-th smallest
// |x| of the row. c >= 1 disables clipping (int2-naive, bf16 windows).
struct ClipRatios {
  float k = 0.96f;
  float v = 0.92f;
};

// clip_threshold (core/quantizer.h, the specification), the same value by another algorithm
// (a bitwise selection, vectorized): what the quantizing kernels below clip with.   x: [d], d <= 256
float clip_threshold_select(const float* x, int d, float ratio);
// The same for n rows at one ratio: rows [n][ld] (row i at rows + i * ld) -> tau [n].
void clip_thresholds_select(const float* rows, int64_t ld, int n, int d, float ratio, float* tau);

// ---- Rotation ---------------------------------------------------------------
// out[i] = x[i] * R (row vector times matrix); R row-major [d][d], so
// out[i][c] = sum_j x[i][j] * R[j][c].   x, out: [n][d]; x == out is allowed.
void rotate_rows_ref(const float* x, int64_t n, int d, const float* R, float* out);
void rotate_rows(const float* x, int64_t n, int d, const float* R, float* out);

// Per-head rotation of token rows x [n][num_heads][d]: head h uses
// R[h] when r_heads == num_heads, R[0] when r_heads == 1 (one rotation per
// layer, DESIGN §3.1 granularity).   R: [r_heads][d][d]; x == out allowed.
void rotate_heads_ref(const float* x, int64_t n, int num_heads, int d, const float* R, int r_heads,
                      float* out);
void rotate_heads(const float* x, int64_t n, int num_heads, int d, const float* R, int r_heads,
                  float* out);

// ---- BF16 windows (sink, recent) -------------------------------------------
// Writes n tokens (all KV heads of each) into BF16 page slots, rounding to
// nearest even.   pages, slots: [n];  k, v: [n][Hkv][d] f32, already rotated.
void write_bf16_tokens(const kv::PagedKvView& kv, int n, const int32_t* pages,
                       const int32_t* slots, const float* k, const float* v);

// ---- Quantized middle --------------------------------------------------------
// Clips each row (ratio clip.k / clip.v), quantizes per group with fp16
// params and packs it into quantized page slots (format: core/quant_format.h,
// kv.bits, kv.group_size).   pages, slots: [n];  k, v: [n][Hkv][d] f32, rotated.
void write_quant_tokens_ref(const kv::PagedKvView& kv, int n, const int32_t* pages,
                            const int32_t* slots, const float* k, const float* v, ClipRatios clip);
void write_quant_tokens(const kv::PagedKvView& kv, int n, const int32_t* pages,
                        const int32_t* slots, const float* k, const float* v, ClipRatios clip);

// ---- Demotion ------------------------------------------------------------------
// BF16 page `bf16_page` (all KV heads, slots [0, num_tokens), K and V) ->
// quantized page `quant_page`, same slots. Rows are already rotated, so this is
// clip -> quantize -> pack only; the result equals write_quant_tokens on the
// BF16-rounded rows. num_tokens < 0 means a full page (the normal case).
// Per-channel keys: each channel's 32 values of each span quantized as one
// group (core/quantizer.h quantize_row, group 32), codes packed into the rows;
// num_tokens must then be a multiple of 32.
// key_offset ([num_kv_heads][head_dim] f32, or nullptr) is subtracted from every key row
// before the clip: the page's centre δ_h(t) under page centering (paged_kv.h).
// head_clips ([num_kv_heads], or nullptr: `clip` for every head): per-head clip ratios, as
// calibrations searched per head have them. The fast version runs the rows on the kernels'
// thread pool (parallel.h).
void demote_page_ref(const kv::PagedKvView& kv, int32_t bf16_page, int32_t quant_page,
                     ClipRatios clip, int num_tokens = -1, const float* key_offset = nullptr,
                     const ClipRatios* head_clips = nullptr);
void demote_page(const kv::PagedKvView& kv, int32_t bf16_page, int32_t quant_page, ClipRatios clip,
                 int num_tokens = -1, const float* key_offset = nullptr, const ClipRatios* head_clips = nullptr);

}  // namespace oscar::kernels::cpu
