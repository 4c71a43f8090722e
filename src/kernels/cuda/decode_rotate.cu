// Query rotation on the device (rotate_queries, decode_attention.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/cuda/decode_attention.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/mma.cuh"
#include "kernels/cuda/rotate_row.cuh"

namespace oscar::kernels::cuda {

namespace {

// One set of rows to rotate: out[row] = (in[row] - mean[head]) R[head / (heads / r_heads)]
// for rows [n][heads][D] (mean optional, [heads][D]).
struct RotJob {
  const float* in;
  float* out;
  const float* R;
  const float* mean;
  int heads, r_heads;
  int64_t rows;  // n * heads
};

// Rotation of rows (out = x R, R [D][D] per head group): one block of 256 threads per
// row. A thread takes 4 adjacent output columns over a slice of the D inputs (16-byte
// loads of R, all in flight), and the slices are summed through shared memory. One
// thread per column over all D inputs (a chain of D dependent loads) took 8.4 us per call
// at batch 1 on the H200. Two jobs per launch (the step's queries and keys: one launch
// instead of two, and the key centering inside it): blocks [0, a.rows) take job a.
template <int D>
__global__ void __launch_bounds__(256) rotate_kernel(const RotJob a, const RotJob b) {
  using Rot = detail::RowRotation<D>;
  __shared__ float x[D];
  __shared__ float4 part[Rot::kParts][Rot::kCols];
  detail::pdl_launch_dependents();  // launched as a programmatic dependent: wait for q
  detail::pdl_wait();
  // The job's fields one by one (a reference to either parameter would put both in local memory).
  const bool first = int64_t(blockIdx.x) < a.rows;
  const int64_t row = first ? int64_t(blockIdx.x) : int64_t(blockIdx.x) - a.rows;
  const int heads = first ? a.heads : b.heads, r_heads = first ? a.r_heads : b.r_heads;
  const float* in = first ? a.in : b.in;
  float* out = first ? a.out : b.out;
  const float* mean = first ? a.mean : b.mean;
  const int head = static_cast<int>(row % heads);
  const float4* R4 = reinterpret_cast<const float4*>((first ? a.R : b.R) + int64_t(head / (heads / r_heads)) * D * D);
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    x[i] = mean ? in[row * D + i] - mean[int64_t(head) * D + i] : in[row * D + i];
  __syncthreads();  // in == out allowed: every x is read before anyone writes
  const Rot rot;
  part[rot.p][rot.cg] = rot.partial(x, [&](int jj) { return __ldg(rot.r_at(R4, jj)); });
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += blockDim.x) out[row * D + c] = Rot::column(part, c);
}

// The job of a block of the tiled kernels (blocks [0, a_blocks) take a's heads, the rest b's):
// its fields selected one by one (a reference to either parameter would put both in local
// memory) and the head's matrix.
struct HeadJob {
  int head;
  const float* in;
  float* out;
  int64_t tokens;
  const float* mean;   // the job's [heads][D] offsets, or null (mean_of gives the head's)
  int64_t stride;      // floats from one token's row of this head to the next
  const float4* R4;    // the head's [D][D] matrix
  template <int D>
  __device__ __forceinline__ const float* mean_of() const {
    return mean ? mean + int64_t(head) * D : nullptr;
  }
};

// Head `idx` of the jobs (a's heads [0, a_heads), then b's).
template <int D>
__device__ __forceinline__ HeadJob head_job_at(const RotJob& a, const RotJob& b, int a_heads, int idx) {
  const bool first = idx < a_heads;
  HeadJob j;
  j.head = first ? idx : idx - a_heads;
  j.in = first ? a.in : b.in;
  j.out = first ? a.out : b.out;
  const int heads = first ? a.heads : b.heads, r_heads = first ? a.r_heads : b.r_heads;
  j.tokens = (first ? a.rows : b.rows) / heads;
  j.mean = first ? a.mean : b.mean;
  j.stride = int64_t(heads) * D;
  j.R4 = reinterpret_cast<const float4*>((first ? a.R : b.R) + int64_t(j.head / (heads / r_heads)) * D * D);
  return j;
}

// The job of a block of the fp32 tiled kernel: its head is its blockIdx.x.
template <int D>
__device__ __forceinline__ HeadJob head_job(const RotJob& a, const RotJob& b, int a_blocks) {
  return head_job_at<D>(a, b, a_blocks, int(blockIdx.x));
}

// Rotation of many rows (a prefill chunk, a large decode batch): one block of 256 threads
// per head of a job and a slice of the tokens. The head's matrix is staged in shared memory
// once per block and every tile of kTile tokens is multiplied against it there, so R is read
// from L2 once per block instead of once per row (the per-row kernel above reads D*D*4 bytes
// per row: 64 KB at D = 128, 21 GB per layer for an 8192-token chunk of Qwen3-8B's 40 heads).
// Thread (ty, tx) of a 16 x 16 grid computes tokens kRows ty .. kRows ty + kRows - 1 of the
// tile and the columns 4 tx + 64 c (c < D / 64), from the tile stored transposed (Xt[k][token],
// padded rows) and R's row k, both read as float4 where they can. fp32 FMA over k = 0 .. D-1
// in order. Tiles of 16 kRows tokens: 64 for a prefill chunk, 16 or 32 where fewer tokens
// would leave SMs without a block.
template <int kRows>
__host__ __device__ constexpr int tile_ld() {
  return 16 * kRows + 4;  // padded row of the transposed tile (16-byte aligned)
}

template <int D, int kRows>
constexpr size_t tiled_smem_bytes() {
  return sizeof(float) * (size_t(D) * D + size_t(D) * tile_ld<kRows>());
}

template <int D, int kRows>
__global__ void __launch_bounds__(256) rotate_tiled_kernel(const RotJob a, const RotJob b, int a_blocks) {
  constexpr int kTile = 16 * kRows, kTileLd = tile_ld<kRows>();
  constexpr int kCG = D / 64;  // float4 column groups per thread
  extern __shared__ float4 smem4[];
  float* Rs = reinterpret_cast<float*>(smem4);
  float* Xt = Rs + D * D;
  detail::pdl_launch_dependents();
  detail::pdl_wait();
  const HeadJob job = head_job<D>(a, b, a_blocks);
  const float* in = job.in;
  float* out = job.out;
  const int head = job.head;
  const int64_t tokens = job.tokens, stride = job.stride;
  for (int i = threadIdx.x; i < D * D / 4; i += 256) reinterpret_cast<float4*>(Rs)[i] = __ldg(job.R4 + i);
  const float* mean = job.mean_of<D>();
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int64_t tiles = (tokens + kTile - 1) / kTile;
  for (int64_t t = blockIdx.y; t < tiles; t += gridDim.y) {
    const int64_t t0 = t * kTile;
    __syncthreads();  // R staged (first tile); the previous tile's Xt read by everyone
    // Load: a warp reads one token's row (coalesced), stores it as a column of Xt.
    for (int e = threadIdx.x; e < kTile * D; e += 256) {
      const int r = e / D, k = e % D;
      float v = 0.0f;
      if (t0 + r < tokens) {
        v = in[(t0 + r) * stride + int64_t(head) * D + k];
        if (mean) v -= mean[k];
      }
      Xt[k * kTileLd + r] = v;
    }
    __syncthreads();  // in == out allowed: the tile is in shared memory before anyone writes
    float4 acc[kRows][kCG];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int c = 0; c < kCG; ++c) acc[i][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
    for (int k = 0; k < D; ++k) {
      float xs[kRows];
      if constexpr (kRows == 4) {
        const float4 x = *reinterpret_cast<const float4*>(Xt + k * kTileLd + ty * 4);
        xs[0] = x.x, xs[1] = x.y, xs[2] = x.z, xs[3] = x.w;
      } else if constexpr (kRows == 2) {
        const float2 x = *reinterpret_cast<const float2*>(Xt + k * kTileLd + ty * 2);
        xs[0] = x.x, xs[1] = x.y;
      } else {
        xs[0] = Xt[k * kTileLd + ty];
      }
#pragma unroll
      for (int c = 0; c < kCG; ++c) {
        const float4 r = *reinterpret_cast<const float4*>(Rs + k * D + c * 64 + tx * 4);
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
          acc[i][c].x = fmaf(xs[i], r.x, acc[i][c].x);
          acc[i][c].y = fmaf(xs[i], r.y, acc[i][c].y);
          acc[i][c].z = fmaf(xs[i], r.z, acc[i][c].z);
          acc[i][c].w = fmaf(xs[i], r.w, acc[i][c].w);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int64_t tok = t0 + ty * kRows + i;
      if (tok >= tokens) break;
      float4* o = reinterpret_cast<float4*>(out + tok * stride + int64_t(head) * D);
#pragma unroll
      for (int c = 0; c < kCG; ++c) o[c * 16 + tx] = acc[i][c];
    }
  }
}

// The tiled rotation on the tensor cores (set_rotate_mma): x R as a GEMM per head (M = the
// tokens, N = K = D) in mma.sync m16n8k8 TF32, each product in three terms so that the result
// keeps fp32 accuracy (x = x_hi + x_lo with x_hi the nearest tf32, the same for R;
// x_lo R_hi + x_hi R_lo + x_hi R_hi, the small terms first; the dropped x_lo R_lo is ~2^-22 of
// a product). Work items are (head, tile of kMmaTile tokens), head-major; each block takes a
// contiguous range of them (one block per SM at D = 128: a wave, no tail of whole blocks), so it
// stages a head's matrix and centre in shared memory once per head it meets (before waiting on
// the previous launch for the first: weights do not depend on it) and streams the tiles through
// a double buffer of cp.async copies, the next tile in flight while the current one is
// multiplied. The 8 warps split the tile's output 2 x 4 (D = 128: 64 tokens x 32 columns each,
// 4 x 4 MMA tiles) or 4 x 2 (D = 64: 32 x 32), so every split fragment of x feeds 4 column tiles
// and every split fragment of R 4 (D = 128) or 2 row tiles. Shared rows are padded (R: D + 8
// floats, the tile: D + 4) so that a warp's fragment loads hit 32 different banks. Per 8192-token
// chunk and layer of Qwen3-8B (H100, ncu): 223 us against the fp32 kernel's 589 (the tensor pipe
// 45 % busy); the first version (2026-12-04: a 16-row tile per warp, R's fragments split once per
// MMA, no copy ahead) took 591 us on the H200, against 537 for the fp32 kernel there.
constexpr int kMmaTile = 128;

template <int D>
constexpr size_t mma_smem_bytes() {
  return sizeof(float) * (size_t(D) * (D + 8) + D + 2 * size_t(kMmaTile) * (D + 4));
}

// Blocks of the tensor-core kernel per SM on device `dev` (an H100 or H200's 228 KB allow one at
// D = 128, two at 64), or 0 where one block's shared memory exceeds what a block may have (GPUs
// with ~100 KB per block take the fp32 kernel).
template <int D>
int mma_blocks_per_sm(int dev) {
  int optin = 0, per_sm = 0;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) != cudaSuccess)
    return 0;
  constexpr size_t kReserved = 1024;  // per block, kept by the runtime
  if (size_t(optin) < mma_smem_bytes<D>()) return 0;
  return std::max(1, int(size_t(per_sm) / (mma_smem_bytes<D>() + kReserved)));
}

