// Small fp32 kernels of the CUDA backend (backend_cuda.cu): the element-wise
// and row-wise parts of a layer, and the gather / permute / softmax steps of
// the GEMM-based prefill attention. Every launcher runs on `st`, checks
// nothing and returns nothing: the caller checks cudaGetLastError once per op.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "backend/sample.h"
#include "kernels/paged_kv.h"

namespace oscar::backend::cuda_ops {

// Small-batch linear layer, memory-bound: y[t][o] = sum_i x[t][i] W[o][i] (+ beta y[t][o])
// (+ b[o]) for t < n <= kGemvMaxRows, W [out][in] bf16 (in a multiple of 8, 16-byte
// aligned), x fp32, fp32 accumulation. Below gemv_mma_min_rows() rows: CUDA cores, x not
// rounded, one warp per R rows of W; from it on: tensor cores, x rounded to BF16.
// Programmatic dependent launch for every kernel below (sm_90; the default off): a
// kernel may be scheduled while the one before it runs, and waits for it before it
// touches memory that one could have written or read (only weights are read earlier).
void set_pdl(bool on);
bool pdl();

inline constexpr int kGemvMaxRows = 8;
// From `mma_from` rows on (and `in` a multiple of 32) it runs on the tensor cores
// (mma.sync; x rounded to BF16 as on the cuBLAS path); below, the fp32 CUDA-core kernel.
void gemv_bf16(const uint16_t* W, const float* x, int n, int out, int in, const float* bias, float beta, float* y,
               int mma_from, cudaStream_t st);
// y[i] = bf16(x[i])
void cast_bf16(const float* x, __nv_bfloat16* y, int64_t n, cudaStream_t st);
// y[r][c] += b[c]
void add_bias(float* y, const float* b, int rows, int cols, cudaStream_t st);
// y[r] = x[r] / rms(x[r]) * w (sum of squares in fp64, as the CPU backend); also
// rounded to BF16 into yb when non-null (a cuBLAS product's input: no cast launch)
void rms_norm(const float* x, const float* w, int rows, int dim, float eps, float* y, __nv_bfloat16* yb,
              cudaStream_t st);
// rotate-half RoPE in place, tables cos/sin [n][d/2] on the device
void rope(float* x, int n, int heads, int d, const float* cos, const float* sin, cudaStream_t st);
// out[t][j] = silu(gu[t][j]) * gu[t][inter + j]; also in BF16 into outb when non-null
void silu_mul(const float* gu, int n, int inter, float* out, __nv_bfloat16* outb, cudaStream_t st);
// x[i] += y[i]
void add(float* x, const float* y, int64_t n, cudaStream_t st);
// Backend::qkv_heads in one pass: qkv [n][(Hq + 2 Hkv) d] -> q, k (per-head RMSNorm with
// qn / kn when non-null, sums in fp64 as rms_norm; then rotate-half RoPE with cos / sin
// [n][d/2] on the device) and v (copied). d even, d/2 <= 1024.
void qkv_heads(const float* qkv, int n, int Hq, int Hkv, int d, const float* qn, const float* kn, float eps,
               const float* cos, const float* sin, float* q, float* k, float* v, cudaStream_t st);
// Backend::qkv_heads_into_cache for a step of few rows (the CUDA backend takes it up to
// kQkvHeadsCacheMaxRows) at d = 64, 128 or 256, in one launch: q, k, v as qkv_heads; where the
// layer has a transform (Rq and Rk [r_heads][d][d], set together) q = q Rq and
// k = (k - k_mean) Rk as kernels::cuda::rotate_queries_keys computes them; then row t's k and v,
// rounded to BF16, into slot slots[t] of page pages[t] of the layer's BF16 pools cache_k /
// cache_v (rows [page][Hkv][page_size][d]), as write_bf16_tokens does.
inline constexpr int kQkvHeadsCacheMaxRows = 64;
struct QkvHeadsCache {
  const float* qkv = nullptr;
  int n = 0, Hq = 0, Hkv = 0;
  const float* qn = nullptr;  // QK-norm weights [d], both or neither
  const float* kn = nullptr;
  float eps = 0.0f;
  const float* cos = nullptr;  // [n][d/2] on the device
  const float* sin = nullptr;
  float* q = nullptr;  // [n][Hq][d]
  float* k = nullptr;  // [n][Hkv][d]
  float* v = nullptr;
  const float* Rq = nullptr;
  const float* Rk = nullptr;
  const float* k_mean = nullptr;  // [Hkv][d] or null
  int r_heads = 1;                // 1 or Hkv
  uint16_t* cache_k = nullptr;
  uint16_t* cache_v = nullptr;
  const int32_t* pages = nullptr;  // [n] device
  const int32_t* slots = nullptr;
  int page_size = 0;
};
void qkv_heads_cache(const QkvHeadsCache& a, int d, cudaStream_t st);
// out[r] = argmax of row r of x [rows][cols] (ties: lowest index; NaN skipped; all NaN: 0)
size_t argmax_scratch_bytes(int rows, int cols);  // device scratch argmax_rows needs
void argmax_rows(const float* x, int rows, int cols, void* scratch, int32_t* out, cudaStream_t st);
// out[r] = the token of row r of logits [rows][V] as draws[r] asks, hist holding the penalized
// rows' ids (device memory; backend/sample.h; sample.cu): one CTA of 1024 threads and ~177 KB
// of shared memory per row. `slots`: the penalty slots, kPenaltySlotBytes each (RowDraw::pen_slot
// indexes them; null when no row names one). `adj` [rows][V]: scratch for the rows with a
// presence or frequency penalty (null when there is none).
inline constexpr int kPenaltySlotBytes = 32768;  // a bitmap of 262,144 ids
void sample_rows(const float* logits, int rows, int V, const RowDraw* draws, const int32_t* hist, uint32_t* slots,
                 float* adj, int32_t* out, cudaStream_t st);
// x[i] = emb[tokens[i]] (emb bf16 when `bf16`, else f32), tokens on the device
void embed(const void* emb, bool bf16, const int32_t* tokens, int n, int hidden, float* x,
           cudaStream_t st);

// ---- prefill attention (T = float or __nv_bfloat16)
// K, V [Hkv][Lt][d] of batch row b of `kv` (device tables): tokens [0, L) from
// the cache (BF16 rows, or INT2 rows dequantized: min + code * scale), tokens
// [L, Lt) from the chunk's own rows k_new/v_new [Lt - L][Hkv][d] f32.
template <typename T>
void gather_kv(const kv::PagedKvView& kv, int b, int L, const float* k_new, const float* v_new,
               int Lt, T* K, T* V, cudaStream_t st);
// q [n][Hq][d] rows [t0, t0 + nc) -> Qp [Hkv][nc * G][d] (row t * G + j = head h * G + j)
template <typename T>
void permute_q(const float* q, int t0, int nc, int Hq, int Hkv, int d, T* Qp, cudaStream_t st);
// Op [Hkv][nc * G][d] -> o [n][Hq][d] rows [t0, t0 + nc)
void unpermute_o(const float* Op, int t0, int nc, int Hq, int Hkv, int d, float* o,
                 cudaStream_t st);
// S [Hkv][nc * G][Lt] scores -> P (same layout, T): row (h, t, j) is the query
// of chunk token t0 + t, which sees keys [0, L + t0 + t]; scaled by sm_scale,
// softmax over them, zero beyond.
template <typename T>
void causal_softmax(const float* S, int Hkv, int nc, int G, int Lt, int L, int t0, float sm_scale,
                    T* P, cudaStream_t st);

}  // namespace oscar::backend::cuda_ops
