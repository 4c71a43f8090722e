// Cache-write and demotion kernels (see cache_write.h).
#include "kernels/cuda/cache_write.h"

#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "core/half.h"
#include "core/quant_format.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"

namespace oscar::kernels::cuda {

namespace {

constexpr int kRowsPerBlock = 4;  // warps per block, one row each
constexpr float kF16Max = 65504.0f;
constexpr float kInputLimit = 1e30f;

// Row index of (page, head, slot) in both pools (paged_kv.h's helpers are host-only):
// quantized rows are indexed by it, BF16 rows start at it * head_dim.
__device__ __forceinline__ int64_t pool_row(const kv::PagedKvView& kv, int32_t page, int h, int slot) {
  return (int64_t(page) * kv.num_kv_heads + h) * kv.page_size + slot;
}

// The clip index rule of core/quantizer.h clip_index (host side, passed in).
int clip_index_host(int d, float ratio) {
  if (!(ratio < 1.0f)) return d - 1;
  const double k = std::floor(static_cast<double>(ratio) * d);
  return static_cast<int>(k < 0 ? 0 : (k > d - 1 ? d - 1 : k));
}

__device__ __forceinline__ float abs_key(float v) {
  const float a = fabsf(v);
  return isnan(a) ? INFINITY : a;
}
__device__ __forceinline__ float finite_or_zero(float v) {
  return isfinite(v) ? fminf(fmaxf(v, -kInputLimit), kInputLimit) : 0.0f;
}
__device__ __forceinline__ float round_param(float v) {
  return f16_to_f32(f32_to_f16(fminf(fmaxf(v, -kF16Max), kF16Max)));
}
__device__ __forceinline__ float warp_min(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Clip (threshold = element clip_idx of sorted |y|, NaN as +inf; NaN -> 0) and
// quantize one row held as y[i] = channel lane + 32 i; writes the packed codes
// and fp16 (scale, min) params. `words`: D/16 shared words owned by this warp.
template <int D>
__device__ __forceinline__ void clip_quantize_store(float (&y)[D / 32], int clip_idx, int G, uint8_t* codes,
                                    uint16_t* params, uint32_t* words) {
  constexpr int V = D / 32;
  const int lane = threadIdx.x & 31;
  float key[V];
#pragma unroll
  for (int i = 0; i < V; ++i) key[i] = abs_key(y[i]);
  float tau;
  if (clip_idx >= D - 1) {
    float m = 0.0f;
#pragma unroll
    for (int i = 0; i < V; ++i) m = fmaxf(m, key[i]);
    tau = warp_max(m);
  } else {
    // Element clip_idx of the sorted keys: a bitonic sort of the D keys over
    // the warp (element e = 32 i + lane in key[i]; log2(D)(log2(D)+1)/2
    // compare-exchange stages, ~5x fewer instructions than a rank count),
    // then a broadcast. Keys have no NaN (abs_key), so min/max order them.
    constexpr int kLogN = D == 64 ? 6 : D == 128 ? 7 : 8;
    static_assert((1 << kLogN) == D, "head_dim 64, 128 or 256");
#pragma unroll
    for (int lk = 1; lk <= kLogN; ++lk)
#pragma unroll
      for (int ls = lk - 1; ls >= 0; --ls) {
        const int k = 1 << lk, st = 1 << ls;
        if (st >= 32) {
          const int js = st / 32;
#pragma unroll
          for (int i = 0; i < V; ++i)
            if ((i & js) == 0) {
              const int e = 32 * i + lane;
              const bool up = (e & k) == 0;
              const float a = key[i], b = key[i | js];
              key[i] = up ? fminf(a, b) : fmaxf(a, b);
              key[i | js] = up ? fmaxf(a, b) : fminf(a, b);
            }
        } else {
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const int e = 32 * i + lane;
            const float other = __shfl_xor_sync(0xffffffffu, key[i], st);
            const bool up = (e & k) == 0, lower = (lane & st) == 0;
            key[i] = (up == lower) ? fminf(key[i], other) : fmaxf(key[i], other);
          }
        }
      }
    // (A max over selects, not key[clip_idx / 32]: the compiler turned that
    // into a local-memory array; keys are >= 0.)
    float sel = -1.0f;
    const int jsel = clip_idx / 32;
#pragma unroll
    for (int i = 0; i < V; ++i) sel = fmaxf(sel, i == jsel ? key[i] : -1.0f);
    tau = __shfl_sync(0xffffffffu, sel, clip_idx % 32);
  }
#pragma unroll
  for (int i = 0; i < V; ++i)
    y[i] = finite_or_zero(isnan(y[i]) ? 0.0f : fminf(fmaxf(y[i], -tau), tau));

  if (lane < D / 16) words[lane] = 0u;
  __syncwarp();
  const int ngroups = D / G, per_lane = G / 4;
  for (int gm = 0; gm < ngroups; ++gm) {
    float lo = INFINITY, hi = -INFINITY;
#pragma unroll
    for (int i = 0; i < V; ++i)
      if ((32 * i) / G == gm) {
        lo = fminf(lo, y[i]);
        hi = fmaxf(hi, y[i]);
      }
    lo = warp_min(lo);
    hi = warp_max(hi);
    const float s = round_param(fmaxf(hi - lo, kMinRange) / 3.0f);
    const float m = round_param(lo);
#pragma unroll
    for (int i = 0; i < V; ++i)
      if ((32 * i) / G == gm) {
        int c = 0;
        if (s > 0.0f) {
          const float t = floorf(__fadd_rn(__fdiv_rn(__fsub_rn(y[i], m), s), 0.5f));
          c = static_cast<int>(fminf(fmaxf(t, 0.0f), 3.0f));
        }
        const int ig = (lane + 32 * i) % G;
        const int byte = gm * per_lane + ig % per_lane;
        const int shift = 2 * (ig / per_lane);
        atomicOr(words + byte / 4, static_cast<uint32_t>(c) << (8 * (byte % 4) + shift));
      }
    if (lane == 0)
      reinterpret_cast<uint32_t*>(params)[gm] =
          uint32_t(f32_to_f16(s)) | (uint32_t(f32_to_f16(m)) << 16);
  }
  __syncwarp();
  if (lane < D / 16) reinterpret_cast<uint32_t*>(codes)[lane] = words[lane];
}

struct WriteArgs {
  kv::PagedKvView kv;
  int n;
  const int32_t* pages;
  const int32_t* slots;
  const float* k;
  const float* v;
  WriteRotation rot;
  int clip_idx_k, clip_idx_v;
  uint32_t* done = nullptr;  // optional per-block flags: see write_bf16_tokens_dependent
  uint32_t epoch = 0;
};

// One block of 4 warps per row (token i, head h, K/V): row = blockIdx.x =
// (i * Hkv + h) * 2 + is_v. The d x d rotation is split over the warps by
// input channel (each lane then has all its loads of R in flight at once:
// decode writes few rows, so this kernel is latency-bound), the partial sums
// meet in shared memory, and warp 0 clips, quantizes and packs (the clip
// needs the whole row: INT2 rows are not split like the BF16 ones below).
template <int D>
__global__ void __launch_bounds__(32 * kRowsPerBlock) write_quant_kernel(const WriteArgs a) {
  __shared__ float xs[D];
  __shared__ float part[kRowsPerBlock][D];
  __shared__ uint32_t words[D / 16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int Hkv = a.kv.num_kv_heads;
  const int64_t row = blockIdx.x;
  const bool is_v = row & 1;
  const int64_t ih = row >> 1;
  const int i = static_cast<int>(ih / Hkv), h = static_cast<int>(ih % Hkv);
  const float* x = (is_v ? a.v : a.k) + ih * D;
  const float* R = is_v ? a.rot.v : a.rot.k;
  if (R && a.rot.r_heads != 1) R += int64_t(h) * D * D;
  const float* mean = is_v || !a.rot.k_mean ? nullptr : a.rot.k_mean + int64_t(h) * D;
  for (int c = threadIdx.x; c < D; c += 32 * kRowsPerBlock) xs[c] = mean ? x[c] - mean[c] : x[c];
  __syncthreads();
  float y[D / 32];
  if (R) {
    // Lane owns output channels [CH lane, CH lane + CH): one 8/16-byte load
    // per row of R, and every load of the warp's J rows is in flight at once.
    constexpr int J = D / kRowsPerBlock, CH = D / 32;
#pragma unroll
    for (int k = 0; k < CH; ++k) y[k] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < J; ++jj) {
      const int j = warp * J + jj;
      const float xj = xs[j];
      const float* rj = R + j * D + CH * lane;
      if constexpr (CH == 2) {
        const float2 v = __ldg(reinterpret_cast<const float2*>(rj));
        y[0] = fmaf(xj, v.x, y[0]);
        y[1] = fmaf(xj, v.y, y[1]);
      } else {
#pragma unroll
        for (int k = 0; k < CH; k += 4) {
          const float4 v = __ldg(reinterpret_cast<const float4*>(rj + k));
          y[k] = fmaf(xj, v.x, y[k]);
          y[k + 1] = fmaf(xj, v.y, y[k + 1]);
          y[k + 2] = fmaf(xj, v.z, y[k + 2]);
          y[k + 3] = fmaf(xj, v.w, y[k + 3]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < CH; ++k) part[warp][CH * lane + k] = y[k];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int k = 0; k < D / 32; ++k) {
      float acc = 0.0f;
#pragma unroll
      for (int w = 0; w < kRowsPerBlock; ++w) acc += part[w][lane + 32 * k];
      y[k] = acc;
    }
  } else {
    if (warp != 0) return;
#pragma unroll
    for (int k = 0; k < D / 32; ++k) y[k] = xs[lane + 32 * k];
  }
  const int32_t page = a.pages[i], slot = a.slots[i];
  const int64_t qr = pool_row(a.kv, page, h, slot);
  uint8_t* codes = (is_v ? a.kv.quant.v_codes : a.kv.quant.k_codes) + qr * (D / 4);
  uint16_t* params = (is_v ? a.kv.quant.v_params : a.kv.quant.k_params) + qr * (D / a.kv.group_size) * 2;
  clip_quantize_store<D>(y, is_v ? a.clip_idx_v : a.clip_idx_k, a.kv.group_size, codes, params, words);
}

// BF16 rows (window writes, the decode step's new tokens): no clip, so a
// row's output channels are independent and its d x d rotation splits over
// P = d / (32 NPB) blocks by output channel (32 NPB each: at d = 128 and
// NPB = 1 a 128 x 32 slice of R, 16 KB, instead of all 64 KB on one SM).
// Block = (token i, KV head h, K or V, part): blockIdx.x = ((i * Hkv + h) *
// 2 + is_v) * P + part; with kBoth, block = (i, h, part), blockIdx.x =
// (i * Hkv + h) * P + part, for K and V (half the blocks; an unrotated row
// is a copy whose loads fly beside the rotation's). Warp w takes input
// channels [w d/4, (w+1) d/4): per load instruction 4 input channels
// (lane / 8) x 32 outputs (8 lanes x 4), the d/16 loads of x and a part's
// d/16 loads of R issued before any arithmetic (one memory latency per
// part, not two), then shuffles and a shared-memory sum; warp 0 stores.
// With `done`, the block publishes its channels: done[blockIdx.x] = epoch
// (a release store after its writes), so that the decode launch's window
// tile holding the rows waits for exactly them.
template <int D, int NPB, bool kBoth>
__global__ void __launch_bounds__(32 * kRowsPerBlock) write_bf16_kernel(const WriteArgs a) {
  // In a decode step (decode_attention.h, StepWrite) the window launch may
  // start now: it waits for these rows (done) or for this grid.
  detail::pdl_launch_dependents();
  constexpr int P = D / 32 / NPB, JW = D / kRowsPerBlock, L = JW / 4;
  static_assert(P >= 1 && P * NPB * 32 == D, "NPB divides d/32");
  __shared__ float part[kRowsPerBlock][32 * NPB];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int Hkv = a.kv.num_kv_heads;
  const int64_t blk = blockIdx.x;
  const int c0 = static_cast<int>(blk % P) * 32 * NPB;  // the block's first output channel
  const int64_t ih = kBoth ? blk / P : blk / P / 2;
  const int kv0 = kBoth ? 0 : static_cast<int>((blk / P) & 1), kv1 = kBoth ? 2 : kv0 + 1;  // K = 0, V = 1
  const int i = static_cast<int>(ih / Hkv), h = static_cast<int>(ih % Hkv);
  const int64_t dst0 = pool_row(a.kv, a.pages[i], h, a.slots[i]) * D + c0;
  // Warp 0 stores every output of the block (so that its lane 0 alone can
  // publish them): unrotated rows are copies, loaded first, stored last.
  float copy[2][NPB];
  if (warp == 0)
#pragma unroll
    for (int kv = 0; kv < 2; ++kv)
      if (kv >= kv0 && kv < kv1 && !(kv ? a.rot.v : a.rot.k))
#pragma unroll
        for (int q = 0; q < NPB; ++q) {
          const int c = c0 + 32 * q + lane;
          copy[kv][q] = (kv ? a.v : a.k)[ih * D + c] - (!kv && a.rot.k_mean ? a.rot.k_mean[h * D + c] : 0.0f);
        }
#pragma unroll 1
  for (int kv = kv0; kv < kv1; ++kv) {
    const float* R = kv ? a.rot.v : a.rot.k;
    if (!R) continue;
    if (a.rot.r_heads != 1) R += int64_t(h) * D * D;
    const float* x = (kv ? a.v : a.k) + ih * D;
    const int j0 = warp * JW + (lane >> 3), c = c0 + 4 * (lane & 7);
    float xj[L];
#pragma unroll
    for (int k = 0; k < L; ++k) xj[k] = __ldg(x + j0 + 4 * k);
    if (!kv && a.rot.k_mean) {
      const float* m = a.rot.k_mean + int64_t(h) * D;
#pragma unroll
      for (int k = 0; k < L; ++k) xj[k] -= __ldg(m + j0 + 4 * k);
    }
    // Part q's 32 outputs from its loads of R: FMAs, then the sum of the
    // warp's 4 input-channel groups (lanes l, l ^ 8, l ^ 16, l ^ 24).
    auto part_sum = [&](const float4(&r)[L], int q) {
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int k = 0; k < L; ++k) {
        acc[0] = fmaf(xj[k], r[k].x, acc[0]);
        acc[1] = fmaf(xj[k], r[k].y, acc[1]);
        acc[2] = fmaf(xj[k], r[k].z, acc[2]);
        acc[3] = fmaf(xj[k], r[k].w, acc[3]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], 8);
        acc[e] += __shfl_xor_sync(0xffffffffu, acc[e], 16);
      }
      if (lane < 8)
#pragma unroll
        for (int e = 0; e < 4; ++e) part[warp][32 * q + 4 * lane + e] = acc[e];
    };
    auto load_r = [&](float4(&r)[L], int q) {
#pragma unroll
      for (int k = 0; k < L; ++k)
        r[k] = __ldg(reinterpret_cast<const float4*>(R + int64_t(j0 + 4 * k) * D + c + 32 * q));
    };
    if constexpr (kBoth) {
      // (Large batches.) One part at a time: few registers, so that the
      // blocks, which run in the middle launch's tail, fit in the slots its
      // CTAs free; part 0's loads of R are issued with those of x.
#pragma unroll 1
      for (int q = 0; q < NPB; ++q) {
        float4 r[L];
        load_r(r, q);
        part_sum(r, q);
      }
    } else {
      // (Small batches, whose write latency shows.) Every part's loads at once.
      float4 r[NPB][L];
#pragma unroll
      for (int q = 0; q < NPB; ++q) load_r(r[q], q);
#pragma unroll
      for (int q = 0; q < NPB; ++q) part_sum(r[q], q);
    }
    __syncthreads();
    if (warp == 0) {
      uint16_t* dst = (kv ? a.kv.bf16.v : a.kv.bf16.k) + dst0;
#pragma unroll
      for (int q = 0; q < NPB; ++q) {
        float y = 0.0f;
#pragma unroll
        for (int w = 0; w < kRowsPerBlock; ++w) y += part[w][32 * q + lane];
        dst[32 * q + lane] = f32_to_bf16(y);
      }
    }
    if (kv + 1 < kv1) __syncthreads();  // part is reused by the V rotation
  }
  if (warp != 0) return;
#pragma unroll
  for (int kv = 0; kv < 2; ++kv)
    if (kv >= kv0 && kv < kv1 && !(kv ? a.rot.v : a.rot.k)) {
      uint16_t* dst = (kv ? a.kv.bf16.v : a.kv.bf16.k) + dst0;
#pragma unroll
      for (int q = 0; q < NPB; ++q) dst[32 * q + lane] = f32_to_bf16(copy[kv][q]);
    }
  if (a.done) {
    __syncwarp();  // the warp's stores before lane 0's release
    if (lane == 0) {
      __threadfence();
      detail::st_release_gpu(a.done + blk, a.epoch);
    }
  }
  // Launched as a programmatic dependent (write_bf16_tokens_dependent): the
  // grid completes only after the previous launch has. No-op otherwise.
  detail::pdl_wait();
}

struct DemoteArgs {
  kv::PagedKvView kv;
  int num_pages, num_tokens;
  const int32_t* bf16_pages;
  const int32_t* quant_pages;
  int clip_idx_k, clip_idx_v;
  const float* key_offset;  // [num_pages][Hkv][D] or nullptr (page centering)
  // Per-head clip indices (calibrations searched per head), used when per_head_clips.
  bool per_head_clips = false;
  int16_t head_clip_k[kMaxClipHeads] = {}, head_clip_v[kMaxClipHeads] = {};
};

// Rows are (page p, head h, slot s, K/V).
template <int D>
__global__ void __launch_bounds__(32 * kRowsPerBlock) demote_kernel(const DemoteArgs a) {
  // In a decode step (decode_attention.h, StepDemote) the next launch may
  // start now: nothing after it in the step reads the new INT2 pages.
  detail::pdl_launch_dependents();
  __shared__ uint32_t words[kRowsPerBlock][D / 16];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int Hkv = a.kv.num_kv_heads, T = a.num_tokens;
  const int64_t row = int64_t(blockIdx.x) * kRowsPerBlock + warp;
  // Launched as a programmatic dependent (demote_pages_dependent): the grid
  // completes only after the previous launch has (block 0 always waits).
  if (row >= int64_t(a.num_pages) * Hkv * T * 2) {
    if (blockIdx.x == 0) detail::pdl_wait();
    return;
  }
  const bool is_v = row & 1;
  int64_t rest = row >> 1;
  const int s = static_cast<int>(rest % T);
  rest /= T;
  const int h = static_cast<int>(rest % Hkv);
  const int p = static_cast<int>(rest / Hkv);
  const int32_t src_page = a.bf16_pages[p], dst_page = a.quant_pages[p];
  const uint16_t* src = (is_v ? a.kv.bf16.v : a.kv.bf16.k) + pool_row(a.kv, src_page, h, s) * D;
  float y[D / 32];
#pragma unroll
  for (int c = 0; c < D / 32; ++c) y[c] = bf16_to_f32(src[lane + 32 * c]);
  if (!is_v && a.key_offset) {
    const float* off = a.key_offset + (int64_t(p) * Hkv + h) * D;
#pragma unroll
    for (int c = 0; c < D / 32; ++c) y[c] -= off[lane + 32 * c];
  }
  const int64_t qr = pool_row(a.kv, dst_page, h, s);
  uint8_t* codes = (is_v ? a.kv.quant.v_codes : a.kv.quant.k_codes) + qr * (D / 4);
  uint16_t* params = (is_v ? a.kv.quant.v_params : a.kv.quant.k_params) + qr * (D / a.kv.group_size) * 2;
  const int clip_idx = a.per_head_clips ? (is_v ? a.head_clip_v[h] : a.head_clip_k[h])
                                        : (is_v ? a.clip_idx_v : a.clip_idx_k);
  clip_quantize_store<D>(y, clip_idx, a.kv.group_size, codes, params, words[warp]);
  detail::pdl_wait();
}

bool format_ok(const kv::PagedKvView& kv) {
  return (kv.head_dim == 64 || kv.head_dim == 128 || kv.head_dim == 256) && kv.num_kv_heads > 0 &&
         kv.page_size > 0 && kv.page_size % 16 == 0 &&
         (kv.group_size == 32 || kv.group_size == 64 || kv.group_size == 128) &&
         kv.group_size <= kv.head_dim;
}

unsigned blocks_for(int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

// Unrotated rows (write_bf16_tokens without a rotation: a step's rows already transformed by
// rotate_queries_keys, or a method without one): a copy to BF16, k_mean subtracted from keys.
// One thread per 8 channels of one (token i, head h, K/V) row, two float4 loads, one 16-byte
// store; blocks of 256 threads, row order as write_bf16_kernel's (K then V of each head).
// write_bf16_kernel's copy path (warp 0 of a 4-warp block per 32 channels) wrote an 8192-token
// chunk of Qwen3-8B's 8 KV heads in 0.63 ms (Nsight Compute, H200), at ~160 GB/s.
template <int D>
__global__ void __launch_bounds__(256) copy_bf16_rows_kernel(const WriteArgs a) {
  constexpr int V8 = D / 8;
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int Hkv = a.kv.num_kv_heads;
  if (e >= int64_t(a.n) * Hkv * 2 * V8) return;
  const int c = static_cast<int>(e % V8) * 8;
  const int64_t row = e / V8, ih = row / 2;
  const int kv = static_cast<int>(row & 1), i = static_cast<int>(ih / Hkv), h = static_cast<int>(ih % Hkv);
  const float4* src = reinterpret_cast<const float4*>((kv ? a.v : a.k) + ih * D + c);
  float x[8];
  *reinterpret_cast<float4*>(x) = __ldg(src);
  *reinterpret_cast<float4*>(x + 4) = __ldg(src + 1);
  if (!kv && a.rot.k_mean) {
    const float* m = a.rot.k_mean + int64_t(h) * D + c;
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] -= __ldg(m + j);
  }
  uint32_t w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = uint32_t(f32_to_bf16(x[2 * j])) | (uint32_t(f32_to_bf16(x[2 * j + 1])) << 16);
  uint16_t* dst = (kv ? a.kv.bf16.v : a.kv.bf16.k) + pool_row(a.kv, a.pages[i], h, a.slots[i]) * D + c;
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// BF16 rows: `parts` blocks per (token, KV head) and K/V (1, 2, 4, ... up
// to d/32), or with `both` per (token, KV head) for K and V together; the
// instance whose NPB = d/32/parts. (INT2 rows: one block per row, below.)
template <int D, bool kBoth>
cudaError_t launch_bf16_write(const WriteArgs& a, int parts, dim3 grid, bool programmatic, cudaStream_t stream) {
  const dim3 block(32 * kRowsPerBlock);
  auto go = [&](auto kernel) { return detail::launch_pdl(kernel, grid, block, 0, programmatic, stream, a); };
  constexpr int P = D / 32;
  if (parts == P) return go(write_bf16_kernel<D, 1, kBoth>);
  if (parts * 2 == P) return go(write_bf16_kernel<D, 2, kBoth>);
  if constexpr (P >= 4)
    if (parts * 4 == P) return go(write_bf16_kernel<D, 4, kBoth>);
  if constexpr (P >= 8)
    if (parts * 8 == P) return go(write_bf16_kernel<D, 8, kBoth>);
  return cudaErrorInvalidValue;
}

template <bool kQuant>
cudaError_t launch_write(const WriteArgs& a, cudaStream_t stream, bool programmatic = false, int parts = 0,
                         bool both = false) {
  if (!kQuant && parts == 0) parts = a.kv.head_dim / 32;
  const int64_t blocks = int64_t(a.n) * a.kv.num_kv_heads * (kQuant ? 2 : parts * (both ? 1 : 2));
  if (blocks == 0) return cudaSuccess;
  if (blocks > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  if constexpr (kQuant) {
    const dim3 block(32 * kRowsPerBlock);
    switch (a.kv.head_dim) {
      case 64: return detail::launch_pdl(write_quant_kernel<64>, grid, block, 0, programmatic, stream, a);
      case 128: return detail::launch_pdl(write_quant_kernel<128>, grid, block, 0, programmatic, stream, a);
      case 256: return detail::launch_pdl(write_quant_kernel<256>, grid, block, 0, programmatic, stream, a);
      default: return cudaErrorInvalidValue;
    }
  } else {
    auto go = [&](auto d_tag) {
      constexpr int D = decltype(d_tag)::value;
      return both ? launch_bf16_write<D, true>(a, parts, grid, programmatic, stream)
                  : launch_bf16_write<D, false>(a, parts, grid, programmatic, stream);
    };
    switch (a.kv.head_dim) {
      case 64: return go(std::integral_constant<int, 64>{});
      case 128: return go(std::integral_constant<int, 128>{});
      case 256: return go(std::integral_constant<int, 256>{});
      default: return cudaErrorInvalidValue;
    }
  }
}

bool rotation_ok(const kv::PagedKvView& kv, const WriteRotation& rot) {
  // Rows of R are read with 8/16-byte loads.
  if (reinterpret_cast<uintptr_t>(rot.k) % 16 || reinterpret_cast<uintptr_t>(rot.v) % 16) return false;
  return (!rot.k && !rot.v) || rot.r_heads == 1 || rot.r_heads == kv.num_kv_heads;
}

// One block per (page, KV head, layer), one thread per channel: the page's S angles staged in
// shared memory, then channel k's fp64 sum over the pairs (coalesced over k).
__global__ void page_centre_kernel(const PageCentreLayer* layers, const float* freq, int S, int Hkv, int d,
                                   int n, const int64_t* first_pos, double half_page, float* out) {
  __shared__ float cs[256];
  const int i = blockIdx.x, h = blockIdx.y, l = blockIdx.z, k = threadIdx.x;
  const PageCentreLayer L = layers[l];
  if (!L.u) return;  // the whole block: no centre in this layer
  const double t = double(first_pos[i]) + half_page;
  for (int s = k; s < S; s += blockDim.x) {
    double sn, cn;
    sincos(double(freq[s]) * t, &sn, &cn);
    cs[2 * s] = static_cast<float>(cn);
    cs[2 * s + 1] = static_cast<float>(sn);
  }
  __syncthreads();
  double acc = L.mu ? -double(L.mu[int64_t(h) * d + k]) : 0.0;
  const float* u = L.u + int64_t(h) * S * d + k;
  const float* w = L.w + int64_t(h) * S * d + k;
  for (int s = 0; s < S; ++s)
    acc += double(cs[2 * s]) * double(u[int64_t(s) * d]) + double(cs[2 * s + 1]) * double(w[int64_t(s) * d]);
  out[((int64_t(l) * n + i) * Hkv + h) * d + k] = static_cast<float>(acc);
}

}  // namespace

cudaError_t write_quant_tokens(const kv::PagedKvView& kv, int n, const int32_t* pages,
                               const int32_t* slots, const float* k, const float* v,
                               WriteRotation rot, ClipRatios clip, cudaStream_t stream) {
  if (!format_ok(kv) || kv.bits != 2 || n < 0 || !rotation_ok(kv, rot) || kv.key_axis != kv::KeyAxis::kToken)
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!pages || !slots || !k || !v || !kv.quant.k_codes || !kv.quant.v_codes || !kv.quant.k_params ||
      !kv.quant.v_params)
    return cudaErrorInvalidValue;
  WriteArgs a{kv, n, pages, slots, k, v, rot, clip_index_host(kv.head_dim, clip.k),
              clip_index_host(kv.head_dim, clip.v)};
  return launch_write<true>(a, stream);
}

cudaError_t write_bf16_tokens_dependent(const kv::PagedKvView& kv, int n, const int32_t* pages,
                                        const int32_t* slots, const float* k, const float* v,
                                        WriteRotation rot, bool programmatic, cudaStream_t stream,
                                        uint32_t* done, uint32_t epoch, int parts, bool both) {
  if (!format_ok(kv) || n < 0 || !rotation_ok(kv, rot) || parts < 0 || parts > kv.head_dim / 32 ||
      (parts > 0 && (kv.head_dim / 32) % parts != 0))
    return cudaErrorInvalidValue;
  if (n == 0) return cudaSuccess;
  if (!pages || !slots || !k || !v || !kv.bf16.k || !kv.bf16.v) return cudaErrorInvalidValue;
  WriteArgs a{kv, n, pages, slots, k, v, rot, 0, 0, done, epoch};
  return launch_write<false>(a, stream, programmatic, parts, both);
}

cudaError_t write_bf16_tokens(const kv::PagedKvView& kv, int n, const int32_t* pages,
                              const int32_t* slots, const float* k, const float* v,
                              WriteRotation rot, cudaStream_t stream) {
  // Without a rotation: the copy kernel (16-byte aligned rows of k, v and k_mean).
  auto a16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!rot.k && !rot.v && a16(k) && a16(v) && a16(rot.k_mean) && format_ok(kv) && n > 0 && pages && slots && k &&
      v && kv.bf16.k && kv.bf16.v && (kv.head_dim == 64 || kv.head_dim == 128 || kv.head_dim == 256)) {
    const WriteArgs a{kv, n, pages, slots, k, v, rot, 0, 0};
    const int64_t threads = int64_t(n) * kv.num_kv_heads * 2 * (kv.head_dim / 8);
    if ((threads + 255) / 256 > 0x7fffffff) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>((threads + 255) / 256)), block(256);
    switch (kv.head_dim) {
      case 64: copy_bf16_rows_kernel<64><<<grid, block, 0, stream>>>(a); break;
      case 128: copy_bf16_rows_kernel<128><<<grid, block, 0, stream>>>(a); break;
      default: copy_bf16_rows_kernel<256><<<grid, block, 0, stream>>>(a); break;
    }
    return cudaGetLastError();
  }
  return write_bf16_tokens_dependent(kv, n, pages, slots, k, v, rot, false, stream);
}

