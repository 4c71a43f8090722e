// Hadamard, bit reversal, the eigenvalue-ordered permutation (pinned on d=8),
// the eigensolver's conventions, and orthogonality of every composition.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/eigen_sym.h"
#include "core/error.h"
#include "core/hadamard.h"
#include "core/rotation.h"

using namespace oscar;

namespace {
std::vector<double> random_spd(int d, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd;
  std::vector<double> A(static_cast<size_t>(d) * d), C(A.size(), 0.0);
  for (auto& a : A) a = nd(rng);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      for (int k = 0; k < d; ++k) C[i * d + j] += A[i * d + k] * A[j * d + k] * std::pow(0.9, k);
  return C;
}
}  // namespace

TEST(Hadamard, MatrixIsOrthogonalAndSylvester) {
  for (int d : {1, 2, 8, 64, 128, 256}) {
    const auto H = hadamard_matrix(d);
    EXPECT_LT(orthogonality_error(H.data(), d), 1e-12) << d;
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) EXPECT_EQ(H[i * d + j], H[j * d + i]);
  }
  const auto H2 = hadamard_matrix(2);
  const double s = 1.0 / std::sqrt(2.0);
  EXPECT_DOUBLE_EQ(H2[0], s);
  EXPECT_DOUBLE_EQ(H2[1], s);
  EXPECT_DOUBLE_EQ(H2[2], s);
  EXPECT_DOUBLE_EQ(H2[3], -s);
  EXPECT_THROW(hadamard_matrix(96), Error);
}

TEST(Hadamard, FastTransformEqualsMatrixProduct) {
  std::mt19937 rng(1);
  std::normal_distribution<double> nd;
  for (int d : {2, 4, 32, 64, 128, 256}) {
    const auto H = hadamard_matrix(d);
    std::vector<double> x(d), ref(d, 0.0);
    for (auto& v : x) v = nd(rng);
    for (int j = 0; j < d; ++j)
      for (int i = 0; i < d; ++i) ref[j] += x[i] * H[i * d + j];
    std::vector<double> y = x;
    fwht(y.data(), d);
    std::vector<float> yf(x.begin(), x.end());
    fwht(yf.data(), d);
    for (int j = 0; j < d; ++j) {
      EXPECT_NEAR(y[j], ref[j], 1e-12) << d;
      EXPECT_NEAR(yf[j], ref[j], 1e-5) << d;
    }
    fwht(y.data(), d);  // H is an involution
    for (int j = 0; j < d; ++j) EXPECT_NEAR(y[j], x[j], 1e-12);
  }
}

TEST(BitReversal, Basics) {
  EXPECT_EQ(bit_reverse(1, 3), 4);
  EXPECT_EQ(bit_reverse(3, 3), 6);
  EXPECT_EQ(bit_reverse(6, 3), 3);
  EXPECT_EQ(bit_reverse(1, 7), 64);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(bit_reverse(bit_reverse(i, 7), 7), i);
}

TEST(BitReversal, EigenOrderedPermutationPinnedD8) {
  // Worked by hand from DESIGN §3.2: σ = eigen-indices by descending value,
  // perm[br(i)] = σ(i).
  const double ev[8] = {0.5, 3.0, 1.0, 7.0, 0.1, 2.0, 5.0, 0.0};
  // σ = [3, 6, 1, 5, 2, 0, 4, 7];  br = [0, 4, 2, 6, 1, 5, 3, 7]
  const std::vector<int> want = {3, 2, 1, 4, 6, 0, 5, 7};
  EXPECT_EQ(eig_bitrev_perm(ev, 8), want);
  // P = I[:, perm]: column j is e_{perm[j]}, so (y·P)[j] = y[perm[j]].
  const auto P = permutation_matrix(want);
  for (int j = 0; j < 8; ++j)
    for (int i = 0; i < 8; ++i) EXPECT_EQ(P[i * 8 + j], i == want[j] ? 1.0 : 0.0);
  // Ties keep the lower index first.
  const double flat[4] = {1.0, 1.0, 1.0, 1.0};
  EXPECT_EQ(eig_bitrev_perm(flat, 4), (std::vector<int>{0, 2, 1, 3}));
}

