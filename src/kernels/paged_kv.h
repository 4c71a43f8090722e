// Non-owning views of ONE layer's paged KV cache, as every attention kernel
// (CPU reference, CPU SIMD, CUDA) sees it, and KvBatch, the region tables of
// one step's batch that such views point into. The kernels include only this
// and core/; page memory comes from a backend's PageStore
// (backend/page_store.h), the tables from the caches' bookkeeping (kv/).
// Kernels only read (decode) or write single rows/pages (cache write, demotion).
// The types keep the namespace oscar::kv of their users (the caches fill them).
//
// Regions. Sequence b holds T_b tokens, split at fixed positions:
//   sink   positions [0, sink_len[b])                       BF16 pages
//   middle positions [sink_len[b], sink_len[b]+mid_len[b])  quantized pages (INT2/INT4)
//   recent positions [sink_len[b]+mid_len[b], T_b)          BF16 pages
// Each region starts at slot 0 of its first page. Region R of sequence b uses
// the pages R.indices[R.indptr[b] .. R.indptr[b+1]) in order; all but the last
// are full (page_size tokens); the last holds len - (npages-1)*page_size.
// An empty region has indptr[b] == indptr[b+1] and len[b] == 0.
//
// Basis. Every stored row is rotated: keys k_rot = rope(k) * R_K, values
// v_rot = v * R_V (R_V folded into W_v). The decode query must be rotated by
// R_K before the kernel, and the output is in the R_V basis (R_V^T folded
// into W_o). For methods without rotation R = I.
//
// BF16 page layout (HND, like FlashInfer's HND): element (page, h, slot, c) of K
// is k[page * page_stride + (h * page_size + slot) * head_dim + c], bf16 bits;
// page_stride = num_kv_heads * page_size * head_dim. V identical in `v`.
//
// Quantized page layout (HND), rows in the format of core/quant_format.h:
//   codes:  [page][h][slot][head_dim * bits / 8]   bytes
//   params: [page][h][slot][head_dim / group_size][2]  fp16 bits (scale, min)
// K and V have separate arrays of identical layout, except for the key params
// when key_axis == KeyAxis::kChannel (KIVI's per-channel keys):
//   k_params: [page][h][slot / kKeySpan][head_dim][2]  fp16 bits (scale, min)
// i.e. one (scale, min) per channel per span of kKeySpan = 32 consecutive slots
// of a page (spans never cross pages: page_size must be a multiple of 32).
// The key of slot t, channel c is then  min[span][c] + code * scale[span][c];
// its codes are packed per row exactly as per-token rows (group_size gives
// the packing groups, quant_format.h), only the params differ. Values are
// always per-token rows. The CPU kernels (reference and optimized) read both
// axes; the CUDA kernels read kToken only (check_decode, write_quant_tokens and
// demote_pages reject kChannel).
//
// Page centering (optional, `center`; core/key_transform.h PageCenter): middle page i of
// sequence b was quantized around the vector δ_h(t) of its centre position
// t = mid_page_center(sink.len[b], i, page_size), so the key of a middle row is
//   x̂ + δ_h(t),   δ_h(t) = Σ_s cos_s·u[h][s] + sin_s·w[h][s] − mu[h]
// with (cos_s, sin_s) = center.angles[angle_row(b, i)*S + s] (center_angles): row
// center.angle_start[b] + i, or mid.indptr[b] + i (a row per page-table slot) without
// angle_start. (A cache whose sequences share their middle pages' centre positions passes one
// table and a start of 0 for every sequence, so the table does not change from step to step.) The
// reference adds δ to the dequantized row; the fast kernels add the equal q·δ to the page's
// logits. pairs == 0: no centering.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

