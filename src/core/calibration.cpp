#include "core/calibration.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>

#include "core/error.h"
#include "core/safetensors.h"

namespace oscar {

namespace {

std::string lower_alnum(const std::string& s) {
  std::string k;
  for (char ch : s)
    if (std::isalnum(static_cast<unsigned char>(ch)))
      k += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return k;
}

constexpr const char* kFormat = "oscar-calibration";
// Version 2 adds the optional key transform (k_mean, k_scale); version-1 files still read.
// A file with a key transform is written as version 2, so that an older reader refuses it
// instead of silently ignoring the tensors.
constexpr int kFormatVersion = 3;

int meta_int(const st::File& f, const std::string& key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end())
    throw Error(fmt::format("{}: metadata '{}' is missing", f.path(), key));
  char* end = nullptr;
  const long long v = std::strtoll(it->second.c_str(), &end, 10);
  if (it->second.empty() || *end != '\0' || v < 0 || v > (1ll << 40))
    throw Error(fmt::format("{}: metadata '{}' = '{}' is not a non-negative integer", f.path(), key,
                            it->second));
  return static_cast<int>(v);
}

std::string meta_str(const st::File& f, const std::string& key) {
  auto it = f.metadata().find(key);
  if (it == f.metadata().end())
    throw Error(fmt::format("{}: metadata '{}' is missing", f.path(), key));
  return it->second;
}

// Reads tensor `name`, checking dtype F32-convertible and exact shape.
std::vector<float> read_checked(const st::File& f, const std::string& name,
                                const std::vector<int64_t>& shape) {
  const st::TensorInfo& t = f.at(name);
  if (t.shape != shape) {
    throw Error(fmt::format("{}: tensor '{}' has shape [{}], expected [{}] (a calibration for another model?)",
                            f.path(), name, fmt::join(t.shape, ", "), fmt::join(shape, ", ")));
  }
  std::vector<float> v = f.read_f32(name);
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw Error(fmt::format("{}: tensor '{}' has a non-finite value at {}", f.path(), name, i));
  return v;
}

}  // namespace

const char* key_target_name(KeyTarget t) {
  return t == KeyTarget::kQuery ? "query" : "raw";
}
const char* value_target_name(ValueTarget t) {
  switch (t) {
    case ValueTarget::kAttnOutput:
      return "attn-output";
    case ValueTarget::kKeyWeighted:
      return "key-weighted";
    case ValueTarget::kRaw:
      return "raw";
  }
  return "?";
}
const char* granularity_name(Granularity g) {
  return g == Granularity::kLayer ? "layer" : "head";
}

KeyTarget parse_key_target(const std::string& s) {
  const auto k = lower_alnum(s);
  if (k == "query" || k == "q") return KeyTarget::kQuery;
  if (k == "raw") return KeyTarget::kRaw;
  throw Error(fmt::format("unknown key target '{}' (query, raw)", s));
}
ValueTarget parse_value_target(const std::string& s) {
  const auto k = lower_alnum(s);
  if (k == "attnoutput" || k == "output") return ValueTarget::kAttnOutput;
  if (k == "keyweighted" || k == "kw") return ValueTarget::kKeyWeighted;
  if (k == "raw") return ValueTarget::kRaw;
  throw Error(fmt::format("unknown value target '{}' (attn-output, key-weighted, raw)", s));
}
Granularity parse_granularity(const std::string& s) {
  const auto k = lower_alnum(s);
  if (k == "layer") return Granularity::kLayer;
  if (k == "head") return Granularity::kHead;
  throw Error(fmt::format("unknown granularity '{}' (layer, head)", s));
}

