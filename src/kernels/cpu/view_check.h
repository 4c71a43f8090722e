// Shared by the CPU kernels: validation of a PagedKvView before any kernel
// touches it, and region/position -> (page, slot) lookup. Internal header.
#pragma once

#include <cstdint>

#include <algorithm>

#include "kernels/cpu/cache_write.h"
#include "kernels/paged_kv.h"

namespace oscar::kernels::cpu::detail {

// Throws oscar::Error naming `who` and the problem: unsupported head_dim /
// group / bits / page size, a GQA ratio that does not divide, missing
// pointers for a non-empty region, or a page table whose page count does not
// match the region length.
void check_view(const kv::PagedKvView& kv, int num_q_heads, const char* who);

// The format part only (head_dim, num_kv_heads, page_size, bits, group_size,
// key_axis: kChannel needs page_size % kKeySpan == 0);
// used by the write kernels, which do not read the region tables.
void check_format(const kv::PagedKvView& kv, const char* who);

// Non-null pool pointers (the quantized pool: codes and params of K and V).
void check_quant_pool(const kv::PagedKvView& kv, const char* who);
void check_bf16_pool(const kv::PagedKvView& kv, const char* who);

// Arguments of a page demotion (the reference and the optimized kernel):
// the format, both pools, page ids, num_tokens (< 0: the whole page) and,
// for per-channel keys, whole key spans and no key clipping (clip_k >= 1).
// Returns the number of tokens to demote.
int check_demote(const kv::PagedKvView& kv, int32_t bf16_page, int32_t quant_page, float clip_k,
                 int num_tokens, const char* who);

// The key clip ratio check_demote checks: clip.k, or the smallest of head_clips' k
// ([num_kv_heads], when given).
inline float min_key_clip(const kv::PagedKvView& kv, ClipRatios clip, const ClipRatios* head_clips) {
  if (!head_clips) return clip.k;
  float k = head_clips[0].k;
  for (int h = 1; h < kv.num_kv_heads; ++h) k = std::min(k, head_clips[h].k);
  return k;
}

// Page ids must be non-negative and slots inside [0, page_size).
void check_slots(const kv::PagedKvView& kv, int n, const int32_t* pages, const int32_t* slots,
                 const char* who);

// Page id and slot of the i-th token of region `r` of sequence b.
inline int32_t region_page(const kv::RegionTable& r, const kv::PagedKvView& kv, int b, int i) {
  return r.indices[r.indptr[b] + i / kv.page_size];
}

}  // namespace oscar::kernels::cpu::detail
