#include "backend/cpu/ops_gemm.h"

#include <cblas.h>
#include <fmt/format.h>
#include <immintrin.h>

// GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized inside its own
// _mm512_undefined_* helpers (GCC bug 105593); the warning is about the header.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "backend/cpu/ops_threads.h"
#include "core/error.h"
#include "core/half.h"
#include "core/simd_exp.h"

#define OSCAR_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,fma")))

namespace oscar::backend::cpu {

namespace {

// Register tile MR x NR (14 rows x 2 zmm: 28 accumulators + 2 B vectors + a
// broadcast = 31 of the 32 zmm registers). KC bounds the depth of one pass so
// a packed B micro-panel (KC x NR floats, 32 KiB) stays in L1 while the A
// rows of the M block (MC x K, <= 688 KiB for K = 1536) stay in L2; so does
// the C block of NCP panels (MC x 512 floats, 224 KiB) the passes over K
// accumulate into. (MC = 112 vs 224, KC = 128..768, NCP = 4..96 were all
// within the noise of the shared 2-core VM; these are the textbook sizes.)
constexpr int MR = 14, NR = 32;
constexpr int64_t KC = 256, MC = 8 * MR, NCP = 16;

bool detect_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}
const bool g_have_avx512 = detect_avx512();
bool g_avx512 = g_have_avx512;  // false: the portable paths (gemm_force_portable)

// Grow-only 64-byte aligned scratch (one per thread via thread_local).
struct Scratch {
  float* p = nullptr;
  size_t n = 0;
  ~Scratch() { std::free(p); }
  float* get(size_t want) {
    if (want > n) {
      std::free(p);
      const size_t bytes = (want * sizeof(float) + 63) / 64 * 64;
      p = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (!p) throw std::bad_alloc();
      n = bytes / sizeof(float);
    }
    return p;
  }
};

inline float widen(float x) { return x; }
inline float widen(uint16_t x) { return bf16_to_f32(x); }

// Full panels of transposed B with AVX-512 gathers: dst[k][c] = B[(n0 + c)*ldb + k].
OSCAR_AVX512 void pack_nk_gather(const float* B, int64_t ldb, int64_t n0, int64_t K, float* dst) {
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(int32_t(ldb)));
  const float* s0 = B + n0 * ldb;
  const float* s1 = s0 + 16 * ldb;
  for (int64_t k = 0; k < K; ++k) {
    _mm512_store_ps(dst + k * NR, _mm512_i32gather_ps(idx, s0 + k, 4));
    _mm512_store_ps(dst + k * NR + 16, _mm512_i32gather_ps(idx, s1 + k, 4));
  }
}
// bf16: gathers 32-bit words at 2-byte steps (the wanted value is the low
// half) for k < K - 1, so nothing past the matrix is read; the last k scalar.
OSCAR_AVX512 void pack_nk_gather(const uint16_t* B, int64_t ldb, int64_t n0, int64_t K,
                                 float* dst) {
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(int32_t(ldb)));
  const uint16_t* s0 = B + n0 * ldb;
  const uint16_t* s1 = s0 + 16 * ldb;
  int64_t k = 0;
  for (; k + 1 < K; ++k) {
    const __m512i a = _mm512_i32gather_epi32(idx, s0 + k, 2), b = _mm512_i32gather_epi32(idx, s1 + k, 2);
    _mm512_store_ps(dst + k * NR, _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)));
    _mm512_store_ps(dst + k * NR + 16, _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)));
  }
  for (; k < K; ++k)
    for (int c = 0; c < NR; ++c) dst[k * NR + c] = bf16_to_f32(B[(n0 + c) * ldb + k]);
}

// Packs B columns [p*NR, p*NR + NR) for all K into dst[K][NR] (zero-padded past N).
template <typename BT>
void pack_b_panel(const BT* B, int64_t ldb, bool b_nk, int64_t N, int64_t K, int64_t p,
                  float* dst) {
  const int64_t n0 = p * NR, nc = std::min<int64_t>(NR, N - n0);
  if (b_nk && g_avx512 && nc == NR && 15 * ldb < (int64_t(1) << 31) / 4)
    return pack_nk_gather(B, ldb, n0, K, dst);
  if (b_nk) {
    // B(k, n) = B[n*ldb + k]: a transpose. k outer so the NR source rows'
    // cache lines are reused over consecutive k; stores are contiguous.
    const BT* src[NR];
    for (int64_t c = 0; c < nc; ++c) src[c] = B + (n0 + c) * ldb;
    for (int64_t k = 0; k < K; ++k) {
      float* d = dst + k * NR;
      int64_t c = 0;
      for (; c < nc; ++c) d[c] = widen(src[c][k]);
      for (; c < NR; ++c) d[c] = 0.0f;
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const BT* s = B + k * ldb + n0;
      float* d = dst + k * NR;
      int64_t c = 0;
      for (; c < nc; ++c) d[c] = widen(s[c]);
      for (; c < NR; ++c) d[c] = 0.0f;
    }
  }
}