// Warps per block (16 measured 4 % slower in kernel time: 232 against 223 us, H100).
constexpr int kMmaWarps = 8;

template <int D, bool kVec, int kWarps>
__global__ void __launch_bounds__(32 * kWarps, 1)
    rotate_mma_kernel(const RotJob a, const RotJob b, int a_heads, int heads, int64_t tiles) {
  constexpr int kRl = D + 8, kXl = D + 4, kThreads = 32 * kWarps;
  constexpr int kWN = D / 32, kWM = kWarps / kWN, kMT = kMmaTile / (16 * kWM);  // warps over columns, rows; row tiles
  static_assert(kWN * kWM == kWarps && kMT * 16 * kWM == kMmaTile, "the warps cover the tile");
  extern __shared__ float4 smem4[];
  float* Rs = reinterpret_cast<float*>(smem4);
  float* ms = Rs + D * kRl;
  float* Xs = ms + D;  // [2][kMmaTile][kXl]
  detail::pdl_launch_dependents();
  const int64_t total = int64_t(heads) * tiles;
  const int64_t i0 = total * blockIdx.x / gridDim.x, i1 = total * (blockIdx.x + 1) / gridDim.x;
  if (i0 >= i1) return;
  // The head's matrix (padded rows) and centre (zeros without one): every thread's earlier reads
  // of them are behind a barrier before this is called.
  auto stage = [&](const HeadJob& j) {
    for (int i = threadIdx.x; i < D * D / 4; i += kThreads) {
      const int row = (4 * i) / D, col = (4 * i) % D;
      *reinterpret_cast<float4*>(Rs + row * kRl + col) = __ldg(j.R4 + i);
    }
    const float* mean = j.mean_of<D>();
    for (int i = threadIdx.x; i < D; i += kThreads) ms[i] = mean ? mean[i] : 0.0f;
  };
  // Issues the copies of item `it`'s tile into buffer `buf` (rows past the job's tokens zero).
  auto load = [&](int64_t it, int buf) {
    const HeadJob j = head_job_at<D>(a, b, a_heads, int(it / tiles));
    const int64_t t0 = (it % tiles) * kMmaTile;
    float* xs = Xs + buf * kMmaTile * kXl;
    const float* base = j.in + int64_t(j.head) * D;
    constexpr int kW = kVec ? 4 : 1;  // floats per copy
    for (int e = threadIdx.x; e < kMmaTile * D / kW; e += kThreads) {
      const int row = e / (D / kW), col = (e % (D / kW)) * kW;
      const bool ok = t0 + row < j.tokens;
      const float* src = ok ? base + (t0 + row) * j.stride + col : base;
      if constexpr (kVec)
        detail::cp_async16_zfill(xs + row * kXl + col, src, ok);
      else
        detail::cp_async4_zfill(xs + row * kXl + col, src, ok);
    }
    detail::cp_async_commit();
  };
  int cur = int(i0 / tiles);
  stage(head_job_at<D>(a, b, a_heads, cur));
  detail::pdl_wait();
  load(i0, 0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, r = lane % 4;
  const int wm = warp % kWM, wn = warp / kWM;
  for (int64_t it = i0; it < i1; ++it) {
    const int buf = int((it - i0) & 1);
    if (it + 1 < i1) {
      load(it + 1, buf ^ 1);  // the buffer the last iteration read; its end barrier freed it
      detail::cp_async_wait<1>();
    } else {
      detail::cp_async_wait<0>();
    }
    const int hh = int(it / tiles);
    if (hh != cur) stage(head_job_at<D>(a, b, a_heads, hh)), cur = hh;
    __syncthreads();  // the tile landed for every thread; the matrix staged
    float acc[kMT][4][4];
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
    const float* xb = Xs + buf * kMmaTile * kXl + (wm * kMT * 16 + g) * kXl + r;
    const float* rb = Rs + r * kRl + wn * 32 + g;
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 8) {
      const float m0 = ms[k0 + r], m1 = ms[k0 + r + 4];
      uint32_t ah[kMT][4], al[kMT][4];
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const float* xp = xb + mt * 16 * kXl + k0;
        // (x - centre) in fp32 first, as the reference takes it; then the split.
        const float f[4] = {xp[0] - m0, xp[8 * kXl] - m0, xp[4] - m1, xp[8 * kXl + 4] - m1};
#pragma unroll
        for (int i = 0; i < 4; ++i) detail::split_tf32(f[i], ah[mt][i], al[mt][i]);
      }
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        uint32_t bh0, bh1, bl0, bl1;
        detail::split_tf32(rb[k0 * kRl + 8 * nt], bh0, bl0);
        detail::split_tf32(rb[(k0 + 4) * kRl + 8 * nt], bh1, bl1);
#pragma unroll
        for (int mt = 0; mt < kMT; ++mt) {
          detail::mma_tf32(acc[mt][nt], al[mt][0], al[mt][1], al[mt][2], al[mt][3], bh0, bh1);
          detail::mma_tf32(acc[mt][nt], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3], bl0, bl1);
          detail::mma_tf32(acc[mt][nt], ah[mt][0], ah[mt][1], ah[mt][2], ah[mt][3], bh0, bh1);
        }
      }
    }
    // The outputs: in place is allowed, the tile's inputs are all in shared memory (and no other
    // item reads these rows of this head).
    {
      const HeadJob j = head_job_at<D>(a, b, a_heads, hh);
      const int64_t t0 = (it % tiles) * kMmaTile + wm * kMT * 16 + g;
      float* ob = j.out + int64_t(j.head) * D + wn * 32 + 2 * r;
#pragma unroll
      for (int mt = 0; mt < kMT; ++mt) {
        const int64_t tok0 = t0 + mt * 16, tok1 = tok0 + 8;
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if (tok0 < j.tokens)
            *reinterpret_cast<float2*>(ob + tok0 * j.stride + 8 * nt) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
          if (tok1 < j.tokens)
            *reinterpret_cast<float2*>(ob + tok1 * j.stride + 8 * nt) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
        }
      }
    }
    __syncthreads();  // every warp done with this buffer and the matrix
  }
}

