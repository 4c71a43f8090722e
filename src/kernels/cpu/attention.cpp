// Optimized CPU decode and prefill attention: work splitting, threading and
// the log-sum-exp merge; the per-row math lives in attention_simd.h and is
// instantiated for AVX-512, AVX2 and (here) a scalar fallback.
//
// Decode: one work item per (sequence, KV head, region, split of the region);
// a split is a page-aligned token range, sized so there are a few items per
// thread even at batch 1. Each item runs every query head of the KV head over
// its rows (rows are read and dequantized once per KV head, DESIGN §3.5) and
// leaves a base-2 softmax partial (m, l, acc); partials of a (sequence, head)
// are merged by log-sum-exp at the end.
// Prefill: one work item per (tile of query tokens, KV head); the tile's
// queries (tokens x heads of the group, at most 8) share every K/V row, first
// over the cached regions, then over the chunk's own rows with a causal limit.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/quant_format.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/attention_impl.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/view_check.h"

namespace oscar::kernels::cpu {

namespace detail {
namespace scalar {

#define OSCAR_TGT

// W = 1: the same kernel structure, one channel at a time (portable fallback).
struct Scalar {
  static constexpr int W = 1;
  using F = float;
  struct Table {
    float s, m;
  };
  static inline F zero() { return 0.0f; }
  static inline F load(const float* p) { return *p; }
  static inline void store(float* p, F v) { *p = v; }
  static inline F fma(F a, F b, F c) { return a * b + c; }
  static inline F mul(F a, F b) { return a * b; }
  static inline F set1(float x) { return x; }
  static inline float reduce_add(F a) { return a; }
  static inline F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static inline void f16_to_f32(const uint16_t* src, int n, float* dst) {
    for (int i = 0; i < n; ++i) dst[i] = oscar::f16_to_f32(src[i]);
  }
  static inline Table make_table(float s, float m, int) { return Table{s, m}; }
  static inline int load_window(const uint8_t* p, bool) { return *p; }
  static inline F dequant_x(int x, const int32_t* shift, bool, const Table& tb, int bits) {
    const int c = (x >> shift[0]) & ((1 << bits) - 1);
    return tb.m + static_cast<float>(c) * tb.s;
  }
  static inline void reduce_rows(const F* v, float* out) {
    for (int t = 0; t < kBlock; ++t) out[t] = v[t];
  }
  static inline float exp2_block(const float* s, float m, float* p) {
    float sum = 0.0f;
    for (int t = 0; t < kBlock; ++t) {
      p[t] = std::exp2(s[t] - m);
      sum += p[t];
    }
    return sum;
  }
};

#include "kernels/cpu/attention_simd.h"

#undef OSCAR_TGT

void region_entry(const RegionRows& rr, QuerySet& qs) { region_rows<Scalar>(rr, qs); }
void dense_t_entry(const DenseTRows& dr, int d, QuerySet& qs) { dense_t_rows<Scalar>(dr, d, qs); }

}  // namespace scalar

const RowKernels& scalar_kernels() {
  static const RowKernels k{"scalar", &scalar::region_entry, &scalar::dense_t_entry};
  return k;
}

}  // namespace detail

namespace {

using detail::kMaxQ;
using detail::QuerySet;
using detail::RegionRows;
using detail::RowKernels;

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::atomic<const RowKernels*> g_forced{nullptr};

const RowKernels& select_kernels() {
  if (const RowKernels* f = g_forced.load()) return *f;
  static const RowKernels* k = [] {
    const char* env = std::getenv("OSCAR_CPU_ISA");
    const std::string cap = env ? env : "";
    const char* prec = std::getenv("OSCAR_CPU_ATTN");
    const bool exact = prec && std::string(prec) == "exact";
#if defined(__x86_64__) && defined(__GNUC__)
    if (!exact && cap.empty() && detail::avx512_vnni_kernels() && detail::cpu_supports(*detail::avx512_vnni_kernels()))
      return detail::avx512_vnni_kernels();
    if (cap != "avx2" && cap != "scalar" && detail::avx512_kernels() &&
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
      return detail::avx512_kernels();
    if (cap != "scalar" && detail::avx2_kernels() && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma"))
      return detail::avx2_kernels();
#endif
    return &detail::scalar_kernels();
  }();
  return *k;
}

// Query heads of one KV head split into sets of at most kMaxQ (GQA > 8).
int num_sets(int group) { return (group + kMaxQ - 1) / kMaxQ; }
int set_begin(int group, int s) {
  const int n = num_sets(group);
  return s * group / n;
}

}  // namespace

namespace detail {
const RowKernels& active_kernels() { return select_kernels(); }
void force_kernels(const RowKernels* k) { g_forced.store(k); }
bool cpu_supports(const RowKernels& k) {
  const std::string n = k.name;
  if (n == "scalar") return true;
#if defined(__x86_64__) && defined(__GNUC__)
  if (n == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (n == "avx512") return avx512;
  if (n == "avx512vnni")
    return avx512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
#endif
  return false;
}
}  // namespace detail

namespace {

// Rows [i0, i1) of a region (KV head h) as f32: keys transposed in blocks of
// kBlock rows, kt [block][d][kBlock] (zero past the end), values v [row][d].
void widen_rows(const kv::PagedKvView& kv, const kv::RegionTable& r, bool quantized, int b, int h, int i0,
                int i1, float* kt, float* v) {
  const int d = kv.head_dim, n = i1 - i0, B = detail::kBlock;
  std::fill(kt, kt + size_t((n + B - 1) / B) * d * B, 0.0f);
  std::vector<float> krow(d);
  // Page centering: middle keys are x̂ + δ_h(t) of their page (paged_kv.h).
  const bool centered = quantized && kv.center.head_active(h);
  std::vector<float> delta(centered ? d : 0);
  int delta_page = -1;
  for (int i = i0; i < i1; ++i) {
    const int32_t page = detail::region_page(r, kv, b, i);
    const int slot = i % kv.page_size;
    float* vrow = v + size_t(i - i0) * d;
    if (quantized) {
      // quant_format.h: byte j of a group holds elements j + q*(G/L) at shift bits*q.
      const int64_t row = kv.quant_row_index(page, h, slot);
      const int cb = kv.row_code_bytes(), ng = kv.row_groups(), G = kv.group_size, bits = kv.bits;
      const int lanes = 8 / bits, per_lane = G / lanes, mask = (1 << bits) - 1;
      for (int which = 0; which < 2; ++which) {
        const uint8_t* codes = (which ? kv.quant.v_codes : kv.quant.k_codes) + row * cb;
        const uint16_t* par = (which ? kv.quant.v_params : kv.quant.k_params) + row * ng * 2;
        float* out = which ? vrow : krow.data();
        if (!which && kv.key_axis == kv::KeyAxis::kChannel) {
          // Per-channel keys: (scale, min) per channel of the slot's span.
          const uint16_t* sp = kv.quant.k_params + kv.key_span_params_offset(page, h, slot);
          for (int g = 0; g < ng; ++g) {
            const uint8_t* gb = codes + g * per_lane;
            for (int q = 0; q < lanes; ++q)
              for (int j = 0; j < per_lane; ++j) {
                const int c = g * G + q * per_lane + j;
                out[c] = f16_to_f32(sp[2 * c + 1]) + float((gb[j] >> (bits * q)) & mask) * f16_to_f32(sp[2 * c]);
              }
          }
          continue;
        }
        for (int g = 0; g < ng; ++g) {
          const float sc = f16_to_f32(par[2 * g]), mn = f16_to_f32(par[2 * g + 1]);
          const uint8_t* gb = codes + g * per_lane;
          for (int q = 0; q < lanes; ++q)
            for (int j = 0; j < per_lane; ++j)
              out[g * G + q * per_lane + j] = mn + float((gb[j] >> (bits * q)) & mask) * sc;
        }
      }
      if (centered) {
        const int pi = i / kv.page_size;
        if (pi != delta_page) mid_page_offset(kv.center, r, d, b, h, delta_page = pi, delta.data());
        for (int c = 0; c < d; ++c) krow[c] += delta[c];
      }
    } else {
      const int64_t off = kv.bf16_row_offset(page, h, slot);
      for (int c = 0; c < d; ++c) {
        krow[c] = bf16_to_f32(kv.bf16.k[off + c]);
        vrow[c] = bf16_to_f32(kv.bf16.v[off + c]);
      }
    }
    float* dst = kt + size_t((i - i0) / B) * d * B + (i - i0) % B;
    for (int c = 0; c < d; ++c) dst[c * B] = krow[c];
  }
}

struct DecodeItem {
  int b, h, region, i0, i1;
};

// Page centering's per-query coefficients (paged_kv.h): for query row r (of `rows`, each
// `num_q_heads` heads) and head g, A_s = q·u[h][s], B_s = q·w[h][s], C = q·mu[h] into
// coef [rows][num_q_heads][2S+1]; q as the kernels see it (pre-scaled).
void center_coefficients(const kv::PagedKvView& kv, const float* q, int rows, int num_q_heads,
                         std::vector<float>& coef) {
  const int d = kv.head_dim, S = kv.center.pairs, group = num_q_heads / kv.num_kv_heads;
  coef.assign(size_t(rows) * num_q_heads * (2 * S + 1), 0.0f);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < num_q_heads; ++g) {
      const int h = g / group;
      const float* qg = q + (int64_t(r) * num_q_heads + g) * d;
      float* cf = coef.data() + (size_t(r) * num_q_heads + g) * (2 * S + 1);
      for (int i = 0; i < 2 * S + 1; ++i) {
        const float* v = i == 2 * S ? kv.center.mu ? kv.center.mu + int64_t(h) * d : nullptr
                                    : ((i & 1) ? kv.center.w : kv.center.u) + (int64_t(h) * S + i / 2) * d;
        float acc = 0.0f;
        if (v)
          for (int c = 0; c < d; ++c) acc += qg[c] * v[c];
        cf[i] = acc;
      }
    }
}

// Page centering: the logit shift of every page of middle rows [i0, i1) of sequence b for the
// group's `group` queries, shift [page - i0 / page_size][group] (log2 domain, as the pre-scaled
// queries): Σ_s A_s cos_s + B_s sin_s − C (coef [group][2S+1], center_coefficients), S
// multiply-adds per page instead of a d-vector. The region kernels add it to the page's logits.
void page_shifts(const kv::PagedKvView& kv, int b, int i0, int i1, int group, const float* coef,
                 std::vector<float>& shift) {
  const int S = kv.center.pairs, ps = kv.page_size, p0 = i0 / ps, np = (i1 - 1) / ps - p0 + 1;
  shift.resize(size_t(np) * group);
  for (int pi = 0; pi < np; ++pi) {
    const float* cs = kv.center.angles + kv.center.angle_row(kv.mid.indptr, b, p0 + pi) * S * 2;
    for (int g = 0; g < group; ++g) {
      const float* cf = coef + size_t(g) * (2 * S + 1);
      double off = -double(cf[2 * S]);
      for (int s = 0; s < S; ++s) off += double(cf[2 * s]) * cs[2 * s] + double(cf[2 * s + 1]) * cs[2 * s + 1];
      shift[size_t(pi) * group + g] = float(off);
    }
  }
}

}  // namespace

const char* attention_isa() { return select_kernels().name; }

void decode_attention(const kv::PagedKvView& kv, const float* q, int num_q_heads, float sm_scale,
                      float* o, float* lse) {
  detail::check_view(kv, num_q_heads, "decode_attention");
  if (kv.batch == 0) return;
  if (!q || !o) throw Error("decode_attention: null q or o");
  const RowKernels& K = select_kernels();
  const int d = kv.head_dim, hkv = kv.num_kv_heads, group = num_q_heads / hkv;

  // Queries pre-scaled into base 2: 2^(q.k * sm_scale * log2 e) = e^(sm_scale q.k).
  std::vector<float> qs(static_cast<size_t>(kv.batch) * num_q_heads * d);
  const float qscale = sm_scale * kLog2e;
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = q[i] * qscale;

  // Split sizes: a few items per thread, page-aligned, at least 256 tokens.
  const int threads = num_threads();
  int max_len = 0;
  for (int b = 0; b < kv.batch; ++b) max_len = std::max(max_len, kv.total_len(b));
  const int64_t units = int64_t(kv.batch) * hkv;
  const int64_t want_splits = std::max<int64_t>(1, (4 * int64_t(threads) + units - 1) / units);
  int64_t chunk = (max_len + want_splits - 1) / want_splits;
  chunk = std::max<int64_t>(chunk, 256);
  chunk = (chunk + kv.page_size - 1) / kv.page_size * kv.page_size;

  std::vector<DecodeItem> items;
  std::vector<int64_t> first_item(size_t(units) + 1, 0);
  const kv::RegionTable* regions[3] = {&kv.sink, &kv.mid, &kv.recent};
  for (int b = 0; b < kv.batch; ++b)
    for (int h = 0; h < hkv; ++h) {
      first_item[size_t(b) * hkv + h] = int64_t(items.size());
      for (int r = 0; r < 3; ++r) {
        const int len = regions[r]->len[b];
        for (int64_t i0 = 0; i0 < len; i0 += chunk)
          items.push_back(DecodeItem{b, h, r, int(i0), int(std::min<int64_t>(len, i0 + chunk))});
      }
    }
  first_item[size_t(units)] = int64_t(items.size());

  // Page centering: the per-query coefficients, once per call; heads whose centre is 0
  // (no ν, MidCenter::active) keep the plain path.
  std::vector<float> coef;
  if (kv.center.pairs > 0) center_coefficients(kv, qs.data(), kv.batch, num_q_heads, coef);

  // Per item: m [group], l [group], acc [group][d].
  const int64_t per_item = int64_t(group) * (d + 2);
  std::vector<float> scratch(items.size() * size_t(per_item));
  parallel_for(int64_t(items.size()), [&](int64_t it) {
    const DecodeItem& w = items[size_t(it)];
    float* st = scratch.data() + it * per_item;
    float* m = st;
    float* l = st + group;
    float* acc = st + 2 * group;
    std::fill(m, m + group, kNegInf);
    std::fill(l, l + group, 0.0f);
    std::fill(acc, acc + int64_t(group) * d, 0.0f);
    const float* qh = qs.data() + (int64_t(w.b) * num_q_heads + w.h * group) * d;
    RegionRows rr{&kv, regions[w.region], w.region == 1, w.b, w.h, w.i0, w.i1, 0};
    thread_local std::vector<float> shift;
    const bool centered = w.region == 1 && kv.center.head_active(w.h);
    if (centered) {
      page_shifts(kv, w.b, w.i0, w.i1, group,
                  coef.data() + (size_t(w.b) * num_q_heads + size_t(w.h) * group) * (2 * kv.center.pairs + 1), shift);
      rr.shift_stride = group;
    }
    for (int s = 0; s < num_sets(group); ++s) {
      const int g0 = set_begin(group, s), g1 = set_begin(group, s + 1);
      QuerySet set{g1 - g0, qh + int64_t(g0) * d, nullptr, m + g0, l + g0, acc + int64_t(g0) * d};
      rr.shift = centered ? shift.data() + g0 : nullptr;
      K.region(rr, set);
    }
  });

  // Log-sum-exp merge of the partials of each (sequence, query head). Serial:
  // a second parallel_for costs more (thread wake-up) than it saves.
  std::vector<double> acc(d);
  for (int b = 0; b < kv.batch; ++b)
    for (int h = 0; h < hkv; ++h) {
      const int64_t u = int64_t(b) * hkv + h;
      const int64_t e0 = first_item[size_t(u)], e1 = first_item[size_t(u) + 1];
      for (int g = 0; g < group; ++g) {
        const int qh = h * group + g;
        float* out = o + (int64_t(b) * num_q_heads + qh) * d;
        if (e0 == e1) {
          std::fill(out, out + d, 0.0f);
          if (lse) lse[int64_t(b) * num_q_heads + qh] = kNegInf;
          continue;
        }
        float mmax = kNegInf;
        for (int64_t e = e0; e < e1; ++e) mmax = std::max(mmax, scratch[size_t(e * per_item + g)]);
        double L = 0.0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t e = e0; e < e1; ++e) {
          const float* st = scratch.data() + e * per_item;
          const double w = std::exp2(double(st[g]) - double(mmax));
          L += double(st[group + g]) * w;
          const float* a = st + 2 * group + int64_t(g) * d;
          for (int c = 0; c < d; ++c) acc[c] += double(a[c]) * w;
        }
        for (int c = 0; c < d; ++c) out[c] = static_cast<float>(acc[c] / L);
        if (lse) lse[int64_t(b) * num_q_heads + qh] = static_cast<float>((double(mmax) + std::log2(L)) * kLn2);
      }
    }
}

void prefill_attention(const kv::PagedKvView& kv, int b, int cached_len, const float* q,
                       const float* k_new, const float* v_new, int n, int num_q_heads,
                       float sm_scale, float* o) {
  detail::check_view(kv, num_q_heads, "prefill_attention");
  if (b < 0 || b >= kv.batch)
    throw Error("prefill_attention: sequence " + std::to_string(b) + " outside batch of " +
                std::to_string(kv.batch));
  if (n < 0 || cached_len < 0 || cached_len > kv.total_len(b))
    throw Error("prefill_attention: cached_len " + std::to_string(cached_len) + " outside [0, " +
                std::to_string(kv.total_len(b)) + "] or negative n");
  if (n == 0) return;
  if (!q || !k_new || !v_new || !o) throw Error("prefill_attention: null pointer");
  const RowKernels& K = select_kernels();
  const int d = kv.head_dim, hkv = kv.num_kv_heads, group = num_q_heads / hkv;
  const int sink_n = std::min(cached_len, kv.sink.len[b]);
  const int mid_n = std::min(cached_len - sink_n, kv.mid.len[b]);
  const int rec_n = cached_len - sink_n - mid_n;

  // A tile: tt consecutive tokens x the heads of one set (tt * heads <= kMaxQ).
  // A work item: a block of up to kTilesPerItem tiles of one (KV head, set);
  // keys are visited in chunks of kKeyChunk rows and each chunk is run for
  // every tile of the block while it is hot in L1/L2 (flash-attention style
  // blocking), so long prefills are bound by arithmetic, not memory.
  constexpr int kTilesPerItem = 32, kKeyChunk = 256;
  const int nsets = num_sets(group);
  const int max_set = (group + nsets - 1) / nsets;
  const int tt = std::max(1, kMaxQ / max_set);
  const int ntiles = (n + tt - 1) / tt;
  const int nblocks = (ntiles + kTilesPerItem - 1) / kTilesPerItem;
  const float qscale = sm_scale * kLog2e;
  const int64_t items = int64_t(nblocks) * hkv * nsets;
  const kv::RegionTable* regions[3] = {&kv.sink, &kv.mid, &kv.recent};
  const int lens[3] = {sink_n, mid_n, rec_n};
  const int cached_chunk = kKeyChunk;
  parallel_for(items, [&](int64_t it) {
    const int s = int(it % nsets);
    const int h = int((it / nsets) % hkv);
    const int blk = int(it / (int64_t(nsets) * hkv));
    const int g0 = set_begin(group, s), g1 = set_begin(group, s + 1), ng = g1 - g0;
    const int tile0 = blk * kTilesPerItem, tile1 = std::min(ntiles, tile0 + kTilesPerItem);
    const int nt = tile1 - tile0;
    // Per tile j: queries [j][kMaxQ][d], state m/l [j][kMaxQ], acc [j][kMaxQ][d], limits.
    std::vector<float> qbuf(size_t(nt) * kMaxQ * d), acc(size_t(nt) * kMaxQ * d, 0.0f);
    std::vector<float> m(size_t(nt) * kMaxQ, kNegInf), l(size_t(nt) * kMaxQ, 0.0f);
    std::vector<int> limit(size_t(nt) * kMaxQ, 0);
    std::vector<QuerySet> sets(nt);
    for (int j = 0; j < nt; ++j) {
      const int i0 = (tile0 + j) * tt, i1 = std::min(n, i0 + tt);
      for (int i = i0; i < i1; ++i)
        for (int g = 0; g < ng; ++g) {
          const int qi = (i - i0) * ng + g;
          const float* src = q + (int64_t(i) * num_q_heads + h * group + g0 + g) * d;
          float* dst = qbuf.data() + (size_t(j) * kMaxQ + qi) * d;
          for (int c = 0; c < d; ++c) dst[c] = src[c] * qscale;
          limit[size_t(j) * kMaxQ + qi] = i;
        }
      const size_t base = size_t(j) * kMaxQ;
      sets[j] = QuerySet{(i1 - i0) * ng, qbuf.data() + base * d, nullptr, m.data() + base, l.data() + base,
                         acc.data() + base * d};
    }
    // Cached rows: every tile sees all of them. Each chunk is widened once
    // (BF16 -> f32, quantized -> m + code*s, as the reference) into
    // transposed keys and row-major values, then shared by all tiles.
    std::vector<float> ckt(size_t(cached_chunk) * d), cv(size_t(cached_chunk) * d);
    for (int r = 0; r < 3; ++r)
      for (int c0 = 0; c0 < lens[r]; c0 += cached_chunk) {
        const int c1 = std::min(lens[r], c0 + cached_chunk);
        widen_rows(kv, *regions[r], r == 1, b, h, c0, c1, ckt.data(), cv.data());
        for (int j = 0; j < nt; ++j) K.dense_t(detail::DenseTRows{ckt.data(), cv.data(), d, c1 - c0, 0}, d, sets[j]);
      }
    // The chunk's own rows, causal: tile j needs keys [0, its last token].
    // Each key chunk is transposed once (kt [block][d][16]) and then shared
    // by all tiles of the item: logits without horizontal reductions.
    const int last = std::min(n, tile1 * tt);
    std::vector<float> kt(size_t(kKeyChunk) * d);
    for (int k0 = 0; k0 < last; k0 += kKeyChunk) {
      const int k1 = std::min(last, k0 + kKeyChunk);
      const int nblk = (k1 - k0 + detail::kBlock - 1) / detail::kBlock;
      std::fill(kt.begin(), kt.begin() + size_t(nblk) * d * detail::kBlock, 0.0f);
      for (int t = k0; t < k1; ++t) {
        const float* src = k_new + (int64_t(t) * hkv + h) * d;
        float* dst = kt.data() + size_t((t - k0) / detail::kBlock) * d * detail::kBlock + (t - k0) % detail::kBlock;
        for (int c = 0; c < d; ++c) dst[c * detail::kBlock] = src[c];
      }
      for (int j = 0; j < nt; ++j) {
        const int i0 = (tile0 + j) * tt, i1 = std::min(n, i0 + tt);
        if (i1 <= k0) continue;  // every key of this chunk is in the tile's future
        sets[j].limit = limit.data() + size_t(j) * kMaxQ;
        const int kend = std::min(k1, i1);
        K.dense_t(detail::DenseTRows{kt.data(), v_new + (int64_t(k0) * hkv + h) * d, int64_t(hkv) * d, kend - k0, k0},
                  d, sets[j]);
      }
    }
    for (int j = 0; j < nt; ++j) {
      const int i0 = (tile0 + j) * tt, i1 = std::min(n, i0 + tt);
      for (int i = i0; i < i1; ++i)
        for (int g = 0; g < ng; ++g) {
          const size_t qi = size_t(j) * kMaxQ + size_t(i - i0) * ng + g;
          float* out = o + (int64_t(i) * num_q_heads + h * group + g0 + g) * d;
          const float inv = 1.0f / l[qi];
          for (int c = 0; c < d; ++c) out[c] = acc[qi * d + c] * inv;
        }
    }
  });
}

}  // namespace oscar::kernels::cpu
