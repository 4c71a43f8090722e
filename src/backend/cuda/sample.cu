// Token draws on the device (backend/sample.h): one CTA of 1024 threads per row of logits.
//
// A draw needs the (logit desc, id asc) order only around two points: where the running
// weight reaches top_p · (kept total), and where it exceeds u · (the top-p prefix's weight);
// top_k needs the id of rank k - 1. So the vocabulary is never sorted:
//   1. the max (and NaN; argmax rows stop here with the lowest id of the max);
//   2. each id's weight w = exp((x - max) · (1 / T)) in double: their total (a fixed reduction
//      order, so the same on every run), and a histogram of z = (max - x) / T in buckets of
//      1/16 nat (exact counts, float masses), 2048 buckets, the last one open-ended. Every
//      bucket holds a contiguous range of ranks, bucket 0 the best;
//   3. for each point: the bucket the float masses put it in (a guess); a window of buckets
//      around it is resolved exactly: its ids gathered into shared memory and sorted there
//      (bitonic on 64-bit (logit, id) keys), their running weights (double) started from the
//      exact weight of every bucket before the window (summed in a fixed order). If the point
//      is not inside the window, the next window (twice as wide) lies towards it.
// The presence and frequency penalties (backend/sample.h) are applied once, into a copy of the row
// (adj) that the passes then read. min_p keeps the ids of weight >= min_p, a prefix of the order
// counted in the weights pass and taken as top_k's is (the shorter of the two). A repetition
// penalty is applied as each logit is read: the row's distinct
// history ids are a bitmap in shared memory, built from the call's list or copied from the row's
// penalty slot (a bitmap in global memory, kept from call to call; the call's list updates it
// first). A window of more than kCand ids (a row so flat that
// thousands of ids share 1/16 nat), a row without a finite logit, or a penalized row of more
// than kPenIds ids answers kDrawHost: the engine draws it on the host from the same
// logits and u. Sums taken in other orders than the reference's may move a point only where
// u · weight is within rounding (~1e-16 relative) of a running weight.
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
constexpr int kCand = 8192;  // ids of a resolved window
constexpr int kWarps = kSampleThreads / 32;
constexpr int kPer = kBuckets / kSampleThreads;
constexpr int kPenIds = 1 << 18;  // vocabulary a penalty bitmap covers
constexpr int kPenSlotWords = kPenIds / 32;  // one penalty slot (32 KB)
static_assert(kPenSlotWords * 4 == kPenaltySlotBytes, "ops.cuh's slot size");

// Shared memory of one CTA (dynamic, ~177 KB).
struct SampleSmem {
  uint32_t pen_bits[kPenIds / 32];  // ids the repetition penalty acts on
  unsigned long long keys[kCand];  // the window's ids, sorted
  double run[kCand];               // their running weights (from rank 0)
  int cum_cnt[kBuckets];           // ids in buckets [0, b]
  float cum_mass[kBuckets];        // weight of buckets [0, b] (float: guesses only)
  double red_d[kWarps];
  float red_f[kWarps];
  int red_i[kWarps];
  int n_w, hit;
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
__device__ __forceinline__ double weight_of(float x, float m, double inv_t) {
  return exp((double(x) - double(m)) * inv_t);
}

// Sum over the block, the same order in every thread and every run.
__device__ double block_sum(double v, SampleSmem& s) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if (threadIdx.x % 32 == 0) s.red_d[threadIdx.x / 32] = v;
  __syncthreads();
  double t = 0;
  for (int w = 0; w < kWarps; ++w) t += s.red_d[w];
  return t;
}