// set_rotate_mma's mode (RotateMma as an int).
std::atomic<int> g_rotate_mma{int(RotateMma::kAuto)};

// Raises `kernel`'s dynamic shared-memory limit to `smem` on device `dev` once. `raised`: the
// kernel's record of the devices done (an attribute of the device's context).
template <class Kernel>
cudaError_t raise_smem(Kernel kernel, size_t smem, std::atomic<uint32_t>& raised, int dev) {
  const uint32_t bit = dev < 32 ? 1u << dev : 0u;
  if (!bit || !(raised.load(std::memory_order_acquire) & bit)) {
    OSCAR_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    raised.fetch_or(bit, std::memory_order_acq_rel);
  }
  return cudaSuccess;
}

// Launches the fp32 tiled kernel: a block per head of the jobs (a's first) times its share of
// the tiles of `tile` tokens, two blocks per SM (the shared memory allows two at D = 128), each
// staging its matrix once and looping over its tiles.
template <class Kernel>
cudaError_t launch_head_tiles(Kernel kernel, size_t smem, int tile, std::atomic<uint32_t>& raised, const RotJob& a,
                              const RotJob& b, int64_t tokens, int dev, int sms, cudaStream_t stream,
                              bool programmatic) {
  OSCAR_CUDA_RETURN_IF_ERROR(raise_smem(kernel, smem, raised, dev));
  const int a_blocks = a.rows > 0 ? a.heads : 0, b_blocks = b.rows > 0 ? b.heads : 0;
  const int heads = a_blocks + b_blocks;
  const int64_t tiles = (tokens + tile - 1) / tile;
  const int64_t per_head = std::min<int64_t>(tiles, std::max<int64_t>(1, (2 * int64_t(sms) + heads - 1) / heads));
  const dim3 grid(static_cast<unsigned>(heads), static_cast<unsigned>(std::min<int64_t>(per_head, 65535)));
  const RotJob& first = a_blocks ? a : b;
  const RotJob& second = a_blocks ? b : a;
  OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(kernel, grid, dim3(256), smem, programmatic, stream, first, second,
                                                a_blocks ? a_blocks : b_blocks));
  return cudaGetLastError();
}