cudaError_t page_centres(const PageCentreLayer* layers, int num_layers, const float* freq, int pairs,
                         int num_kv_heads, int head_dim, int num_pages, const int64_t* first_pos,
                         int page_size, float* key_offset, cudaStream_t stream) {
  if (num_layers < 0 || num_pages < 0 || pairs < 0 || num_kv_heads <= 0 || page_size <= 0 ||
      (head_dim != 64 && head_dim != 128 && head_dim != 256) || pairs > head_dim / 2 ||
      num_kv_heads > 65535 || num_layers > 65535)
    return cudaErrorInvalidValue;
  if (num_layers == 0 || num_pages == 0) return cudaSuccess;
  if (!layers || !first_pos || !key_offset || (pairs > 0 && !freq)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(num_pages), static_cast<unsigned>(num_kv_heads),
                  static_cast<unsigned>(num_layers));
  page_centre_kernel<<<grid, head_dim, 0, stream>>>(layers, freq, pairs, num_kv_heads, head_dim, num_pages,
                                                    first_pos, 0.5 * (page_size - 1), key_offset);
  return cudaGetLastError();
}

cudaError_t demote_pages(const kv::PagedKvView& kv, int num_pages, const int32_t* bf16_pages,
                         const int32_t* quant_pages, ClipRatios clip, int num_tokens,
                         cudaStream_t stream, const float* key_offset, const ClipRatios* head_clips) {
  return demote_pages_dependent(kv, num_pages, bf16_pages, quant_pages, clip, num_tokens, false, stream,
                                key_offset, head_clips);
}

