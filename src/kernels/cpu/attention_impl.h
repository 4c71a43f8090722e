// Internal interface between the attention driver (attention.cpp) and the
// per-ISA row kernels (attention_avx512.cpp, attention_avx2.cpp, scalar in
// attention.cpp). Not a public header.
//
// A "query set" is up to kMaxQ query vectors that read the same KV head
// (the query heads of one GQA group, or in prefill a tile of tokens x heads);
// every K/V row is loaded and dequantized once per set. Queries arrive
// pre-scaled by sm_scale * log2(e), so the kernels work in base 2: the
// running state per query is m (max logit, log2 units), l (sum of 2^(s-m))
// and acc[d] (sum of 2^(s-m) v).
#pragma once

#include <cstdint>

#include "kernels/paged_kv.h"

namespace oscar::kernels::cpu::detail {

inline constexpr int kMaxQ = 8;
inline constexpr int kBlock = 16;  // rows per softmax block (page sizes are multiples of 16)

struct QuerySet {
  int nq = 0;                     // 1..kMaxQ
  const float* q = nullptr;       // [nq][d] pre-scaled queries
  const int* limit = nullptr;     // [nq] last visible key index (causal), or nullptr: all
  float* m = nullptr;             // [nq] running state, m = -inf and l = 0 initially
  float* l = nullptr;             // [nq]
  float* acc = nullptr;           // [nq][d], zero initially
};

// Rows [i0, i1) of region `r` (page-table indexed) of sequence b, KV head h.
// key_base is the key index of row i0 (compared against QuerySet::limit).
struct RegionRows {
  const kv::PagedKvView* kv = nullptr;
  const kv::RegionTable* r = nullptr;
  bool quantized = false;
  int b = 0, h = 0, i0 = 0, i1 = 0;
  int key_base = 0;
  // Page centering (quantized rows, optional): every logit of the rows of region page
  // pi = i / page_size moves by shift[(pi - i0 / page_size) * shift_stride + j] (log2 domain)
  // for query j of the set. nullptr: no shift.
  const float* shift = nullptr;
  int shift_stride = 0;
  // The shifts of the page holding region row i (within [i0, i1)), or nullptr.
  const float* page_shift(int i) const {
    const int ps = kv->page_size;
    return shift ? shift + int64_t(i / ps - i0 / ps) * shift_stride : nullptr;
  }
};


// Dense f32 rows with keys pre-transposed: kt [ceil(n/kBlock)][d][kBlock]
// (block-major, rows past n zero), v row t at v + t*vstride.
struct DenseTRows {
  const float* kt = nullptr;
  const float* v = nullptr;
  int64_t vstride = 0;
  int n = 0;
  int key_base = 0;
};

struct RowKernels {
  const char* name;
  void (*region)(const RegionRows&, QuerySet&);
  void (*dense_t)(const DenseTRows&, int d, QuerySet&);
  // true: float kernels, kernel error tier vs the reference (f32 rounding
  // only). false: the INT2 middle uses integer dot products with a quantized
  // query and quantized value weights (attention_vnni.cpp), a separate,
  // bounded error tier.
  bool exact = true;
  // Approximate tier only: the query of each group is rounded to multiples of
  // max|q| / query_range, and the value weights w_t = p_t * s_t of a span of
  // at most weight_span consecutive middle rows to multiples of
  // max w / weight_range (tests derive the tolerance from these).
  float query_range = 0.0f, weight_range = 0.0f;
  int weight_span = 0;
};

const RowKernels& scalar_kernels();
const RowKernels* avx2_kernels();    // nullptr when not compiled in
const RowKernels* avx512_kernels();  // nullptr when not compiled in
// AVX-512 + VNNI + VBMI integer-dot-product kernel for INT2 middle rows
// (approximate tier, exact = false); other rows go to avx512_kernels().
const RowKernels* avx512_vnni_kernels();  // nullptr when not compiled in

// The kernel set decode_attention / prefill_attention use now.
const RowKernels& active_kernels();
// Tests and benchmarks: force one kernel set (nullptr: automatic selection).
// The caller checks that the CPU supports it (cpu_supports below).
void force_kernels(const RowKernels* k);
bool cpu_supports(const RowKernels& k);

}  // namespace oscar::kernels::cpu::detail
