// The scalar reference of decode and prefill attention: the specification the
// optimized CPU kernels and the CUDA kernels are tested against. Clarity over
// speed: every row is materialized in f32 exactly as stored, dot products and
// softmax sums are accumulated in fp64, and each region (sink, middle,
// recent) is a separate softmax partial merged by log-sum-exp — the same
// split the fast kernels use, so a bug in their merge cannot hide.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/quant_format.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/view_check.h"

namespace oscar::kernels::cpu {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// One softmax partial: running max m, sum l = sum exp(s - m), acc = sum exp(s - m) v.
struct Partial {
  double m = kNegInf;
  double l = 0.0;
  int count = 0;  // rows seen; empty partials are skipped by the merge (a NaN l is not)
  std::vector<double> acc;
};

// Row `i` of region `r` (KV head h) as f32: BF16 rows widened, quantized rows
// dequantized as x_hat = min + code * scale with the stored fp16 params (per
// row and group, or for per-channel keys per span and channel, paged_kv.h).
// So a per-channel key logit is sum_c q_c (min_c + code_tc * scale_c).
void fetch_row(const kv::PagedKvView& kv, const kv::RegionTable& r, bool quantized, bool value,
               int b, int i, int h, float* out /*[d]*/) {
  const int d = kv.head_dim;
  const int32_t page = detail::region_page(r, kv, b, i);
  const int slot = i % kv.page_size;
  if (!quantized) {
    const uint16_t* src = (value ? kv.bf16.v : kv.bf16.k) + kv.bf16_row_offset(page, h, slot);
    for (int c = 0; c < d; ++c) out[c] = bf16_to_f32(src[c]);
    return;
  }
  const int64_t row = kv.quant_row_index(page, h, slot);
  const uint8_t* codes = (value ? kv.quant.v_codes : kv.quant.k_codes) + row * kv.row_code_bytes();
  if (!value && kv.key_axis == kv::KeyAxis::kChannel) {
    // Per-channel keys: (scale, min) of channel c over the row's span of
    // kKeySpan slots, x_hat = min_c + code * scale_c.
    const uint16_t* sp = kv.quant.k_params + kv.key_span_params_offset(page, h, slot);
    for (int c = 0; c < d; ++c) {
      const float scale = f16_to_f32(sp[2 * c]);
      const float mn = f16_to_f32(sp[2 * c + 1]);
      out[c] = mn + static_cast<float>(get_code(codes, c, kv.group_size, kv.bits)) * scale;
    }
    return;
  }
  const uint16_t* params = (value ? kv.quant.v_params : kv.quant.k_params) + row * kv.row_groups() * 2;
  for (int c = 0; c < d; ++c) {
    const int g = c / kv.group_size;
    const float scale = f16_to_f32(params[2 * g]);
    const float mn = f16_to_f32(params[2 * g + 1]);
    out[c] = mn + static_cast<float>(get_code(codes, c, kv.group_size, kv.bits)) * scale;
  }
}

// Two-pass softmax partial of one query over rows [i0, i1) of region r.
void region_partial(const kv::PagedKvView& kv, const kv::RegionTable& r, bool quantized, int b,
                    int i0, int i1, int h, const float* q /*[d]*/, double sm_scale, Partial& p) {
  const int d = kv.head_dim;
  p.m = kNegInf;
  p.l = 0.0;
  p.count = std::max(i1 - i0, 0);
  p.acc.assign(d, 0.0);
  if (i1 <= i0) return;
  std::vector<float> row(d);
  std::vector<double> s(i1 - i0);
  // Page centering: a middle row's key is x̂ + δ_h(t) of its page (paged_kv.h).
  const bool centered = quantized && kv.center.head_active(h);
  std::vector<float> delta(centered ? d : 0);
  int delta_page = -1;
  for (int i = i0; i < i1; ++i) {
    fetch_row(kv, r, quantized, /*value=*/false, b, i, h, row.data());
    if (centered) {
      const int pi = i / kv.page_size;
      if (pi != delta_page) mid_page_offset(kv.center, r, d, b, h, delta_page = pi, delta.data());
      for (int c = 0; c < d; ++c) row[c] += delta[c];
    }
    double dot = 0.0;
    for (int c = 0; c < d; ++c) dot += double(q[c]) * double(row[c]);
    s[i - i0] = dot * sm_scale;
    p.m = std::max(p.m, s[i - i0]);
  }
  for (int i = i0; i < i1; ++i) {
    const double w = std::exp(s[i - i0] - p.m);
    p.l += w;
    fetch_row(kv, r, quantized, /*value=*/true, b, i, h, row.data());
    for (int c = 0; c < d; ++c) p.acc[c] += w * double(row[c]);
  }
}

// Merge partials by log-sum-exp; writes o [d] and returns lse (-inf if empty).
double merge(const std::vector<Partial>& parts, int d, float* o) {
  double m = kNegInf;
  for (const Partial& p : parts)
    if (p.count > 0) m = std::max(m, p.m);
  bool any = false;
  for (const Partial& p : parts) any = any || p.count > 0;
  if (!any) {
    std::fill(o, o + d, 0.0f);
    return kNegInf;
  }
  double l = 0.0;
  std::vector<double> acc(d, 0.0);
  for (const Partial& p : parts) {
    if (p.count == 0) continue;
    const double w = std::exp(p.m - m);
    l += p.l * w;
    for (int c = 0; c < d; ++c) acc[c] += p.acc[c] * w;
  }
  for (int c = 0; c < d; ++c) o[c] = static_cast<float>(acc[c] / l);
  return m + std::log(l);
}

}  // namespace