const char* key_transform_name(KeyTransformMode m) {
  switch (m) {
    case KeyTransformMode::kOff:
      return "off";
    case KeyTransformMode::kCenter:
      return "center";
    case KeyTransformMode::kCenterScale:
      return "center+scale";
    case KeyTransformMode::kAuto:
      return "auto";
    case KeyTransformMode::kOffsetHeads:
      return "offset-heads";
  }
  return "?";
}
KeyTransformMode parse_key_transform(const std::string& s) {
  const auto k = lower_alnum(s);
  if (k == "off" || k == "none") return KeyTransformMode::kOff;
  if (k == "center") return KeyTransformMode::kCenter;
  if (k == "centerscale") return KeyTransformMode::kCenterScale;
  if (k == "auto") return KeyTransformMode::kAuto;
  if (k == "offsetheads") return KeyTransformMode::kOffsetHeads;
  throw Error(fmt::format("unknown key transform '{}' (off, center, center+scale, auto, offset-heads)", s));
}

void write_calibration(const Calibration& c, const std::string& path) {
  const int d = c.head_dim();
  if (d <= 0 || static_cast<int>(c.layers.size()) != c.model.n_layers)
    throw Error(fmt::format("{}: calibration has {} layers for a {}-layer model (head_dim {})",
                            path, c.layers.size(), c.model.n_layers, d));
  st::Writer w;
  w.set_metadata("format", kFormat);
  bool transform = false;
  for (const LayerCalibration& L : c.layers) transform = transform || L.has_key_transform();
  // The oldest version that holds what the file has: readers that would ignore a tensor refuse.
  w.set_metadata("format_version", c.has_page_center() ? "3" : transform ? "2" : "1");
  w.set_metadata("key_transform", c.key_transform);
  w.set_metadata("method", c.method);
  w.set_metadata("composition", composition_name(c.composition));
  w.set_metadata("key_target", key_target_name(c.key_target));
  w.set_metadata("value_target", value_target_name(c.value_target));
  w.set_metadata("granularity", granularity_name(c.granularity));
  w.set_metadata("bits", std::to_string(c.bits));
  w.set_metadata("group_size", std::to_string(c.group_size));
  w.set_metadata("scale_dtype", c.scale_dtype == ScaleDtype::kF16 ? "f16" : "f32");
  w.set_metadata("sink", std::to_string(c.sink));
  w.set_metadata("recent", std::to_string(c.recent));
  w.set_metadata("clip_search", c.clip_search ? "true" : "false");
  w.set_metadata("model.architecture", c.model.architecture);
  w.set_metadata("model.n_layers", std::to_string(c.model.n_layers));
  w.set_metadata("model.n_q_heads", std::to_string(c.model.n_q_heads));
  w.set_metadata("model.n_kv_heads", std::to_string(c.model.n_kv_heads));
  w.set_metadata("model.head_dim", std::to_string(c.model.head_dim));
  w.set_metadata("model.weights_hash", c.model.weights_hash);
  w.set_metadata("calib.tokens", std::to_string(c.calib_tokens));
  w.set_metadata("calib.positions", std::to_string(c.calib_positions));
  w.set_metadata("calib.text_hash", c.text_hash);
  w.set_metadata("calib.source", c.source);
  for (size_t i = 0; i < c.layers.size(); ++i) {
    const LayerCalibration& L = c.layers[i];
    const int64_t n = L.n_rot;
    const std::string p = fmt::format("layers.{}.", i);
    auto need = [&](const std::vector<float>& v, size_t want, const char* what) {
      if (v.size() != want)
        throw Error(fmt::format("{}: layer {} {} has {} values, expected {}", path, i, what,
                                v.size(), want));
    };
    need(L.k_rotation, static_cast<size_t>(n * d * d), "k_rotation");
    need(L.v_rotation, static_cast<size_t>(n * d * d), "v_rotation");
    need(L.k_clip, static_cast<size_t>(n), "k_clip");
    need(L.v_clip, static_cast<size_t>(n), "v_clip");
    w.add_f32(p + "k_rotation", {n, d, d}, L.k_rotation.data());
    w.add_f32(p + "v_rotation", {n, d, d}, L.v_rotation.data());
    w.add_f32(p + "k_clip", {n}, L.k_clip.data());
    w.add_f32(p + "v_clip", {n}, L.v_clip.data());
    if (!L.k_eigenvalues.empty()) {
      need(L.k_eigenvalues, static_cast<size_t>(n * d), "k_eigenvalues");
      w.add_f32(p + "k_eigenvalues", {n, d}, L.k_eigenvalues.data());
    }
    if (!L.v_eigenvalues.empty()) {
      need(L.v_eigenvalues, static_cast<size_t>(n * d), "v_eigenvalues");
      w.add_f32(p + "v_eigenvalues", {n, d}, L.v_eigenvalues.data());
    }
    const int64_t H = c.model.n_kv_heads;
    if (!L.k_mean.empty()) {
      need(L.k_mean, static_cast<size_t>(H * d), "k_mean");
      w.add_f32(p + "k_mean", {H, d}, L.k_mean.data());
    }
    if (!L.k_scale.empty()) {
      need(L.k_scale, static_cast<size_t>(H * d), "k_scale");
      w.add_f32(p + "k_scale", {H, d}, L.k_scale.data());
    }
    if (!L.k_rope_mean.empty()) {
      need(L.k_rope_mean, static_cast<size_t>(H * d), "k_rope_mean");
      w.add_f32(p + "k_rope_mean", {H, d}, L.k_rope_mean.data());
    }
  }
  if (c.has_page_center()) {
    if (c.rope_freq.size() != size_t(d / 2))
      throw Error(fmt::format("{}: page centering needs the {} RoPE frequencies, have {}", path,
                              d / 2, c.rope_freq.size()));
    w.add_f32("rope_freq", {d / 2}, c.rope_freq.data());
  }
  w.write(path);
}

