// Attention-aware quantization error of rotated, clipped, INT-B rows.
//
// For rows x (original basis), rotation R, clip ratio c and quantizer spec:
//   x̃ = x·R,  x̂ = dequant(quant(clip(x̃, c))),  e = (x̂ − x̃)·Rᵀ  (original basis)
// the weighted error is Σ e·C·eᵀ for a PSD weight C (the query covariance for
// keys: E[(q·e)²] = e C_K eᵀ is the logit error; the value target for values),
// reported relative to Σ x·C·xᵀ; the raw error is Σ‖e‖² relative to Σ‖x‖².
// (R is orthogonal, so the sums are computed in the rotated basis with
// C̃ = Rᵀ C R.) Accumulation in fp64.
#pragma once

#include <cstdint>

#include "core/quantizer.h"

namespace oscar {

struct ErrorSums {
  double err_w = 0, den_w = 0;      // Σ e C eᵀ, Σ x C xᵀ
  double err_raw = 0, den_raw = 0;  // Σ ‖e‖², Σ ‖x‖²
  double rel_w() const { return den_w > 0 ? err_w / den_w : 0.0; }
  double rel_raw() const { return den_raw > 0 ? err_raw / den_raw : 0.0; }
  ErrorSums& operator+=(const ErrorSums& o) {
    err_w += o.err_w, den_w += o.den_w, err_raw += o.err_raw, den_raw += o.den_raw;
    return *this;
  }
};

// rows: n rows of d floats, row r at rows + r*row_stride. R: [d][d] fp64
// (x̃ = x·R). C: [d][d] fp64 symmetric weight, or nullptr for identity.
ErrorSums quant_error_sums(const float* rows, int64_t n, int64_t row_stride, int d, const double* R,
                           float clip_ratio, const QuantSpec& spec, const double* C);

// The same for several clip ratios at once (the rotation is applied once):
// out[i] = sums for ratios[i].
void quant_error_sweep(const float* rows, int64_t n, int64_t row_stride, int d, const double* R,
                       const float* ratios, int n_ratios, const QuantSpec& spec, const double* C,
                       ErrorSums* out);

}  // namespace oscar
