// Decode-attention benchmark on Qwen3-8B attention shapes (32 query heads,
// 8 KV heads, d = 128, page 64): the INT2 three-region kernel (sink 64 BF16 +
// INT2 middle + recent 256 BF16, group 128, fp16 params) vs our BF16 paged
// kernel of the same design, per layer, DESIGN §7 reporting: time, bytes, GB/s,
// % of the copy bandwidth measured in the same run, floor = bytes / copy BW.
// Also times the per-step cache write (one token per sequence into the recent
// BF16 window, rotated) and the page demotion (one page per sequence every
// `page` steps) against the decode step.
//
//   bench_decode [--quick] [--csv FILE] [--iters N] [--warmup N] [--only BATCH,CTX] [--pdl 0|1]
//                [--ctas N] [--skew S] [--fuse F] [--first-pages 0|1] [--int2] [--parts] [--trace]
//                [--trace-dump FILE]
// --first-pages 0: plans without the host page table (every CTA looks its
// first pages up behind its chunk entry; v44 default 1: the plan carries them).
// --parts times the call with plans that leave regions out; --trace (a build
// with -DOSCAR_DECODE_TRACE) prints the CTA timeline of one call; --trace-dump
// also appends every CTA (batch,ctx,i,kind,head,position,sm,start,first
// data,loop end of warps 0-3,end; us; merge: q head and sequence) to FILE.
// Rows: int2 = the default INT2 kernel (int8-key loop, v10), bf16 = our BF16
// baseline, int2v7 = the previous INT2 loop (fp16 tensor cores for K, v7) in
// the same run.
// L2 is emptied before every timed launch (256 MB memset, or a 256 MB read
// with OSCAR_BENCH_FLUSH=read: see Timer); median of N.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/cuda/cache_write.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_attention.h"

using namespace oscar;
using namespace oscar::kernels::cuda;

namespace {

constexpr int kHq = 32, kHkv = 8, kD = 128, kPage = 64, kGroup = 128, kSink = 64, kRecent = 256;

__device__ __forceinline__ uint32_t hash32(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
__device__ __forceinline__ float unit(uint64_t i, uint32_t seed) {  // [-1, 1)
  return (hash32(i * 0x9E3779B97F4A7C15ULL + seed) >> 8) * (2.0f / 16777216.0f) - 1.0f;
}
__global__ void fill_bf16(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = static_cast<uint16_t>(__float_as_uint(1.7f * unit(i, seed)) >> 16);
}
__global__ void fill_bytes(uint32_t* p, size_t n_words, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n_words; i += size_t(gridDim.x) * blockDim.x)
    p[i] = hash32(i + (uint64_t(seed) << 40));
}
// (scale, min) pairs: scale in [0.4, 0.8], min = -1.5 scale.
__global__ void fill_params(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float s = 0.6f + 0.2f * unit(i, seed);
    const __half hs = __float2half(s), hm = __float2half(-1.5f * s);
    p[i] = uint32_t(__half_as_ushort(hs)) | (uint32_t(__half_as_ushort(hm)) << 16);
  }
}
__global__ void empty_kernel() {}
__global__ void fill_f32(float* p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = scale * unit(i, seed);
}

template <typename T>
T* dalloc(size_t n) {
  T* p = nullptr;
  OSCAR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
  return p;
}

// Reads n 16-byte words, four independent loads in flight per thread and
// step; writes only if their xor is a value it never is in practice (keeps
// the loads alive). kStream: evict-first loads (the read floor below: a
// plain streaming read of a call's bytes, timed like the call); otherwise
// plain loads, which leave the lines in L2 (the read flush).
template <bool kStream>
__global__ void read_kernel(const uint4* p, size_t n, uint4* sink) {
  auto ld = [](const uint4* q) { return kStream ? __ldcs(q) : *q; };
  uint4 x = make_uint4(0, 0, 0, 0);
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = ld(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) x.x ^= v[u].x, x.y ^= v[u].y, x.z ^= v[u].z, x.w ^= v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = ld(p + i);
    x.x ^= v.x, x.y ^= v.y, x.z ^= v.z, x.w ^= v.w;
  }
  if (x.x == 0x9E3779B9u && x.y == 0x7F4A7C15u) *sink = x;
}

