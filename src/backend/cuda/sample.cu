// Token draws on the device (backend/sample.h): one CTA per row of logits.
//
// A kSample row in four steps, every pass over the row by the whole CTA:
//   1. the max (and NaN; argmax rows stop here with the lowest id of the max);
//   2. each id's weight w = exp((x - max) / T) in double: their total (a fixed reduction
//      order, so the same on every run), and a histogram of z = (max - x) / T in buckets
//      of 1/16 nat (count, float mass), 2048 of them, the last one open-ended;
//   3. from the histogram, the last bucket the draw can need: the one where the count
//      reaches top_k, else where the mass reaches top_p · total (top_p < 1), else where it
//      reaches u · total, plus one bucket of margin for the float masses; the ids of every
//      bucket up to it are a prefix of the (logit desc, id asc) order, gathered into shared
//      memory (at most kCand) and sorted there (bitonic, 64-bit keys);
//   4. the running weights of that sorted prefix (double), and the draw on it exactly as
//      reference_draw defines it.
// Where the prefix is too long for shared memory or does not reach the draw's point (the
// margin was not enough), the row answers kDrawHost and the engine draws it on the host
// from the same logits and u: slower, never different.
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>

#include "backend/cuda/ops.cuh"

namespace oscar::backend::cuda_ops {

namespace {

constexpr int kSampleThreads = 1024;
constexpr int kBuckets = 2048;
constexpr double kBucketsPerNat = 16.0;
constexpr int kCand = 8192;  // candidates sorted in shared memory
constexpr int kWarps = kSampleThreads / 32;

// Shared memory of one CTA (dynamic: 104 KB).
struct SampleSmem {
  unsigned long long keys[kCand];
  int cnt[kBuckets];
  float mass[kBuckets];
  double red_d[kWarps];
  float red_f[kWarps];
  int red_i[kWarps];
  int n_cand, cut, flag;
  int i_topp, i_draw;
  double total, kept_total, mass_n;
};

// Key of (x, id) so that ascending keys are (x descending, id ascending); -0 is +0.
__device__ __forceinline__ unsigned long long order_key(float x, int id) {
  if (x == 0.0f) x = 0.0f;
  uint32_t u = __float_as_uint(x);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending in x
  return (static_cast<unsigned long long>(~u) << 32) | static_cast<uint32_t>(id);
}
__device__ __forceinline__ float key_value(unsigned long long k) {
  uint32_t u = ~static_cast<uint32_t>(k >> 32);
  u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
  return __uint_as_float(u);
}
__device__ __forceinline__ int key_id(unsigned long long k) { return static_cast<int>(k & 0xffffffffu); }

// The bucket of z = (m - x) * inv_t: the same arithmetic in every pass.
__device__ __forceinline__ int bucket_of(float x, float m, double inv_t) {
  const double z = (double(m) - double(x)) * inv_t;
  return z < double(kBuckets - 1) / kBucketsPerNat ? int(z * kBucketsPerNat) : kBuckets - 1;
}

__device__ __forceinline__ double block_sum(double v, SampleSmem& s) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) s.red_d[threadIdx.x / 32] = v;
  __syncthreads();
  double t = 0;
  for (int w = 0; w < kWarps; ++w) t += s.red_d[w];  // the same order in every thread
  return t;
}

// Inclusive block scan of one double per thread (thread order).
__device__ __forceinline__ double block_scan(double v, SampleSmem& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 1; o < 32; o <<= 1) {
    const double n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  __syncthreads();
  if (lane == 31) s.red_d[warp] = v;
  __syncthreads();
  double before = 0;
  for (int w = 0; w < warp; ++w) before += s.red_d[w];
  return v + before;
}

// Inclusive block scan of (count, mass) pairs.
__device__ __forceinline__ void block_scan2(int& c, float& m, SampleSmem& s) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int o = 1; o < 32; o <<= 1) {
    const int nc = __shfl_up_sync(0xffffffffu, c, o);
    const float nm = __shfl_up_sync(0xffffffffu, m, o);
    if (lane >= o) c += nc, m += nm;
  }
  __syncthreads();
  if (lane == 31) s.red_i[warp] = c, s.red_f[warp] = m;
  __syncthreads();
  int bc = 0;
  float bm = 0;
  for (int w = 0; w < warp; ++w) bc += s.red_i[w], bm += s.red_f[w];
  c += bc;
  m += bm;
}

constexpr int kWiden = INT_MIN;  // draw_prefix: the prefix ends before the draw's point

