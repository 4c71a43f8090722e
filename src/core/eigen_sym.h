// Symmetric eigendecomposition in fp64 with a documented, deterministic
// result (DESIGN §3.2).
#pragma once

#include <vector>

namespace oscar {

struct SymEig {
  int d = 0;
  // Eigenvalues in DESCENDING order (largest first).   [d]
  std::vector<double> values;
  // Eigenvectors as the COLUMNS of a row-major [d][d] matrix U, column j
  // belonging to values[j], so C = U·diag(values)·Uᵀ. Sign convention: the
  // largest-magnitude component of each column is positive (ties: the lowest
  // index wins).
  std::vector<double> vectors;
};

// C: row-major [d][d], symmetric (asymmetry beyond 1e-9 relative, or any
// non-finite entry, is an oscar::Error naming `what`). Only the average
// (C + Cᵀ)/2 is used.
SymEig sym_eig(const double* C, int d, const char* what = "covariance");

}  // namespace oscar
