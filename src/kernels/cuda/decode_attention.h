// CUDA decode attention over the paged three-region KV cache (kernels/paged_kv.h):
// sink (BF16) + middle (INT2) + recent (BF16), split-KV with a log-sum-exp
// merge, GQA-aware (one CTA loads and unpacks a KV tile once for all query
// heads of its KV head). Specification: kernels/cpu/attention.h
// decode_attention_ref. Design notes and measured numbers: docs/kernels-cuda.md.
//
// Usage per decode step (per layer the same plan can be reused):
//   DecodePlan plan = plan_decode(batch, host region tables, ...); // host, cheap
//   DecodeWorkspace ws = ...; (capacity >= plan.num_chunks) // device buffers
//   upload_plan(plan, ws, stream);
//   decode_attention(params, plan, ws, stream);            // returns cudaError_t
//   (params.write / params.demote: the step's new rows and page demotions,
//    done inside the same launch sequence, in the middle launch's tail)
//
// Page centering (a view with kv.center.pairs > 0) needs a plan whose middle chunks each span
// at most kCenterMaxPages pages: plan_decode(..., max_mid_chunk_tiles =
// center_max_chunk_tiles(page_size)); check_decode refuses others.
// The host plan (HostRegions, DecodePlan, plan_decode) is in decode_plan.h,
// plain C++. The implementation's files: docs/kernels-cuda.md, "Files".
//
// Supported (compile-time dispatch, everything else is a clear error):
// head_dim 64/128/256, group 32/64/128 (<= head_dim), 2-bit codes, fp16
// params, GQA ratio 1..8, page_size a multiple of 16. With
// OSCAR_CUDA_MIN_INSTANCES only head_dim 128 / group 128 is compiled.
// This header compiles without nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "kernels/cuda/cache_write.h"
#include "kernels/cuda/decode_plan.h"
#include "kernels/paged_kv.h"

