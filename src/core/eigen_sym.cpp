#include "core/eigen_sym.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace oscar {

SymEig sym_eig(const double* C, int d, const char* what) {
  if (d <= 0) throw Error(fmt::format("{}: eigendecomposition of an empty matrix", what));
  using Mat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  Eigen::Map<const Mat> A(C, d, d);
  double scale = 0.0, asym = 0.0;
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) {
      if (!std::isfinite(A(i, j)))
        throw Error(fmt::format("{}: non-finite entry at ({}, {})", what, i, j));
      scale = std::max(scale, std::fabs(A(i, j)));
      asym = std::max(asym, std::fabs(A(i, j) - A(j, i)));
    }
  if (asym > 1e-9 * std::max(scale, 1e-300))
    throw Error(fmt::format("{}: matrix is not symmetric (max |C - Cᵀ| = {:.3g})", what, asym));
  const Eigen::MatrixXd S = 0.5 * (A + A.transpose());
  Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(S);
  if (es.info() != Eigen::Success)
    throw Error(fmt::format("{}: eigensolver did not converge", what));

  // Eigen returns ascending order; we reverse to descending.
  SymEig r;
  r.d = d;
  r.values.resize(static_cast<size_t>(d));
  r.vectors.resize(static_cast<size_t>(d) * d);
  for (int j = 0; j < d; ++j) {
    const int src = d - 1 - j;
    r.values[j] = es.eigenvalues()(src);
    int arg = 0;
    for (int i = 1; i < d; ++i)
      if (std::fabs(es.eigenvectors()(i, src)) > std::fabs(es.eigenvectors()(arg, src)) + 1e-12)
        arg = i;
    const double sign = es.eigenvectors()(arg, src) < 0 ? -1.0 : 1.0;
    for (int i = 0; i < d; ++i)
      r.vectors[static_cast<size_t>(i) * d + j] = sign * es.eigenvectors()(i, src);
  }
  return r;
}

}  // namespace oscar
