#include "core/linalg.h"

#include <cblas.h>

namespace oscar::la {

void syrk_upper_acc(const double* A, int64_t n, int d, int64_t lda, double* C) {
  if (n <= 0) return;
  cblas_dsyrk(CblasRowMajor, CblasUpper, CblasTrans, d, static_cast<int>(n), 1.0, A, static_cast<int>(lda), 1.0,
              C, d);
}

void symmetrize_from_upper(double* C, int d) {
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < i; ++j) C[static_cast<int64_t>(i) * d + j] = C[static_cast<int64_t>(j) * d + i];
}

void gemm(const double* A, const double* B, double* C, int64_t m, int k, int n, bool accumulate) {
  if (m <= 0) return;
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(m), n, k, 1.0, A, k, B, n,
              accumulate ? 1.0 : 0.0, C, n);
}

void gemm_nt(const double* A, const double* B, double* C, int64_t m, int k, int n) {
  if (m <= 0) return;
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m), n, k, 1.0, A, k, B, k, 0.0, C, n);
}

void gemm_tn(const double* A, const double* B, double* C, int k, int64_t m, int n) {
  cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, static_cast<int>(m), n, k, 1.0, A, static_cast<int>(m), B,
              n, 0.0, C, n);
}

}  // namespace oscar::la