// Tokens from which a job goes to the tiled kernel (set_rotate_tiled_min_tokens). Qwen3-8B
// shapes on the H200 (2026-12-04, 2-bit decode steps at 32K): per-row / tiled 6.98 / 7.46 ms at
// batch 8, level at 32 and 64 (within 0.2 ms), 30.4 / 28.7 ms at 128; a prefill chunk of 8192
// tokens: 32K prompt 1,625 / 1,553 ms.
std::atomic<int> g_tiled_min_tokens{128};

template <int D, int kRows>
cudaError_t launch_tiled_rows(const RotJob& a, const RotJob& b, int64_t tokens, int dev, int sms,
                              cudaStream_t stream, bool programmatic) {
  static std::atomic<uint32_t> raised{0};
  return launch_head_tiles(rotate_tiled_kernel<D, kRows>, tiled_smem_bytes<D, kRows>(), 16 * kRows, raised, a, b,
                           tokens, dev, sms, stream, programmatic);
}

template <int D, bool kVec>
cudaError_t launch_mma(const RotJob& first, const RotJob& second, int first_heads, int heads, int64_t tiles,
                       unsigned grid, int dev, cudaStream_t stream, bool programmatic) {
  static std::atomic<uint32_t> raised{0};
  auto kernel = rotate_mma_kernel<D, kVec, kMmaWarps>;
  OSCAR_CUDA_RETURN_IF_ERROR(raise_smem(kernel, mma_smem_bytes<D>(), raised, dev));
  OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(kernel, dim3(grid), dim3(32 * kMmaWarps), mma_smem_bytes<D>(),
                                                programmatic, stream, first, second, first_heads, heads, tiles));
  return cudaGetLastError();
}

