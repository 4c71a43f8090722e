#include "core/key_transform.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace oscar {

KeyTransform prepare_key_transform(const LayerCalibration& L, int H, int d) {
  if (H <= 0 || d <= 0 || (L.n_rot != 1 && L.n_rot != H))
    throw Error(fmt::format("key transform: {} rotations for {} KV heads (head_dim {})", L.n_rot, H, d));
  const size_t dd = size_t(d) * d;
  if (L.k_rotation.size() != size_t(L.n_rot) * dd)
    throw Error(fmt::format("key transform: k_rotation has {} values, expected {}",
                            L.k_rotation.size(), size_t(L.n_rot) * dd));
  if (!L.k_mean.empty() && L.k_mean.size() != size_t(H) * d)
    throw Error(fmt::format("key transform: k_mean has {} values, expected {} x {}", L.k_mean.size(), H, d));
  if (!L.k_scale.empty() && L.k_scale.size() != size_t(H) * d)
    throw Error(fmt::format("key transform: k_scale has {} values, expected {} x {}", L.k_scale.size(), H, d));
  KeyTransform t;
  t.d = d;
  const bool scaled = !L.k_scale.empty();
  t.n = scaled ? H : L.n_rot;
  t.key.resize(size_t(t.n) * dd);
  t.query.resize(size_t(t.n) * dd);
  for (int m = 0; m < t.n; ++m) {
    const float* R = L.k_rot(m, d);
    float* K = t.key.data() + size_t(m) * dd;
    float* Q = t.query.data() + size_t(m) * dd;
    for (int i = 0; i < d; ++i) {
      // Row i of diag(1/s)·R is R's row i divided by s_i.
      const float s = scaled ? L.k_scale[size_t(m) * d + i] : 1.0f;
      for (int j = 0; j < d; ++j) {
        K[size_t(i) * d + j] = R[size_t(i) * d + j] / s;
        Q[size_t(i) * d + j] = R[size_t(i) * d + j] * s;
      }
    }
  }
  t.mean = L.k_mean;
  return t;
}

std::vector<int> page_center_pairs(const Calibration& c) {
  std::vector<int> pairs;
  if (!c.has_page_center()) return pairs;
  const int d = c.head_dim(), half = d / 2;
  for (int j = 0; j < half; ++j) {
    bool any = false;
    for (const LayerCalibration& L : c.layers)
      for (size_t h = 0; !L.k_rope_mean.empty() && h * d < L.k_rope_mean.size(); ++h)
        any = any || L.k_rope_mean[h * d + j] != 0.0f || L.k_rope_mean[h * d + j + half] != 0.0f;
    if (any) pairs.push_back(j);
  }
  return pairs;
}

PageCenter prepare_page_center(const Calibration& c, int layer, const KeyTransform& xf,
                               const std::vector<int>& pairs, int H, int d) {
  PageCenter pc;
  if (pairs.empty()) return pc;
  const LayerCalibration& L = c.layers.at(size_t(layer));
  const int S = int(pairs.size()), half = d / 2;
  if (xf.d != d || c.rope_freq.size() != size_t(half))
    throw Error(fmt::format("page centering: head_dim {} / {} RoPE frequencies for head_dim {}", xf.d,
                            c.rope_freq.size(), d));
  if (!L.k_rope_mean.empty() && L.k_rope_mean.size() != size_t(H) * d)
    throw Error(fmt::format("page centering: layer {} k_rope_mean has {} values, expected {} x {}", layer,
                            L.k_rope_mean.size(), H, d));
  // A layer without any ν gets none (its pages keep the fixed μ and no per-page work).
  bool any = false;
  for (float x : L.k_rope_mean) any = any || x != 0.0f;
  if (!any) return pc;
  pc.pair = pairs;
  for (int j : pairs) {
    if (j < 0 || j >= half) throw Error(fmt::format("page centering: pair {} outside [0, {})", j, half));
    pc.freq.push_back(c.rope_freq[size_t(j)]);
  }
  pc.u.assign(size_t(H) * S * d, 0.0f);
  pc.w.assign(size_t(H) * S * d, 0.0f);
  pc.mu.assign(size_t(H) * d, 0.0f);
  pc.active.assign(size_t(H), 0);
  for (int h = 0; h < H; ++h) {
    // A head without ν keeps its fixed μ: δ = 0 (u = w = mu = 0).
    bool has = false;
    for (int i = 0; i < d && !L.k_rope_mean.empty(); ++i) has = has || L.k_rope_mean[size_t(h) * d + i] != 0.0f;
    if (!has) continue;
    pc.active[size_t(h)] = 1;
    const float* M = xf.key_matrix(h);  // row i = e_i·M_K
    for (int s = 0; s < S; ++s) {
      const int j = pairs[size_t(s)], jp = j + half;
      const double a = L.k_rope_mean.empty() ? 0.0 : L.k_rope_mean[size_t(h) * d + j];
      const double b = L.k_rope_mean.empty() ? 0.0 : L.k_rope_mean[size_t(h) * d + jp];
      float* u = pc.u.data() + (size_t(h) * S + s) * d;
      float* w = pc.w.data() + (size_t(h) * S + s) * d;
      for (int c2 = 0; c2 < d; ++c2) {
        const double mj = M[size_t(j) * d + c2], mjp = M[size_t(jp) * d + c2];
        u[c2] = float(a * mj + b * mjp);
        w[c2] = float(a * mjp - b * mj);
      }
    }
    // mu: μ on the centred pairs only; on the other pairs the page keeps the fixed μ.
    if (!xf.mean.empty())
      for (int c2 = 0; c2 < d; ++c2) {
        double acc = 0;
        for (int j : pairs)
          for (int i : {j, j + half}) acc += double(xf.mean[size_t(h) * d + i]) * M[size_t(i) * d + c2];
        pc.mu[size_t(h) * d + c2] = float(acc);
      }
  }
  return pc;
}