namespace oscar::kv {

// How the keys of the quantized pool are grouped for their (scale, min).
enum class KeyAxis : int32_t {
  kToken = 0,    // per token (row), groups of group_size channels (OSCAR, int2/int4 methods)
  kChannel = 1,  // per channel, groups of kKeySpan consecutive tokens of a page (KIVI)
};
inline constexpr int kKeySpan = 32;

struct RegionTable {
  const int32_t* indptr = nullptr;   // [batch + 1]
  const int32_t* indices = nullptr;  // [indptr[batch]] page ids in the region's pool
  const int32_t* len = nullptr;      // [batch] tokens in the region
};

struct Bf16PagePool {
  uint16_t* k = nullptr;  // [num_pages][num_kv_heads][page_size][head_dim] bf16
  uint16_t* v = nullptr;  // same
};

struct QuantPagePool {
  uint8_t* k_codes = nullptr;    // [num_pages][num_kv_heads][page_size][head_dim*bits/8]
  uint8_t* v_codes = nullptr;
  uint16_t* k_params = nullptr;  // [num_pages][num_kv_heads][page_size][head_dim/group_size][2] fp16
  uint16_t* v_params = nullptr;
};

struct MidCenter {
  int pairs = 0;                  // S; 0 = none
  const float* u = nullptr;       // [num_kv_heads][S][head_dim]
  const float* w = nullptr;       // [num_kv_heads][S][head_dim]
  const float* mu = nullptr;      // [num_kv_heads][head_dim]
  const float* angles = nullptr;  // [rows][S][2] (cos, sin): the rows of the middle pages
  // Host memory, optional: [num_kv_heads] 0 where a head's centre is 0 (u = w = mu = 0), so a
  // kernel may skip it; nullptr = every head. (CPU kernels only.)
  const uint8_t* active = nullptr;
  // [batch]: the angles row of sequence b's middle page 0 (page i: row angle_start[b] + i);
  // nullptr: mid.indptr[b] (rows = mid.indptr[batch], one per page-table slot).
  const int32_t* angle_start = nullptr;
  bool head_active(int h) const { return pairs > 0 && (!active || active[h]); }
  // The angles row of middle page i of sequence b (mid: the view's middle region table).
  int64_t angle_row(const int32_t* mid_indptr, int b, int64_t i) const {
    return (angle_start ? int64_t(angle_start[b]) : int64_t(mid_indptr[b])) + i;
  }
};

// Centre position of middle page i of a sequence whose sink holds sink_len tokens.
inline double mid_page_center(int64_t sink_len, int64_t page_index, int page_size) {
  return double(sink_len) + double(page_index) * page_size + 0.5 * (page_size - 1);
}
// (cos, sin) of θ_s · pos for S frequencies: cs [S][2]. Computed in double, stored as f32;
// demotion and attention both read these values.
inline void center_angles(const float* freq, int S, double pos, float* cs) {
  for (int s = 0; s < S; ++s) {
    const double a = double(freq[s]) * pos;
    cs[2 * s] = static_cast<float>(std::cos(a));
    cs[2 * s + 1] = static_cast<float>(std::sin(a));
  }
}
// δ_h of middle page i of sequence b (its angles in the table): out [head_dim].
inline void center_offset(const MidCenter& c, int head_dim, int h, const float* cs, float* out);
inline void mid_page_offset(const MidCenter& c, const RegionTable& mid, int head_dim, int b, int h, int i,
                            float* out) {
  center_offset(c, head_dim, h, c.angles + c.angle_row(mid.indptr, b, i) * c.pairs * 2, out);
}
// δ_h for angles cs [S][2]: out [head_dim] (fp64 accumulation, the pairs in order for each
// channel; the channels in blocks of 64 so that the inner loop runs over contiguous u / w).
inline void center_offset(const MidCenter& c, int head_dim, int h, const float* cs, float* out) {
  const int S = c.pairs, d = head_dim;
  constexpr int kBlock = 64;
  for (int k0 = 0; k0 < d; k0 += kBlock) {
    const int nk = d - k0 < kBlock ? d - k0 : kBlock;
    double acc[kBlock];
    for (int k = 0; k < nk; ++k) acc[k] = c.mu ? -double(c.mu[int64_t(h) * d + k0 + k]) : 0.0;
    for (int s = 0; s < S; ++s) {
      const double cn = cs[2 * s], sn = cs[2 * s + 1];
      const float* u = c.u + (int64_t(h) * S + s) * d + k0;
      const float* w = c.w + (int64_t(h) * S + s) * d + k0;
      for (int k = 0; k < nk; ++k) acc[k] += cn * u[k] + sn * w[k];
    }
    for (int k = 0; k < nk; ++k) out[k0 + k] = static_cast<float>(acc[k]);
  }
}

struct PagedKvView {
  int batch = 0;
  int num_kv_heads = 0;
  int head_dim = 0;      // 64, 128 or 256
  int page_size = 64;    // tokens per page, a multiple of 16
  int bits = 2;          // bits per code in the quantized pool (2 or 4)
  int group_size = 128;  // channels per (scale, min) group, divides head_dim
  Bf16PagePool bf16;     // sink and recent pages (one pool; regions index into it)
  QuantPagePool quant;   // middle pages
  RegionTable sink, mid, recent;

