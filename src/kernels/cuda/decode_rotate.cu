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

template <int D>
__device__ __forceinline__ HeadJob head_job(const RotJob& a, const RotJob& b, int a_blocks) {
  const bool first = int(blockIdx.x) < a_blocks;
  HeadJob j;
  j.head = first ? int(blockIdx.x) : int(blockIdx.x) - a_blocks;
  j.in = first ? a.in : b.in;
  j.out = first ? a.out : b.out;
  const int heads = first ? a.heads : b.heads, r_heads = first ? a.r_heads : b.r_heads;
  j.tokens = (first ? a.rows : b.rows) / heads;
  j.mean = first ? a.mean : b.mean;
  j.stride = int64_t(heads) * D;
  j.R4 = reinterpret_cast<const float4*>((first ? a.R : b.R) + int64_t(j.head / (heads / r_heads)) * D * D);
  return j;
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

// The tiled rotation on the tensor cores (set_rotate_mma): the same blocks, tiles of 64 tokens
// and staged matrix as rotate_tiled_kernel, the products as mma.sync m16n8k8 TF32 in three terms
// (x = x_hi + x_lo with x_hi the nearest tf32, the same for R; x_lo R_hi + x_hi R_lo + x_hi R_hi,
// the small terms first) so that the result keeps fp32 accuracy (the dropped x_lo R_lo is
// ~2^-22 of it). Warp w owns tokens 16 (w % 4) .. +15 of the tile and the column half w / 4
// (D / 16 tiles of 8 columns). Shared rows are padded (R: D + 8, the tile: D + 4 floats) so
// that a warp's fragment loads hit 32 different banks. Not yet run on a GPU (2026-12-04):
// off by default until the tests and the prefill A/B have run on the H200.
template <int D>
constexpr size_t mma_smem_bytes() {
  return sizeof(float) * (size_t(D) * (D + 8) + size_t(64) * (D + 4));
}

template <int D>
__global__ void __launch_bounds__(256) rotate_mma_kernel(const RotJob a, const RotJob b, int a_blocks) {
  constexpr int kTile = 64, kRl = D + 8, kXl = D + 4;
  constexpr int kNT = D / 16;  // 8-column tiles per warp
  extern __shared__ float4 smem4[];
  float* Rs = reinterpret_cast<float*>(smem4);
  float* Xs = Rs + D * kRl;
  detail::pdl_launch_dependents();
  detail::pdl_wait();
  const HeadJob job = head_job<D>(a, b, a_blocks);
  const float* in = job.in;
  float* out = job.out;
  const int head = job.head;
  const int64_t tokens = job.tokens, stride = job.stride;
  for (int i = threadIdx.x; i < D * D / 4; i += 256) {
    const int row = (4 * i) / D, col = (4 * i) % D;
    *reinterpret_cast<float4*>(Rs + row * kRl + col) = __ldg(job.R4 + i);
  }
  const float* mean = job.mean_of<D>();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, r = lane % 4;
  const int m0 = (warp % 4) * 16, n_base = (warp / 4) * (D / 2);
  const int64_t tiles = (tokens + kTile - 1) / kTile;
  for (int64_t t = blockIdx.y; t < tiles; t += gridDim.y) {
    const int64_t t0 = t * kTile;
    __syncthreads();  // R staged (first tile); the previous tile read by every warp
    for (int e = threadIdx.x; e < kTile * D; e += 256) {
      const int row = e / D, k = e % D;
      float v = 0.0f;
      if (t0 + row < tokens) {
        v = in[(t0 + row) * stride + int64_t(head) * D + k];
        if (mean) v -= mean[k];
      }
      Xs[row * kXl + k] = v;
    }
    __syncthreads();  // in == out allowed: the tile is in shared memory before anyone writes
    float acc[kNT][4];
#pragma unroll
    for (int j = 0; j < kNT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    const float* xa = Xs + (m0 + g) * kXl + r;
#pragma unroll 2
    for (int k0 = 0; k0 < D; k0 += 8) {
      const float af[4] = {xa[k0], xa[k0 + 8 * kXl], xa[k0 + 4], xa[k0 + 8 * kXl + 4]};
      uint32_t ah[4], al[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        ah[i] = detail::tf32_rna(af[i]);
        al[i] = detail::tf32_rna(af[i] - __uint_as_float(ah[i]));
      }
      const float* rb = Rs + (k0 + r) * kRl + n_base + g;
#pragma unroll
      for (int j = 0; j < kNT; ++j) {
        const float b0 = rb[8 * j], b1 = rb[8 * j + 4 * kRl];
        const uint32_t bh0 = detail::tf32_rna(b0), bh1 = detail::tf32_rna(b1);
        const uint32_t bl0 = detail::tf32_rna(b0 - __uint_as_float(bh0)),
                       bl1 = detail::tf32_rna(b1 - __uint_as_float(bh1));
        detail::mma_tf32(acc[j], al[0], al[1], al[2], al[3], bh0, bh1);
        detail::mma_tf32(acc[j], ah[0], ah[1], ah[2], ah[3], bl0, bl1);
        detail::mma_tf32(acc[j], ah[0], ah[1], ah[2], ah[3], bh0, bh1);
      }
    }
    const int64_t tok0 = t0 + m0 + g, tok1 = tok0 + 8;
#pragma unroll
    for (int j = 0; j < kNT; ++j) {
      const int c = n_base + 8 * j + 2 * r;
      if (tok0 < tokens)
        *reinterpret_cast<float2*>(out + tok0 * stride + int64_t(head) * D + c) = make_float2(acc[j][0], acc[j][1]);
      if (tok1 < tokens)
        *reinterpret_cast<float2*>(out + tok1 * stride + int64_t(head) * D + c) = make_float2(acc[j][2], acc[j][3]);
    }
  }
}

std::atomic<bool> g_rotate_mma{false};

// Launches one of the tiled kernels: a block per head of the jobs (a's first) times its share of
// the tiles of `tile` tokens, two blocks per SM (the shared memory allows two at D = 128), each
// staging its matrix once and looping over its tiles. `raised`: the kernel's record of the
// devices whose shared-memory limit it has raised (an attribute of the device's context).
template <class Kernel>
cudaError_t launch_head_tiles(Kernel kernel, size_t smem, int tile, std::atomic<uint32_t>& raised, const RotJob& a,
                              const RotJob& b, int64_t tokens, int dev, int sms, cudaStream_t stream,
                              bool programmatic) {
  const uint32_t bit = dev < 32 ? 1u << dev : 0u;
  if (!bit || !(raised.load(std::memory_order_acquire) & bit)) {
    OSCAR_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    raised.fetch_or(bit, std::memory_order_acq_rel);
  }
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

template <int D>
cudaError_t launch_mma_rows(const RotJob& a, const RotJob& b, int64_t tokens, int dev, int sms, cudaStream_t stream,
                            bool programmatic) {
  static std::atomic<uint32_t> raised{0};
  return launch_head_tiles(rotate_mma_kernel<D>, mma_smem_bytes<D>(), 64, raised, a, b, tokens, dev, sms, stream,
                           programmatic);
}

// The tensor-core kernel where it is on (set_rotate_mma), else the largest tile (64, 32 or 16
// tokens) that still gives every SM a block.
template <int D>
cudaError_t launch_tiled(const RotJob& a, const RotJob& b, int64_t tokens, cudaStream_t stream, bool programmatic) {
  int dev = 0, sms = 132;
  OSCAR_CUDA_RETURN_IF_ERROR(cudaGetDevice(&dev));
  OSCAR_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  if (g_rotate_mma.load(std::memory_order_relaxed))
    return launch_mma_rows<D>(a, b, tokens, dev, sms, stream, programmatic);
  const int64_t heads = (a.rows > 0 ? a.heads : 0) + (b.rows > 0 ? b.heads : 0);
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
void set_rotate_mma(bool on) { g_rotate_mma.store(on, std::memory_order_relaxed); }
bool rotate_mma() { return g_rotate_mma.load(std::memory_order_relaxed); }
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