// L2 is emptied before each timed launch, by one of:
//   write (default): a 256 MB memset, as Triton's do_bench and our earlier
//     tables; it leaves ~50 MB of dirty lines in L2 whose write-back to DRAM
//     then happens during the timed launch;
//   read (OSCAR_BENCH_FLUSH=read): a 256 MB read, leaving L2 full of clean
//     lines, as after a weight-streaming GEMM.
struct Timer {
  cudaEvent_t a, b;
  void* flush;
  size_t flush_bytes = size_t(256) << 20;
  bool read_flush = false;
  Timer() {
    OSCAR_CUDA_CHECK(cudaEventCreate(&a));
    OSCAR_CUDA_CHECK(cudaEventCreate(&b));
    OSCAR_CUDA_CHECK(cudaMalloc(&flush, flush_bytes + 16));
    const char* f = std::getenv("OSCAR_BENCH_FLUSH");
    read_flush = f && !std::strcmp(f, "read");
    if (read_flush) OSCAR_CUDA_CHECK(cudaMemset(flush, 1, flush_bytes));
  }
  void empty_l2(int i) {
    if (read_flush)
      read_kernel<false><<<132 * 8, 256>>>(static_cast<const uint4*>(flush), flush_bytes / 16,
                                    reinterpret_cast<uint4*>(static_cast<char*>(flush) + flush_bytes));
    else
      OSCAR_CUDA_CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes));
  }
  // Median time (ms) of fn() over iters, L2 flushed before each.
  // Warm-up calls, each after a flush like the timed ones, at least
  // `warmup` of them and for at least 30 ms: a fresh process's first calls
  // run slower (8 x 32K, v34: 54 us as the median of 15 calls after 2 in a
  // new process, 49.5 us of 200; docs/kernels-cuda.md).
  int warmup = 30;
  template <typename F>
  double median_ms(F&& fn, int iters) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0;; ++i) {
      empty_l2(i);
      fn();
      if (i + 1 >= warmup && (i & 7) == 7) {
        OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
        if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(30)) break;
      }
    }
    std::vector<float> t;
    for (int i = 0; i < iters; ++i) {
      empty_l2(i);
      OSCAR_CUDA_CHECK(cudaEventRecord(a));
      fn();
      OSCAR_CUDA_CHECK(cudaEventRecord(b));
      OSCAR_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      OSCAR_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(ms);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

unsigned grid_for(size_t n) { return static_cast<unsigned>(std::min<size_t>((n + 255) / 256, 132 * 64)); }

// One layer's cache for `batch` sequences of `ctx` tokens. int2: three
// regions; else every token in one BF16 region (the baseline).
struct BenchCache {
  bool int2;
  int batch, ctx;
  std::vector<int32_t> h_len[3], h_indptr[3], h_indices[3];  // host copies of the region tables (the plan's input)
  int32_t *indptr[3] = {}, *indices[3] = {}, *len[3] = {};
  uint16_t *bk = nullptr, *bv = nullptr, *kp = nullptr, *vp = nullptr;
  uint8_t *kc = nullptr, *vc = nullptr;
  kv::PagedKvView view;
  double kv_bytes = 0;  // bytes of K/V (codes, params, BF16 rows) the step must read
  int n_bf16_pages = 0;
  int first_spare_quant_page = 0;  // int2: `batch` INT2 pages no region uses (demotion targets)

  BenchCache(bool int2_, int batch_, int ctx_, std::mt19937& rng) : int2(int2_), batch(batch_), ctx(ctx_) {
    const int lens[3] = {int2 ? std::min(ctx, kSink) : ctx, int2 ? std::max(ctx - kSink - kRecent, 0) : 0,
                         int2 ? std::min(std::max(ctx - kSink, 0), kRecent) : 0};
    int next[2] = {0, 0};
    for (int r = 0; r < 3; ++r) h_indptr[r].push_back(0);
    for (int b = 0; b < batch; ++b)
      for (int r = 0; r < 3; ++r) {
        h_len[r].push_back(lens[r]);
        const int np = (lens[r] + kPage - 1) / kPage;
        for (int p = 0; p < np; ++p) h_indices[r].push_back(next[r == 1]++);
        h_indptr[r].push_back(static_cast<int32_t>(h_indices[r].size()));
      }
    // Shuffle page ids inside each pool: pages of a sequence are not contiguous.
    std::vector<int32_t> perm_b(next[0]), perm_q(next[1]);
    std::iota(perm_b.begin(), perm_b.end(), 0);
    std::iota(perm_q.begin(), perm_q.end(), 0);
    std::shuffle(perm_b.begin(), perm_b.end(), rng);
    std::shuffle(perm_q.begin(), perm_q.end(), rng);
    for (int r = 0; r < 3; ++r)
      for (auto& id : h_indices[r]) id = (r == 1 ? perm_q : perm_b)[id];
    n_bf16_pages = next[0];
    first_spare_quant_page = next[1];
    const size_t bf16_elems = size_t(next[0]) * kHkv * kPage * kD;
    const size_t qrows = size_t(next[1] + (int2 ? batch : 0)) * kHkv * kPage;
    bk = dalloc<uint16_t>(bf16_elems);
    bv = dalloc<uint16_t>(bf16_elems);
    fill_bf16<<<grid_for(bf16_elems), 256>>>(bk, bf16_elems, 1);
    fill_bf16<<<grid_for(bf16_elems), 256>>>(bv, bf16_elems, 2);
    if (qrows) {
      kc = dalloc<uint8_t>(qrows * kD / 4);
      vc = dalloc<uint8_t>(qrows * kD / 4);
      kp = dalloc<uint16_t>(qrows * 2 * (kD / kGroup));
      vp = dalloc<uint16_t>(qrows * 2 * (kD / kGroup));
      fill_bytes<<<grid_for(qrows * kD / 16), 256>>>(reinterpret_cast<uint32_t*>(kc), qrows * kD / 16, 3);
      fill_bytes<<<grid_for(qrows * kD / 16), 256>>>(reinterpret_cast<uint32_t*>(vc), qrows * kD / 16, 4);
      fill_params<<<grid_for(qrows * (kD / kGroup)), 256>>>(reinterpret_cast<uint32_t*>(kp), qrows * (kD / kGroup), 5);
      fill_params<<<grid_for(qrows * (kD / kGroup)), 256>>>(reinterpret_cast<uint32_t*>(vp), qrows * (kD / kGroup), 6);
    }
    OSCAR_CUDA_CHECK(cudaGetLastError());
    for (int r = 0; r < 3; ++r) {
      indptr[r] = dalloc<int32_t>(h_indptr[r].size());
      indices[r] = dalloc<int32_t>(h_indices[r].size());
      len[r] = dalloc<int32_t>(h_len[r].size());
      OSCAR_CUDA_CHECK(cudaMemcpy(indptr[r], h_indptr[r].data(), 4 * h_indptr[r].size(), cudaMemcpyHostToDevice));
      if (!h_indices[r].empty())
        OSCAR_CUDA_CHECK(cudaMemcpy(indices[r], h_indices[r].data(), 4 * h_indices[r].size(), cudaMemcpyHostToDevice));
      OSCAR_CUDA_CHECK(cudaMemcpy(len[r], h_len[r].data(), 4 * h_len[r].size(), cudaMemcpyHostToDevice));
    }
    view.batch = batch;
    view.num_kv_heads = kHkv;
    view.head_dim = kD;
    view.page_size = kPage;
    view.bits = 2;
    view.group_size = kGroup;
    view.bf16 = {bk, bv};
    view.quant = {kc, vc, kp, vp};
    view.sink = {indptr[0], indices[0], len[0]};
    view.mid = {indptr[1], indices[1], len[1]};
    view.recent = {indptr[2], indices[2], len[2]};
    const double bf16_tokens = double(batch) * (lens[0] + lens[2]);
    const double q_tokens = double(batch) * lens[1];
    kv_bytes = bf16_tokens * kHkv * kD * 2 * 2 + q_tokens * kHkv * (kD / 4 + 4 * (kD / kGroup)) * 2;
  }
  ~BenchCache() {
    for (void* p : {(void*)bk, (void*)bv, (void*)kc, (void*)vc, (void*)kp, (void*)vp}) cudaFree(p);
    for (int r = 0; r < 3; ++r) {
      cudaFree(indptr[r]);
      cudaFree(indices[r]);
      cudaFree(len[r]);
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  int iters = 15, warmup = 30;
  const char* csv_path = nullptr;
  int only_b = 0, only_ctx = 0, pdl = 1, ctas = 0;
  float skew = -1.0f;  // planner rank skew (< 0: the default)
  int fuse = -1;       // planner fuse_windows (-1: its choice, 0: never, 1: wherever it can)
  int first_pages = 1;  // plans get the host page table (DecodePlan::first_pages, v44)
  bool parts = false, trace = false, int2_only = false;
  const char* trace_dump = nullptr;  // --trace-dump FILE: CSV of every CTA (appended)
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--only") && i + 1 < argc) std::sscanf(argv[++i], "%d,%d", &only_b, &only_ctx);
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    else if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv_path = argv[++i];
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--warmup") && i + 1 < argc) warmup = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--pdl") && i + 1 < argc) pdl = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--ctas") && i + 1 < argc) ctas = std::atoi(argv[++i]);  // planner CTAs per SM
    else if (!std::strcmp(argv[i], "--skew") && i + 1 < argc) skew = std::atof(argv[++i]);  // planner rank skew
    else if (!std::strcmp(argv[i], "--fuse") && i + 1 < argc) fuse = std::atoi(argv[++i]);  // planner fuse_windows
    else if (!std::strcmp(argv[i], "--first-pages") && i + 1 < argc) first_pages = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--int2")) int2_only = true;  // the default INT2 kernel only
    else if (!std::strcmp(argv[i], "--parts")) parts = true;
    else if (!std::strcmp(argv[i], "--trace")) trace = true;  // needs -DOSCAR_DECODE_TRACE
    else if (!std::strcmp(argv[i], "--trace-dump") && i + 1 < argc) trace = true, trace_dump = argv[++i];
  }
#if !defined(OSCAR_DECODE_TRACE)
  if (trace) std::printf("--trace: this build lacks -DOSCAR_DECODE_TRACE; ignored\n");
  if (trace_dump) std::printf("--trace-dump %s: not written\n", trace_dump);
#endif
  cudaDeviceProp prop;
  OSCAR_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs, L2 %d MB, %.1f GB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, prop.totalGlobalMem / 1e9);
  Timer timer;
  timer.warmup = warmup;

  // Copy bandwidth: device-to-device memcpy of 2 GiB, bytes read + written.
  double copy_gbs = 0;
  {
    const size_t n = size_t(2) << 30;
    void *src = nullptr, *dst = nullptr;
    OSCAR_CUDA_CHECK(cudaMalloc(&src, n));
    OSCAR_CUDA_CHECK(cudaMalloc(&dst, n));
    OSCAR_CUDA_CHECK(cudaMemset(src, 1, n));
    const double ms = timer.median_ms([&] { OSCAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice)); }, 10);
    copy_gbs = 2.0 * n / (ms * 1e-3) / 1e9;
    cudaFree(src);
    cudaFree(dst);
  }
  std::printf("measured copy bandwidth: %.0f GB/s (read + write)\n", copy_gbs);
  if (parts) {
    const double one = timer.median_ms([&] { empty_kernel<<<132, 128>>>(); }, iters);
    const double two = timer.median_ms([&] { empty_kernel<<<132, 128>>>(); empty_kernel<<<132, 128>>>(); }, iters);
    std::printf("parts  empty kernel: %.1f us, two in a row: %.1f us\n", one * 1e3, two * 1e3);
  }

  FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv)
    std::fprintf(csv, "kernel,batch,ctx,time_us,bytes,gbs,pct_copy,floor_us,chunks,write_us,demote_us_per_step,"
                 "write_in_step_us,demote_in_step_us_per_step,read_floor_us\n");

  std::vector<int> batches = quick ? std::vector<int>{1, 32} : std::vector<int>{1, 8, 32, 64};
  std::vector<int> ctxs = quick ? std::vector<int>{4096, 32768} : std::vector<int>{4096, 16384, 32768, 65536, 131072};
  if (only_b) {
    batches = {only_b};
    ctxs = {only_ctx};
  }
  std::mt19937 rng(7);
  float* q = dalloc<float>(size_t(64) * kHq * kD);
  float* o = dalloc<float>(size_t(64) * kHq * kD);
  float* lse = dalloc<float>(size_t(64) * kHq);
  fill_f32<<<64, 256>>>(q, size_t(64) * kHq * kD, 9, 2.0f);
  // Write/demotion inputs: one new token per sequence, rotation R_K.
  float* knew = dalloc<float>(size_t(64) * kHkv * kD);
  float* vnew = dalloc<float>(size_t(64) * kHkv * kD);
  float* rot = dalloc<float>(size_t(kD) * kD);
  fill_f32<<<64, 256>>>(knew, size_t(64) * kHkv * kD, 10, 1.0f);
  fill_f32<<<64, 256>>>(vnew, size_t(64) * kHkv * kD, 11, 1.0f);
  fill_f32<<<64, 256>>>(rot, size_t(kD) * kD, 12, 0.15f);
  DecodeWorkspace ws = alloc_decode_workspace(1 << 16, 64, kHq, kD);

  uint4* read_buf = nullptr;  // the read floor's source (grown to the largest INT2 call)
  size_t read_words = 0;
  std::printf("\n%-7s %5s %7s %10s %9s %8s %7s %9s %7s %9s %10s %9s %9s %8s\n", "kern", "batch", "ctx", "time_us",
              "MB", "GB/s", "%copy", "floor_us", "chunks", "write_us", "demote/st", "wr_in_st", "dem_in_st",
              "read_us");
  for (int batch : batches)
    for (int ctx : ctxs) {
      double t_by_kind[4] = {0, 0, 0, 0};
      // 0: INT2 three-region (default: the v13 loop, int8 tensor cores for K
      // and V), 1: BF16 baseline, 2: INT2 with the v7 loop (fp16 tensor cores
      // for K and V), 3: INT2 with the v10 loop (int8 for K only); docs/history.md
      for (int kind = 0; kind < 4; ++kind) {
        if (int2_only && kind != 0) continue;
        const bool int2 = kind != 1;
        const char* name = kind == 0 ? "int2" : kind == 1 ? "bf16" : kind == 2 ? "int2v7" : "int2v10";
        const double bf16_gb = double(batch) * ctx * kHkv * kD * 4 / 1e9;
        if (!int2 && bf16_gb > 60) continue;
        BenchCache cache(int2, batch, ctx, rng);
        HostRegions hr;
        for (int k = 0; k < 3; ++k) {
          hr.len[k] = cache.h_len[k].data();
          hr.indptr[k] = cache.h_indptr[k].data();
        }
        if (first_pages) {
          hr.mid_indices = cache.h_indices[1].data();
          hr.page_size = kPage;
        }
        DecodePlan plan = plan_decode(batch, hr, kHkv, prop.multiProcessorCount, 0,
                                      kind == 2 ? 4 : ctas, skew, fuse);  // the v7 loop keeps 4 CTAs per SM
        OSCAR_CUDA_CHECK(upload_plan(plan, ws, nullptr));
        DecodeParams p;
        p.kv = cache.view;
        p.q = q;
        p.num_q_heads = kHq;
        p.sm_scale = 1.0f / std::sqrt(float(kD));
        p.o = o;
        p.lse = lse;
        p.pdl = pdl;
        p.variant = kind == 2 ? 2 : kind == 3 ? 3 : 0;
        const std::string err = check_decode(p, plan, ws);
        if (!err.empty()) {
          std::printf("skip: %s\n", err.c_str());
          continue;
        }
        const double ms = timer.median_ms(
            [&] { OSCAR_CUDA_CHECK(int2 ? decode_attention(p, plan, ws, nullptr) : decode_attention_bf16(p, plan, ws, nullptr)); },
            iters);
        t_by_kind[kind] = ms;
#if defined(OSCAR_DECODE_TRACE)
        if (trace && kind == 0) {
          // CTA timeline of one call (the 3rd of 3, L2 emptied before each).
          const int cap = 1 << 16;
          constexpr int W = 10;  // words per CTA: id, start, first data, loop end of warps 0-3, end, SM, 0
          unsigned long long* buf = dalloc<unsigned long long>(1 + W * size_t(cap));
          OSCAR_CUDA_CHECK(set_decode_trace(buf, cap));
          std::vector<unsigned long long> h(1 + W * size_t(cap));
          for (int rep = 0; rep < 3; ++rep) {
            timer.empty_l2(rep);
            OSCAR_CUDA_CHECK(cudaMemset(buf, 0, 8));
            OSCAR_CUDA_CHECK(decode_attention(p, plan, ws, nullptr));
            OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
          }
          OSCAR_CUDA_CHECK(cudaMemcpy(h.data(), buf, h.size() * 8, cudaMemcpyDeviceToHost));
          OSCAR_CUDA_CHECK(set_decode_trace(nullptr, 0));
          cudaFree(buf);
          const size_t n = std::min<size_t>(h[0], cap);
          unsigned long long t0 = ~0ull;
          for (size_t i = 0; i < n; ++i) t0 = std::min(t0, h[1 + W * i + 1]);
          const char* kn[3] = {"middle", "window", "merge"};
          if (trace_dump) {
            // Every CTA of the traced call, times in us from the first start.
            if (FILE* f = std::fopen(trace_dump, "a")) {
              for (size_t i = 0; i < n; ++i) {
                const unsigned long long* e = &h[1 + W * i];
                std::fprintf(f, "%d,%d,%d,%s,%llu,%llu,%llu", batch, ctx, int(i), kn[std::min(2, int(e[0] >> 48))],
                             (e[0] >> 24) & 0xffffff, e[0] & 0xffffff, e[8]);
                for (int w = 1; w < 8; ++w) std::fprintf(f, ",%.3f", (double(e[w]) - double(t0)) * 1e-3);
                std::fprintf(f, "\n");
              }
              std::fclose(f);
            }
          }
          for (int k = 0; k < 3; ++k) {
            std::vector<double> st, en, du, ramp, first, loop, drain;
            for (size_t i = 0; i < n; ++i) {
              const unsigned long long* e = &h[1 + W * i];
              if (int(e[0] >> 48) != k) continue;
              st.push_back((e[1] - t0) * 1e-3);
              en.push_back((e[7] - t0) * 1e-3);
              du.push_back((e[7] - e[1]) * 1e-3);
              first.push_back((e[2] - t0) * 1e-3);
              ramp.push_back((e[2] - e[1]) * 1e-3);
              loop.push_back((e[3] - t0) * 1e-3);
              drain.push_back((e[7] - e[3]) * 1e-3);
            }
            if (st.empty()) continue;
            auto q = [](std::vector<double> v, double f) {
              std::sort(v.begin(), v.end());
              return v[std::min(v.size() - 1, size_t(f * v.size()))];
            };
            if (k == 0) {
              // Is a CTA's speed a property of its SM? Per SM: the mean and
              // range of its middle CTAs' end times.
              std::vector<std::vector<double>> by_sm(1024);
              for (size_t i = 0; i < n; ++i) {
                const unsigned long long* e = &h[1 + W * i];
                if (int(e[0] >> 48) == 0 && e[8] < 1024) by_sm[e[8]].push_back((e[7] - t0) * 1e-3);
              }
              std::vector<double> means, ranges;
              for (auto& v : by_sm) {
                if (v.empty()) continue;
                std::sort(v.begin(), v.end());
                double m = 0;
                for (double x : v) m += x;
                means.push_back(m / v.size());
                ranges.push_back(v.back() - v.front());
              }
              std::sort(means.begin(), means.end());
              std::sort(ranges.begin(), ranges.end());
              std::printf("trace  per-SM mean end: min %.1f p10 %.1f med %.1f p90 %.1f max %.1f; within-SM range med %.1f max %.1f us (%zu SMs)\n",
                          means.front(), means[means.size() / 10], means[means.size() / 2],
                          means[means.size() * 9 / 10], means.back(), ranges[ranges.size() / 2], ranges.back(),
                          means.size());
            }
            std::printf("trace  %5d %7d %-6s %4zu CTAs  start %5.1f %5.1f %5.1f  end %5.1f %5.1f %5.1f %5.1f  dur %5.1f %5.1f %5.1f us (min/med/max; end p90)\n",
                        batch, ctx, kn[k], st.size(), q(st, 0), q(st, 0.5), q(st, 1), q(en, 0), q(en, 0.5),
                        q(en, 0.9), q(en, 1), q(du, 0), q(du, 0.5), q(du, 1));
            // Split kernels: start -> warp 0's first tiles in (ramp), warp 0
            // out of its loop -> CTA end (drain). Merge: start -> its wait over.
            std::printf("trace  %5d %7d %-6s first data at %5.1f %5.1f %5.1f (ramp %4.1f %4.1f %4.1f)  loop end %5.1f %5.1f %5.1f  drain %4.1f %4.1f %4.1f us (min/med/max)\n",
                        batch, ctx, kn[k], q(first, 0), q(first, 0.5), q(first, 1), q(ramp, 0), q(ramp, 0.5),
                        q(ramp, 1), q(loop, 0), q(loop, 0.5), q(loop, 1), q(drain, 0), q(drain, 0.5), q(drain, 1));
          }
        }
#endif
        if (parts && kind == 0) {
          // Where the time of a call goes: the same launch sequence with
          // plans that leave regions out (the kernels still read the full
          // cache's tables), and an empty plan (the merge launch alone).
          const std::vector<int32_t> zero(batch, 0);
          const int32_t* L[3] = {cache.h_len[0].data(), cache.h_len[1].data(), cache.h_len[2].data()};
          const struct { const char* name; bool s, m, r; } cfg[] = {
              {"middle+merge", false, true, false}, {"windows+merge", true, false, true}, {"merge only", false, false, false}};
          for (const auto& c : cfg) {
            HostRegions pr = hr;
            pr.len[0] = c.s ? L[0] : zero.data();
            pr.len[1] = c.m ? L[1] : zero.data();
            pr.len[2] = c.r ? L[2] : zero.data();
            DecodePlan pp = plan_decode(batch, pr, kHkv, prop.multiProcessorCount, 0, ctas, skew, fuse);
            OSCAR_CUDA_CHECK(upload_plan(pp, ws, nullptr));
            const double t = timer.median_ms([&] { OSCAR_CUDA_CHECK(decode_attention(p, pp, ws, nullptr)); }, iters);
            std::printf("parts  %5d %7d %-14s %8.1f us (%d chunks)\n", batch, ctx, c.name, t * 1e3, pp.num_chunks);
          }
          OSCAR_CUDA_CHECK(upload_plan(plan, ws, nullptr));
        }
        const double bytes = cache.kv_bytes + double(batch) * kHq * kD * 4 * 2;  // + q, o
        double write_us = 0, demote_us = 0, write_ov_us = 0, demote_ov_us = 0;
        if (kind == 0) {
          // Per decode step: write each sequence's new token (rotated K) into
          // its recent window; every kPage steps demote one page per sequence.
          std::vector<int32_t> pg(batch), sl(batch);
          for (int b = 0; b < batch; ++b) {
            pg[b] = b % std::max(cache.n_bf16_pages, 1);
            sl[b] = b % kPage;
          }
          int32_t* dpg = dalloc<int32_t>(batch);
          int32_t* dsl = dalloc<int32_t>(batch);
          int32_t* dq = dalloc<int32_t>(batch);
          std::vector<int32_t> qp(batch);
          for (int b = 0; b < batch; ++b) qp[b] = cache.first_spare_quant_page + b;  // pages no region reads
          OSCAR_CUDA_CHECK(cudaMemcpy(dpg, pg.data(), 4 * batch, cudaMemcpyHostToDevice));
          OSCAR_CUDA_CHECK(cudaMemcpy(dsl, sl.data(), 4 * batch, cudaMemcpyHostToDevice));
          OSCAR_CUDA_CHECK(cudaMemcpy(dq, qp.data(), 4 * batch, cudaMemcpyHostToDevice));
          WriteRotation r{rot, nullptr, 1};
          write_us = 1e3 * timer.median_ms(
                               [&] { OSCAR_CUDA_CHECK(write_bf16_tokens(cache.view, batch, dpg, dsl, knew, vnew, r, nullptr)); },
                               iters);
          // The step as served: the decode with this step's write in its
          // launch sequence (DecodeParams::write: in the middle launch's
          // tail); the write's cost in the step is the difference to the
          // decode alone.
          DecodeParams pw = p;
          pw.write = StepWrite{batch, dpg, dsl, knew, vnew, r};
          const double step_us =
              1e3 * timer.median_ms([&] { OSCAR_CUDA_CHECK(decode_attention(pw, plan, ws, nullptr)); }, iters);
          write_ov_us = std::max(0.0, step_us - ms * 1e3);
          demote_us = 1e3 / kPage *
                      timer.median_ms([&] { OSCAR_CUDA_CHECK(demote_pages(cache.view, batch, dpg, dq, {}, -1, nullptr)); }, iters);
          // The same with one page demotion per sequence in the step
          // (DecodeParams::demote, in the middle launch's tail), amortized
          // over the kPage steps between demotions.
          DecodeParams pd = pw;
          pd.demote = StepDemote{batch, dpg, dq, {}, -1};
          const double step_d_us =
              1e3 * timer.median_ms([&] { OSCAR_CUDA_CHECK(decode_attention(pd, plan, ws, nullptr)); }, iters);
          demote_ov_us = std::max(0.0, step_d_us - step_us) / kPage;
          cudaFree(dpg);
          cudaFree(dsl);
          cudaFree(dq);
        }
        const double gbs = bytes / (ms * 1e-3) / 1e9;
        // INT2: the same bytes read by a plain streaming kernel (the best of
        // three grids), timed the same way: the floor at this size, launch
        // and ramp included.
        double read_us = 0;
        if (kind == 0) {
          const size_t words = size_t(bytes / 16);
          if (words > read_words) {
            cudaFree(read_buf);
            read_buf = dalloc<uint4>(words + 1);
            read_words = words;
            fill_bytes<<<grid_for(words * 4), 256>>>(reinterpret_cast<uint32_t*>(read_buf), words * 4, 13);
          }
          read_us = 1e30;
          for (int ctas_per_sm : {4, 8, 16})
            read_us = std::min(read_us, 1e3 * timer.median_ms([&] {
              read_kernel<true><<<prop.multiProcessorCount * ctas_per_sm, 256>>>(read_buf, words, read_buf + words);
            }, iters));
        }
        std::printf("%-7s %5d %7d %10.1f %9.1f %8.0f %6.1f%% %9.1f %7d %9.1f %10.2f %9.1f %9.2f %8.1f\n", name,
                    batch, ctx, ms * 1e3, bytes / 1e6, gbs, 100.0 * gbs / copy_gbs, bytes / copy_gbs / 1e3,
                    plan.num_chunks, write_us, demote_us, write_ov_us, demote_ov_us, read_us);
        if (csv)
          std::fprintf(csv, "%s,%d,%d,%.2f,%.0f,%.1f,%.2f,%.2f,%d,%.2f,%.3f,%.2f,%.3f,%.2f\n", name, batch, ctx,
                       ms * 1e3, bytes, gbs, 100.0 * gbs / copy_gbs, bytes / copy_gbs / 1e3, plan.num_chunks,
                       write_us, demote_us, write_ov_us, demote_ov_us, read_us);
      }
      if (t_by_kind[0] > 0 && t_by_kind[1] > 0)
        std::printf("       speedup int2 vs our bf16: %.2fx (v7 loop: %.2fx, v10 loop: %.2fx)\n",
                    t_by_kind[1] / t_by_kind[0], t_by_kind[2] > 0 ? t_by_kind[1] / t_by_kind[2] : 0.0,
                    t_by_kind[3] > 0 ? t_by_kind[1] / t_by_kind[3] : 0.0);
    }
  // Host planning cost (per step, per plan; a plan serves all layers).
  {
    std::vector<int32_t> s(64, kSink), m(64, 131072 - 320), r(64, kRecent), ptr(65);
    for (int b = 0; b <= 64; ++b) ptr[b] = b * (131072 / kPage);  // offsets only: the plan reads no page id
    const HostRegions hr{{s.data(), m.data(), r.data()}, {ptr.data(), ptr.data(), ptr.data()}};
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 100; ++i) plan_decode(64, hr, kHkv, prop.multiProcessorCount);
    const auto t1 = std::chrono::steady_clock::now();
    std::printf("host plan_decode (batch 64, 128K): %.1f us\n",
                std::chrono::duration<double, std::micro>(t1 - t0).count() / 100);
  }
  if (csv) std::fclose(csv);
  free_decode_workspace(ws);
  cudaFree(read_buf);
  std::printf("copy_gbs=%.0f\n", copy_gbs);
  return 0;
}
