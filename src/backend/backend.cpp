#include "backend/backend.h"

#include <vector>

#include "core/error.h"

namespace oscar::backend {

const char* to_string(WeightDtype d) {
  switch (d) {
    case WeightDtype::kF32: return "f32";
    case WeightDtype::kQ8: return "q8";
    default: return "bf16";
  }
}

WeightDtype weight_dtype_from_string(const std::string& s) {
  if (s == "f32") return WeightDtype::kF32;
  if (s == "bf16") return WeightDtype::kBf16;
  if (s == "q8") return WeightDtype::kQ8;
  throw Error("weight dtype '" + s + "': expected f32, bf16 or q8");
}

void Backend::linear_add(const PreparedWeight& w, const float* x, int n, float* y, float* tmp) {
  linear(w, x, n, tmp);
  add(y, tmp, size_t(n) * size_t(w.rows));
}

void Backend::rms_norm_linear(const float* x, const PreparedWeight& norm, float eps, const PreparedWeight& w,
                              int n, float* h, float* y) {
  rms_norm(x, norm, n, int(w.cols), eps, h);
  linear(w, h, n, y);
}

void Backend::silu_mul_linear_add(const float* gu, int n, int inter, const PreparedWeight& w, float* act,
                                  float* y, float* tmp) {
  silu_mul(gu, n, inter, act);
  linear_add(w, act, n, y, tmp);
}

void Backend::qkv_heads(const float* qkv, int n, int Hq, int Hkv, int d, const PreparedWeight* q_norm,
                        const PreparedWeight* k_norm, float eps, const float* cos, const float* sin, float* q,
                        float* k, float* v) {
  if (!q_norm != !k_norm) throw Error("qkv_heads: q_norm and k_norm come together");
  const int Dq = Hq * d, Dkv = Hkv * d, Dqkv = Dq + 2 * Dkv;
  copy_cols(qkv, n, Dqkv, 0, Dq, q);
  copy_cols(qkv, n, Dqkv, Dq, Dkv, k);
  copy_cols(qkv, n, Dqkv, Dq + Dkv, Dkv, v);
  if (q_norm) {
    rms_norm(q, *q_norm, n * Hq, d, eps, q);
    rms_norm(k, *k_norm, n * Hkv, d, eps, k);
  }
  rope(q, n, Hq, d, cos, sin);
  rope(k, n, Hkv, d, cos, sin);
}

void Backend::check_into_cache(int n, const PageStore& store, int layer, const RowPlacement& rows) {
  if (rows.size() != n)
    throw Error("qkv_heads_into_cache: " + std::to_string(rows.size()) + " rows placed for a step of " +
                std::to_string(n));
  if (layer < 0 || layer >= store.spec().n_layers)
    throw Error("qkv_heads_into_cache: layer " + std::to_string(layer) + " outside the cache's " +
                std::to_string(store.spec().n_layers));
}

void Backend::qkv_heads_into_cache(const float* qkv, int n, int Hq, int Hkv, int d, const PreparedWeight* q_norm,
                                   const PreparedWeight* k_norm, float eps, const float* cos, const float* sin,
                                   float* q, float* k, float* v, PageStore& store, int layer,
                                   const RowPlacement& rows) {
  check_into_cache(n, store, layer, rows);
  qkv_heads(qkv, n, Hq, Hkv, d, q_norm, k_norm, eps, cos, sin, q, k, v);
  if (n == 0) return;
  store.transform_queries_keys(layer, q, Hq, k, n);
  store.write_bf16(layer, rows, k, v);
}

void Backend::argmax_rows(const float* x, int rows, int cols, int32_t* out) {
  std::vector<float> h(size_t(rows) * size_t(cols));
  to_host(x, h.data(), h.size());
  for (int r = 0; r < rows; ++r) {
    const float* row = h.data() + size_t(r) * size_t(cols);
    int best = 0;
    bool any = false;
    for (int c = 0; c < cols; ++c)
      if (row[c] == row[c] && (!any || row[c] > row[best])) best = c, any = true;
    out[r] = best;
  }
}

void Backend::sample_rows(const float* x, int rows, int cols, const RowDraw* draws, const int32_t*, int64_t,
                          int32_t* out) {
  std::vector<int> am;  // the argmax rows without a penalty, in order
  for (int r = 0; r < rows; ++r) {
    out[r] = draws[r].mode == RowDraw::kSkip ? kDrawSkipped : kDrawHost;
    if (draws[r].mode == RowDraw::kArgmax && draws[r].penalty == 1.0f && draws[r].presence == 0.0f &&
        draws[r].frequency == 0.0f)
      am.push_back(r);
  }
  if (am.empty()) return;
  if (int(am.size()) == rows) return argmax_rows(x, rows, cols, out);
  std::vector<int32_t> ids(am.size());
  for (size_t i = 0; i < am.size(); ++i) argmax_rows(x + size_t(am[i]) * size_t(cols), 1, cols, &ids[i]);
  for (size_t i = 0; i < am.size(); ++i) out[am[i]] = ids[i];
}

}  // namespace oscar::backend
