// Per-layer INT-B error of a calibration on real activations (what
// `oscar quant-error` prints): keys weighted by each KV head's query
// covariance (logit error), values by the value target, plus raw MSEs.
#pragma once

#include <cstdint>

#include "core/calibration.h"
#include "core/calibrator.h"
#include "core/quant_error.h"

namespace oscar {

struct KvErrors {
  ErrorSums k;  // k.rel_w(): relative logit MSE (q·k);  k.rel_raw(): relative K MSE
  ErrorSums v;  // v.rel_w(): value error weighted by the value target;  v.rel_raw(): relative V MSE
};

// k, v: [T][H_kv][d] (original basis). Rotations and clips from L (per head
// or per layer), quantizer from spec.
KvErrors layer_kv_errors(const LayerTargets& t, const float* k, const float* v, int64_t T,
                         const LayerCalibration& L, const QuantSpec& spec);

}  // namespace oscar
