// The fp64 product kernels (AVX-512 path when the CPU has it, else OpenBLAS)
// against naive loops, including leftover rows and the upper-only syrk.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "core/linalg.h"

using namespace oscar;

TEST(Linalg, SyrkAndGemmMatchNaive) {
  std::mt19937 rng(2);
  std::normal_distribution<double> nd;
  for (int d : {16, 64, 128, 24}) {  // 24: not a multiple of 16 -> BLAS path
    for (int64_t n : {1, 7, 300, 513}) {
      std::vector<double> A(static_cast<size_t>(n * d)), C(static_cast<size_t>(d * d), 0.5), ref(C);
      for (auto& a : A) a = nd(rng);
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j)
          for (int64_t r = 0; r < n; ++r) ref[i * d + j] += A[r * d + i] * A[r * d + j];
      la::syrk_upper_acc(A.data(), n, d, d, C.data());
      for (int i = 0; i < d; ++i)
        for (int j = i; j < d; ++j)
          ASSERT_NEAR(C[i * d + j], ref[i * d + j], 1e-9 * n) << d << " " << n;
      // gemm: [n][d] x [d][d]
      std::vector<double> Bm(static_cast<size_t>(d * d)), G(static_cast<size_t>(n * d), 7.0),
          gref(G.size(), 0.0);
      for (auto& b : Bm) b = nd(rng);
      for (int64_t r = 0; r < n; ++r)
        for (int j = 0; j < d; ++j)
          for (int k = 0; k < d; ++k) gref[r * d + j] += A[r * d + k] * Bm[k * d + j];
      la::gemm(A.data(), Bm.data(), G.data(), n, d, d);
      for (size_t i = 0; i < G.size(); ++i) ASSERT_NEAR(G[i], gref[i], 1e-10 * d) << d << " " << n;
      // Lower-triangular right factor: zero the upper part, same product.
      for (int k = 0; k < d; ++k)
        for (int j = k + 1; j < d; ++j) Bm[k * d + j] = 0.0;
      std::fill(gref.begin(), gref.end(), 0.0);
      for (int64_t r = 0; r < n; ++r)
        for (int j = 0; j < d; ++j)
          for (int k = 0; k < d; ++k) gref[r * d + j] += A[r * d + k] * Bm[k * d + j];
      la::gemm_lower(A.data(), Bm.data(), G.data(), n, d);
      for (size_t i = 0; i < G.size(); ++i)
        ASSERT_NEAR(G[i], gref[i], 1e-10 * d) << "lower " << d << " " << n;
    }
  }
}