// The tensor-core kernel: one wave of blocks (mma_blocks_per_sm per SM, fewer where there are
// fewer items), each over a contiguous range of the (head, tile) items; 16-byte copies where
// every input row is 16-byte aligned, else 4-byte ones.
template <int D>
cudaError_t launch_mma_rows(const RotJob& a, const RotJob& b, int64_t tokens, int dev, int slots,
                            cudaStream_t stream, bool programmatic) {
  const int a_heads = a.rows > 0 ? a.heads : 0, b_heads = b.rows > 0 ? b.heads : 0;
  const RotJob& first = a_heads ? a : b;
  const RotJob& second = a_heads ? b : a;
  const int64_t tiles = (tokens + kMmaTile - 1) / kMmaTile, items = int64_t(a_heads + b_heads) * tiles;
  const unsigned grid = unsigned(std::min<int64_t>(items, slots));
  auto a16 = [](const RotJob& j) { return j.rows == 0 || reinterpret_cast<uintptr_t>(j.in) % 16 == 0; };
  const int heads = a_heads + b_heads, fh = a_heads ? a_heads : b_heads;
  if (a16(a) && a16(b)) return launch_mma<D, true>(first, second, fh, heads, tiles, grid, dev, stream, programmatic);
  return launch_mma<D, false>(first, second, fh, heads, tiles, grid, dev, stream, programmatic);
}

