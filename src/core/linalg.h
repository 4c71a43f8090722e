// Thin fp64 wrappers over OpenBLAS (runtime-dispatched AVX2/AVX-512 kernels,
// multi-threaded) for the few large products of calibration. Row-major.
#pragma once

#include <cstdint>

namespace oscar::la {

// C[d][d] (upper triangle incl. diagonal) += Aᵀ·A,  A: [n][d] with row stride lda.
void syrk_upper_acc(const double* A, int64_t n, int d, int64_t lda, double* C);
// Copies the upper triangle of C[d][d] into the lower one.
void symmetrize_from_upper(double* C, int d);
// C[m][n] = A[m][k] · B[k][n]   (beta = 0), or += when accumulate.
void gemm(const double* A, const double* B, double* C, int64_t m, int k, int n,
          bool accumulate = false);
// C[m][d] = A[m][d] · L[d][d] with L lower-triangular (entries above the
// diagonal are ignored when the fast path is taken, so pass them as zeros).
void gemm_lower(const double* A, const double* L, double* C, int64_t m, int d);
// C[m][n] = A[m][k] · B[n][k]ᵀ
void gemm_nt(const double* A, const double* B, double* C, int64_t m, int k, int n);
// C[m][n] = A[k][m]ᵀ · B[k][n]
void gemm_tn(const double* A, const double* B, double* C, int k, int64_t m, int n);

}  // namespace oscar::la