Calibration read_calibration(const std::string& path) {
  const st::File f = st::File::open(path);
  if (f.meta("format") != kFormat)
    throw Error(fmt::format("{}: not an OSCAR calibration file (metadata format = '{}')", path,
                            f.meta("format")));
  const int version = meta_int(f, "format_version");
  if (version < 1 || version > kFormatVersion)
    throw Error(
        fmt::format("{}: calibration format version {} is not supported (this build reads {})",
                    path, version, kFormatVersion));
  Calibration c;
  c.method = f.meta("method", "oscar");
  c.composition = parse_composition(meta_str(f, "composition"));
  c.key_target = parse_key_target(meta_str(f, "key_target"));
  c.value_target = parse_value_target(meta_str(f, "value_target"));
  c.granularity = parse_granularity(meta_str(f, "granularity"));
  c.bits = meta_int(f, "bits");
  c.group_size = meta_int(f, "group_size");
  const std::string sd = meta_str(f, "scale_dtype");
  if (sd != "f16" && sd != "f32")
    throw Error(fmt::format("{}: scale_dtype '{}' is not f16/f32", path, sd));
  c.scale_dtype = sd == "f16" ? ScaleDtype::kF16 : ScaleDtype::kF32;
  c.sink = meta_int(f, "sink");
  c.recent = meta_int(f, "recent");
  c.clip_search = f.meta("clip_search") == "true";
  c.key_transform = f.meta("key_transform", "off");
  c.model.architecture = f.meta("model.architecture");
  c.model.n_layers = meta_int(f, "model.n_layers");
  c.model.n_q_heads = meta_int(f, "model.n_q_heads");
  c.model.n_kv_heads = meta_int(f, "model.n_kv_heads");
  c.model.head_dim = meta_int(f, "model.head_dim");
  c.model.weights_hash = f.meta("model.weights_hash");
  c.calib_tokens = std::strtoll(f.meta("calib.tokens", "0").c_str(), nullptr, 10);
  c.calib_positions = std::max<int64_t>(0, std::strtoll(f.meta("calib.positions", "0").c_str(), nullptr, 10));
  c.text_hash = f.meta("calib.text_hash");
  c.source = f.meta("calib.source");
  const int d = c.model.head_dim, H = c.model.n_kv_heads;
  if (d <= 0 || H <= 0 || c.model.n_layers <= 0 || c.model.n_q_heads <= 0 ||
      c.model.n_q_heads % H != 0)
    throw Error(fmt::format(
        "{}: bad model shape in metadata (layers {}, q heads {}, kv heads {}, head_dim {})", path,
        c.model.n_layers, c.model.n_q_heads, H, d));
  if (c.model.n_layers > 100000 || d > 4096 || H > 4096)
    throw Error(fmt::format("{}: implausible model shape in metadata", path));
  const int64_t n = c.granularity == Granularity::kLayer ? 1 : H;
  c.layers.resize(static_cast<size_t>(c.model.n_layers));
  for (int i = 0; i < c.model.n_layers; ++i) {
    LayerCalibration& L = c.layers[static_cast<size_t>(i)];
    const std::string p = fmt::format("layers.{}.", i);
    L.n_rot = static_cast<int>(n);
    L.k_rotation = read_checked(f, p + "k_rotation", {n, d, d});
    L.v_rotation = read_checked(f, p + "v_rotation", {n, d, d});
    L.k_clip = read_checked(f, p + "k_clip", {n});
    L.v_clip = read_checked(f, p + "v_clip", {n});
    if (f.find(p + "k_eigenvalues")) L.k_eigenvalues = read_checked(f, p + "k_eigenvalues", {n, d});
    if (f.find(p + "v_eigenvalues")) L.v_eigenvalues = read_checked(f, p + "v_eigenvalues", {n, d});
    if (version >= 2 && f.find(p + "k_mean")) L.k_mean = read_checked(f, p + "k_mean", {H, d});
    if (version < 3 && f.find(p + "k_rope_mean"))
      throw Error(fmt::format("{}: {}k_rope_mean (page centering) needs format version 3, the file says {}", path,
                              p, version));
    if (version >= 3 && f.find(p + "k_rope_mean")) {
      if (d % 2 != 0) throw Error(fmt::format("{}: page centering needs an even head_dim", path));
      L.k_rope_mean = read_checked(f, p + "k_rope_mean", {H, d});
    }
    if (version >= 2 && f.find(p + "k_scale")) {
      L.k_scale = read_checked(f, p + "k_scale", {H, d});
      for (size_t j = 0; j < L.k_scale.size(); ++j)
        if (!(L.k_scale[j] > 1e-6f && L.k_scale[j] < 1e6f))
          throw Error(fmt::format("{}: layer {} k_scale[{}] = {} is outside (1e-6, 1e6)", path, i,
                                  j, L.k_scale[j]));
    }
    for (int64_t r = 0; r < n; ++r) {
      for (const auto* rot : {&L.k_rotation, &L.v_rotation}) {
        const double e = orthogonality_error(rot->data() + r * d * d, d);
        if (!(e < 1e-3))
          throw Error(
              fmt::format("{}: layer {} {} rotation {} is not orthogonal (max |RᵀR−I| = {:.3g})",
                          path, i, rot == &L.k_rotation ? "k" : "v", r, e));
      }
      for (const auto* cl : {&L.k_clip, &L.v_clip}) {
        const float v = (*cl)[static_cast<size_t>(r)];
        if (!(v > 0.0f && v <= 1.0f))
          throw Error(fmt::format("{}: layer {} clip ratio {} is outside (0, 1]", path, i, v));
      }
    }
  }
  if (c.has_page_center()) {
    if (!f.find("rope_freq"))
      throw Error(fmt::format("{}: has page centering (k_rope_mean) but no rope_freq", path));
    c.rope_freq = read_checked(f, "rope_freq", {d / 2});
    for (float x : c.rope_freq)
      if (!(x >= 0.0f && x <= 4.0f))
        throw Error(fmt::format("{}: rope_freq value {} is outside [0, 4]", path, x));
  }
  // Tensors for layers beyond n_layers mean the metadata lies.
  if (f.find(fmt::format("layers.{}.k_rotation", c.model.n_layers)))
    throw Error(
        fmt::format("{}: has more layers than model.n_layers = {}", path, c.model.n_layers));
  return c;
}

