#include "core/linalg.h"

#include <cblas.h>
#include <immintrin.h>

#include <algorithm>

namespace oscar::la {

// Why our own kernel: the Debian OpenBLAS picks its kernels by CPU model at
// load time and falls back to the SSE3 "Prescott" kernels on CPUs it does not
// recognize (this dev VM reports a generic "Intel Xeon Processor"), which made
// calibration ~3x slower. The products here have one fixed small dimension
// (d = 64..256), so a plain AVX-512 register-tiled kernel, selected at run
// time, is enough. Without AVX-512 we call OpenBLAS.
namespace {

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return ok;
}

// C[i][j] += Σ_k A(i,k)·B(k,j) for i in [0,M), j in [0,N) with N % 16 == 0,
// A(i,k) = A[i*sa_i + k*sa_k], B(k,j) = B[k*ldb + j]. upper: only tiles that
// reach the diagonal or above (j0 + 16 > i0) are computed.
__attribute__((target("avx512f,fma"))) void gemm_acc_avx512(const double* A, int64_t sa_i,
                                                            int64_t sa_k, const double* B,
                                                            int64_t ldb, double* C, int64_t ldc,
                                                            int64_t M, int N, int64_t K, bool upper,
                                                            bool lower_b = false) {
  constexpr int64_t KC = 256;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    for (int j0 = 0; j0 < N; j0 += 16) {
      const double* Bp = B + k0 * ldb + j0;
      // lower_b: B(k, j) = 0 for k < j, so this column tile starts at k = j0.
      const int64_t ks = lower_b ? std::clamp<int64_t>(j0 - k0, 0, kc) : 0;
      int64_t i0 = 0;
      // 8x16 register tile: 16 accumulators, 2 B loads + 8 broadcasts per 16 FMAs.
      for (; i0 + 8 <= M; i0 += 8) {
        if (upper && j0 + 16 <= i0) continue;
        __m512d c[8][2];
        for (int r = 0; r < 8; ++r) c[r][0] = c[r][1] = _mm512_setzero_pd();
        const double* a0 = A + i0 * sa_i + k0 * sa_k;
        for (int64_t k = ks; k < kc; ++k) {
          const __m512d b0 = _mm512_loadu_pd(Bp + k * ldb), b1 = _mm512_loadu_pd(Bp + k * ldb + 8);
          const double* ak = a0 + k * sa_k;
#pragma GCC unroll 8
          for (int r = 0; r < 8; ++r) {
            const __m512d x = _mm512_set1_pd(ak[r * sa_i]);
            c[r][0] = _mm512_fmadd_pd(x, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_pd(x, b1, c[r][1]);
          }
        }
        double* cp = C + i0 * ldc + j0;
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
          _mm512_storeu_pd(cp + r * ldc, _mm512_add_pd(_mm512_loadu_pd(cp + r * ldc), c[r][0]));
          _mm512_storeu_pd(cp + r * ldc + 8,
                           _mm512_add_pd(_mm512_loadu_pd(cp + r * ldc + 8), c[r][1]));
        }
      }
      for (; i0 < M; ++i0) {  // leftover rows (M % 8)
        if (upper && j0 + 16 <= i0) continue;
        __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
        for (int64_t k = ks; k < kc; ++k) {
          const __m512d x = _mm512_set1_pd(A[i0 * sa_i + (k0 + k) * sa_k]);
          lo = _mm512_fmadd_pd(x, _mm512_loadu_pd(Bp + k * ldb), lo);
          hi = _mm512_fmadd_pd(x, _mm512_loadu_pd(Bp + k * ldb + 8), hi);
        }
        double* c = C + i0 * ldc + j0;
        _mm512_storeu_pd(c, _mm512_add_pd(_mm512_loadu_pd(c), lo));
        _mm512_storeu_pd(c + 8, _mm512_add_pd(_mm512_loadu_pd(c + 8), hi));
      }
    }
  }
}

}  // namespace

void syrk_upper_acc(const double* A, int64_t n, int d, int64_t lda, double* C) {
  if (n <= 0) return;
  if (have_avx512() && d % 16 == 0) {
    // C += Aᵀ A: A(i,k) = A[k*lda + i], B(k,j) = A[k*lda + j].
    gemm_acc_avx512(A, 1, lda, A, lda, C, d, d, d, n, /*upper=*/true);
    return;
  }
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, static_cast<int>(n), 1.0, A,
              static_cast<int>(lda), 1.0, C, d);
}

void symmetrize_from_upper(double* C, int d) {
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < i; ++j)
      C[static_cast<int64_t>(i) * d + j] = C[static_cast<int64_t>(j) * d + i];
}

void gemm(const double* A, const double* B, double* C, int64_t m, int k, int n, bool accumulate) {
  if (m <= 0) return;
  if (have_avx512() && n % 16 == 0) {
    if (!accumulate) std::fill(C, C + m * n, 0.0);
    gemm_acc_avx512(A, k, 1, B, n, C, n, m, n, k, false);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), n, k, 1.0, A, k, B, n,
              accumulate ? 1.0 : 0.0, C, n);
}

void gemm_lower(const double* A, const double* L, double* C, int64_t m, int d) {
  if (m <= 0) return;
  if (have_avx512() && d % 16 == 0) {
    std::fill(C, C + m * d, 0.0);
    gemm_acc_avx512(A, d, 1, L, d, C, d, m, d, d, false, /*lower_b=*/true);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), d, d, 1.0, A, d, L, d,
              0.0, C, d);
}

void gemm_nt(const double* A, const double* B, double* C, int64_t m, int k, int n) {
  if (m <= 0) return;
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), n, k, 1.0, A, k, B, k,
              0.0, C, n);
}

void gemm_tn(const double* A, const double* B, double* C, int k, int64_t m, int n) {
  if (have_avx512() && n % 16 == 0) {
    std::fill(C, C + m * n, 0.0);
    gemm_acc_avx512(A, 1, m, B, n, C, n, m, n, k, false);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(m), n, k, 1.0, A,
              static_cast<int>(m), B, n, 0.0, C, n);
}

}  // namespace oscar::la