cudaError_t demote_pages_dependent(const kv::PagedKvView& kv, int num_pages, const int32_t* bf16_pages,
                                   const int32_t* quant_pages, ClipRatios clip, int num_tokens,
                                   bool programmatic, cudaStream_t stream, const float* key_offset,
                                   const ClipRatios* head_clips) {
  // Per-channel key params (kivi2) are not implemented here: per-token only.
  if (!format_ok(kv) || kv.bits != 2 || num_pages < 0 || kv.key_axis != kv::KeyAxis::kToken)
    return cudaErrorInvalidValue;
  if (num_tokens < 0) num_tokens = kv.page_size;
  if (num_tokens > kv.page_size) return cudaErrorInvalidValue;
  if (num_pages == 0 || num_tokens == 0) return cudaSuccess;
  if (!bf16_pages || !quant_pages || !kv.bf16.k || !kv.bf16.v || !kv.quant.k_codes ||
      !kv.quant.v_codes || !kv.quant.k_params || !kv.quant.v_params)
    return cudaErrorInvalidValue;
  if (head_clips && kv.num_kv_heads > kMaxClipHeads) return cudaErrorInvalidValue;
  DemoteArgs a{kv, num_pages, num_tokens, bf16_pages, quant_pages,
               clip_index_host(kv.head_dim, clip.k), clip_index_host(kv.head_dim, clip.v), key_offset};
  if (head_clips) {
    a.per_head_clips = true;
    for (int h = 0; h < kv.num_kv_heads; ++h) {
      a.head_clip_k[h] = static_cast<int16_t>(clip_index_host(kv.head_dim, head_clips[h].k));
      a.head_clip_v[h] = static_cast<int16_t>(clip_index_host(kv.head_dim, head_clips[h].v));
    }
  }
  const int64_t rows = int64_t(num_pages) * kv.num_kv_heads * num_tokens * 2;
  const dim3 grid(blocks_for(rows)), block(32 * kRowsPerBlock);
  switch (kv.head_dim) {
    case 64: return detail::launch_pdl(demote_kernel<64>, grid, block, 0, programmatic, stream, a);
    case 128: return detail::launch_pdl(demote_kernel<128>, grid, block, 0, programmatic, stream, a);
    case 256: return detail::launch_pdl(demote_kernel<256>, grid, block, 0, programmatic, stream, a);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace oscar::kernels::cuda