TEST(BitReversal, ConventionOfUAndSigmaAgree) {
  // sym_eig returns columns in descending eigenvalue order, so σ = identity and
  // U·H·P must equal U·H·I[:, br]: the pinned convention shared by U and σ.
  const int d = 16;
  const auto C = random_spd(d, 3);
  const SymEig e = sym_eig(C.data(), d);
  for (int i = 1; i < d; ++i) EXPECT_GE(e.values[i - 1], e.values[i]);
  std::vector<int> br(d);
  for (int i = 0; i < d; ++i) br[i] = bit_reverse(i, 4);
  EXPECT_EQ(eig_bitrev_perm(e.values.data(), d), br);
  const auto H = hadamard_matrix(d);
  const auto UH = matmul(e.vectors.data(), H.data(), d);
  const auto P = permutation_matrix(br);
  const auto want = matmul(UH.data(), P.data(), d);
  const auto got = compose_rotation(Composition::kUHP, &e, d);
  for (int i = 0; i < d * d; ++i) EXPECT_NEAR(got[i], want[i], 1e-14);
}

TEST(Eigen, DeterministicSignsAndReconstruction) {
  const int d = 24;
  const auto C = random_spd(d, 7);
  const SymEig e = sym_eig(C.data(), d);
  for (int j = 0; j < d; ++j) {
    int arg = 0;
    for (int i = 1; i < d; ++i)
      if (std::fabs(e.vectors[i * d + j]) > std::fabs(e.vectors[arg * d + j])) arg = i;
    EXPECT_GT(e.vectors[arg * d + j], 0.0) << "largest-magnitude component positive";
  }
  // C = U Λ Uᵀ
  for (int i = 0; i < d; ++i)
    for (int k = 0; k < d; ++k) {
      double s = 0;
      for (int j = 0; j < d; ++j) s += e.vectors[i * d + j] * e.values[j] * e.vectors[k * d + j];
      EXPECT_NEAR(s, C[i * d + k], 1e-9 * std::fabs(C[0]) + 1e-9);
    }
  // Same input, same output, bit for bit; a negated input basis changes nothing.
  const SymEig e2 = sym_eig(C.data(), d);
  EXPECT_EQ(e.vectors, e2.vectors);
}

TEST(Eigen, RejectsBadInput) {
  std::vector<double> C = {1, 2, 3, 4};
  EXPECT_THROW(sym_eig(C.data(), 2), Error);  // not symmetric
  C = {1, NAN, NAN, 1};
  EXPECT_THROW(sym_eig(C.data(), 2), Error);
}

TEST(Rotation, EveryCompositionIsOrthogonal) {
  for (int d : {64, 128}) {
    const auto C = random_spd(d, 11);
    const SymEig e = sym_eig(C.data(), d);
    for (auto c : {Composition::kNone, Composition::kHadamard, Composition::kRandom,
                   Composition::kU, Composition::kUH, Composition::kUHP}) {
      const auto R = compose_rotation(c, &e, d, 42);
      EXPECT_LT(orthogonality_error(R.data(), d), 1e-10) << composition_name(c) << " d=" << d;
    }
    EXPECT_THROW(compose_rotation(Composition::kUHP, nullptr, d), Error);
  }
  // Random is deterministic in the seed and differs across seeds.
  EXPECT_EQ(random_orthogonal(16, 5), random_orthogonal(16, 5));
  EXPECT_NE(random_orthogonal(16, 5), random_orthogonal(16, 6));
  // A non-orthogonal matrix is detected; NaN is never orthogonal.
  std::vector<double> bad = compose_rotation(Composition::kNone, nullptr, 4);
  bad[1] = 1e-3;
  EXPECT_GT(orthogonality_error(bad.data(), 4), 5e-4);
  bad[1] = NAN;
  EXPECT_FALSE(orthogonality_error(bad.data(), 4) < 1.0);
}

TEST(Rotation, Names) {
  for (auto c : {Composition::kNone, Composition::kHadamard, Composition::kRandom, Composition::kU,
                 Composition::kUH, Composition::kUHP})
    EXPECT_EQ(parse_composition(composition_name(c)), c);
  EXPECT_EQ(parse_composition("U·H·P"), Composition::kUHP);
  EXPECT_THROW(parse_composition("UPH"), Error);
}
