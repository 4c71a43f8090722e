// Reference cache-write kernels: the specification of rotation, BF16 slot
// writes, clip -> quantize -> pack and demotion. Row work is delegated to the
// reference quantizer of core/quantizer.h so there is one definition of the
// format arithmetic.
#include <algorithm>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/quantizer.h"
#include "kernels/cpu/cache_write.h"
#include "kernels/cpu/view_check.h"

namespace oscar::kernels::cpu {

namespace {

void check_rotation_args(const float* x, int64_t n, int d, const float* R, float* out, const char* who) {
  if (n < 0 || d <= 0) throw Error(std::string(who) + ": bad shape n=" + std::to_string(n) + " d=" + std::to_string(d));
  if (n > 0 && (!x || !R || !out)) throw Error(std::string(who) + ": null pointer");
}

// Clip one row (a copy) and quantize it into the quantized page slot.
void quantize_into(const kv::PagedKvView& kv, const float* row /*[d]*/, float ratio, bool value,
                   int32_t page, int h, int slot) {
  const int d = kv.head_dim;
  std::vector<float> tmp(row, row + d);
  clip_row(tmp.data(), d, ratio);
  const QuantSpec spec{kv.bits, kv.group_size, ScaleDtype::kF16};
  const int64_t r = kv.quant_row_index(page, h, slot);
  uint8_t* codes = (value ? kv.quant.v_codes : kv.quant.k_codes) + r * kv.row_code_bytes();
  uint16_t* params = (value ? kv.quant.v_params : kv.quant.k_params) + r * kv.row_groups() * 2;
  quantize_row(tmp.data(), d, spec, codes, params);
}

// Per-channel keys (kv.key_axis == kChannel) of slots [s0, s0 + kKeySpan) of
// one head: each channel's kKeySpan values are quantized as one group by the
// reference quantizer (quantize_row on the column, group kKeySpan, no clip),
// its (scale, min) stored in the span's params, its codes scattered into the
// rows' packed codes (quant_format.h with kv.group_size).
void quantize_key_span(const kv::PagedKvView& kv, const uint16_t* bf16_rows /*[kKeySpan][d]*/,
                       int32_t page, int h, int s0) {
  const int d = kv.head_dim, n = kv::kKeySpan;
  const QuantSpec spec{kv.bits, n, ScaleDtype::kF16};
  std::vector<float> col(n);
  std::vector<uint8_t> cc(static_cast<size_t>(row_code_bytes(n, spec)));
  uint16_t* params = kv.quant.k_params + kv.key_span_params_offset(page, h, s0);
  uint8_t* codes0 = kv.quant.k_codes + kv.quant_row_index(page, h, s0) * kv.row_code_bytes();
  for (int i = 0; i < n; ++i) std::fill_n(codes0 + int64_t(i) * kv.row_code_bytes(), kv.row_code_bytes(), 0);
  for (int c = 0; c < d; ++c) {
    for (int i = 0; i < n; ++i) col[i] = bf16_to_f32(bf16_rows[int64_t(i) * d + c]);
    quantize_row(col.data(), n, spec, cc.data(), params + 2 * c);
    for (int i = 0; i < n; ++i) {
      uint8_t* row = codes0 + int64_t(i) * kv.row_code_bytes();
      row[code_byte(c, kv.group_size, kv.bits)] |=
          static_cast<uint8_t>(get_code(cc.data(), i, n, kv.bits) << code_shift(c, kv.group_size, kv.bits));
    }
  }
}

}  // namespace

void rotate_rows_ref(const float* x, int64_t n, int d, const float* R, float* out) {
  check_rotation_args(x, n, d, R, out, "rotate_rows_ref");
  std::vector<double> acc(d);
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * d;
    for (int c = 0; c < d; ++c) {
      double s = 0.0;
      for (int j = 0; j < d; ++j) s += double(xi[j]) * double(R[int64_t(j) * d + c]);
      acc[c] = s;
    }
    for (int c = 0; c < d; ++c) out[i * d + c] = static_cast<float>(acc[c]);
  }
}

