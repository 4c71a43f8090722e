// Folding the value rotation into the weights at load time (DESIGN §3.5):
// values are stored rotated, ṽ = v·R_V, at no run-time cost, by
//   W_v[h] ← R_Vᵀ·W_v[h]   (rows h*d .. h*d+d-1; v_h = x·W_v[h]ᵀ, so ṽ_h = x·(R_Vᵀ W_v[h])ᵀ)
//   b_v[h] ← b_v[h]·R_V
//   W_o[:, g] ← W_o[:, g]·R_V(h(g))   (columns of query head g; o = õ·R_Vᵀ)
// so the attention output comes out in the R_V basis and o_proj undoes it.
#pragma once

#include "core/calibration.h"
#include "model/weights.h"

namespace oscar::model {

// Folds every layer's v_rotation of `calib` into w (in place). The calibration
// must match the model (check_calibration_matches); throws oscar::Error otherwise.
void fold_value_rotation(ModelWeights& w, const Calibration& calib);

// The fingerprint a calibration is checked against.
ModelFingerprint model_fingerprint(const ModelWeights& w);

}  // namespace oscar::model