  int64_t bf16_page_elems() const { return int64_t(num_kv_heads) * page_size * head_dim; }
  int64_t bf16_row_offset(int32_t page, int h, int slot) const {
    return page * bf16_page_elems() + (int64_t(h) * page_size + slot) * head_dim;
  }
  int row_code_bytes() const { return head_dim * bits / 8; }
  int row_groups() const { return head_dim / group_size; }
  int64_t quant_row_index(int32_t page, int h, int slot) const {
    return (int64_t(page) * num_kv_heads + h) * page_size + slot;
  }
  int total_len(int b) const { return sink.len[b] + mid.len[b] + recent.len[b]; }

  // Declared last so that positional initializers of the fields above stay valid.
  KeyAxis key_axis = KeyAxis::kToken;
  MidCenter center;  // page centering of the middle (see above); pairs == 0: none

  // fp16 elements of key params per (page, KV head), for either axis.
  int64_t key_params_per_page_head() const {
    return key_axis == KeyAxis::kChannel ? int64_t(page_size / kKeySpan) * head_dim * 2
                                         : int64_t(page_size) * row_groups() * 2;
  }
  // kChannel: offset (fp16 elements) into quant.k_params of the [head_dim][2]
  // (scale, min) pairs of the span holding `slot`.
  int64_t key_span_params_offset(int32_t page, int h, int slot) const {
    return ((int64_t(page) * num_kv_heads + h) * (page_size / kKeySpan) + slot / kKeySpan) *
           int64_t(head_dim) * 2;
  }
};

// Region tables of one batch of sequences, shared by every layer (page id p is
// the same slot in every layer's pool). Owns the arrays the views point into;
// not copyable so views never dangle. Filled by KvCache::make_batch.
class KvBatch {
 public:
  KvBatch() = default;
  KvBatch(const KvBatch&) = delete;
  KvBatch& operator=(const KvBatch&) = delete;

  // The view of layer l for the kernels. Valid while this object and the cache live
  // and until the next make_batch into it.
  PagedKvView layer(int l) const {
    PagedKvView v = base;
    if (bf16_pools) v.bf16 = bf16_pools->at(l);
    if (quant_pools) v.quant = quant_pools->at(l);
    v.sink = {sink_indptr.data(), sink_indices.data(), sink_len.data()};
    v.mid = {mid_indptr.data(), mid_indices.data(), mid_len.data()};
    v.recent = {recent_indptr.data(), recent_indices.data(), recent_len.data()};
    if (centers && !centers->empty() && centers->at(l).pairs > 0) {
      v.center = centers->at(l);
      v.center.angles = mid_angles ? mid_angles->data() : nullptr;
      v.center.angle_start = mid_angle_start.data();
    }
    return v;
  }
  int batch() const { return static_cast<int>(recent_len.size()); }

  PagedKvView base;  // shapes and format; pools and tables are set by layer()
  std::vector<int32_t> sink_indptr, sink_indices, sink_len;
  std::vector<int32_t> mid_indptr, mid_indices, mid_len;
  std::vector<int32_t> recent_indptr, recent_indices, recent_len;
  const std::vector<Bf16PagePool>* bf16_pools = nullptr;   // [n_layers]
  const std::vector<QuantPagePool>* quant_pools = nullptr; // [n_layers] or null
  // Page centering: per layer u / w / mu (angles unset) or null; the cache's angle table
  // [rows][S][2] (middle page i of sequence b: row mid_angle_start[b] + i), shared with the
  // cache and never changed once made (a longer one is a new table, with a new version, so a
  // device copy is refreshed only when the version changes); mid_angle_start [batch].
  const std::vector<MidCenter>* centers = nullptr;
  std::shared_ptr<const std::vector<float>> mid_angles;
  uint64_t mid_angles_version = 0;
  std::vector<int32_t> mid_angle_start;
};

}  // namespace oscar::kv