void decode_attention_ref(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                          float sm_scale, float* o, float* lse) {
  detail::check_view(kv, num_q_heads, "decode_attention_ref");
  const int d = kv.head_dim;
  const int group = num_q_heads / kv.num_kv_heads;
  std::vector<Partial> parts(3);
  for (int b = 0; b < kv.batch; ++b) {
    for (int g = 0; g < num_q_heads; ++g) {
      const int h = g / group;
      const float* qg = q + (int64_t(b) * num_q_heads + g) * d;
      region_partial(kv, kv.sink, false, b, 0, kv.sink.len[b], h, qg, sm_scale, parts[0]);
      region_partial(kv, kv.mid, true, b, 0, kv.mid.len[b], h, qg, sm_scale, parts[1]);
      region_partial(kv, kv.recent, false, b, 0, kv.recent.len[b], h, qg, sm_scale, parts[2]);
      const double l = merge(parts, d, o + (int64_t(b) * num_q_heads + g) * d);
      if (lse) lse[int64_t(b) * num_q_heads + g] = static_cast<float>(l);
    }
  }
}

void prefill_attention_ref(const kv::PagedKvView& kv, int b, int cached_len, const float* q,
                           const float* k_new, const float* v_new, int n, int num_q_heads,
                           float sm_scale, float* o) {
  detail::check_view(kv, num_q_heads, "prefill_attention_ref");
  if (b < 0 || b >= kv.batch)
    throw Error("prefill_attention_ref: sequence " + std::to_string(b) + " outside batch of " +
                std::to_string(kv.batch));
  if (n < 0 || cached_len < 0 || cached_len > kv.total_len(b))
    throw Error("prefill_attention_ref: cached_len " + std::to_string(cached_len) +
                " outside [0, " + std::to_string(kv.total_len(b)) + "] or negative n");
  const int d = kv.head_dim;
  const int hkv = kv.num_kv_heads;
  const int group = num_q_heads / hkv;
  // Cached positions split into the regions they are stored in.
  const int sink_n = std::min(cached_len, kv.sink.len[b]);
  const int mid_n = std::min(cached_len - sink_n, kv.mid.len[b]);
  const int rec_n = cached_len - sink_n - mid_n;
  std::vector<Partial> parts(4);
  for (int i = 0; i < n; ++i) {
    for (int g = 0; g < num_q_heads; ++g) {
      const int h = g / group;
      const float* qg = q + (int64_t(i) * num_q_heads + g) * d;
      region_partial(kv, kv.sink, false, b, 0, sink_n, h, qg, sm_scale, parts[0]);
      region_partial(kv, kv.mid, true, b, 0, mid_n, h, qg, sm_scale, parts[1]);
      region_partial(kv, kv.recent, false, b, 0, rec_n, h, qg, sm_scale, parts[2]);
      // The chunk itself, rows 0..i, full precision.
      Partial& p = parts[3];
      p.acc.assign(d, 0.0);
      std::vector<double> s(i + 1);
      p.m = kNegInf;
      p.count = i + 1;
      for (int j = 0; j <= i; ++j) {
        const float* kj = k_new + (int64_t(j) * hkv + h) * d;
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot += double(qg[c]) * double(kj[c]);
        s[j] = dot * sm_scale;
        p.m = std::max(p.m, s[j]);
      }
      p.l = 0.0;
      for (int j = 0; j <= i; ++j) {
        const double w = std::exp(s[j] - p.m);
        p.l += w;
        const float* vj = v_new + (int64_t(j) * hkv + h) * d;
        for (int c = 0; c < d; ++c) p.acc[c] += w * double(vj[c]);
      }
      merge(parts, d, o + (int64_t(i) * num_q_heads + g) * d);
    }
  }
}

}  // namespace oscar::kernels::cpu