// Inclusive block scan of one double per thread (thread order).
__device__ double block_scan(double v, SampleSmem& s) {
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
__device__ void block_scan2(int& c, float& m, SampleSmem& s) {
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

// The row after steps 1-2: what every query reads.
struct Row {
  const float* x;
  int V;
  float m;
  double inv_t;
  float pen;              // repetition penalty (1: none)
  const uint32_t* bits;   // its ids (null without a penalty)
};

// Logit i of the row, penalized as engine::Sampler does it. (x not __restrict__: it may be the
// row's adjusted copy written earlier in the same kernel, which a non-coherent load could miss.)
__device__ __forceinline__ float load(const float* x, int i, float pen, const uint32_t* bits) {
  float v = x[i];
  if (bits && ((bits[i >> 5] >> (i & 31)) & 1u)) v = v > 0 ? v / pen : v * pen;
  return v;
}
__device__ __forceinline__ float load(const Row& r, int i) { return load(r.x, i, r.pen, r.bits); }

// A resolved window of buckets [lo, hi]: s.keys / s.run hold its n ids, ranks
// [base_count, base_count + n), s.run already including `base` (the weight of every id before).
struct Window {
  int n = 0, base_count = 0;
  double base = 0;
  bool overflow = false;
};

__device__ Window resolve(const Row& r, int lo, int hi, SampleSmem& s) {
  const int tid = threadIdx.x;
  Window w;
  w.base_count = lo > 0 ? s.cum_cnt[lo - 1] : 0;
  w.n = s.cum_cnt[hi] - w.base_count;
  if (w.n > kCand) {
    w.overflow = true;
    return w;
  }
  __syncthreads();  // (s.keys / s.run / s.n_w of the previous window are read no more)
  if (tid == 0) s.n_w = 0;
  __syncthreads();
  double before_lo = 0;  // this thread's ids of the buckets before the window, in id order
  for (int i = tid; i < r.V; i += kSampleThreads) {
    const float v = load(r, i);
    const int b = bucket_of(v, r.m, r.inv_t);
    if (b < lo) {
      before_lo += weight_of(v, r.m, r.inv_t);
    } else if (b <= hi) {
      s.keys[atomicAdd(&s.n_w, 1)] = order_key(v, i);
    }
  }
  w.base = block_sum(before_lo, s);  // (its barriers also publish the keys)
  const int n = w.n;
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
  // Running weights: thread t sums [t E, t E + E), then the block scan places the segments.
  const int E = (n + kSampleThreads - 1) / kSampleThreads, i0 = min(n, tid * E), i1 = min(n, i0 + E);
  double seg = 0;
  for (int i = i0; i < i1; ++i) seg += weight_of(key_value(s.keys[i]), r.m, r.inv_t);
  double run = w.base + (block_scan(seg, s) - seg);
  for (int i = i0; i < i1; ++i) s.run[i] = (run += weight_of(key_value(s.keys[i]), r.m, r.inv_t));
  __syncthreads();
  return w;
}

// The first local index of w whose running weight reaches t (strict: exceeds it), or -1.
__device__ int first_reaching(const Window& w, double t, bool strict, SampleSmem& s) {
  __syncthreads();
  if (threadIdx.x == 0) s.hit = INT_MAX;
  __syncthreads();
  for (int i = threadIdx.x; i < w.n; i += kSampleThreads) {
    const bool reached = strict ? s.run[i] > t : s.run[i] >= t;
    if (reached && (i == 0 || !(strict ? s.run[i - 1] > t : s.run[i - 1] >= t))) atomicMin(&s.hit, i);
  }
  __syncthreads();
  return s.hit == INT_MAX ? -1 : s.hit;
}

// A point of the order: its rank (V when no id reaches t), its running weight and id.
struct Point {
  int rank = 0, id = -1;
  double run = 0;
  bool host = false;  // a window overflowed
};

// The first rank whose running weight reaches t (strict: exceeds it).
__device__ Point find(const Row& r, double t, bool strict, SampleSmem& s) {
  const int tid = threadIdx.x;
  // Guess: the first bucket whose float running mass reaches t (a little below, for rounding).
  __syncthreads();
  if (tid == 0) s.hit = kBuckets - 1;
  __syncthreads();
  const float tf = float(t * (1.0 - 1e-4));
  for (int j = 0; j < kPer; ++j) {
    const int b = tid * kPer + j;
    if (s.cum_mass[b] >= tf && (b == 0 || s.cum_mass[b - 1] < tf)) atomicMin(&s.hit, b);
  }
  __syncthreads();
  int lo = s.hit, hi = s.hit, grow = 1;
  Point p;
  for (;;) {
    const Window w = resolve(r, lo, hi, s);
    if (w.overflow) {
      p.host = true;
      return p;
    }
    const bool before = lo > 0 && (strict ? w.base > t : w.base >= t);
    if (!before) {
      const int i = first_reaching(w, t, strict, s);
      if (i >= 0) {
        p.rank = w.base_count + i;
        p.run = s.run[i];
        p.id = key_id(s.keys[i]);
        return p;
      }
      if (hi == kBuckets - 1) {  // no id reaches t
        p.rank = r.V;
        return p;
      }
      lo = hi + 1, hi = min(kBuckets - 1, hi + grow);  // the point is after the window
    } else {
      hi = lo - 1, lo = max(0, lo - grow);  // ... before it
    }
    grow *= 2;
  }
}

// The id of rank k and the running weight through it.
__device__ Point at_rank(const Row& r, int k, SampleSmem& s) {
  const int tid = threadIdx.x;
  __syncthreads();
  if (tid == 0) s.hit = kBuckets - 1;
  __syncthreads();
  for (int j = 0; j < kPer; ++j) {
    const int b = tid * kPer + j;
    if (s.cum_cnt[b] > k && (b == 0 || s.cum_cnt[b - 1] <= k)) atomicMin(&s.hit, b);
  }
  __syncthreads();
  Point p;
  const Window w = resolve(r, s.hit, s.hit, s);
  if (w.overflow) {
    p.host = true;
    return p;
  }
  p.rank = k;
  p.run = s.run[k - w.base_count];
  p.id = key_id(s.keys[k - w.base_count]);
  return p;
}

__global__ void __launch_bounds__(kSampleThreads) sample_rows_k(const float* __restrict__ logits, int V,
                                                               const RowDraw* __restrict__ draws,
                                                               const int32_t* __restrict__ hist,
                                                               uint32_t* __restrict__ slots, float* adj,
                                                               int32_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SampleSmem& s = *reinterpret_cast<SampleSmem*>(smem_raw);
  const int tid = threadIdx.x, row = blockIdx.x;
  const RowDraw d = draws[row];
  const int words = (V + 31) / 32;
  uint32_t* slot = nullptr;
  if (d.pen_slot >= 0 && V <= kPenIds) {  // the slot's update comes first, whatever the row's mode
    slot = slots + int64_t(d.pen_slot) * kPenSlotWords;
    if (d.pen_reset) {
      for (int w = tid; w < words; w += kSampleThreads) slot[w] = 0;
      __syncthreads();  // (orders this block's global writes too)
    }
    for (int j = tid; j < d.hist_len; j += kSampleThreads) {
      const int t = hist[d.hist_off + j];
      if (t >= 0 && t < V) atomicOr(&slot[t >> 5], 1u << (t & 31));
    }
    __syncthreads();
  }
  if (d.mode == RowDraw::kSkip || d.mode == RowDraw::kHost) {
    if (tid == 0) out[row] = d.mode == RowDraw::kSkip ? kDrawSkipped : kDrawHost;
    return;
  }
  const float* x = logits + int64_t(row) * V;
  const float pen = d.penalty;
  const uint32_t* bits = nullptr;
  if (pen != 1.0f) {  // the penalty's ids as a bitmap
    if (V > kPenIds) {
      if (tid == 0) out[row] = kDrawHost;
      return;
    }
    if (slot) {
      for (int w = tid; w < words; w += kSampleThreads) s.pen_bits[w] = __ldcg(slot + w);  // (L2: written above)
    } else {
      for (int w = tid; w < words; w += kSampleThreads) s.pen_bits[w] = 0;
      __syncthreads();
      for (int j = tid; j < d.hist_len; j += kSampleThreads) {
        const int t = hist[d.hist_off + j];
        if (t >= 0 && t < V) atomicOr(&s.pen_bits[t >> 5], 1u << (t & 31));
      }
    }
    __syncthreads();
    bits = s.pen_bits;
  }
  if (d.presence != 0.0f || d.frequency != 0.0f) {
    // Presence / frequency penalties: the row's logits after every penalty, into its copy
    // adj[row] (each generated id is listed once, so no two threads write one id).
    float* y = adj + int64_t(row) * V;
    for (int i = tid; i < V; i += kSampleThreads) y[i] = load(x, i, pen, bits);
    __syncthreads();
    for (int j = tid; j < d.cnt_len; j += kSampleThreads) {
      const int t = hist[d.cnt_off + 2 * j], c = hist[d.cnt_off + 2 * j + 1];
      if (t >= 0 && t < V && c > 0) y[t] -= fmaf(d.frequency, float(c), d.presence);
    }
    __syncthreads();
    x = y;
    bits = nullptr;
  }

  // 1. Max (lowest id on ties, NaN skipped) and NaN.
  float bv = -INFINITY;
  int bi = -1, nan = 0;
#pragma unroll 4
  for (int i = tid; i < V; i += kSampleThreads) {
    const float v = load(x, i, pen, bits);
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
  if (tid % 32 == 0) s.red_f[tid / 32] = bv, s.red_i[tid / 32] = bi, s.cum_cnt[tid / 32] = nan;
  __syncthreads();
  float m = -INFINITY;
  int mi = -1;
  bool any_nan = false;
  for (int w = 0; w < kWarps; ++w) {
    const float ov = s.red_f[w];
    const int oi = s.red_i[w];
    any_nan = any_nan || s.cum_cnt[w] != 0;
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
  if (!(m > -INFINITY && m < INFINITY)) {  // +inf logits, or every id -inf: the host's arithmetic decides
    if (tid == 0) out[row] = kDrawHost;
    return;
  }
  const Row r{x, V, m, 1.0 / double(d.temperature), pen, bits};

  // 2. Weights: the total and the histogram.
  __syncthreads();
  for (int b = tid; b < kBuckets; b += kSampleThreads) s.cum_cnt[b] = 0, s.cum_mass[b] = 0.0f;
  __syncthreads();
  double local = 0;
  const double min_p = d.min_p;
  int above_min_p = 0;  // ids of weight >= min_p (min_p > 0): a prefix of the order, as top_k's
  for (int i = tid; i < V; i += kSampleThreads) {
    const float v = load(r, i);
    const double w = weight_of(v, m, r.inv_t);
    local += w;
    above_min_p += w >= min_p;
    const int b = bucket_of(v, m, r.inv_t);
    atomicAdd(&s.cum_cnt[b], 1);
    if (b < kBuckets - 1) atomicAdd(&s.cum_mass[b], float(w));
  }
  const double total = block_sum(local, s);
  const int n_min_p = min_p > 0.0 ? max(1, int(block_sum(double(above_min_p), s))) : V;
  {  // counts and masses -> running counts and masses
    int c[kPer], c_sum = 0;
    float ms[kPer], m_sum = 0;
    for (int j = 0; j < kPer; ++j) {
      c[j] = s.cum_cnt[tid * kPer + j], ms[j] = s.cum_mass[tid * kPer + j];
      c_sum += c[j], m_sum += ms[j];
    }
    int cc = c_sum;
    float mm = m_sum;
    block_scan2(cc, mm, s);
    cc -= c_sum, mm -= m_sum;
    __syncthreads();
    for (int j = 0; j < kPer; ++j) s.cum_cnt[tid * kPer + j] = (cc += c[j]), s.cum_mass[tid * kPer + j] = (mm += ms[j]);
    __syncthreads();
  }

  // 3. The points of the draw.
  const int keep = min(d.top_k > 0 && d.top_k < V ? d.top_k : V, n_min_p);
  double kept_total = total;
  if (keep < V) {  // the weight through rank keep - 1
    const Point k = at_rank(r, keep - 1, s);
    if (k.host) {
      if (tid == 0) out[row] = kDrawHost;
      return;
    }
    kept_total = k.run;
  }
  int n_p = keep;  // the top-p prefix: ranks [0, n_p), weight mass_n
  double mass_n = kept_total;
  if (d.top_p < 1.0f) {
    const Point p = find(r, double(d.top_p) * kept_total, false, s);
    if (p.host) {
      if (tid == 0) out[row] = kDrawHost;
      return;
    }
    if (p.rank < keep) n_p = p.rank + 1, mass_n = p.run;  // (else all kept ids, as the reference's loop ends)
  }
  Point q = find(r, d.u * mass_n, true, s);
  if (!q.host && q.rank >= n_p) q = at_rank(r, n_p - 1, s);  // u rounds to 1: the prefix's last id
  if (tid == 0) out[row] = q.host ? kDrawHost : q.id;
}

}  // namespace

void sample_rows(const float* logits, int rows, int V, const RowDraw* draws, const int32_t* hist, uint32_t* slots,
                 float* adj, int32_t* out, cudaStream_t st) {
  if (rows <= 0) return;
  // Per call, not once per process: the attribute belongs to the current device (a failure
  // shows as the launch's error, which the caller checks).
  cudaFuncSetAttribute(sample_rows_k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(sizeof(SampleSmem)));
  sample_rows_k<<<rows, kSampleThreads, sizeof(SampleSmem), st>>>(logits, V, draws, hist, slots, adj, out);
}

}  // namespace oscar::backend::cuda_ops
