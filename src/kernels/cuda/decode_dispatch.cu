// The decode's dispatch (decode_attention.h): check_decode, and the launch
// sequence of one step (page centering, middle, step write, demotion,
// windows, merge) with the one place where runtime shapes become template
// arguments. The kernels are instantiated in the files of decode_dispatch.h.
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_args.cuh"
#include "kernels/cuda/decode_attention.h"
#include "kernels/cuda/decode_dispatch.h"

namespace oscar::kernels::cuda {

namespace {

using namespace decode_impl;

constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------
// Dispatch: the one place where runtime shapes become template arguments.
#if defined(OSCAR_CUDA_MIN_INSTANCES)
#define OSCAR_DISPATCH_HEAD_DIM(d, D, ...) \
  if ((d) == 128) {                        \
    constexpr int D = 128;                 \
    __VA_ARGS__                            \
  }
#define OSCAR_DISPATCH_GROUP(gs, D, G, ...) \
  if ((gs) == 128) {                        \
    constexpr int G = 128;                  \
    __VA_ARGS__                             \
  }
#else
#define OSCAR_DISPATCH_HEAD_DIM(d, D, ...) \
  if ((d) == 64) {                         \
    constexpr int D = 64;                  \
    __VA_ARGS__                            \
  } else if ((d) == 128) {                 \
    constexpr int D = 128;                 \
    __VA_ARGS__                            \
  } else if ((d) == 256) {                 \
    constexpr int D = 256;                 \
    __VA_ARGS__                            \
  }
#define OSCAR_DISPATCH_GROUP(gs, D, G, ...)   \
  if ((gs) == 32) {                           \
    constexpr int G = 32;                     \
    __VA_ARGS__                               \
  } else if ((gs) == 64) {                    \
    constexpr int G = 64;                     \
    __VA_ARGS__                               \
  } else if ((gs) == 128 && D >= 128) {       \
    constexpr int G = (D >= 128 ? 128 : 64);  \
    __VA_ARGS__                               \
  }
#endif

bool head_dim_supported(int d) {
#if defined(OSCAR_CUDA_MIN_INSTANCES)
  return d == 128;
#else
  return d == 64 || d == 128 || d == 256;
#endif
}
bool group_supported(int d, int gs) {
#if defined(OSCAR_CUDA_MIN_INSTANCES)
  return d == 128 && gs == 128;
#else
  return (gs == 32 || gs == 64 || gs == 128) && gs <= d;
#endif
}

// Whole-group copies in the int8 K/V ring where they apply (v34); 0 keeps
// the per-tile copies (A/B builds).
#ifndef OSCAR_GROUP_COPIES
#define OSCAR_GROUP_COPIES 1
#endif
template <int D, int G>
cudaError_t launch_quant(dim3 grid, const KernelArgs& a, int variant, bool groups, cudaStream_t stream) {
  constexpr bool pdl = false;  // reads q: after whatever produced it
  // head_dim 128 / group 128 (the benchmark shape) has three loop shapes
  // (`variant` picks, docs/kernels-cuda.md); the others use the
  // register-prefetch loop. The default copies whole 4-tile groups where
  // the plan and the page size allow (`groups`, v34).
  if constexpr (D == 128 && G == 128) {
    if (variant == 0 && groups && a.gqa <= 4) return launch_split<D, G, true, 3, false, true>(grid, pdl, stream, a);
    if ((variant == 0 || variant == 4) && a.gqa <= 4)
      return launch_split<D, G, true, 3>(grid, pdl, stream, a);
    if (variant == 3 && a.gqa <= 4)
      return launch_split<D, G, true, 2>(grid, pdl, stream, a);
    if (variant != 1)
      return launch_split<D, G, true, 0>(grid, pdl, stream, a);
  }
  return launch_split<D, G, true, 1>(grid, pdl, stream, a);
}

// The same with page centering folded into the loop (kCenter instances): the int8 K/V ring
// with whole-group copies where the default would take it, the fp16 ring for head_dim 128 /
// group 128 otherwise (variant 1: the register-prefetch loop), the register-prefetch loop for
// the other shapes. (The benchmark-only variants 3 and 4 map to these.)
// pdl: a programmatic dependent of center_coef_kernel (the kCenter instances wait first).
template <int D, int G>
cudaError_t launch_quant_centered(dim3 grid, const KernelArgs& a, int variant, bool groups, bool pdl,
                                  cudaStream_t stream) {
  if constexpr (D == 128 && G == 128) {
    if (variant == 0 && groups && a.gqa <= 4) return launch_split<D, G, true, 3, false, true, true>(grid, pdl, stream, a);
    if (variant != 1) return launch_split<D, G, true, 0, false, false, true>(grid, pdl, stream, a);
  }
  return launch_split<D, G, true, 1, false, false, true>(grid, pdl, stream, a);
}

// How the step write's blocks split its rows (v42; same-call A/Bs in
// docs/kernels-cuda.md). Its blocks run where the middle launch leaves room:
// at once where it does not fill the GPU, else in its tail, each in a slot
// that the window launch waits for (more blocks there delay the windows:
// 512 blocks at 8 x 32K cost ~1.5 us more than 128, 1024-2048 at 32 x 32K
// ~6.5 us more than 512). Where every row's d/32 parts fit in
// kStepWriteBlocks blocks with K and V rows in blocks of their own (batch
// <= 2 at 8 KV heads, d = 128), so: the parts of a row on as many SMs (1 x
// 4K: 3.7 -> 1.1 us in the step). Beyond, one block writes
// a (token, KV head)'s K and V, with as many parts per row as fit, and its
// parts one after the other (few registers: the tail's slots).
#ifndef OSCAR_STEP_WRITE_BLOCKS
#define OSCAR_STEP_WRITE_BLOCKS 128
#endif
constexpr int kStepWriteBlocks = OSCAR_STEP_WRITE_BLOCKS;
struct StepWriteSplit {
  int parts;  // blocks per row
  bool both;  // one block writes K and V
  int flags() const { return both ? parts : 2 * parts; }  // blocks per (token, KV head)
};
StepWriteSplit step_write_split(const DecodeParams& p) {
  const int64_t pairs = int64_t(p.write.n) * p.kv.num_kv_heads;
  const int all = p.kv.head_dim / 32;
  if (pairs * 2 * all <= kStepWriteBlocks) return {all, false};
  int parts = all;
  while (parts > 1 && pairs * parts > kStepWriteBlocks) parts /= 2;
  return {parts, true};
}

cudaError_t launch(const DecodeParams& p, const DecodePlan& plan, const DecodeWorkspace& ws,
                   cudaStream_t stream, bool force_bf16) {
  if (!check_decode(p, plan, ws).empty()) return cudaErrorInvalidValue;
  if (force_bf16 && plan.num_quant_chunks > 0) return cudaErrorInvalidValue;
  if (p.kv.batch == 0) return cudaSuccess;
  KernelArgs a;
  a.kv = p.kv;
  a.q = p.q;
  a.num_q_heads = p.num_q_heads;
  a.gqa = p.num_q_heads / p.kv.num_kv_heads;
  a.sm_scale_log2 = p.sm_scale * kLog2e;
  a.tiles_per_page = FastDiv(static_cast<uint32_t>(p.kv.page_size / kTileTokens));
  a.chunks = reinterpret_cast<const int4*>(ws.chunks);
  a.first_pages = plan.first_pages.empty() ? nullptr : ws.first_pages;
  a.partial_o = ws.partial_o;
  a.partial_lse = ws.partial_lse;
  a.step_write = p.write.n > 0;
  a.o = p.o;
  a.lse = p.lse;
  // v40: the step write publishes its rows to the window CTAs, under an
  // epoch of its own (never 0, the flag's initial value).
  static std::atomic<uint32_t> epochs{0};
  uint32_t epoch = 0;
  while (a.step_write && epoch == 0) epoch = ++epochs;
  uint32_t* const write_done = a.step_write ? ws.step_sync : nullptr;
  a.write_done = write_done;
  a.write_epoch = epoch;
  const StepWriteSplit split = step_write_split(p);
  a.write_flags = split.flags();
  const int nq = plan.num_quant_chunks, nb = plan.num_chunks - plan.num_quant_chunks;
  bool launched = false;
  const bool pdl = p.pdl != 0;
  const bool centered = p.kv.center.pairs > 0 && nq > 0;
  a.center_coef = centered ? ws.center_coef : nullptr;
  a.center_ld = centered ? coef_row_floats(p.kv.center.pairs) : 0;
  OSCAR_DISPATCH_HEAD_DIM(p.kv.head_dim, D, {
    if (centered) {
      // Page centering: each query's coefficients, before the middle launch, whose CTAs
      // make their pages' shifts from them and add those in the loop.
      OSCAR_CUDA_RETURN_IF_ERROR(
          launch_center_coef<D>(p.kv, p.q, p.num_q_heads, a.gqa, ws.center_coef, pdl, stream));
    }
    if (nq > 0) {
      OSCAR_DISPATCH_GROUP(p.kv.group_size, D, G, {
        a.first = 0;
        const bool groups = OSCAR_GROUP_COPIES != 0 && plan.mid_groups_aligned &&
                            p.kv.page_size % (kRingTiles * kTileTokens) == 0;
        const dim3 grid(p.kv.num_kv_heads, nq);
        OSCAR_CUDA_RETURN_IF_ERROR((centered ? launch_quant_centered<D, G>(grid, a, p.variant, groups, pdl, stream)
                                             : launch_quant<D, G>(grid, a, p.variant, groups, stream)));
        launched = true;
      });
      if (!launched) return cudaErrorInvalidValue;
    }
    if (a.step_write) {
      // This step's new rows, between the middle launch (a programmatic
      // dependent of it: runs in its tail; touches nothing it reads) and the
      // window launch, whose tiles holding the rows wait for it.
      OSCAR_CUDA_RETURN_IF_ERROR(write_bf16_tokens_dependent(p.kv, p.write.n, p.write.pages, p.write.slots,
                                                             p.write.k, p.write.v, p.write.rot,
                                                             pdl && nq > 0, stream, write_done, epoch,
                                                             split.parts, split.both));
    }
    if (p.demote.n > 0) {
      // Likewise: reads BF16 pages, writes INT2 pages this step does not
      // read; its grid completes after the launches before it.
      OSCAR_CUDA_RETURN_IF_ERROR(demote_pages_dependent(p.kv, p.demote.n, p.demote.bf16_pages, p.demote.quant_pages,
                                                        p.demote.clip, p.demote.num_tokens,
                                                        pdl && (nq > 0 || a.step_write), stream));
    }
    if (plan.fused_windows) {
      // One CTA per (sequence, KV head): its window, then (after the
      // launches before it) the merge with the middle's partials (v27).
      a.first = nq;
      return launch_split<D, 128, false, 0, true>(dim3(p.kv.num_kv_heads, nb),
                                                  pdl && (nq > 0 || a.step_write || p.demote.n > 0), stream, a);
    }
    if (nb > 0) {
      a.first = nq;
      // The window chunks do not read the middle's results: with PDL they
      // run in the middle launch's tail instead of after it.
      OSCAR_CUDA_RETURN_IF_ERROR((launch_split<D, 128, false, 0>(
          dim3(p.kv.num_kv_heads, nb), pdl && (nq > 0 || a.step_write || p.demote.n > 0), stream, a)));
    }
    OSCAR_CUDA_RETURN_IF_ERROR(launch_merge<D>(
        dim3(p.kv.batch, p.num_q_heads), pdl, stream, ws.seq_chunk_ptr, ws.partial_o,
        ws.partial_lse, p.num_q_heads, p.o, p.lse));
    return cudaGetLastError();
  });
  return cudaErrorInvalidValue;
}

}  // namespace

std::string check_decode(const DecodeParams& p, const DecodePlan& plan, const DecodeWorkspace& ws) {
  const kv::PagedKvView& kv = p.kv;
  const std::string who = "cuda decode_attention: ";
  if (!head_dim_supported(kv.head_dim))
    return who + "head_dim " + std::to_string(kv.head_dim) + " not compiled (64, 128, 256" +
           std::string(
#if defined(OSCAR_CUDA_MIN_INSTANCES)
               "; this build has OSCAR_CUDA_INSTANCES=min: 128 only"
#else
               ""
#endif
               ) +
           ")";
  if (kv.num_kv_heads <= 0 || p.num_q_heads <= 0 || p.num_q_heads % kv.num_kv_heads != 0)
    return who + "num_q_heads " + std::to_string(p.num_q_heads) + " is not a multiple of num_kv_heads " +
           std::to_string(kv.num_kv_heads);
  if (p.num_q_heads / kv.num_kv_heads > kMaxGqa)
    return who + "GQA ratio " + std::to_string(p.num_q_heads / kv.num_kv_heads) + " > 8 unsupported";
  if (kv.page_size <= 0 || kv.page_size % kTileTokens != 0)
    return who + "page_size " + std::to_string(kv.page_size) + " is not a positive multiple of 16";
  if (plan.num_quant_chunks > 0) {
    if (kv.bits != 2) return who + "only 2-bit codes are implemented (bits = " + std::to_string(kv.bits) + ")";
    if (!group_supported(kv.head_dim, kv.group_size))
      return who + "group_size " + std::to_string(kv.group_size) + " unsupported for head_dim " +
             std::to_string(kv.head_dim);
    if (!kv.quant.k_codes || !kv.quant.v_codes || !kv.quant.k_params || !kv.quant.v_params)
      return who + "middle pages present but quantized pool pointers are null";
    if (kv.key_axis != kv::KeyAxis::kToken)
      return who + "per-channel key params (kivi2's format) are not implemented on the GPU; "
                   "per-token keys only";
  }
  bool bf16_tokens = false;
  for (size_t b = 0; 6 * b + 5 < plan.regions.size(); ++b)
    bf16_tokens = bf16_tokens || plan.regions[6 * b + 1] > 0 || plan.regions[6 * b + 5] > 0;
  if (bf16_tokens && (!kv.bf16.k || !kv.bf16.v)) return who + "BF16 pages present but BF16 pool pointers are null";
  if (plan.batch != kv.batch) return who + "plan batch differs from view batch";
  if (!plan.first_pages.empty() && plan.first_pages_page_size != kv.page_size)
    return who + "plan's first pages were computed for page size " + std::to_string(plan.first_pages_page_size) +
           ", the view's is " + std::to_string(kv.page_size);
  if (plan.num_quant_chunks > 65535 || plan.num_chunks - plan.num_quant_chunks > 65535)
    return who + "plan has more than 65535 middle or window chunks (one grid dimension)";
  if (plan.num_chunks > ws.capacity)
    return who + "plan has " + std::to_string(plan.num_chunks) + " chunks, workspace holds " +
           std::to_string(ws.capacity);
  if (kv.batch > ws.max_batch || p.num_q_heads > ws.max_q_heads || kv.head_dim > ws.head_dim)
    return who + "workspace too small for batch/heads/head_dim";
  if (kv.batch > 0 && (!p.q || !p.o)) return who + "null q or o";
  if (reinterpret_cast<uintptr_t>(p.q) % 16 || reinterpret_cast<uintptr_t>(p.o) % 16)
    return who + "q and o must be 16-byte aligned";  // (read and written as float4)
  if (reinterpret_cast<uintptr_t>(kv.quant.k_codes) % 16 || reinterpret_cast<uintptr_t>(kv.bf16.k) % 16 ||
      reinterpret_cast<uintptr_t>(kv.bf16.v) % 16 || reinterpret_cast<uintptr_t>(kv.quant.v_codes) % 16)
    return who + "pools must be 16-byte aligned";
  if (kv.center.pairs > 0 && plan.num_quant_chunks > 0) {
    if (kv.center.pairs > kv.head_dim / 2 || !kv.center.u || !kv.center.w || !kv.center.angles)
      return who + "page centering without its vectors or angle table (or more pairs than head_dim / 2)";
    if (!ws.center_coef) return who + "page centering without the workspace's coefficient rows";
    const int tpp = kv.page_size / kTileTokens;
    if (chunk_pages_bound(plan.max_mid_chunk_tiles, tpp) > kCenterMaxPages)
      return who + "page centering: a middle chunk of the plan has " + std::to_string(plan.max_mid_chunk_tiles) +
             " tiles, which may span more than the " + std::to_string(kCenterMaxPages) +
             " pages whose shifts a CTA stages (plan_decode's max_mid_chunk_tiles: center_max_chunk_tiles)";
    if (p.demote.n > 0)
      return who + "step demotions (DecodeParams::demote) do not take page centres; demote with "
                   "demote_pages(..., key_offset) instead";
  }
  if (p.write.n < 0) return who + "write.n < 0";
  if (p.demote.n < 0) return who + "demote.n < 0";
  if (p.demote.n > 0) {
    if (!p.demote.bf16_pages || !p.demote.quant_pages || kv.bits != 2 || kv.key_axis != kv::KeyAxis::kToken ||
        !kv.quant.k_codes || !kv.quant.v_codes || !kv.quant.k_params || !kv.quant.v_params || !kv.bf16.k ||
        !kv.bf16.v)
      return who + "demote: null page lists or pools, or a format demote_pages does not write";
    if (p.demote.num_tokens > kv.page_size) return who + "demote: num_tokens > page_size";
  }
  if (p.write.n > 0) {
    if (p.write.n != kv.batch)
      return who + "write.n " + std::to_string(p.write.n) + " != batch " + std::to_string(kv.batch) +
             " (one new row per sequence)";
    if (!p.write.pages || !p.write.slots || !p.write.k || !p.write.v || !kv.bf16.k || !kv.bf16.v)
      return who + "write: null pages, slots, k, v or BF16 pool";
    if (reinterpret_cast<uintptr_t>(p.write.rot.k) % 16 || reinterpret_cast<uintptr_t>(p.write.rot.v) % 16 ||
        ((p.write.rot.k || p.write.rot.v) && p.write.rot.r_heads != 1 && p.write.rot.r_heads != kv.num_kv_heads))
      return who + "write: rotation must be 16-byte aligned with r_heads 1 or num_kv_heads";
  }
  return "";
}

cudaError_t decode_attention(const DecodeParams& p, const DecodePlan& plan,
                             const DecodeWorkspace& ws, cudaStream_t stream) {
  return launch(p, plan, ws, stream, false);
}

cudaError_t decode_attention_bf16(const DecodeParams& p, const DecodePlan& plan,
                                  const DecodeWorkspace& ws, cudaStream_t stream) {
  return launch(p, plan, ws, stream, true);
}

#if defined(OSCAR_DECODE_TRACE)
cudaError_t set_decode_trace(unsigned long long* buf, int capacity) {
  // Every .cu with traced kernels has its own copy of the buffer's address.
  cudaError_t e = set_merge_trace(buf, capacity);
#if !defined(OSCAR_CUDA_MIN_INSTANCES)
  if (e == cudaSuccess) e = set_split_trace<64>(buf, capacity);
  if (e == cudaSuccess) e = set_split_trace<256>(buf, capacity);
#endif
  if (e == cudaSuccess) e = set_split_trace<128>(buf, capacity);
  return e;
}
#endif

}  // namespace oscar::kernels::cuda