void rotate_heads_ref(const float* x, int64_t n, int num_heads, int d, const float* R, int r_heads,
                      float* out) {
  if (num_heads <= 0 || (r_heads != 1 && r_heads != num_heads))
    throw Error("rotate_heads_ref: r_heads " + std::to_string(r_heads) + " must be 1 or num_heads " +
                std::to_string(num_heads));
  for (int64_t t = 0; t < n; ++t)
    for (int h = 0; h < num_heads; ++h) {
      const int64_t off = (t * num_heads + h) * d;
      rotate_rows_ref(x + off, 1, d, R + (r_heads == 1 ? 0 : int64_t(h) * d * d), out + off);
    }
}

void write_bf16_tokens(const kv::PagedKvView& kv, int n, const int32_t* pages,
                       const int32_t* slots, const float* k, const float* v) {
  detail::check_format(kv, "write_bf16_tokens");
  detail::check_slots(kv, n, pages, slots, "write_bf16_tokens");
  if (n == 0) return;
  detail::check_bf16_pool(kv, "write_bf16_tokens");
  if (!k || !v) throw Error("write_bf16_tokens: null k/v rows");
  const int d = kv.head_dim;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < kv.num_kv_heads; ++h) {
      const int64_t dst = kv.bf16_row_offset(pages[t], h, slots[t]);
      const int64_t src = (int64_t(t) * kv.num_kv_heads + h) * d;
      for (int c = 0; c < d; ++c) {
        kv.bf16.k[dst + c] = f32_to_bf16(k[src + c]);
        kv.bf16.v[dst + c] = f32_to_bf16(v[src + c]);
      }
    }
}

void write_quant_tokens_ref(const kv::PagedKvView& kv, int n, const int32_t* pages,
                            const int32_t* slots, const float* k, const float* v, ClipRatios clip) {
  detail::check_format(kv, "write_quant_tokens_ref");
  detail::check_slots(kv, n, pages, slots, "write_quant_tokens_ref");
  if (n == 0) return;
  detail::check_quant_pool(kv, "write_quant_tokens_ref");
  if (kv.key_axis == kv::KeyAxis::kChannel)
    throw Error("write_quant_tokens_ref: per-channel keys are quantized a page at a time (demote_page)");
  if (!k || !v) throw Error("write_quant_tokens_ref: null k/v rows");
  const int d = kv.head_dim;
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < kv.num_kv_heads; ++h) {
      const int64_t src = (int64_t(t) * kv.num_kv_heads + h) * d;
      quantize_into(kv, k + src, clip.k, false, pages[t], h, slots[t]);
      quantize_into(kv, v + src, clip.v, true, pages[t], h, slots[t]);
    }
}

void demote_page_ref(const kv::PagedKvView& kv, int32_t bf16_page, int32_t quant_page,
                     ClipRatios clip, int num_tokens,
                     const float* key_offset, const ClipRatios* head_clips) {
  num_tokens = detail::check_demote(kv, bf16_page, quant_page, detail::min_key_clip(kv, clip, head_clips), num_tokens,
                                    "demote_page_ref");
  const bool kchan = kv.key_axis == kv::KeyAxis::kChannel;
  if (kchan && key_offset) throw Error("demote_page: page centering needs per-token keys");
  const int d = kv.head_dim;
  std::vector<float> row(d);
  if (kchan)
    for (int h = 0; h < kv.num_kv_heads; ++h)
      for (int s0 = 0; s0 < num_tokens; s0 += kv::kKeySpan)
        quantize_key_span(kv, kv.bf16.k + kv.bf16_row_offset(bf16_page, h, s0), quant_page, h, s0);
  for (int h = 0; h < kv.num_kv_heads; ++h)
    for (int s = 0; s < num_tokens; ++s)
      for (int value = kchan ? 1 : 0; value < 2; ++value) {
        const uint16_t* src = (value ? kv.bf16.v : kv.bf16.k) + kv.bf16_row_offset(bf16_page, h, s);
        for (int c = 0; c < d; ++c) row[c] = bf16_to_f32(src[c]);
        if (!value && key_offset)
          for (int c = 0; c < d; ++c) row[c] -= key_offset[int64_t(h) * d + c];
        const ClipRatios& c = head_clips ? head_clips[h] : clip;
        quantize_into(kv, row.data(), value ? c.v : c.k, value, quant_page, h, s);
      }
}

}  // namespace oscar::kernels::cpu