// Packs A rows [m0, m0+rows) x cols [k0, k0+kc) into dst[kc][MR] (rows >= rows zero).
void pack_a_panel(const float* A, int64_t lda, int64_t m0, int rows, int64_t k0, int64_t kc,
                  float* dst) {
  const float* src[MR];
  for (int r = 0; r < rows; ++r) src[r] = A + (m0 + r) * lda + k0;
  for (int64_t k = 0; k < kc; ++k) {
    float* d = dst + k * MR;
    int r = 0;
    for (; r < rows; ++r) d[r] = src[r][k];
    for (; r < MR; ++r) d[r] = 0.0f;
  }
}

// The 14x32 micro-kernel. A(r, k) = a[k*MR + r] when packed, else a[r*lda + k]
// (all MR rows must exist then). b: packed [kc][NR]. Writes rows [0, rows) of
// C (ldc), columns masked by m0/m1: C = alpha*acc (+bias) (+C when load_c).
template <bool kPackedA>
OSCAR_AVX512 void kernel_14x32(int64_t kc, const float* a, int64_t lda, const float* b, float* c,
                               int64_t ldc, int rows, int nc, float alpha, const float* bias,
                               bool load_c) {
  const __mmask16 m0 = nc >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << nc) - 1);
  const __mmask16 m1 = nc >= 32   ? __mmask16(0xFFFF)
                       : nc <= 16 ? __mmask16(0)
                                  : __mmask16((1u << (nc - 16)) - 1);
  __m512 acc[MR][2];
