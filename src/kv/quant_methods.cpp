#include "kv/quant_methods.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

#include "core/error.h"
#include "core/hadamard.h"
#include "core/quantizer.h"
#include "kv/bf16_cache.h"
#include "kv/oscar_cache.h"

namespace oscar::kv {

namespace {

constexpr int kKiviGroup = 32, kKiviResidual = 128;
static_assert(kKiviGroup == kKeySpan, "kivi2's key span is the cache's per-channel span");

// U from one rotation R composed as `from` (row-major [d][d]); eigenvalues
// [d] in U's column order (descending as stored).
std::vector<double> recover_u(const float* R, const float* eig, int d, Composition from) {
  std::vector<double> M(R, R + size_t(d) * d);
  if (from == Composition::kU) return M;
  if (from == Composition::kUHP) {
    // R = (U H) P, (y P)[j] = y[perm[j]]  =>  (U H)[r][perm[j]] = R[r][j].
    std::vector<double> ev(eig, eig + d);
    const std::vector<int> perm = eig_bitrev_perm(ev.data(), d);
    std::vector<double> UH(M.size());
    for (int r = 0; r < d; ++r)
      for (int j = 0; j < d; ++j) UH[size_t(r) * d + perm[j]] = M[size_t(r) * d + j];
    M.swap(UH);
  } else if (from != Composition::kUH) {
    throw Error(fmt::format("recompose: composition {} has no eigenvectors", composition_name(from)));
  }
  for (int r = 0; r < d; ++r) fwht(M.data() + size_t(r) * d, d);  // (U H) H = U
  return M;
}

std::vector<float> compose_from_u(std::vector<double> U, const float* eig, int d, Composition to) {
  if (to != Composition::kU) {
    for (int r = 0; r < d; ++r) fwht(U.data() + size_t(r) * d, d);
    if (to == Composition::kUHP) {
      std::vector<double> ev(eig, eig + d);
      const std::vector<int> perm = eig_bitrev_perm(ev.data(), d);
      std::vector<double> out(U.size());
      for (int r = 0; r < d; ++r)
        for (int j = 0; j < d; ++j) out[size_t(r) * d + j] = U[size_t(r) * d + perm[j]];
      U.swap(out);
    } else if (to != Composition::kUH) {
      throw Error(fmt::format("recompose: target {} is not U, UH or UHP", composition_name(to)));
    }
  }
  return std::vector<float>(U.begin(), U.end());
}

std::shared_ptr<const Calibration> load_calibration(const std::string& path,
                                                    const ModelFingerprint& model,
                                                    const std::vector<float>& rope_freq) {
  if (path.empty()) return nullptr;
  auto c = std::make_shared<Calibration>(read_calibration(path));
  check_calibration_matches(*c, model, path);
  if (!rope_freq.empty()) check_calibration_rope(*c, rope_freq, path);
  c->source = path;
  return c;
}

}  // namespace

Calibration recompose(const Calibration& c, Composition target) {
  if (c.composition == target) return c;
  Calibration out = c;
  out.composition = target;
  const int d = c.head_dim();
  for (LayerCalibration& L : out.layers) {
    for (int which = 0; which < 2; ++which) {
      std::vector<float>& rot = which ? L.v_rotation : L.k_rotation;
      const std::vector<float>& eig = which ? L.v_eigenvalues : L.k_eigenvalues;
      if (eig.size() != size_t(L.n_rot) * d)
        throw Error(fmt::format("calibration {}: no eigenvalues stored, cannot recompose as {}",
                                c.source, composition_name(target)));
      for (int r = 0; r < L.n_rot; ++r) {
        float* R = rot.data() + size_t(r) * d * d;
        const float* e = eig.data() + size_t(r) * d;
        std::vector<float> n = compose_from_u(recover_u(R, e, d, c.composition), e, d, target);
        std::copy(n.begin(), n.end(), R);
      }
    }
  }
  return out;
}

bool KvMethod::folds_values() const {
  return kind == Kind::kRow && calib && calib->composition != Composition::kNone;
}

double KvMethod::bits_per_element(int64_t T, int head_dim, int page_size) const {
  if (T <= 0 || kind == Kind::kBf16) return 16.0;
  const int G = std::min(group_size, head_dim);
  // Page-granular demotion for every quantized method (kivi2 included): the
  // middle holds the whole pages of [sink, T - recent).
  const int64_t mid = std::max<int64_t>(0, (T - sink - recent) / page_size * page_size);
  const double v = row_bits_per_element(bits, G, ScaleDtype::kF16);
  // kivi2 keys: 2-bit codes + one fp16 (scale, min) per channel per 32 tokens.
  const double k = kind == Kind::kKivi ? row_bits_per_element(bits, kv::kKeySpan, ScaleDtype::kF16) : v;
  const double quant = (mid * 0.5 * (k + v) + (T - mid) * 16.0) / double(T);
  // Layers kept in BF16 (+bf16L) at 16 bits, the others as above.
  const int L = calib ? int(calib->layers.size()) : 0;
  if (bf16_layers.empty() || L <= 0) return quant;
  const double nb = double(bf16_layers.size());
  return (quant * (L - nb) + 16.0 * nb) / L;
}

bool KvMethod::bf16_layer(int layer) const {
  return std::binary_search(bf16_layers.begin(), bf16_layers.end(), layer);
}

std::vector<std::string> kv_method_names() {
  return {"bf16",   "int2-naive", "int2-hadamard", "int4-hadamard", "kivi2",       "oscar",
          "oscar-U", "oscar-UH",  "oscar-UHP",     "oscar-noclip",  "int2-raw-pca"};
}

namespace {
KvMethod resolve_base(const std::string& spec_in, const KvMethodOptions& opts);
}  // namespace

// Modifiers after '+' (row methods): clipK/V overrides every clip ratio,
// gN the quantization group (e.g. oscar+clip0.92/0.88, int2-hadamard+g32).
KvMethod resolve_kv_method(const std::string& spec, const KvMethodOptions& opts) {
  const size_t plus = spec.find('+');
  KvMethod m = resolve_base(spec.substr(0, plus), opts);
  if (plus == std::string::npos) return m;
  m.label += spec.substr(plus);  // e.g. oscar@calib-head+clip0.88/0.84
  size_t b = plus + 1;
  while (b <= spec.size()) {
    size_t e = spec.find('+', b);
    if (e == std::string::npos) e = spec.size();
    const std::string mod = spec.substr(b, e - b);
    b = e + 1;
    if (m.kind != KvMethod::Kind::kRow)
      throw Error(fmt::format("kv method '{}': modifiers apply to row-quantized methods only", spec));
    char* end = nullptr;
    if (mod.rfind("clip", 0) == 0) {
      const float kc = std::strtof(mod.c_str() + 4, &end);
      float vc = kc;
      if (*end == '/') vc = std::strtof(end + 1, &end);
      if (*end != '\0' || !(kc > 0 && kc <= 1) || !(vc > 0 && vc <= 1))
        throw Error(fmt::format("kv method '{}': '{}' is not clipK/V with ratios in (0, 1]", spec, mod));
      auto c = std::make_shared<Calibration>(*m.calib);
      for (LayerCalibration& L : c->layers) {
        std::fill(L.k_clip.begin(), L.k_clip.end(), kc);
        std::fill(L.v_clip.begin(), L.v_clip.end(), vc);
      }
      m.calib = c;
    } else if (mod.rfind("bf16L", 0) == 0) {
      // Layer numbers and ranges joined by '.': 0-3.27
      std::vector<int> layers;
      size_t p = 5;
      while (p <= mod.size()) {
        size_t q = mod.find('.', p);
        if (q == std::string::npos) q = mod.size();
        const std::string item = mod.substr(p, q - p);
        p = q + 1;
        const size_t dash = item.find('-');
        char* e1 = nullptr;
        char* e2 = nullptr;
        const long a = std::strtol(item.c_str(), &e1, 10);
        const long z = dash == std::string::npos ? a : std::strtol(item.c_str() + dash + 1, &e2, 10);
        const bool ok = !item.empty() && e1 != item.c_str() &&
                        (dash == std::string::npos ? *e1 == '\0'
                                                   : (e1 == item.c_str() + dash && e2 != item.c_str() + dash + 1 &&
                                                      *e2 == '\0'));
        const int n_layers = m.calib ? int(m.calib->layers.size()) : 0;
        if (!ok || a < 0 || z < a || z >= n_layers)
          throw Error(fmt::format("kv method '{}': '{}' is not bf16L with layers (ranges a-b, joined by '.') "
                                  "in [0, {})", spec, mod, n_layers));
        for (long l = a; l <= z; ++l) layers.push_back(int(l));
      }
      std::sort(layers.begin(), layers.end());
      layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
      m.bf16_layers = std::move(layers);
    } else if (mod.rfind("g", 0) == 0) {
      const long g = std::strtol(mod.c_str() + 1, &end, 10);
      if (*end != '\0' || (g != 32 && g != 64 && g != 128) || (opts.model.head_dim > 0 && g > opts.model.head_dim))
        throw Error(fmt::format("kv method '{}': group '{}' must be 32, 64 or 128 and <= head_dim", spec, mod));
      m.group_size = int(g);
    } else {
      throw Error(fmt::format("kv method '{}': unknown modifier '{}' (clipK/V, gN, bf16L)", spec, mod));
    }
  }
  return m;
}

namespace {
KvMethod resolve_base(const std::string& spec_in, const KvMethodOptions& opts) {
  std::string name = spec_in, path = opts.calib_path, label = spec_in;
  if (auto eq = spec_in.find('='); eq != std::string::npos) {
    name = spec_in.substr(0, eq);
    path = spec_in.substr(eq + 1);
    label = name + "@" + std::filesystem::path(path).stem().string();
  }
  KvMethod m;
  m.label = label;
  m.sink = opts.sink;
  m.recent = opts.recent;
  m.group_size = opts.group_size;
  const ModelFingerprint& fp = opts.model;
  auto data_free = [&](Composition c, float kc, float vc, int bits) {
    m.kind = KvMethod::Kind::kRow;
    m.bits = bits;
    m.calib = std::make_shared<Calibration>(
        data_free_calibration(c, fp, kc, vc, bits, std::min(opts.group_size, fp.head_dim)));
  };
  if (name == "bf16") return m;
  if (name == "int2-naive") return data_free(Composition::kNone, 1.0f, 1.0f, 2), m;
  if (name == "int2-hadamard") return data_free(Composition::kHadamard, 0.96f, 0.92f, 2), m;
  if (name == "int4-hadamard") return data_free(Composition::kHadamard, 1.0f, 1.0f, 4), m;
  if (name == "kivi2") {
    // The OSCAR cache with per-channel keys (paged_kv.h KeyAxis::kChannel), no
    // sink, a BF16 residual of 128, no rotation, no clipping, values in groups of 32.
    m.kind = KvMethod::Kind::kKivi;
    m.bits = 2;
    m.group_size = kKiviGroup;
    m.sink = 0;
    m.recent = kKiviResidual;
    m.calib = std::make_shared<Calibration>(
        data_free_calibration(Composition::kNone, fp, 1.0f, 1.0f, 2, std::min(kKiviGroup, fp.head_dim)));
    return m;
  }
  const bool calibrated = name == "oscar" || name == "oscar-U" || name == "oscar-UH" ||
                          name == "oscar-UHP" || name == "oscar-noclip" || name == "int2-raw-pca";
  if (!calibrated)
    throw Error(fmt::format("kv method '{}' is unknown (known: {}; NAME=CALIB_FILE for calibrated "
                            "ones)",
                            spec_in, fmt::join(kv_method_names(), ", ")));
  if (path.empty())
    throw Error(fmt::format("kv method '{}' needs a calibration file (--calib FILE or {}=FILE)",
                            name, name));
  auto c = load_calibration(path, fp, opts.rope_freq);
  if (name == "int2-raw-pca" && (c->key_target != KeyTarget::kRaw || c->value_target != ValueTarget::kRaw))
    throw Error(fmt::format("kv method int2-raw-pca: {} was calibrated with targets {}/{}, not "
                            "raw/raw (oscar calibrate --key-target raw --value-target raw)",
                            path, key_target_name(c->key_target), value_target_name(c->value_target)));
  Calibration cc = *c;
  if (name == "oscar-U") cc = recompose(cc, Composition::kU);
  if (name == "oscar-UH") cc = recompose(cc, Composition::kUH);
  if (name == "oscar-UHP") cc = recompose(cc, Composition::kUHP);
  if (name == "oscar-noclip")
    for (LayerCalibration& L : cc.layers) {
      std::fill(L.k_clip.begin(), L.k_clip.end(), 1.0f);
      std::fill(L.v_clip.begin(), L.v_clip.end(), 1.0f);
    }
  m.kind = KvMethod::Kind::kRow;
  m.bits = cc.bits;
  m.group_size = cc.group_size;  // the file's quantizer (clip search used it)
  m.calib = std::make_shared<Calibration>(std::move(cc));
  return m;
}
}  // namespace

std::vector<KvMethod> resolve_kv_methods(const std::string& list, const KvMethodOptions& opts) {
  std::vector<KvMethod> out;
  size_t b = 0;
  while (b <= list.size()) {
    size_t e = list.find(',', b);
    if (e == std::string::npos) e = list.size();
    std::string item = list.substr(b, e - b);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(resolve_kv_method(item, opts));
    b = e + 1;
  }
  if (out.empty()) throw Error("kv methods: empty list");
  return out;
}

// The OSCAR cache for a quantized method; `sizing` carries the page counts (or
// max_tokens) and prefix_caching, the method fills in the rest.
static std::unique_ptr<KvCache> make_quant_cache(const KvMethod& m, const KvCacheShape& shape,
                                                 OscarCacheOptions sizing) {
  if (m.kind == KvMethod::Kind::kKivi && shape.page_size % kKeySpan != 0)
    throw Error(fmt::format("kv method {}: keys are quantized per channel over spans of {} tokens, "
                            "so the page size must be a multiple of {} (got {})",
                            m.label, kKeySpan, kKeySpan, shape.page_size));
  if (!m.calib) throw Error(fmt::format("kv method {}: no calibration", m.label));
  if (!m.bf16_layers.empty())
    throw Error(fmt::format("kv method {}: layers kept in BF16 (+bf16L) exist only in the evaluation's "
                            "simulation (oscar eval), not in the caches", m.label));
  OscarCacheOptions& o = sizing;
  if (m.kind == KvMethod::Kind::kKivi) o.key_axis = KeyAxis::kChannel;
  o.label = m.label;
  o.sink = m.sink;
  o.recent = m.recent;
  o.bits = m.bits;
  o.group_size = m.group_size;
  o.prompt_bf16 = m.prompt_bf16;
  return std::make_unique<OscarKvCache>(shape, m.calib, o);
}

std::unique_ptr<KvCache> make_method_cache(const KvMethod& m, const KvCacheShape& shape,
                                           int64_t max_tokens, bool prefix_caching,
                                           const backend::PageStoreFactory& store) {
  const int64_t tokens = max_tokens > 0 ? max_tokens : 32768;
  if (m.kind == KvMethod::Kind::kBf16) {
    KvCacheOptions o;
    o.method = "bf16";
    o.page_size = shape.page_size;
    o.max_tokens = tokens;
    o.prefix_caching = prefix_caching;
    o.store = store;
    return make_kv_cache(shape, o);
  }
  OscarCacheOptions sizing;
  sizing.max_tokens = tokens;
  sizing.prefix_caching = prefix_caching;
  sizing.store = store;
  return make_quant_cache(m, shape, sizing);
}

int64_t bf16_page_bytes(const KvCacheShape& s) {
  return int64_t(s.n_layers) * 2 /*K,V*/ * s.num_kv_heads * s.page_size * s.head_dim * 2 /*bytes*/;
}

int64_t quant_page_bytes(const KvMethod& m, const KvCacheShape& s) {
  if (m.kind == KvMethod::Kind::kBf16) return 0;
  const int d = s.head_dim, ps = s.page_size, g = std::min(m.group_size, d);
  // Per head: K and V codes, V params per row group, K params per row group
  // (or per channel per kKeySpan tokens for kivi2), fp16 scale and min each.
  const int64_t vparams = int64_t(ps) * (d / g) * 2 * 2;
  const int64_t kparams = m.kind == KvMethod::Kind::kKivi ? int64_t(ps / kKeySpan) * d * 2 * 2 : vparams;
  const int64_t head = 2 * int64_t(ps) * packed_row_bytes(d, m.bits) + vparams + kparams;
  return head * s.num_kv_heads * s.n_layers;
}

namespace {

// The BF16 pages one running sequence of a quantized method holds: its sink and a window of
// < recent + page tokens (+ a partial page). (A prefill chunk adds up to `chunk` tokens beyond.)
int64_t window_pages(const KvMethod& m, int ps) { return (m.sink + ps - 1) / ps + (m.recent + ps + ps - 1) / ps + 1; }

}  // namespace

int sequences_for_bytes(const KvMethod& m, const KvCacheShape& shape, int64_t bytes, int64_t tokens, int chunk) {
  const int ps = shape.page_size;
  if (ps <= 0 || tokens < 0) throw Error(fmt::format("sequences_for_bytes: page size {}, {} tokens", ps, tokens));
  const int64_t bf = bf16_page_bytes(shape), q = quant_page_bytes(m, shape);
  auto holds = [&](int64_t B) {
    if (m.kind == KvMethod::Kind::kBf16) return B * ((tokens + ps - 1) / ps) * bf <= bytes;
    const int64_t bf_pages = B * window_pages(m, ps) + (std::max(1, chunk) + ps - 1) / ps;
    const int64_t q_pages = (bytes - bf_pages * bf) / std::max<int64_t>(q, 1);
    const int64_t mid = std::max<int64_t>(0, tokens - m.sink - m.recent) / ps + 1;  // middle pages, rounded up
    return bytes >= bf_pages * bf && q_pages >= B * mid;
  };
  int64_t lo = 0, hi = 1;
  while (holds(hi) && hi < (int64_t(1) << 30)) hi *= 2;  // holds(lo), !holds(hi) (or the cap)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (holds(mid) ? lo : hi) = mid;
  }
  return static_cast<int>(lo);
}