void check_calibration_matches(const Calibration& c, const ModelFingerprint& m,
                               const std::string& what) {
  auto mismatch = [&](const char* field, const std::string& have, const std::string& want) {
    return Error(fmt::format(
        "{}: calibration is for a different model: {} is {} in the calibration but {} in the model",
        what, field, have, want));
  };
  if (c.model.n_layers != m.n_layers)
    throw mismatch("n_layers", std::to_string(c.model.n_layers), std::to_string(m.n_layers));
  if (c.model.n_q_heads != m.n_q_heads)
    throw mismatch("n_q_heads", std::to_string(c.model.n_q_heads), std::to_string(m.n_q_heads));
  if (c.model.n_kv_heads != m.n_kv_heads)
    throw mismatch("n_kv_heads", std::to_string(c.model.n_kv_heads), std::to_string(m.n_kv_heads));
  if (c.model.head_dim != m.head_dim)
    throw mismatch("head_dim", std::to_string(c.model.head_dim), std::to_string(m.head_dim));
  if (!c.model.architecture.empty() && !m.architecture.empty() &&
      c.model.architecture != m.architecture)
    throw mismatch("architecture", c.model.architecture, m.architecture);
  if (!c.model.weights_hash.empty() && !m.weights_hash.empty() &&
      c.model.weights_hash != m.weights_hash)
    throw mismatch("weights hash", c.model.weights_hash, m.weights_hash);
}