#pragma GCC unroll 14
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_load_ps(b + k * NR), b1 = _mm512_load_ps(b + k * NR + 16);
#pragma GCC unroll 14
    for (int r = 0; r < MR; ++r) {
      const __m512 av = _mm512_set1_ps(kPackedA ? a[k * MR + r] : a[r * lda + k]);
      acc[r][0] = _mm512_fmadd_ps(av, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(av, b1, acc[r][1]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(m0, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(m1, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 14
  for (int r = 0; r < MR; ++r) {
    if (r >= rows) break;
    float* cr = c + r * ldc;
    __m512 y0 = _mm512_fmadd_ps(acc[r][0], va, bias0), y1 = _mm512_fmadd_ps(acc[r][1], va, bias1);
    if (load_c) {
      y0 = _mm512_add_ps(y0, _mm512_maskz_loadu_ps(m0, cr));
      y1 = _mm512_add_ps(y1, _mm512_maskz_loadu_ps(m1, cr + 16));
    }
    _mm512_mask_storeu_ps(cr, m0, y0);
    _mm512_mask_storeu_ps(cr + 16, m1, y1);
  }
}

// The same contract without SIMD (CPUs without AVX-512).
void kernel_generic(bool packed_a, int64_t kc, const float* a, int64_t lda, const float* b,
                    float* c, int64_t ldc, int rows, int nc, float alpha, const float* bias,
                    bool load_c) {
  float acc[MR][NR] = {};
  for (int64_t k = 0; k < kc; ++k)
    for (int r = 0; r < rows; ++r) {
      const float av = packed_a ? a[k * MR + r] : a[r * lda + k];
      for (int j = 0; j < NR; ++j) acc[r][j] += av * b[k * NR + j];
    }
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < nc; ++j) {
      float y = acc[r][j] * alpha + (bias ? bias[j] : 0.0f);
      if (load_c) y += c[r * ldc + j];
      c[r * ldc + j] = y;
    }
}

struct Problem {
  int64_t M, N, K;
  const float* A;
  int64_t lda;
  const float* Bp;  // packed: panel p at Bp + p*pstride, [>= K][NR]
  int64_t pstride;
  float* C;
  int64_t ldc;
  float alpha;
  const float* bias;
  bool accumulate;
  int64_t kcs;  // depth of one pass (<= KC)
};

// Rows [mb0, mb1) x panels [p0, p1) on the calling thread.
void run_range(const Problem& P, int64_t mb0, int64_t mb1, int64_t p0, int64_t p1) {
  // Pack A unless its rows can be read in place cheaply: a row stride that is a
  // multiple of 4 KiB would put all MR rows in the same L1 sets. Partial row
  // tiles are always packed (zero rows, no reads past the matrix).
  const bool pack_a = (P.lda * 4) % 4096 == 0;
  thread_local Scratch a_scratch;
  // Packed A of one M block, all passes: pass k0 at k0*MC, its row tile i at (i - mb)*kc.
  float* Ap = a_scratch.get(size_t(MC * P.K));
  for (int64_t mb = mb0; mb < mb1; mb += MC) {
    const int64_t me = std::min(mb1, mb + MC);
    for (int64_t k0 = 0; k0 < P.K; k0 += P.kcs) {
      const int64_t kc = std::min(P.kcs, P.K - k0);
      for (int64_t i = mb; i < me; i += MR) {
        const int rows = int(std::min<int64_t>(MR, me - i));
        if (pack_a || rows < MR)
          pack_a_panel(P.A, P.lda, i, rows, k0, kc, Ap + k0 * MC + (i - mb) * kc);
      }
    }
    // Column chunks of NCP panels: the chunk's C block (MC x NCP*NR) stays in
    // L2 across the passes over K.
    for (int64_t pb = p0; pb < p1; pb += NCP) {
      const int64_t pe = std::min(p1, pb + NCP);
      for (int64_t k0 = 0; k0 < P.K; k0 += P.kcs) {
        const int64_t kc = std::min(P.kcs, P.K - k0);
        const bool load_c = P.accumulate || k0 > 0;
        const float* bias = k0 == 0 ? P.bias : nullptr;
        for (int64_t p = pb; p < pe; ++p) {
          const int64_t n0 = p * NR;
          const int nc = int(std::min<int64_t>(NR, P.N - n0));
          const float* bp = P.Bp + p * P.pstride + k0 * NR;
          const float* bias_p = bias ? bias + n0 : nullptr;
          for (int64_t i = mb; i < me; i += MR) {
            const int rows = int(std::min<int64_t>(MR, me - i));
            float* c = P.C + i * P.ldc + n0;
            const bool packed = pack_a || rows < MR;
            const float* a = packed ? Ap + k0 * MC + (i - mb) * kc : P.A + i * P.lda + k0;
            if (!g_avx512)
              kernel_generic(packed, kc, a, P.lda, bp, c, P.ldc, rows, nc, P.alpha, bias_p,
                             load_c);
            else if (packed)
              kernel_14x32<true>(kc, a, 0, bp, c, P.ldc, rows, nc, P.alpha, bias_p, load_c);
            else
              kernel_14x32<false>(kc, a, P.lda, bp, c, P.ldc, rows, nc, P.alpha, bias_p, load_c);
          }
        }
      }
    }
  }
}

void run(const Problem& P, int64_t npan) {
  // Tasks are M blocks (or, when M is short, groups of 4 column panels), pulled
  // by the op threads from a counter: on a shared machine a thread that is
  // descheduled for a while does not hold the others up at the end.
  const int nt = op_threads();
  const bool split_m = P.M >= int64_t(nt) * MR * 4 || npan == 1;
  // Row blocks: at most MC, about 4 per thread when M is short, whole tiles.
  const int64_t per = (P.M + 4 * nt - 1) / (4 * nt);
  const int64_t mblk = std::min<int64_t>(MC, std::max<int64_t>(MR, (per + MR - 1) / MR * MR));
  const int64_t ntask = split_m ? (P.M + mblk - 1) / mblk : (npan + 3) / 4;
  std::atomic<int64_t> next{0};
  parallel_for(std::min<int64_t>(nt, ntask), 1, [&](int64_t, int64_t) {
    for (int64_t t; (t = next.fetch_add(1)) < ntask;) {
      if (split_m)
        run_range(P, t * mblk, std::min(P.M, (t + 1) * mblk), 0, npan);
      else
        run_range(P, 0, P.M, t * 4, std::min(npan, (t + 1) * 4));
    }
  });
}

int64_t pass_depth(int64_t K) {
  const int64_t nk = (K + KC - 1) / KC;
  return (K + nk - 1) / nk;
}

template <typename BT>
void pack_all(const BT* B, int64_t ldb, bool b_nk, int64_t N, int64_t K, float* dst) {
  const int64_t npan = (N + NR - 1) / NR;
  parallel_for(npan, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p) pack_b_panel(B, ldb, b_nk, N, K, p, dst + p * K * NR);
  });
}

template <typename BT>
void gemm_avx512_impl(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const BT* B,
                      int64_t ldb, bool b_nk, float* C, int64_t ldc, float alpha,
                      const float* bias, bool accumulate) {
  // Column chunks of at most ~8 MiB of packed B (a whole LM head is never
  // copied at once; the usual linears are one chunk).
  const int64_t chunk = std::max<int64_t>(1, (int64_t(8) << 20) / (K * NR * 4)) * NR;
  thread_local Scratch b_scratch;
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t nc = std::min(chunk, N - n0), npan = (nc + NR - 1) / NR;
    float* Bp = b_scratch.get(size_t(npan * K * NR));
    pack_all(B + (b_nk ? n0 * ldb : n0), ldb, b_nk, nc, K, Bp);
    run(Problem{M, nc, K, A, lda, Bp, K * NR, C + n0, ldc, alpha, bias ? bias + n0 : nullptr,
                accumulate, pass_depth(K)},
        npan);
  }
}