// Steps 3-4 for the ids of buckets [0, cut]: gathers and sorts them, then draws. Returns the
// token, kDrawHost (more than kCand of them), or kWiden (the draw needs ids beyond them).
// The result is the same in every thread.
__device__ int draw_prefix(const float* __restrict__ x, int V, float m, double inv_t, int cut, int keep,
                           double total, const RowDraw& d, SampleSmem& s) {
  const int tid = threadIdx.x;
  __syncthreads();  // (s is reused from the previous attempt)
  if (tid == 0) s.n_cand = 0, s.i_topp = INT_MAX, s.i_draw = INT_MAX, s.mass_n = 0, s.kept_total = 0;
  __syncthreads();
  for (int i = tid; i < V; i += kSampleThreads) {
    const float v = x[i];
    if (bucket_of(v, m, inv_t) > cut) continue;
    const int p = atomicAdd(&s.n_cand, 1);
    if (p < kCand) s.keys[p] = order_key(v, i);
  }
  __syncthreads();
  const int n = s.n_cand;
  if (n > kCand) return kDrawHost;
  if (n < keep && keep < V) return kWiden;  // (top_k: the count reached keep at cut)
  int P = 1;
  while (P < n) P <<= 1;
  for (int i = n + tid; i < P; i += kSampleThreads) s.keys[i] = ~0ull;
  __syncthreads();
  for (int k = 2; k <= P; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < P; i += kSampleThreads) {
        const int ixj = i ^ j;
        if (ixj > i) {
          const unsigned long long a = s.keys[i], b = s.keys[ixj];
          if ((a > b) == ((i & k) == 0)) s.keys[i] = b, s.keys[ixj] = a;
        }
      }
      __syncthreads();
    }

  // Running weights: thread t owns [t E, t E + E) of the sorted ids.
  auto weight = [&](int i) { return exp((double(key_value(s.keys[i])) - double(m)) * inv_t); };
  const int E = (n + kSampleThreads - 1) / kSampleThreads, i0 = min(n, tid * E), i1 = min(n, i0 + E);
  double seg = 0;
  for (int i = i0; i < i1; ++i) seg += weight(i);
  const double before = block_scan(seg, s) - seg;
  // The running weight through id `last` (its owner writes it).
  auto running_to = [&](int last, double& dst) {
    if (last >= i0 && last < i1) {
      double r = before;
      for (int i = i0; i <= last; ++i) r += weight(i);
      dst = r;
    }
  };
  // The kept total: the running weight through keep - 1 (top_k), else every id's.
  if (keep < V) running_to(keep - 1, s.kept_total);
  __syncthreads();
  const double kept_total = keep < V ? s.kept_total : total;
  const int limit = min(n, keep);  // kept candidates
  // top_p: the smallest prefix whose running weight reaches top_p · kept_total.
  int n_p = keep;
  if (d.top_p < 1.0f) {
    const double need = double(d.top_p) * kept_total;
    double r = before;
    for (int i = i0; i < min(i1, limit); ++i) {
      r += weight(i);
      if (r >= need) {
        atomicMin(&s.i_topp, i);
        break;
      }
    }
    __syncthreads();
    if (s.i_topp != INT_MAX)
      n_p = s.i_topp + 1;
    else if (keep == V)
      return kWiden;
    // (top_k: every kept id is a candidate, so not reaching it means all of them, as the
    // reference's loop ends)
  }
  double mass_n = total;
  if (n_p < V) {
    running_to(n_p - 1, s.mass_n);
    __syncthreads();
    mass_n = s.mass_n;
  }
  // The draw: the first id of the prefix whose running weight exceeds u · mass_n.
  const double need = d.u * mass_n;
  double r = before;
  for (int i = i0; i < min(i1, n_p); ++i) {
    r += weight(i);
    if (r > need) {
      atomicMin(&s.i_draw, i);
      break;
    }
  }
  __syncthreads();
  if (s.i_draw != INT_MAX) return key_id(s.keys[s.i_draw]);
  if (n_p <= n) return key_id(s.keys[n_p - 1]);  // u rounds to 1: the prefix's last id
  return kWiden;
}