namespace {
void mul_row(const float* x, const float* M, int d, float* out) {
  for (int j = 0; j < d; ++j) {
    double acc = 0;
    for (int i = 0; i < d; ++i) acc += double(x[i]) * M[size_t(i) * d + j];
    out[j] = float(acc);
  }
}
}  // namespace

void apply_key_transform_ref(const KeyTransform& t, float* k, int64_t T, int Hkv) {
  const int d = t.d;
  std::vector<float> tmp(static_cast<size_t>(d));
  for (int64_t r = 0; r < T; ++r)
    for (int h = 0; h < Hkv; ++h) {
      float* x = k + (size_t(r) * Hkv + h) * d;
      if (!t.mean.empty())
        for (int j = 0; j < d; ++j) x[j] -= t.mean[size_t(h) * d + j];
      mul_row(x, t.key_matrix(h), d, tmp.data());
      std::copy(tmp.begin(), tmp.end(), x);
    }
}

void apply_query_transform_ref(const KeyTransform& t, float* q, int64_t T, int Hq, int Hkv) {
  if (Hkv <= 0 || Hq % Hkv != 0)
    throw Error(fmt::format("key transform: {} query heads for {} KV heads", Hq, Hkv));
  const int d = t.d, group = Hq / Hkv;
  std::vector<float> tmp(static_cast<size_t>(d));
  for (int64_t r = 0; r < T; ++r)
    for (int g = 0; g < Hq; ++g) {
      float* x = q + (size_t(r) * Hq + g) * d;
      mul_row(x, t.query_matrix(g / group), d, tmp.data());
      std::copy(tmp.begin(), tmp.end(), x);
    }
}

std::vector<float> smoothing_scales(const double* key_var, const double* query_ms, int d) {
  std::vector<float> s(size_t(d), 1.0f);
  if (d < 2 || d % 2) return s;
  const int half = d / 2;
  double amax = 0, bmax = 0;
  for (int c = 0; c < d; ++c) amax = std::max(amax, key_var[c]), bmax = std::max(bmax, query_ms[c]);
  std::vector<double> ls(size_t(half), 0.0);
  double sum = 0;
  int n = 0;
  for (int c = 0; c < half; ++c) {
    const double a = key_var[c] + key_var[c + half], b = query_ms[c] + query_ms[c + half];
    if (!(a > 1e-12 * amax) || !(b > 1e-12 * bmax) || !std::isfinite(a) || !std::isfinite(b)) continue;
    ls[size_t(c)] = 0.25 * std::log(a / b);
    sum += ls[size_t(c)];
    ++n;
  }
  if (n == 0) return s;
  const double mean = sum / n;
  for (int c = 0; c < half; ++c) {
    const double a = key_var[c] + key_var[c + half], b = query_ms[c] + query_ms[c + half];
    const bool signal = a > 1e-12 * amax && b > 1e-12 * bmax && std::isfinite(a) && std::isfinite(b);
    const double v = signal ? std::exp(std::clamp(ls[size_t(c)] - mean, -std::log(64.0), std::log(64.0))) : 1.0;
    s[size_t(c)] = s[size_t(c + half)] = float(v);
  }
  return s;
}

}  // namespace oscar
