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
__attribute__((target("avx512f,fma"))) void gemm_acc_avx512(const double* A, int64_t sa_i, int64_t sa_k,
                                                             const double* B, int64_t ldb, double* C, int64_t ldc,
                                                             int64_t M, int N, int64_t K, bool upper) {
  constexpr int64_t KC = 256;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    for (int j0 = 0; j0 < N; j0 += 16) {
      const double* Bp = B + k0 * ldb + j0;
      int64_t i0 = 0;
      for (; i0 + 4 <= M; i0 += 4) {
        if (upper && j0 + 16 <= i0) continue;
        __m512d c00 = _mm512_setzero_pd(), c01 = _mm512_setzero_pd(), c10 = _mm512_setzero_pd(),
                c11 = _mm512_setzero_pd(), c20 = _mm512_setzero_pd(), c21 = _mm512_setzero_pd(),
                c30 = _mm512_setzero_pd(), c31 = _mm512_setzero_pd();
        const double* a0 = A + i0 * sa_i + k0 * sa_k;
        for (int64_t k = 0; k < kc; ++k) {
          const __m512d b0 = _mm512_loadu_pd(Bp + k * ldb), b1 = _mm512_loadu_pd(Bp + k * ldb + 8);
          const double* ak = a0 + k * sa_k;
          const __m512d x0 = _mm512_set1_pd(ak[0]), x1 = _mm512_set1_pd(ak[sa_i]), x2 = _mm512_set1_pd(ak[2 * sa_i]),
                        x3 = _mm512_set1_pd(ak[3 * sa_i]);
          c00 = _mm512_fmadd_pd(x0, b0, c00);
          c01 = _mm512_fmadd_pd(x0, b1, c01);
          c10 = _mm512_fmadd_pd(x1, b0, c10);
          c11 = _mm512_fmadd_pd(x1, b1, c11);
          c20 = _mm512_fmadd_pd(x2, b0, c20);
          c21 = _mm512_fmadd_pd(x2, b1, c21);
          c30 = _mm512_fmadd_pd(x3, b0, c30);
          c31 = _mm512_fmadd_pd(x3, b1, c31);
        }
        double* c = C + i0 * ldc + j0;
#define OSCAR_UPD(p, lo, hi)                                        \
  _mm512_storeu_pd((p), _mm512_add_pd(_mm512_loadu_pd(p), (lo))); \
  _mm512_storeu_pd((p) + 8, _mm512_add_pd(_mm512_loadu_pd((p) + 8), (hi)))
        OSCAR_UPD(c, c00, c01);
        OSCAR_UPD(c + ldc, c10, c11);
        OSCAR_UPD(c + 2 * ldc, c20, c21);
        OSCAR_UPD(c + 3 * ldc, c30, c31);
#undef OSCAR_UPD
      }
      for (; i0 < M; ++i0) {  // leftover rows (M % 4)
        if (upper && j0 + 16 <= i0) continue;
        __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
        for (int64_t k = 0; k < kc; ++k) {
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
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, static_cast<int>(n), 1.0, A, static_cast<int>(lda), 1.0,
              C, d);
}

void symmetrize_from_upper(double* C, int d) {
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < i; ++j) C[static_cast<int64_t>(i) * d + j] = C[static_cast<int64_t>(j) * d + i];
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

void gemm_nt(const double* A, const double* B, double* C, int64_t m, int k, int n) {
  if (m <= 0) return;
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), n, k, 1.0, A, k, B, k, 0.0, C, n);
}

void gemm_tn(const double* A, const double* B, double* C, int k, int64_t m, int n) {
  if (have_avx512() && n % 16 == 0) {
    std::fill(C, C + m * n, 0.0);
    gemm_acc_avx512(A, 1, m, B, n, C, n, m, n, k, false);
    return;
  }
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(m), n, k, 1.0, A, static_cast<int>(m), B,
              n, 0.0, C, n);
}

}  // namespace oscar::la
