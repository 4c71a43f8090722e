// Rotation composition for every variant of DESIGN §3.2.
//
// Convention: rows are rotated on the right, x̃ = x·R, with R row-major
// [d][d] and orthogonal. For U-based variants U is sym_eig(C).vectors
// (columns in descending eigenvalue order), so
//   none      R = I
//   hadamard  R = H                  (data-free, QuaRot-style)
//   random    R = Haar-random orthogonal (seeded; data-free)
//   U         R = U
//   UH        R = U·H
//   UHP       R = U·H·P,  P = I[:, eig_bitrev_perm(values)]   (OSCAR)
// "raw targets" is not a composition: it is UHP on raw KᵀK / VᵀV covariances
// (CalibConfig::key_target / value_target).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/eigen_sym.h"

namespace oscar {

enum class Composition { kNone, kHadamard, kRandom, kU, kUH, kUHP };

const char* composition_name(Composition c);  // "none", "hadamard", "random", "U", "UH", "UHP"
Composition parse_composition(const std::string&);  // also accepts "U·H·P", "uhp", ...; throws
bool composition_uses_data(Composition c);          // U, UH, UHP

// Builds R (row-major [d][d], fp64). `eig` is required for the data-driven
// variants (may be null otherwise); `seed` is used by kRandom only.
std::vector<double> compose_rotation(Composition c, const SymEig* eig, int d, uint64_t seed = 0);

// Haar-random orthogonal matrix from QR of a Gaussian matrix (sign-fixed),
// deterministic in seed.   [d][d]
std::vector<double> random_orthogonal(int d, uint64_t seed);

// max |RᵀR − I| over all entries.   R: [d][d]
double orthogonality_error(const double* R, int d);
double orthogonality_error(const float* R, int d);

// C = A·B for row-major square [d][d] matrices (fp64).
std::vector<double> matmul(const double* A, const double* B, int d);

}  // namespace oscar