// No AVX-512: OpenBLAS (bf16 B widened first).
void gemm_blas(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, bool b_nk, float* C, int64_t ldc, float alpha, const float* bias,
               bool accumulate) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, b_nk ? CblasTrans : CblasNoTrans, int(M), int(N),
              int(K), alpha, A, int(lda), B, int(ldb), accumulate ? 1.0f : 0.0f, C, int(ldc));
  if (bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) C[m * ldc + n] += bias[n];
}

// K == 0: C = bias (or 0), or C += bias.
void gemm_empty_k(int64_t M, int64_t N, float* C, int64_t ldc, const float* bias,
                  bool accumulate) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n)
      C[m * ldc + n] = (accumulate ? C[m * ldc + n] : 0.0f) + (bias ? bias[n] : 0.0f);
}

// 2^x for x <= 0, flushed to 0 below x = -126 (x = -inf gives 0): no
// denormal results, whose use in the value product would cost microcode
// assists (their weight, < 2^-126, is below fp32 resolution of the sum anyway).
// x = n + f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial (Taylor
// coefficients of e^(f ln2), relative error < 3e-8 on the interval), times 2^n.
OSCAR_AVX512 inline __m512 exp2_neg(__m512 x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, simd::exp2_clamped_avx512(_mm512_max_ps(x, _mm512_set1_ps(-126.0f))));
}

// p[i] = 2^(p[i] - mx) on the lanes of m; their sum added to s0/s1 in fp64.
OSCAR_AVX512 inline void exp_store(float* p, __mmask16 m, __m512 mx, __m512d& s0, __m512d& s1) {
  const __m512 e = _mm512_maskz_mov_ps(m, exp2_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p), mx)));
  _mm512_mask_storeu_ps(p, m, e);
  s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
  s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(e, 1)));
}

// s[j] = 2^(s[j] - max) for j < len, 0 for len <= j < width; returns Σ (fp64).
OSCAR_AVX512 double exp2_row_avx512(float* s, int len, int width) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int j = 0;
  for (; j + 16 <= len; j += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + j));
  const __mmask16 tail = __mmask16((1u << (len - j)) - 1);
  vmax = _mm512_mask_max_ps(vmax, tail, vmax, _mm512_maskz_loadu_ps(tail, s + j));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  // Σ in fp64 (two 8-lane halves per vector).
  __m512d sum0 = _mm512_setzero_pd(), sum1 = _mm512_setzero_pd();
  for (j = 0; j + 16 <= len; j += 16) exp_store(s + j, 0xFFFF, mx, sum0, sum1);
  if (j < len) exp_store(s + j, tail, mx, sum0, sum1);
  for (j = len; j < width; ++j) s[j] = 0.0f;
  return _mm512_reduce_add_pd(_mm512_add_pd(sum0, sum1));
}

