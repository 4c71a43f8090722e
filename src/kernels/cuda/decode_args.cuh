// What the host hands the decode's split kernels: KernelArgs (one struct, by
// value; decode_dispatch.cu fills it, the kernels of decode_split_kernel.cuh
// read it) and the divider it carries. Named namespace, not the unnamed one
// of the device headers: the dispatch and the instance files pass it to
// each other.
#pragma once

#include <cstdint>

#include "kernels/paged_kv.h"

namespace oscar::kernels::cuda::decode_impl {

// Query heads per KV head: the N dimension (8) of m16n8k16.
inline constexpr int kMaxGqa = 8;

// Page centering: the length of a coefficient row (center_coef_kernel: the (A_s, B_s) pairs, C,
// zeros) for S RoPE pairs: >= 2S + 1 floats, an odd number of float4s; <= 2S + 8.
__host__ __device__ constexpr int coef_row_floats(int S) { return 4 * (((2 * S + 4) / 4) | 1); }

// ---------------------------------------------------------------------------
// Division by the run-time tiles-per-page without an integer divide
// (multiply-high by a magic number; exact for 0 <= n < 2^31).
struct FastDiv {
  uint32_t d = 1, magic = 0, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    while ((1u << shift) < d) ++shift;
    magic = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, magic) + n) >> shift; }
};

struct KernelArgs {
  kv::PagedKvView kv;
  const float* q;          // [batch][Hq][D]
  int num_q_heads;
  int gqa;
  float sm_scale_log2;     // sm_scale * log2(e)
  FastDiv tiles_per_page;  // page_size / 16
  const int4* chunks;      // [num_chunks][2] in launch order: {b | region << 24, t0, t1, chunk id},
                           // {page-table offset, region length, 0, 0} (upload_plan); fused window
                           // chunks (region 3): t0..t1 = the middle chunk ids, then {sink offset,
                           // sink length, recent offset, recent length}
  int first;               // this launch's first entry (blockIdx.y counts from it)
  const int32_t* first_pages;  // [num_chunks][4] in launch order (v44: DecodePlan::first_pages) or nullptr
  float* partial_o;        // [num_chunks][Hq][D]
  float* partial_lse;      // [num_chunks][Hq], log2 domain
  int step_write;          // the launch sequence writes new rows (DecodeParams::write)
  // Fused window + merge launch (v27, plan.fused_windows): the final outputs.
  float* o;                // [batch][Hq][D]
  float* lse;              // [batch][Hq] natural log, or nullptr
  // Step write (v40, v42): each block of the write launch publishes
  // write_epoch in its flag once its channels of the new K and/or V row are
  // written (flags of sequence b, KV head h: [(b Hkv + h) F, + F), F =
  // write_flags blocks per token and head, write_bf16_tokens_dependent);
  // the window tile holding the new rows waits for those instead of for the
  // write grid's completion (which follows the middle's). nullptr: pdl_wait.
  const uint32_t* write_done;
  uint32_t write_epoch;
  int write_flags;
  // Page centering (kCenter middle instances): each query's coefficient rows, [batch][Hq][ld]
  // with ld = coef_row_floats(kv.center.pairs), written by center_coef_kernel
  // (decode_center.cu) before the launch; each CTA turns them into its pages' shifts
  // (stage_page_bias). (Last: the other fields keep their parameter offsets, so the other
  // instances' code is unchanged by them.)
  const float* center_coef;
  int center_ld;
};

}  // namespace oscar::kernels::cuda::decode_impl
