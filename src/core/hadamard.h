// Walsh–Hadamard transform and the bit-reversal permutations of DESIGN §3.2.
//
// H is the normalized Sylvester matrix of size d (a power of two):
//   H[i][j] = (-1)^popcount(i & j) / sqrt(d),  H = Hᵀ,  H Hᵀ = I.
// With row vectors, fwht(x) computes x·H (= H·x since H is symmetric).
#pragma once

#include <cstdint>
#include <vector>

namespace oscar {

bool is_pow2(int d);
// log2(d) for a power of two; throws oscar::Error otherwise.
int log2_exact(int d);

// Normalized Sylvester Hadamard matrix, row-major [d][d].
std::vector<double> hadamard_matrix(int d);

// In-place fast transform x <- x·H, O(d log d), normalized.   x: [d]
void fwht(float* x, int d);
void fwht(double* x, int d);

// Reverses the low `bits` bits of i.
int bit_reverse(int i, int bits);

// The eigenvalue-ordered bit-reversal permutation (DESIGN §3.2, ref
// `perm[br[i]] = σ(i)`): σ = indices of `eigenvalues` sorted by descending
// value (ties: lower index first), perm[bit_reverse(i)] = σ(i).
// P = I[:, perm], i.e. column j of P is e_{perm[j]} and (y·P)[j] = y[perm[j]].
// eigenvalues: [d], indexed like the columns of U.
std::vector<int> eig_bitrev_perm(const double* eigenvalues, int d);

// Row-major [d][d] matrix I[:, perm].
std::vector<double> permutation_matrix(const std::vector<int>& perm);

}  // namespace oscar