// The tensor-core kernel where set_rotate_mma selects it and its shared memory fits the device
// (kAuto: where its items fill a wave, i.e. a prefill chunk; a decode batch's few tokens per head
// would leave SMs idle), else the fp32 kernel with the largest tile (64, 32 or 16 tokens) that
// still gives every SM a block.
template <int D>
cudaError_t launch_tiled(const RotJob& a, const RotJob& b, int64_t tokens, cudaStream_t stream, bool programmatic) {
  int dev = 0, sms = 132;
  OSCAR_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  OSCAR_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  const int64_t heads = (a.rows > 0 ? a.heads : 0) + (b.rows > 0 ? b.heads : 0);
  const auto mode = RotateMma(g_rotate_mma.load(std::memory_order_relaxed));
  if (mode != RotateMma::kOff) {
    // A wave of the tensor-core kernel's blocks (none where its shared memory does not fit).
    const int64_t slots = int64_t(sms) * mma_blocks_per_sm<D>(dev);
    if (slots > 0 && (mode == RotateMma::kOn || heads * ((tokens + kMmaTile - 1) / kMmaTile) >= slots))
      return launch_mma_rows<D>(a, b, tokens, dev, int(slots), stream, programmatic);
  }
  if (heads * ((tokens + 63) / 64) >= sms) return launch_tiled_rows<D, 4>(a, b, tokens, dev, sms, stream, programmatic);
  if (heads * ((tokens + 31) / 32) >= sms) return launch_tiled_rows<D, 2>(a, b, tokens, dev, sms, stream, programmatic);
  return launch_tiled_rows<D, 1>(a, b, tokens, dev, sms, stream, programmatic);
}

