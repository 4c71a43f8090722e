#include "core/quant_error.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <vector>

#include "core/error.h"
#include "core/linalg.h"

namespace oscar {

using RowMat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

void quant_error_sweep(const float* rows, int64_t n, int64_t row_stride, int d, const double* R,
                       const float* ratios, int n_ratios, const QuantSpec& spec, const double* C,
                       ErrorSums* out) {
  validate_spec(spec, d);
  for (int i = 0; i < n_ratios; ++i) out[i] = ErrorSums{};
  if (n <= 0) return;
  Eigen::Map<const RowMat> Rm(R, d, d);
  RowMat Ct;  // C̃ = Rᵀ C R
  if (C) Ct = Rm.transpose() * Eigen::Map<const RowMat>(C, d, d) * Rm;
  constexpr int64_t kChunk = 2048;
  RowMat X, Xt, E, EC;
  std::vector<float> row(static_cast<size_t>(d)), deq(static_cast<size_t>(d));
  std::vector<uint8_t> codes(static_cast<size_t>(row_code_bytes(d, spec)));
  std::vector<uint8_t> params(static_cast<size_t>(row_param_bytes(d, spec)));
  for (int64_t r0 = 0; r0 < n; r0 += kChunk) {
    const int64_t m = std::min(kChunk, n - r0);
    X.resize(m, d);
    for (int64_t r = 0; r < m; ++r)
      for (int c = 0; c < d; ++c) X(r, c) = rows[(r0 + r) * row_stride + c];
    Xt.resize(m, d);
    la::gemm(X.data(), R, Xt.data(), m, d, d);
    // Denominators (basis-invariant): Σ x̃ C̃ x̃ᵀ and Σ ‖x̃‖².
    double den_w = 0, den_raw = Xt.squaredNorm();
    if (C) {
      EC.resize(m, d);
      la::gemm(Xt.data(), Ct.data(), EC.data(), m, d, d);
      den_w = EC.cwiseProduct(Xt).sum();
    } else {
      den_w = den_raw;
    }
    E.resize(m, d);
    for (int i = 0; i < n_ratios; ++i) {
      for (int64_t r = 0; r < m; ++r) {
        for (int c = 0; c < d; ++c) row[c] = static_cast<float>(Xt(r, c));
        clip_row(row.data(), d, ratios[i]);
        quantize_row(row.data(), d, spec, codes.data(), params.data());
        dequantize_row(codes.data(), params.data(), d, spec, deq.data());
        for (int c = 0; c < d; ++c) E(r, c) = static_cast<double>(deq[c]) - Xt(r, c);
      }
      ErrorSums s;
      s.err_raw = E.squaredNorm();
      s.den_raw = den_raw;
      if (C) {
        la::gemm(E.data(), Ct.data(), EC.data(), m, d, d);
        s.err_w = EC.cwiseProduct(E).sum();
      } else {
        s.err_w = s.err_raw;
      }
      s.den_w = den_w;
      out[i] += s;
    }
  }
}

ErrorSums quant_error_sums(const float* rows, int64_t n, int64_t row_stride, int d, const double* R,
                           float clip_ratio, const QuantSpec& spec, const double* C) {
  ErrorSums s;
  quant_error_sweep(rows, n, row_stride, d, R, &clip_ratio, 1, spec, C, &s);
  return s;
}

}  // namespace oscar
