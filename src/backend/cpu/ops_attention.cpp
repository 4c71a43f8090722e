#include "backend/cpu/ops_attention.h"

#include <fmt/format.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "core/half.h"

namespace oscar::backend::cpu {

bool kernel_supports_head_dim(int d) { return d == 64 || d == 128 || d == 256; }

namespace {

// Pointer to the bf16 K (or V) row of cached position p of sequence b.
const uint16_t* cached_row(const kv::PagedKvView& kv, const uint16_t* pool, int b, int p, int h) {
  const int sink = kv.sink.len[b];
  const kv::RegionTable* r = &kv.sink;
  if (p >= sink) {
    if (kv.mid.len[b] != 0)
      throw Error("generic attention: quantized middle region not supported for this head_dim");
    r = &kv.recent;
    p -= sink;
  }
  const int32_t page = r->indices[r->indptr[b] + p / kv.page_size];
  return pool + kv.bf16_row_offset(page, h, p % kv.page_size);
}

// One query row against `cached` cache rows then `own` full-precision rows.
void attend(const kv::PagedKvView& kv, int b, int cached, const float* q, int g, int hk,
            const float* k_own, const float* v_own, int own, float sm_scale, float* o) {
  const int d = kv.head_dim, Hkv = kv.num_kv_heads;
  std::vector<double> s(cached + own);
  double mx = -INFINITY;
  for (int j = 0; j < cached + own; ++j) {
    double dot = 0;
    if (j < cached) {
      const uint16_t* kr = cached_row(kv, kv.bf16.k, b, j, hk);
      for (int c = 0; c < d; ++c) dot += double(q[c]) * bf16_to_f32(kr[c]);
    } else {
      const float* kr = k_own + (int64_t(j - cached) * Hkv + hk) * d;
      for (int c = 0; c < d; ++c) dot += double(q[c]) * kr[c];
    }
    s[j] = dot * sm_scale;
    mx = std::max(mx, s[j]);
  }
  std::vector<double> acc(d, 0.0);
  double den = 0;
  for (int j = 0; j < cached + own; ++j) {
    const double p = std::exp(s[j] - mx);
    den += p;
    if (j < cached) {
      const uint16_t* vr = cached_row(kv, kv.bf16.v, b, j, hk);
      for (int c = 0; c < d; ++c) acc[c] += p * bf16_to_f32(vr[c]);
    } else {
      const float* vr = v_own + (int64_t(j - cached) * Hkv + hk) * d;
      for (int c = 0; c < d; ++c) acc[c] += p * vr[c];
    }
  }
  for (int c = 0; c < d; ++c) o[c] = den > 0 ? static_cast<float>(acc[c] / den) : 0.f;
  (void)g;
}

void check(const kv::PagedKvView& kv, int hq) {
  if (kv.num_kv_heads <= 0 || hq % kv.num_kv_heads != 0)
    throw Error(fmt::format("generic attention: {} query heads for {} KV heads", hq, kv.num_kv_heads));
}

}  // namespace

void decode_attention_generic(const kv::PagedKvView& kv, const float* q, int hq, float sm_scale,
                              float* o) {
  check(kv, hq);
  const int d = kv.head_dim, grp = hq / kv.num_kv_heads;
  for (int b = 0; b < kv.batch; ++b)
    for (int g = 0; g < hq; ++g)
      attend(kv, b, kv.total_len(b), q + (int64_t(b) * hq + g) * d, g, g / grp, nullptr, nullptr, 0,
             sm_scale, o + (int64_t(b) * hq + g) * d);
}

void prefill_attention_generic(const kv::PagedKvView& kv, int b, int cached_len, const float* q,
                               const float* k_new, const float* v_new, int n, int hq,
                               float sm_scale, float* o) {
  check(kv, hq);
  if (b < 0 || b >= kv.batch || cached_len > kv.total_len(b))
    throw Error(fmt::format("generic attention: batch row {} / cached length {} out of range", b,
                            cached_len));
  const int d = kv.head_dim, grp = hq / kv.num_kv_heads;
  for (int i = 0; i < n; ++i)
    for (int g = 0; g < hq; ++g)
      attend(kv, b, cached_len, q + (int64_t(i) * hq + g) * d, g, g / grp, k_new, v_new, i + 1,
             sm_scale, o + (int64_t(i) * hq + g) * d);
}

}  // namespace oscar::backend::cpu