void check_calibration_rope(const Calibration& c, const std::vector<float>& freq,
                            const std::string& what) {
  if (!c.has_page_center()) return;
  if (c.rope_freq.size() != freq.size())
    throw Error(fmt::format("{}: calibration has {} RoPE frequencies, the model {}", what,
                            c.rope_freq.size(), freq.size()));
  for (size_t j = 0; j < freq.size(); ++j)
    if (!(std::fabs(double(c.rope_freq[j]) - freq[j]) <= 1e-5 * std::fabs(double(freq[j])) + 1e-12))
      throw Error(fmt::format(
          "{}: calibration is for a different RoPE: frequency {} is {} in the calibration but {} in the "
          "model (context extension changed? calibrate again)",
          what, j, c.rope_freq[j], freq[j]));
}

Calibration data_free_calibration(Composition comp, const ModelFingerprint& model, float k_clip,
                                  float v_clip, int bits, int group_size, uint64_t seed) {
  if (composition_uses_data(comp))
    throw Error(fmt::format("composition {} needs calibration data", composition_name(comp)));
  const int d = model.head_dim;
  if (d <= 0 || model.n_layers <= 0) throw Error("data_free_calibration: model shape is unknown");
  Calibration c;
  c.model = model;
  c.method = composition_name(comp);
  c.composition = comp;
  c.bits = bits;
  c.group_size = std::min(group_size, d);  // a group cannot exceed the head
  c.layers.resize(static_cast<size_t>(model.n_layers));
  for (int i = 0; i < model.n_layers; ++i) {
    LayerCalibration& L = c.layers[static_cast<size_t>(i)];
    const auto rk = compose_rotation(comp, nullptr, d, seed + 2 * static_cast<uint64_t>(i));
    const auto rv = compose_rotation(comp, nullptr, d, seed + 2 * static_cast<uint64_t>(i) + 1);
    L.k_rotation.assign(rk.begin(), rk.end());
    L.v_rotation.assign(rv.begin(), rv.end());
    L.k_clip = {k_clip};
    L.v_clip = {v_clip};
  }
  return c;
}

}  // namespace oscar
