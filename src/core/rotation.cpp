#include "core/rotation.h"

#include <fmt/format.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <random>

#include "core/error.h"
#include "core/hadamard.h"

namespace oscar {

using RowMat = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

const char* composition_name(Composition c) {
  switch (c) {
    case Composition::kNone:
      return "none";
    case Composition::kHadamard:
      return "hadamard";
    case Composition::kRandom:
      return "random";
    case Composition::kU:
      return "U";
    case Composition::kUH:
      return "UH";
    case Composition::kUHP:
      return "UHP";
  }
  return "?";
}

Composition parse_composition(const std::string& s) {
  std::string k;
  for (char ch : s)
    if (std::isalnum(static_cast<unsigned char>(ch)))
      k += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  if (k == "none" || k == "identity") return Composition::kNone;
  if (k == "hadamard" || k == "h") return Composition::kHadamard;
  if (k == "random") return Composition::kRandom;
  if (k == "u") return Composition::kU;
  if (k == "uh") return Composition::kUH;
  if (k == "uhp" || k == "oscar") return Composition::kUHP;
  throw Error(
      fmt::format("unknown rotation composition '{}' (none, hadamard, random, U, UH, UHP)", s));
}

bool composition_uses_data(Composition c) {
  return c == Composition::kU || c == Composition::kUH || c == Composition::kUHP;
}

std::vector<double> matmul(const double* A, const double* B, int d) {
  std::vector<double> out(static_cast<size_t>(d) * d);
  Eigen::Map<RowMat>(out.data(), d, d) =
      Eigen::Map<const RowMat>(A, d, d) * Eigen::Map<const RowMat>(B, d, d);
  return out;
}

std::vector<double> random_orthogonal(int d, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  Eigen::MatrixXd g(d, d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j) g(i, j) = nd(rng);
  Eigen::HouseholderQR<Eigen::MatrixXd> qr(g);
  Eigen::MatrixXd q = qr.householderQ();
  const Eigen::MatrixXd r = qr.matrixQR();
  // Sign fix (Mezzadri): Q·diag(sign(diag R)) is Haar-distributed.
  for (int j = 0; j < d; ++j)
    if (r(j, j) < 0) q.col(j) *= -1.0;
  std::vector<double> out(static_cast<size_t>(d) * d);
  Eigen::Map<RowMat>(out.data(), d, d) = q;
  return out;
}

std::vector<double> compose_rotation(Composition c, const SymEig* eig, int d, uint64_t seed) {
  if (d <= 0) throw Error("compose_rotation: d must be positive");
  if (composition_uses_data(c) && (!eig || eig->d != d))
    throw Error(
        fmt::format("compose_rotation: composition {} needs an eigendecomposition of size {}",
                    composition_name(c), d));
  switch (c) {
    case Composition::kNone: {
      std::vector<double> r(static_cast<size_t>(d) * d, 0.0);
      for (int i = 0; i < d; ++i) r[static_cast<size_t>(i) * d + i] = 1.0;
      return r;
    }
    case Composition::kHadamard:
      return hadamard_matrix(d);
    case Composition::kRandom:
      return random_orthogonal(d, seed);
    case Composition::kU:
      return eig->vectors;
    case Composition::kUH: {
      const auto h = hadamard_matrix(d);
      return matmul(eig->vectors.data(), h.data(), d);
    }
    case Composition::kUHP: {
      const auto h = hadamard_matrix(d);
      const auto uh = matmul(eig->vectors.data(), h.data(), d);
      const auto perm = eig_bitrev_perm(eig->values.data(), d);
      // (U·H)·P = columns of U·H reordered: column j of the result is column perm[j].
      std::vector<double> r(static_cast<size_t>(d) * d);
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j)
          r[static_cast<size_t>(i) * d + j] = uh[static_cast<size_t>(i) * d + perm[j]];
      return r;
    }
  }
  throw Error("compose_rotation: unknown composition");
}

namespace {
template <typename T>
double ortho_err(const T* R, int d) {
  double worst = 0.0;
  for (int i = 0; i < d; ++i)
    for (int j = i; j < d; ++j) {
      double s = 0.0;
      for (int k = 0; k < d; ++k)
        s += double(R[static_cast<size_t>(k) * d + i]) * double(R[static_cast<size_t>(k) * d + j]);
      if (!std::isfinite(s)) return INFINITY;  // NaN must never look orthogonal
      worst = std::max(worst, std::fabs(s - (i == j ? 1.0 : 0.0)));
    }
  return worst;
}
}  // namespace

double orthogonality_error(const double* R, int d) {
  return ortho_err(R, d);
}
double orthogonality_error(const float* R, int d) {
  return ortho_err(R, d);
}

}  // namespace oscar
