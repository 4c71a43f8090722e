#include "core/quantizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "core/error.h"

namespace oscar {

namespace {

constexpr float kF16Max = 65504.0f;

// |x| with NaN mapped to +inf, so ordering is total (NaN sorts last).
inline float abs_key(float v) {
  const float a = std::fabs(v);
  return std::isnan(a) ? std::numeric_limits<float>::infinity() : a;
}

// Non-finite -> 0; finite values saturate at +-kInputLimit so that hi - lo and
// m + qmax*s stay finite in fp32 even with fp32 params.
constexpr float kInputLimit = 1e30f;
inline float finite_or_zero(float v) {
  // |v| <= limit is false for NaN and ±inf: branch-free select, vectorizable.
  const float c = v < -kInputLimit ? -kInputLimit : (v > kInputLimit ? kInputLimit : v);
  return std::fabs(v) <= std::numeric_limits<float>::max() ? c : 0.0f;
}

// Rounds a param to its storage dtype (saturating for fp16) and returns the
// value that dequantization will see.
inline float round_param(float v, ScaleDtype sd) {
  if (sd == ScaleDtype::kF32) return v;
  return f16_to_f32(f32_to_f16(std::clamp(v, -kF16Max, kF16Max)));
}

}  // namespace

int clip_index(int d, float ratio) {
  if (d <= 0) return 0;
  if (!(ratio < 1.0f)) return d - 1;  // ratio >= 1 (or NaN): max|x|
  // floor(ratio*d) in double so that e.g. 0.96f*128 = 122.88 is not perturbed.
  // The reference implementation indexes the ascending sort at int(c*d):
  // d=128 -> 122 for c=0.96, 117 for c=0.92 (DESIGN §3.3's worked numbers).
  const double k = std::floor(static_cast<double>(ratio) * d);
  return static_cast<int>(std::clamp(k, 0.0, static_cast<double>(d - 1)));
}

float clip_threshold(const float* x, int d, float ratio) {
  if (d <= 0) throw Error(fmt::format("clip_threshold: row length {} must be positive", d));
  const int idx = clip_index(d, ratio);
  if (idx == d - 1) {  // max |x|: no selection needed
    float m = 0.0f;
    for (int i = 0; i < d; ++i) m = std::max(m, abs_key(x[i]));
    return m;
  }
  // Small fixed-size buffer for the common head dims; heap beyond.
  float stack[256];
  std::vector<float> heap;
  float* a = stack;
  if (d > 256) {
    heap.resize(static_cast<size_t>(d));
    a = heap.data();
  }
  for (int i = 0; i < d; ++i) a[i] = abs_key(x[i]);
  std::nth_element(a, a + idx, a + d);
  return a[idx];
}

float clip_row(float* x, int d, float ratio) {
  const float tau = clip_threshold(x, d, ratio);
  for (int i = 0; i < d; ++i) {
    const float v = x[i];
    x[i] = std::isnan(v) ? 0.0f : std::clamp(v, -tau, tau);
  }
  return tau;
}

void validate_spec(const QuantSpec& spec, int d) {
  if (spec.bits != 2 && spec.bits != 4)
    throw Error(fmt::format("quantizer: bits = {} unsupported (2 or 4)", spec.bits));
  if (spec.group_size != 32 && spec.group_size != 64 && spec.group_size != 128)
    throw Error(
        fmt::format("quantizer: group size {} unsupported (32, 64 or 128)", spec.group_size));
  if (spec.scale_dtype != ScaleDtype::kF16 && spec.scale_dtype != ScaleDtype::kF32)
    throw Error("quantizer: unknown scale dtype");
  if (d <= 0 || spec.group_size > d || d % spec.group_size != 0)
    throw Error(fmt::format("quantizer: row length {} is not a positive multiple of group size {}",
                            d, spec.group_size));
}

void quantize_row(const float* x, int d, const QuantSpec& spec, uint8_t* codes, void* params) {
  validate_spec(spec, d);
  const int G = spec.group_size, B = spec.bits;
  const int qmax = (1 << B) - 1;
  const int group_bytes = G * B / 8;
  std::memset(codes, 0, static_cast<size_t>(packed_row_bytes(d, B)));
  float xs[128];    // one sanitized group
  uint8_t cs[128];  // its codes
  for (int g = 0; g < d / G; ++g) {
    const float* xg = x + g * G;
    // Four independent min/max chains (the compiler keeps this scalar without
    // -ffast-math; splitting the dependency chain is what makes it fast).
    float lo[4], hi[4];
    for (int a = 0; a < 4; ++a) lo[a] = hi[a] = finite_or_zero(xg[a]);
    for (int i = 0; i < G; i += 4)
      for (int a = 0; a < 4; ++a) {
        const float v = finite_or_zero(xg[i + a]);
        xs[i + a] = v;
        lo[a] = v < lo[a] ? v : lo[a];
        hi[a] = v > hi[a] ? v : hi[a];
      }
    const float lo_all = std::min(std::min(lo[0], lo[1]), std::min(lo[2], lo[3]));
    const float hi_all = std::max(std::max(hi[0], hi[1]), std::max(hi[2], hi[3]));
    const float range = hi_all - lo_all;  // finite: inputs are saturated at 1e30
    const float s =
        round_param(std::max(range, kMinRange) / static_cast<float>(qmax), spec.scale_dtype);
    const float m = round_param(lo_all, spec.scale_dtype);
    if (spec.scale_dtype == ScaleDtype::kF16) {
      auto* p = static_cast<uint16_t*>(params) + 2 * g;
      p[0] = f32_to_f16(s);  // exact: s is already an fp16 value
      p[1] = f32_to_f16(m);
    } else {
      auto* p = static_cast<float*>(params) + 2 * g;
      p[0] = s;
      p[1] = m;
    }
    if (!(s > 0.0f)) continue;  // every code 0 (already zeroed)
    const float fq = static_cast<float>(qmax);
    for (int i = 0; i < G; ++i) {  // vectorizable: no stores to the packed bytes here
      const float t = std::floor((xs[i] - m) / s + 0.5f);
      cs[i] = static_cast<uint8_t>(static_cast<int>(t < 0.0f ? 0.0f : (t > fq ? fq : t)));
    }
    // Element i = lane*group_bytes + j lives in byte j at shift B*lane
    // (quant_format.h).
    uint8_t* cg = codes + g * group_bytes;
    if (B == 2) {
      for (int j = 0; j < group_bytes; ++j)
        cg[j] =
            static_cast<uint8_t>(cs[j] | (cs[j + group_bytes] << 2) |
                                 (cs[j + 2 * group_bytes] << 4) | (cs[j + 3 * group_bytes] << 6));
    } else {
      for (int j = 0; j < group_bytes; ++j)
        cg[j] = static_cast<uint8_t>(cs[j] | (cs[j + group_bytes] << 4));
    }
  }
}

void dequantize_row(const uint8_t* codes, const void* params, int d, const QuantSpec& spec,
                    float* out) {
  validate_spec(spec, d);
  const int G = spec.group_size, B = spec.bits;
  for (int g = 0; g < d / G; ++g) {
    float s, m;
    if (spec.scale_dtype == ScaleDtype::kF16) {
      const auto* p = static_cast<const uint16_t*>(params) + 2 * g;
      s = f16_to_f32(p[0]);
      m = f16_to_f32(p[1]);
    } else {
      const auto* p = static_cast<const float*>(params) + 2 * g;
      s = p[0];
      m = p[1];
    }
    const int group_bytes = G * B / 8, mask = (1 << B) - 1;
    const uint8_t* cg = codes + g * group_bytes;
    float* og = out + g * G;
    for (int lane = 0; lane < 8 / B; ++lane)
      for (int j = 0; j < group_bytes; ++j)
        og[lane * group_bytes + j] = m + static_cast<float>((cg[j] >> (B * lane)) & mask) * s;
  }
}

void fake_quantize_rows(const float* x, int64_t n, int d, const QuantSpec& spec, float* out) {
  validate_spec(spec, d);
  std::vector<uint8_t> codes(static_cast<size_t>(row_code_bytes(d, spec)));
  std::vector<uint8_t> params(static_cast<size_t>(row_param_bytes(d, spec)));
  for (int64_t r = 0; r < n; ++r) {
    quantize_row(x + r * d, d, spec, codes.data(), params.data());
    dequantize_row(codes.data(), params.data(), d, spec, out + r * d);
  }
}

double cache_bits_per_element(int64_t T, int sink, int recent, int bits, int group_size,
                              ScaleDtype sd) {
  if (T <= 0) return 16.0;
  const int64_t window = static_cast<int64_t>(sink) + recent;
  const double hi = static_cast<double>(std::min(T, window)) * 16.0;
  const double lo = static_cast<double>(std::max<int64_t>(T - window, 0)) *
                    row_bits_per_element(bits, group_size, sd);
  return (hi + lo) / static_cast<double>(T);
}

}  // namespace oscar