bool valid(const RotJob& j) {
  return j.rows >= 0 && j.heads > 0 && j.r_heads > 0 && j.heads % j.r_heads == 0 &&
         (j.rows == 0 || (j.in && j.out && j.R));
}

cudaError_t launch_rotate(const RotJob& a, const RotJob& b, int d, cudaStream_t stream, bool programmatic) {
  if (!valid(a) || !valid(b)) return cudaErrorInvalidValue;
  const int64_t rows = a.rows + b.rows;
  if (rows == 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;
  // Many tokens: the tiled kernel (the matrix staged once per block), at D <= 128 (the
  // matrix of D = 256 would take 256 KB of shared memory).
  // (Its rows are written as float4: 16-byte aligned outputs only.)
  const int min_tokens = g_tiled_min_tokens.load(std::memory_order_relaxed);
  const int64_t tokens = std::max(a.rows > 0 ? a.rows / a.heads : 0, b.rows > 0 ? b.rows / b.heads : 0);
  auto aligned = [](const RotJob& j) { return j.rows == 0 || reinterpret_cast<uintptr_t>(j.out) % 16 == 0; };
  if (min_tokens > 0 && tokens >= min_tokens && (a.rows == 0 || a.rows % a.heads == 0) &&
      (b.rows == 0 || b.rows % b.heads == 0) && aligned(a) && aligned(b)) {
    if (d == 64) return launch_tiled<64>(a, b, tokens, stream, programmatic);
    if (d == 128) return launch_tiled<128>(a, b, tokens, stream, programmatic);
  }
  const dim3 grid(static_cast<unsigned>(rows));
  if (d == 64) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<64>, grid, dim3(256), 0, programmatic, stream, a, b));
  } else if (d == 128) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<128>, grid, dim3(256), 0, programmatic, stream, a, b));
  } else if (d == 256) {
    OSCAR_CUDA_RETURN_IF_ERROR(detail::launch_pdl(rotate_kernel<256>, grid, dim3(256), 0, programmatic, stream, a, b));
  } else {
    return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

void set_rotate_tiled_min_tokens(int tokens) { g_tiled_min_tokens.store(tokens, std::memory_order_relaxed); }
void set_rotate_mma(RotateMma mode) { g_rotate_mma.store(int(mode), std::memory_order_relaxed); }
RotateMma rotate_mma() { return RotateMma(g_rotate_mma.load(std::memory_order_relaxed)); }
int rotate_tiled_min_tokens() { return g_tiled_min_tokens.load(std::memory_order_relaxed); }

cudaError_t rotate_queries(const float* q, int n, int num_q_heads, int d, const float* R,
                           int r_heads, float* q_rot, cudaStream_t stream, bool programmatic, const float* mean) {
  if (n < 0 || num_q_heads <= 0 || !q || !R || !q_rot) return cudaErrorInvalidValue;
  const RotJob a{q, q_rot, R, mean, num_q_heads, r_heads, int64_t(n) * num_q_heads};
  const RotJob none{nullptr, nullptr, nullptr, nullptr, 1, 1, 0};
  return launch_rotate(a, none, d, stream, programmatic);
}

cudaError_t rotate_queries_keys(float* q, int num_q_heads, const float* Rq, float* k, int num_kv_heads,
                                const float* Rk, const float* k_mean, int n, int d, int r_heads, cudaStream_t stream,
                                bool programmatic) {
  if (n < 0 || num_q_heads <= 0 || num_kv_heads <= 0 || !q || !k || !Rq || !Rk) return cudaErrorInvalidValue;
  const RotJob a{q, q, Rq, nullptr, num_q_heads, r_heads, int64_t(n) * num_q_heads};
  const RotJob b{k, k, Rk, k_mean, num_kv_heads, r_heads, int64_t(n) * num_kv_heads};
  return launch_rotate(a, b, d, stream, programmatic);
}

}  // namespace oscar::kernels::cuda
