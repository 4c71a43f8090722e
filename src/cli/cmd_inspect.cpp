// `oscar inspect CALIB`: readable summary of a calibration file (or --json).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cli/registry.h"
#include "core/calibration.h"
#include "core/key_transform.h"
#include "core/quantizer.h"

namespace {

// Spectrum concentration of one rotation's eigenvalues [d] (descending):
// share of the trace in the top eigenvalue and in the top d/8, and the
// effective rank (Σλ)²/Σλ².
struct Spectrum {
  double top1 = 0, top8th = 0, eff_rank = 0;
};
Spectrum spectrum(const float* ev, int d) {
  Spectrum s;
  double sum = 0, sq = 0, top = 0;
  for (int i = 0; i < d; ++i) {
    const double v = std::max(0.0, double(ev[i]));
    sum += v;
    sq += v * v;
    if (i < std::max(1, d / 8)) top += v;
  }
  if (sum <= 0) return s;
  s.top1 = std::max(0.0, double(ev[0])) / sum;
  s.top8th = top / sum;
  s.eff_rank = sum * sum / sq;
  return s;
}

const oscar::cli::Registrar reg(
    {"inspect", "Summarize a calibration file", [](CLI::App& app) {
       auto path = std::make_shared<std::string>();
       auto json = std::make_shared<bool>(false);
       app.add_option("calibration", *path, "Calibration file (safetensors)")->required();
       app.add_flag("--json", *json, "Machine-readable output");
       return [path, json]() -> int {
         using namespace oscar;
         const Calibration c = read_calibration(*path);
         const int d = c.head_dim();
         nlohmann::json j;
         j["file"] = *path;
         j["method"] = c.method;
         j["composition"] = composition_name(c.composition);
         j["key_target"] = key_target_name(c.key_target);
         j["value_target"] = value_target_name(c.value_target);
         j["granularity"] = granularity_name(c.granularity);
         j["bits"] = c.bits;
         j["group_size"] = c.group_size;
         j["scale_dtype"] = c.scale_dtype == ScaleDtype::kF16 ? "f16" : "f32";
         j["sink"] = c.sink;
         j["recent"] = c.recent;
         j["clip_search"] = c.clip_search;
         j["model"] = {{"architecture", c.model.architecture},
                       {"n_layers", c.model.n_layers},
                       {"n_q_heads", c.model.n_q_heads},
                       {"n_kv_heads", c.model.n_kv_heads},
                       {"head_dim", d},
                       {"weights_hash", c.model.weights_hash}};
         j["calibration"] = {
             {"tokens", c.calib_tokens}, {"positions", c.calib_positions}, {"text_hash", c.text_hash}, {"source", c.source}};
         {
           int heads = 0;
           for (const auto& L : c.layers) heads += L.page_center_heads(d);
           j["page_center"] = {{"kv_heads", heads}, {"rope_pairs", page_center_pairs(c).size()}};
         }
         nlohmann::json bpe = nlohmann::json::object();
         for (int64_t T : {1024, 4096, 32768, 131072})
           bpe[std::to_string(T)] =
               cache_bits_per_element(T, c.sink, c.recent, c.bits, c.group_size, c.scale_dtype);
         j["bits_per_element"] = bpe;
         j["row_bits_per_element"] = row_bits_per_element(c.bits, c.group_size, c.scale_dtype);
         nlohmann::json layers = nlohmann::json::array();
         for (size_t i = 0; i < c.layers.size(); ++i) {
           const LayerCalibration& L = c.layers[i];
           nlohmann::json lj;
           lj["layer"] = i;
           lj["n_rot"] = L.n_rot;
           lj["k_clip"] = L.k_clip;
           lj["v_clip"] = L.v_clip;
           double ortho = 0;
           for (int r = 0; r < L.n_rot; ++r) {
             ortho =
                 std::max(ortho, orthogonality_error(L.k_rotation.data() + size_t(r) * d * d, d));
             ortho =
                 std::max(ortho, orthogonality_error(L.v_rotation.data() + size_t(r) * d * d, d));
           }
           lj["orthogonality_error"] = ortho;
           for (int kv = 0; kv < 2; ++kv) {
             const auto& ev = kv == 0 ? L.k_eigenvalues : L.v_eigenvalues;
             if (ev.empty()) continue;
             // Mean over rotations of each statistic.
             Spectrum m;
             for (int r = 0; r < L.n_rot; ++r) {
               const Spectrum s = spectrum(ev.data() + size_t(r) * d, d);
               m.top1 += s.top1 / L.n_rot;
               m.top8th += s.top8th / L.n_rot;
               m.eff_rank += s.eff_rank / L.n_rot;
             }
             lj[kv == 0 ? "k_spectrum" : "v_spectrum"] = {{"top1_share", m.top1},
                                                          {"top_eighth_share", m.top8th},
                                                          {"effective_rank", m.eff_rank}};
           }
           layers.push_back(lj);
         }
         j["layers"] = layers;
         if (*json) {
           std::printf("%s\n", j.dump(2).c_str());
           return 0;
         }
         std::printf("%s\n", path->c_str());
         std::printf(
             "  method %s, composition %s, granularity %s, key target %s, value target %s\n",
             c.method.c_str(), composition_name(c.composition), granularity_name(c.granularity),
             key_target_name(c.key_target), value_target_name(c.value_target));
         std::printf(
             "  INT%d, group %d, %s scale/min -> %.3f bits per quantized element; sink %d, recent "
             "%d%s\n",
             c.bits, c.group_size, c.scale_dtype == ScaleDtype::kF16 ? "fp16" : "fp32",
             row_bits_per_element(c.bits, c.group_size, c.scale_dtype), c.sink, c.recent,
             c.clip_search ? ", searched clips" : "");
         std::printf("  bits/element with windows: T=1K %.2f, 4K %.2f, 32K %.2f, 128K %.2f\n",
                     bpe["1024"].get<double>(), bpe["4096"].get<double>(),
                     bpe["32768"].get<double>(), bpe["131072"].get<double>());
         std::printf("  model: %s, %d layers, %d q heads, %d kv heads, head_dim %d, weights %s\n",
                     c.model.architecture.empty() ? "?" : c.model.architecture.c_str(),
                     c.model.n_layers, c.model.n_q_heads, c.model.n_kv_heads, d,
                     c.model.weights_hash.empty() ? "?" : c.model.weights_hash.c_str());
         std::printf("  calibration: %lld tokens at positions < %lld, text %s, source %s\n",
                     static_cast<long long>(c.calib_tokens), static_cast<long long>(c.calib_positions),
                     c.text_hash.empty() ? "?" : c.text_hash.c_str(),
                     c.source.empty() ? "?" : c.source.c_str());
         std::printf("  page centering: %d KV heads over %d RoPE pairs\n", j["page_center"]["kv_heads"].get<int>(),
                     int(j["page_center"]["rope_pairs"].get<size_t>()));
         std::printf("\n%5s %4s | %-22s | %-22s | %-13s | %s\n", "layer", "rot",
                     "K spectrum top1/top⅛/rank", "V spectrum top1/top⅛/rank", "clip K / V",
                     "|RᵀR−I|");
         for (const auto& lj : layers) {
           auto spec = [&](const char* key) -> std::string {
             if (!lj.contains(key)) return "-";
             const auto& s = lj[key];
             return fmt::format("{:5.3f} {:5.3f} {:6.2f}", s["top1_share"].get<double>(),
                                s["top_eighth_share"].get<double>(),
                                s["effective_rank"].get<double>());
           };
           const auto kc = lj["k_clip"].get<std::vector<float>>(),
                      vc = lj["v_clip"].get<std::vector<float>>();
           auto clips = [](const std::vector<float>& v) {
             const auto [mn, mx] = std::minmax_element(v.begin(), v.end());
             return *mn == *mx ? fmt::format("{:.2f}", *mn)
                               : fmt::format("{:.2f}-{:.2f}", *mn, *mx);
           };
           std::printf("%5d %4d | %-22s | %-22s | %5s / %-5s | %.1e\n", lj["layer"].get<int>(),
                       lj["n_rot"].get<int>(), spec("k_spectrum").c_str(),
                       spec("v_spectrum").c_str(), clips(kc).c_str(), clips(vc).c_str(),
                       lj["orthogonality_error"].get<double>());
         }
         return 0;
       };
     }});

}  // namespace