__global__ void __launch_bounds__(kSampleThreads) sample_rows_k(const float* __restrict__ logits, int V,
                                                               const RowDraw* __restrict__ draws,
                                                               int32_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(smem_raw);
  const int tid = threadIdx.x, row = blockIdx.x;
  const RowDraw d = draws[row];
  if (d.mode == RowDraw::kSkip || d.mode == RowDraw::kHost) {
    if (tid == 0) out[row] = d.mode == RowDraw::kSkip ? kDrawSkipped : kDrawHost;
    return;
  }
  const float* x = logits + int64_t(row) * V;

  // 1. Max (lowest id on ties, NaN skipped) and NaN.
  float bv = -INFINITY;
  int bi = -1, nan = 0;
#pragma unroll 4
  for (int i = tid; i < V; i += kSampleThreads) {
    const float v = x[i];
    if (v != v) {
      nan = 1;
      continue;
    }
    if (bi < 0 || v > bv) bv = v, bi = i;  // i grows: a tie keeps the earlier id
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi))) bv = ov, bi = oi;
  }
  nan = __any_sync(0xffffffffu, nan);
  if (tid % 32 == 0) s.red_f[tid / 32] = bv, s.red_i[tid / 32] = bi, s.keys[tid / 32] = nan;
  __syncthreads();
  float m = -INFINITY;
  int mi = -1;
  bool any_nan = false;
  for (int w = 0; w < kWarps; ++w) {
    const float ov = s.red_f[w];
    const int oi = s.red_i[w];
    any_nan = any_nan || s.keys[w] != 0;
    if (oi >= 0 && (mi < 0 || ov > m || (ov == m && oi < mi))) m = ov, mi = oi;
  }
  if (d.mode == RowDraw::kArgmax) {
    if (tid == 0) out[row] = mi < 0 ? 0 : mi;
    return;
  }
  if (any_nan) {
    if (tid == 0) out[row] = kDrawNaN;
    return;
  }
  if (!(m < INFINITY)) {  // +inf logits: the host's arithmetic decides
    if (tid == 0) out[row] = kDrawHost;
    return;
  }
  const double inv_t = 1.0 / double(d.temperature);

  // 2. Weights: the total and the histogram.
  for (int b = tid; b < kBuckets; b += kSampleThreads) s.cnt[b] = 0, s.mass[b] = 0.0f;
  if (tid == 0) s.cut = kBuckets;
  __syncthreads();
  double local = 0;
  for (int i = tid; i < V; i += kSampleThreads) {
    const float v = x[i];
    const double w = exp((double(v) - double(m)) * inv_t);
    local += w;
    const int b = bucket_of(v, m, inv_t);
    atomicAdd(&s.cnt[b], 1);
    if (b < kBuckets - 1) atomicAdd(&s.mass[b], float(w));
  }
  const double total = block_sum(local, s);

  // 3. The last bucket the draw can need.
  const int keep = d.top_k > 0 && d.top_k < V ? d.top_k : V;
  constexpr int per = kBuckets / kSampleThreads;
  int c[per], c_sum = 0;
  float ms[per], m_sum = 0;
  for (int j = 0; j < per; ++j) {
    c[j] = s.cnt[tid * per + j], ms[j] = s.mass[tid * per + j];
    c_sum += c[j], m_sum += ms[j];
  }
  int c_inc = c_sum;
  float m_inc = m_sum;
  block_scan2(c_inc, m_inc, s);
  {
    int cc = c_inc - c_sum;
    float mm = m_inc - m_sum;
    const double target = keep < V ? 0.0 : (d.top_p < 1.0f ? double(d.top_p) : d.u) * total * (1.0 - 1e-3);
    for (int j = 0; j < per; ++j) {
      cc += c[j], mm += ms[j];
      const bool reached = keep < V ? cc >= keep : double(mm) >= target;
      if (reached) {
        atomicMin(&s.cut, tid * per + j);
        break;
      }
    }
  }
  __syncthreads();
  int cut = s.cut;
  if (cut >= kBuckets) cut = kBuckets - 1;     // the float masses never reached it: everything
  if (keep == V && cut < kBuckets - 1) ++cut;  // margin for the float masses
  for (int widen = 4;; widen *= 2) {
    const int token = draw_prefix(x, V, m, inv_t, cut, keep, total, d, s);
    if (token != kWiden) {
      if (tid == 0) out[row] = token;
      return;
    }
    if (cut == kBuckets - 1) {  // (every id was a candidate: only rounding gets here)
      if (tid == 0) out[row] = kDrawHost;
      return;
    }
    cut = min(kBuckets - 1, cut + widen);
  }
}

}  // namespace

size_t sample_smem_bytes() { return sizeof(SampleSmem); }

void sample_rows(const float* logits, int rows, int V, const RowDraw* draws, int32_t* out, cudaStream_t st) {
  if (rows <= 0) return;
  static bool attr = false;
  if (!attr) {
    cudaFuncSetAttribute(sample_rows_k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(SampleSmem)));
    attr = true;
  }
  sample_rows_k<<<rows, kSampleThreads, sizeof(SampleSmem), st>>>(logits, V, draws, out);
}

}  // namespace oscar::backend::cuda_ops