namespace oscar::kernels::cuda {

// This step's new rows, written into the BF16 windows by the decode launch
// sequence itself (rotate keys, round to BF16; write_bf16_tokens): between
// the middle launch (which reads no BF16 row) and the window launch, so that
// the write runs in the middle launch's tail instead of before it. One row
// per sequence: row b is sequence b's newest token (the last slot of its
// last non-empty window region); the window tile holding it waits for that
// row only.
struct StepWrite {
  int n = 0;                       // rows: 0 = no write, else the batch
  const int32_t* pages = nullptr;  // [n] BF16 page of each row (device)
  const int32_t* slots = nullptr;  // [n] slot in that page
  const float* k = nullptr;        // [n][Hkv][d] f32 post-RoPE keys, not yet rotated
  const float* v = nullptr;        // [n][Hkv][d] f32 values (already in the R_V basis)
  WriteRotation rot;               // R_K (and optionally R_V), as write_bf16_tokens
};

// Page demotions done by the decode launch sequence itself (demote_pages),
// after this step's write and before the window launch, in the middle
// launch's tail. The BF16 pages are read (the window chunks may read them
// too) and must not receive this step's write; the INT2 pages written must not
// be in this step's middle region (they join it in a later step, when the
// caller moves them into the tables).
struct StepDemote {
  int n = 0;                            // pages; 0 = none
  const int32_t* bf16_pages = nullptr;  // [n] device
  const int32_t* quant_pages = nullptr; // [n] device
  ClipRatios clip;                      // as demote_pages
  int num_tokens = -1;                  // slots per page (-1: full pages)
};

struct DecodeParams {
  kv::PagedKvView kv;      // device pointers (pools, region tables, lengths)
  const float* q = nullptr;  // [batch][Hq][d] f32 device, already rotated by R_K (16-byte aligned, as o)
  int num_q_heads = 0;       // Hq, a multiple of kv.num_kv_heads, Hq/Hkv <= 8
  float sm_scale = 0.0f;     // usually 1/sqrt(d)
  float* o = nullptr;        // [batch][Hq][d] f32 device, R_V basis (16-byte aligned: check_decode)
  float* lse = nullptr;      // [batch][Hq] f32 device (natural log) or nullptr
  int variant = 0;           // INT2 loop shape for d=128/G=128 (benchmarking; docs/kernels-cuda.md):
                             // 0 = default (= 4 where it applies, else 2; with whole-group
                             // copies where the plan's middle chunks start at multiples of 4
                             // tiles and the page size is a multiple of 64, v34), 1 = 2 tiles/step +
                             // register prefetch, 2 = 4 tiles/step cp.async ring, fp16 tensor
                             // cores for K and V (v7), 3 = the ring with int8 tensor cores for
                             // K (v10; GQA <= 4, else 2), 4 = the ring with int8 tensor cores
                             // for K and V (v13; GQA <= 4, else 2)
  int pdl = 1;               // launch the window and merge kernels as programmatic dependents
                             // (overlap with the middle launch's tail); 0 = plain launches
  StepWrite write;           // optional: this step's new rows (see StepWrite)
  StepDemote demote;         // optional: page demotions in the step's tail (see StepDemote)
};

// Device buffers the decode kernels use; the caller owns them (kv/ or the
// engine allocates once, sized for the largest plan).
struct DecodeWorkspace {
  int capacity = 0;                  // chunks the buffers hold
  int max_batch = 0;
  int max_q_heads = 0;
  int head_dim = 0;
  int32_t* chunks = nullptr;         // [capacity][8]: the chunks in launch order (upload_plan)
  int32_t* seq_chunk_ptr = nullptr;  // [max_batch+1]
  float* partial_o = nullptr;        // [capacity][max_q_heads][head_dim]
  float* partial_lse = nullptr;      // [capacity][max_q_heads] (log2 domain)
  int32_t* first_pages = nullptr;    // [capacity][4]: DecodePlan::first_pages in launch order
  float* center_coef = nullptr;      // [max_batch][max_q_heads][head_dim + 8]: page centering's
                                     // per-query coefficients (A_s, B_s, C, zero padding)
  uint32_t* step_sync = nullptr;     // [max_batch][max_q_heads][2][head_dim / 32], zeroed once:
                                     // the step write's per-block flags (DecodeParams::write, v42);
                                     // nullptr: the window tiles wait for the write launch's
                                     // completion instead
};

// cudaMalloc/cudaFree helpers for a workspace (throw oscar::Error on failure).
DecodeWorkspace alloc_decode_workspace(int capacity, int max_batch, int max_q_heads, int head_dim);
void free_decode_workspace(DecodeWorkspace& ws);

// Copies the plan's tables into the workspace (async on `stream`, from
// pageable host memory: the plan may change or go once the call returns; the
// copies are ordered before later work on `stream`, not with other streams).
// A plan whose tables do not
// fit the workspace or are inconsistent (sizes, chunk ids, regions) gives
// cudaErrorInvalidValue before anything is copied.
// Each entry: {b | region << 24, t0, t1, chunk id, page-table offset, region
// length, 0, 0} (32 bytes, one sector); a fused window chunk: {b | 3 << 24,
// first middle chunk id, end, chunk id, sink offset, sink length, recent
// offset, recent length}.
cudaError_t upload_plan(const DecodePlan& plan, const DecodeWorkspace& ws, cudaStream_t stream);

// Checks shapes, capacity and dispatch support; returns "" when fine, else a
// message naming the problem (the launchers return cudaErrorInvalidValue then).
std::string check_decode(const DecodeParams& p, const DecodePlan& plan, const DecodeWorkspace& ws);

// Mixed-precision decode: every sequence's sink + middle + recent tokens.
// Picks the BF16-only kernel instance when no middle region is non-empty.
cudaError_t decode_attention(const DecodeParams& p, const DecodePlan& plan,
                             const DecodeWorkspace& ws, cudaStream_t stream);

// Same design forced to the BF16-only instance (the baseline). The view's
// middle regions must be empty.
cudaError_t decode_attention_bf16(const DecodeParams& p, const DecodePlan& plan,
                                  const DecodeWorkspace& ws, cudaStream_t stream);

// Query rotation on the device (DESIGN §3.5: q~ = q R_K, once per step):
// q_rot[i][g] = (q[i][g] - mean[g]) * R[g / (Hq / r_heads)] (row vector times a row-major
// [d][d] matrix); r_heads is 1 (one rotation per layer) or Hkv (per KV head).
//   q, q_rot: [n][Hq][d] f32 device (q == q_rot is allowed); R: [r_heads][d][d];
//   mean: [Hq][d] or null (the key transform's centering, when these rows are keys).
// programmatic: launched as a programmatic dependent of the previous launch (PDL; the
// kernel waits for it before reading q).
cudaError_t rotate_queries(const float* q, int n, int num_q_heads, int d, const float* R,
                           int r_heads, float* q_rot, cudaStream_t stream, bool programmatic = false,
                           const float* mean = nullptr);
// A step's queries and keys in one launch, in place: q[i][g] = q[i][g] Rq[g / (Hq / r_heads)],
// k[i][h] = (k[i][h] - k_mean[h]) Rk[h / (Hkv / r_heads)] (k_mean [Hkv][d] or null: the key
// transform's centering). r_heads is 1 or Hkv for both.
cudaError_t rotate_queries_keys(float* q, int num_q_heads, const float* Rq, float* k, int num_kv_heads,
                                const float* Rk, const float* k_mean, int n, int d, int r_heads, cudaStream_t stream,
                                bool programmatic = false);

// Both rotations switch to a tiled kernel (the head's matrix staged in shared memory once per
// block of tokens) from this many tokens on, at d <= 128; below, and at d = 256, one block per
// row. Default 128; 0 keeps the per-row kernel for every call (A/B: OSCAR_CUDA_ROTATE_TILED).
// Process-wide.
void set_rotate_tiled_min_tokens(int tokens);
int rotate_tiled_min_tokens();
// The tiled rotation's products on the tensor cores (3xTF32, fp32 accuracy) instead of fp32 FMAs,
// at d = 64 and 128: kAuto (the default) where a call's (head, 128-token tile) items fill a wave
// of blocks (prefill chunks), kOn for every call that takes the tiled path (tests, A/B), kOff
// never (A/B: OSCAR_CUDA_ROTATE_MMA=0 / 1 / auto). Process-wide.
enum class RotateMma { kOff, kAuto, kOn };
void set_rotate_mma(RotateMma mode);
RotateMma rotate_mma();

#if defined(OSCAR_DECODE_TRACE)
// Diagnostic builds only (bench_decode --trace): buf[0] counts CTAs (zero it
// before a call), then per CTA 10 words {kind << 48 | head << 24 | position
// (split kernels: KV head, launch position; merge: q head, sequence), start,
// first data, loop end of warps 0..3, end (ns,
// %globaltimer), SM id, 0}, kind 0 middle / 1 window / 2 merge; capacity =
// entries.
cudaError_t set_decode_trace(unsigned long long* buf, int capacity);
#endif

}  // namespace oscar::kernels::cuda
