#include "core/hadamard.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"

namespace oscar {

bool is_pow2(int d) {
  return d > 0 && (d & (d - 1)) == 0;
}

int log2_exact(int d) {
  if (!is_pow2(d)) throw Error(fmt::format("hadamard: size {} is not a power of two", d));
  int b = 0;
  while ((1 << b) < d) ++b;
  return b;
}

std::vector<double> hadamard_matrix(int d) {
  log2_exact(d);
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> h(static_cast<size_t>(d) * d);
  for (int i = 0; i < d; ++i)
    for (int j = 0; j < d; ++j)
      h[static_cast<size_t>(i) * d + j] = (__builtin_popcount(i & j) & 1) ? -s : s;
  return h;
}

namespace {
template <typename T>
void fwht_impl(T* x, int d) {
  log2_exact(d);
  for (int len = 1; len < d; len <<= 1)
    for (int i = 0; i < d; i += 2 * len)
      for (int j = i; j < i + len; ++j) {
        const T a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
  const T s = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  for (int i = 0; i < d; ++i) x[i] *= s;
}
}  // namespace

void fwht(float* x, int d) {
  fwht_impl(x, d);
}
void fwht(double* x, int d) {
  fwht_impl(x, d);
}

int bit_reverse(int i, int bits) {
  int r = 0;
  for (int b = 0; b < bits; ++b) r |= ((i >> b) & 1) << (bits - 1 - b);
  return r;
}

std::vector<int> eig_bitrev_perm(const double* eigenvalues, int d) {
  const int bits = log2_exact(d);
  std::vector<int> sigma(static_cast<size_t>(d));
  std::iota(sigma.begin(), sigma.end(), 0);
  std::stable_sort(sigma.begin(), sigma.end(),
                   [&](int a, int b) { return eigenvalues[a] > eigenvalues[b]; });
  std::vector<int> perm(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) perm[bit_reverse(i, bits)] = sigma[i];
  return perm;
}

std::vector<double> permutation_matrix(const std::vector<int>& perm) {
  const size_t d = perm.size();
  std::vector<double> p(d * d, 0.0);
  for (size_t j = 0; j < d; ++j) p[static_cast<size_t>(perm[j]) * d + j] = 1.0;
  return p;
}

}  // namespace oscar