double exp2_row_scalar(float* s, int len, int width) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int j = 0; j < len; ++j) mx = std::max(mx, s[j]);
  double sum = 0;
  for (int j = 0; j < len; ++j) sum += (s[j] = std::exp2(s[j] - mx));
  for (int j = len; j < width; ++j) s[j] = 0.0f;
  return sum;
}

}  // namespace

double exp2_row(float* s, int len, int width) {
  return g_avx512 ? exp2_row_avx512(s, len, width) : exp2_row_scalar(s, len, width);
}

void softmax_exp2_row(float* s, int len, int width) {
  const float inv = float(1.0 / exp2_row(s, len, width));
  for (int j = 0; j < len; ++j) s[j] *= inv;
}

bool gemm_avx512() { return g_avx512; }

void gemm_force_portable(bool on) { g_avx512 = on ? false : g_have_avx512; }

PackedB::~PackedB() { std::free(data_); }

void PackedB::pack(const float* B, int64_t ldb, bool b_nk, int64_t N, int64_t K) {
  if (N < 0 || K < 0) throw Error(fmt::format("PackedB::pack: negative shape {} x {}", N, K));
  const int64_t npan = (N + NR - 1) / NR;
  const size_t want = size_t(std::max<int64_t>(1, npan * K * NR));
  if (want > cap_) {
    std::free(data_);
    data_ = static_cast<float*>(std::aligned_alloc(64, (want * sizeof(float) + 63) / 64 * 64));
    if (!data_) throw std::bad_alloc();
    cap_ = want;
  }
  N_ = N;
  K_ = K;
  pack_all(B, ldb, b_nk, N, K, data_);
}

void gemm_packed(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const PackedB& B,
                 float* C, int64_t ldc, float alpha, const float* bias, bool accumulate) {
  if (N > B.N_ || K > B.K_)
    throw Error(fmt::format("gemm_packed: a {} x {} (N x K) product from a packed B of {} x {}", N, K,
                            B.N_, B.K_));
  if (M <= 0 || N <= 0) return;
  if (K <= 0) return gemm_empty_k(M, N, C, ldc, bias, accumulate);
  run(Problem{M, N, K, A, lda, B.data_, B.K_ * NR, C, ldc, alpha, bias, accumulate, pass_depth(K)},
      (N + NR - 1) / NR);
}

void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, bool b_nk, float* C, int64_t ldc, float alpha, const float* bias,
              bool accumulate) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) return gemm_empty_k(M, N, C, ldc, bias, accumulate);
  if (g_avx512)
    return gemm_avx512_impl(M, N, K, A, lda, B, ldb, b_nk, C, ldc, alpha, bias, accumulate);
  gemm_blas(M, N, K, A, lda, B, ldb, b_nk, C, ldc, alpha, bias, accumulate);
}

void gemm_bf16w(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const uint16_t* B,
                int64_t ldb, float* C, int64_t ldc, const float* bias) {
  if (M <= 0 || N <= 0) return;
  if (K <= 0) return gemm_empty_k(M, N, C, ldc, bias, false);
  if (g_avx512)
    return gemm_avx512_impl(M, N, K, A, lda, B, ldb, true, C, ldc, 1.0f, bias, false);
  // Widen a tile of rows at a time and hand it to BLAS.
  const int64_t tile = std::max<int64_t>(64, (1 << 20) / K);
  std::vector<float> wf(size_t(std::min(tile, N) * K));
  for (int64_t r0 = 0; r0 < N; r0 += tile) {
    const int64_t rows = std::min(tile, N - r0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < K; ++k) wf[size_t(r * K + k)] = bf16_to_f32(B[(r0 + r) * ldb + k]);
    gemm_blas(M, rows, K, A, lda, wf.data(), K, true, C + r0, ldc, 1.0f,
              bias ? bias + r0 : nullptr, false);
  }
}

void gemm_f32_ref(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                  int64_t ldb, bool b_nk, float* C, int64_t ldc, float alpha, const float* bias,
                  bool accumulate) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float s = 0.0f;
      for (int64_t k = 0; k < K; ++k) s += A[m * lda + k] * (b_nk ? B[n * ldb + k] : B[k * ldb + n]);
      float y = alpha * s + (bias ? bias[n] : 0.0f);
      if (accumulate) y += C[m * ldc + n];
      C[m * ldc + n] = y;
    }
}

}  // namespace oscar::backend::cpu
