// `oscar quant-error`: per-layer INT-B error of a calibration on an activation
// dump, beside the data-free baselines `none` and `hadamard`.
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli/registry.h"
#include "core/activation_dump.h"
#include "core/calibration.h"
#include "core/calibrator.h"
#include "core/error.h"
#include "core/layer_error.h"

namespace {

const oscar::cli::Registrar reg(
    {"quant-error",
     "Per-layer INT2 logit / value / K / V error of a calibration vs none and hadamard",
     [](CLI::App& app) {
       struct Opts {
         std::string dump, calib, value_target;
         int64_t max_tokens = 4096, skip_tokens = 0;
         float base_k_clip = 1.0f, base_v_clip = 1.0f;
         bool json = false, quiet = false;
       };
       auto o = std::make_shared<Opts>();
       app.add_option("--activations,-a", o->dump, "Activation dump (safetensors)")->required();
       app.add_option("--calib,-c", o->calib, "Calibration file")->required();
       app.add_option("--max-tokens", o->max_tokens, "Evaluate on the first N tokens (0 = all)")
           ->capture_default_str();
       app.add_option("--skip-tokens", o->skip_tokens,
                 "Evaluate from token N on (e.g. held out from a calibrate --max-tokens N)")
      ->capture_default_str();
  app.add_option("--value-target", o->value_target,
                      "Weight for the value error: attn-output | key-weighted | raw (default: the "
                      "calibration's)");
       app.add_option("--baseline-k-clip", o->base_k_clip,
                      "Key clip ratio of the none/hadamard baselines")
           ->capture_default_str();
       app.add_option("--baseline-v-clip", o->base_v_clip,
                      "Value clip ratio of the none/hadamard baselines")
           ->capture_default_str();
       app.add_flag("--json", o->json, "Machine-readable output");
       app.add_flag("-q,--quiet", o->quiet, "No progress display");
       return [o]() -> int {
         using namespace oscar;
         const auto t0 = std::chrono::steady_clock::now();
         const ActivationDump dump = ActivationDump::open(o->dump);
         const Calibration cal = read_calibration(o->calib);
         check_calibration_matches(cal, dump.fingerprint(), o->calib);
         const int L = dump.n_layers(), Hq = dump.n_q_heads(), H = dump.n_kv_heads(),
                   d = dump.head_dim();
         if (o->skip_tokens < 0 || o->skip_tokens >= dump.tokens())
           throw Error(fmt::format("--skip-tokens {} leaves none of the {} tokens of {}",
                                   o->skip_tokens, dump.tokens(), o->dump));
         const int64_t first = o->skip_tokens, avail = dump.tokens() - first;
         const int64_t T = o->max_tokens > 0 ? std::min(o->max_tokens, avail) : avail;
         CalibConfig cfg;  // only the targets are used
         cfg.value_target =
             o->value_target.empty() ? cal.value_target : parse_value_target(o->value_target);
         cfg.quant = QuantSpec{cal.bits, std::min(cal.group_size, d), cal.scale_dtype};
         const bool need_o = cfg.value_target == ValueTarget::kAttnOutput;
         if (need_o && !dump.has_o())
           throw Error(fmt::format(
               "{}: the value target attn-output needs 'layers.{{i}}.o'; pass --value-target "
               "key-weighted (or raw)",
               o->dump));
         const Calibration base_none =
             data_free_calibration(Composition::kNone, cal.model, o->base_k_clip, o->base_v_clip);
         const Calibration base_had = data_free_calibration(Composition::kHadamard, cal.model,
                                                            o->base_k_clip, o->base_v_clip);
         struct Method {
           std::string name;
           const Calibration* c;
           KvErrors total;
         };
         std::vector<Method> methods = {
             {cal.method == "oscar" ? std::string("calib:") + composition_name(cal.composition)
                                    : cal.method,
              &cal,
              {}},
             {"none", &base_none, {}},
             {"hadamard", &base_had, {}}};
         std::vector<float> q(static_cast<size_t>(T * Hq * d)), k(static_cast<size_t>(T * H * d)),
             v(k.size()), ob(need_o ? q.size() : 0);
         nlohmann::json jl = nlohmann::json::array();
         const ProgressFn progress =
             o->quiet || o->json ? ProgressFn{} : stderr_progress("quant-error");
         std::vector<std::vector<KvErrors>> per_layer(static_cast<size_t>(L));
         uint64_t bytes = 0;
         for (int l = 0; l < L; ++l) {
           dump.read(l, 'q', first, T, q.data());
           dump.read(l, 'k', first, T, k.data());
           dump.read(l, 'v', first, T, v.data());
           if (need_o) dump.read(l, 'o', first, T, ob.data());
           bytes += static_cast<uint64_t>(T) * d * (Hq + 2 * H + (need_o ? Hq : 0)) * 4;
           Calibrator stats(cfg, 1, Hq, H, d);
           stats.add(0, q.data(), k.data(), v.data(), need_o ? ob.data() : nullptr, T);
           const LayerTargets t = stats.targets(0);
           nlohmann::json lj = {{"layer", l}};
           for (auto& m : methods) {
             const KvErrors e = layer_kv_errors(t, k.data(), v.data(), T,
                                                m.c->layers[static_cast<size_t>(l)], cfg.quant);
             m.total.k += e.k;
             m.total.v += e.v;
             per_layer[static_cast<size_t>(l)].push_back(e);
             lj[m.name] = {{"logit_rel_mse", e.k.rel_w()},
                           {"value_weighted_rel_mse", e.v.rel_w()},
                           {"k_rel_mse", e.k.rel_raw()},
                           {"v_rel_mse", e.v.rel_raw()}};
           }
           jl.push_back(lj);
           if (progress) progress(l + 1, L, bytes);
         }
         const double secs =
             std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
         if (o->json) {
           nlohmann::json j;
           j["activations"] = o->dump;
           j["calibration"] = o->calib;
           j["tokens"] = T;
      j["skip_tokens"] = first;
           j["bits"] = cfg.quant.bits;
           j["group_size"] = cfg.quant.group_size;
           j["value_weight"] = value_target_name(cfg.value_target);
           j["baseline_clip"] = {o->base_k_clip, o->base_v_clip};
           j["layers"] = jl;
           nlohmann::json tot;
           for (const auto& m : methods)
             tot[m.name] = {{"logit_rel_mse", m.total.k.rel_w()},
                            {"value_weighted_rel_mse", m.total.v.rel_w()},
                            {"k_rel_mse", m.total.k.rel_raw()},
                            {"v_rel_mse", m.total.v.rel_raw()}};
           j["total"] = tot;
           j["seconds"] = secs;
           std::printf("%s\n", j.dump(2).c_str());
           return 0;
         }
         std::printf(
             "INT%d group %d, tokens [%lld, %lld), value error weighted by %s; baselines clip K %.2f V "
             "%.2f\n",
             cfg.quant.bits, cfg.quant.group_size, static_cast<long long>(first),
             static_cast<long long>(first + T),
             value_target_name(cfg.value_target), o->base_k_clip, o->base_v_clip);
         std::printf("relative MSE: columns are %s / none / hadamard\n", methods[0].name.c_str());
         std::printf("%5s | %-26s | %-26s | %-26s | %-26s\n", "layer", "logit (q·k)",
                     "value (weighted)", "K", "V");
         auto row = [&](const std::string& label, const std::vector<KvErrors>& es) {
           auto cell = [&](auto f) {
             return fmt::format("{:8.4f} {:8.4f} {:8.4f}", f(es[0]), f(es[1]), f(es[2]));
           };
           std::printf("%5s | %-26s | %-26s | %-26s | %-26s\n", label.c_str(),
                       cell([](const KvErrors& e) { return e.k.rel_w(); }).c_str(),
                       cell([](const KvErrors& e) { return e.v.rel_w(); }).c_str(),
                       cell([](const KvErrors& e) { return e.k.rel_raw(); }).c_str(),
                       cell([](const KvErrors& e) { return e.v.rel_raw(); }).c_str());
         };
         for (int l = 0; l < L; ++l) row(std::to_string(l), per_layer[static_cast<size_t>(l)]);
         row("all", {methods[0].total, methods[1].total, methods[2].total});
         std::fprintf(stderr, "%.1f s\n", secs);
         return 0;
       };
     }});

}  // namespace