int64_t bytes_for_sequences(const KvMethod& m, const KvCacheShape& shape, int sequences, int64_t tokens, int chunk) {
  constexpr int64_t kMiB = int64_t(1) << 20;
  // (sequences_for_bytes counts below 2^30: more could never be reached.)
  if (sequences < 1 || sequences >= (1 << 30))
    throw Error(fmt::format("bytes_for_sequences: {} sequences (1 to 2^30 - 1)", sequences));
  int64_t lo = 0, hi = kMiB;  // sequences_for_bytes(hi) >= sequences > sequences_for_bytes(lo)
  while (sequences_for_bytes(m, shape, hi, tokens, chunk) < sequences) {
    if (hi > (int64_t(1) << 61))
      throw Error(fmt::format("bytes_for_sequences: {} sequences of {} tokens need more than 2^61 bytes", sequences,
                              tokens));
    lo = hi, hi *= 2;
  }
  while (hi - lo > kMiB) {
    const int64_t mid = (lo + hi) / 2;
    (sequences_for_bytes(m, shape, mid, tokens, chunk) >= sequences ? hi : lo) = mid;
  }
  return hi;
}

std::unique_ptr<KvCache> make_method_cache_for_bytes(const KvMethod& m, const KvCacheShape& shape,
                                                     int64_t bytes, int sequences, int chunk,
                                                     bool prefix_caching,
                                                     const backend::PageStoreFactory& store) {
  const int ps = shape.page_size;
  const int64_t bf = bf16_page_bytes(shape);
  if (m.kind == KvMethod::Kind::kBf16) {
    const int64_t pages = bytes / bf;
    if (pages < 1)
      throw Error(fmt::format("kv cache: {} bytes hold no BF16 page ({} bytes each)", bytes, bf));
    KvCacheOptions o;
    o.method = "bf16";
    o.page_size = ps;
    o.max_tokens = pages * ps;
    o.prefix_caching = prefix_caching;
    o.store = store;
    return make_kv_cache(shape, o);
  }
  const int64_t bf_pages = int64_t(std::max(1, sequences)) * window_pages(m, ps) + (std::max(1, chunk) + ps - 1) / ps;
  const int64_t q = quant_page_bytes(m, shape);
  const int64_t q_pages = (bytes - bf_pages * bf) / q;
  if (q_pages < 1)
    throw Error(fmt::format("kv cache {}: {} MiB cannot hold the BF16 windows of {} sequences "
                            "({} pages, {} MiB) and any quantized page",
                            m.label, bytes >> 20, sequences, bf_pages, (bf_pages * bf) >> 20));
  OscarCacheOptions sizing;
  sizing.bf16_pages = checked_page_count(bf_pages, bf_pages * ps, "kv cache " + m.label + " (BF16 pool)");
  sizing.quant_pages = checked_page_count(q_pages, q_pages * ps, "kv cache " + m.label + " (quantized pool)");
  sizing.prefix_caching = prefix_caching;
  sizing.store = store;
  return make_quant_cache(m, shape, sizing);
}

}  // namespace oscar::kv
