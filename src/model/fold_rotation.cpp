#include "model/fold_rotation.h"

#include <fmt/format.h>

#include <vector>

#include "core/error.h"
#include "model/loader.h"

namespace oscar::model {

ModelFingerprint model_fingerprint(const ModelWeights& w) {
  ModelFingerprint f;
  f.architecture = arch_name(w.cfg.arch);
  f.n_layers = w.cfg.n_layers;
  f.n_q_heads = w.cfg.n_heads;
  f.n_kv_heads = w.cfg.n_kv_heads;
  f.head_dim = w.cfg.head_dim;
  f.weights_hash = w.fingerprint.empty() ? weights_fingerprint(w) : w.fingerprint;
  return f;
}

void fold_value_rotation(ModelWeights& w, const Calibration& calib) {
  const ModelConfig& c = w.cfg;
  check_calibration_matches(calib, model_fingerprint(w), "calibration (" + calib.source + ")");
  const int d = c.head_dim, Hkv = c.n_kv_heads, Hq = c.n_heads, group = Hq / Hkv;
  const int64_t hidden = c.hidden;
  std::vector<double> acc(d);
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w.layers[l];
    const LayerCalibration& lc = calib.layers.at(l);
    // W_v[h] [d][hidden] <- R^T W_v[h]: new row c = sum_j R[j][c] * row j.
    for (int h = 0; h < Hkv; ++h) {
      const float* R = lc.v_rot(h, d);
      float* W = L.wv.data.data() + int64_t(h) * d * hidden;
      std::vector<float> old(W, W + int64_t(d) * hidden);
      for (int cc = 0; cc < d; ++cc)
        for (int64_t col = 0; col < hidden; ++col) {
          double s = 0;
          for (int j = 0; j < d; ++j) s += double(R[j * d + cc]) * old[int64_t(j) * hidden + col];
          W[int64_t(cc) * hidden + col] = float(s);
        }
      if (!L.bv.empty()) {
        float* b = L.bv.data.data() + int64_t(h) * d;
        for (int cc = 0; cc < d; ++cc) {
          double s = 0;
          for (int j = 0; j < d; ++j) s += double(b[j]) * R[j * d + cc];
          acc[cc] = s;
        }
        for (int cc = 0; cc < d; ++cc) b[cc] = float(acc[cc]);
      }
    }
    // W_o [hidden][Hq*d]: columns of query head g <- W_o[:, g] R.
    const int64_t ld = int64_t(Hq) * d;
    for (int64_t r = 0; r < hidden; ++r)
      for (int g = 0; g < Hq; ++g) {
        const float* R = lc.v_rot(g / group, d);
        float* row = L.wo.data.data() + r * ld + int64_t(g) * d;
        for (int cc = 0; cc < d; ++cc) {
          double s = 0;
          for (int j = 0; j < d; ++j) s += double(row[j]) * R[j * d + cc];
          acc[cc] = s;
        }
        for (int cc = 0; cc < d; ++cc) row[cc] = float(acc[cc]);
      }
  }
}

}  // namespace oscar::model
