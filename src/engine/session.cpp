#include "engine/session.h"

#include <fmt/format.h>

#include "core/error.h"
#if OSCAR_WITH_CUDA
#include "backend/cuda/backend_cuda.h"
#endif

#include "backend/cpu/backend_cpu.h"
#include "model/fold_rotation.h"
#include "model/loader.h"
#include "model/rope.h"

namespace oscar::engine {

std::unique_ptr<backend::Backend> make_backend(const std::string& device, backend::WeightDtype weights,
                                             int threads) {
  if (device == "cpu") return backend::make_cpu_backend({weights, threads});
  if (device == "cuda" || device.rfind("cuda:", 0) == 0) {
#if OSCAR_WITH_CUDA
    backend::CudaBackendOptions co;
    co.weight_dtype = weights;
    if (device.size() > 5) {
      try {
        co.device = std::stoi(device.substr(5));
      } catch (const std::exception&) {
        throw Error("--device: bad CUDA device '" + device + "' (want cuda or cuda:N)");
      }
    }
    return backend::make_cuda_backend(co);
#else
    throw Error("--device cuda: this build has no CUDA (configure with nvcc on PATH)");
#endif
  }
  throw Error("--device: unknown device '" + device + "' (cpu, cuda, cuda:N)");
}

PreparedModel prepare_model(model::ModelWeights w, const kv::KvMethod& method,
                            const std::string& device, backend::WeightDtype weights, int threads) {
  if (method.folds_values()) model::fold_value_rotation(w, *method.calib);
  PreparedModel p;
  p.backend = make_backend(device, weights, threads);
  p.model = std::make_unique<model::Model>(w, *p.backend);
  return p;  // the dense fp32 weights go here; the backend keeps its own copy
}

Session open_session(const SessionOptions& o) {
  Session s{model::load_tokenizer(o.model), nullptr, nullptr, {}};
  model::ModelWeights w = model::load_model(o.model);
  if (o.kv != "bf16") {
    kv::KvMethodOptions mo;
    mo.calib_path = o.calib;
    mo.model = model::model_fingerprint(w);
    mo.rope_freq = model::rope_inv_freq(w.cfg);
    s.method = kv::resolve_kv_method(o.kv, mo);
  }
  PreparedModel p = prepare_model(std::move(w), s.method, o.device,
                                  backend::weight_dtype_from_string(o.weights), o.threads);
  s.backend = std::move(p.backend);
  s.model = std::move(p.model);
  return s;
}

int64_t gpu_kv_budget(backend::Backend::MemoryInfo mem, double utilization) {
  if (!(utilization > 0.0 && utilization <= 1.0))
    throw Error(fmt::format("--gpu-memory-utilization {} is outside (0, 1]", utilization));
  if (mem.total <= 0 || mem.free < 0 || mem.free > mem.total)
    throw Error(fmt::format("device memory: {} bytes free of {}: no device memory to size the KV cache from",
                            mem.free, mem.total));
  constexpr int64_t kMiB = int64_t(1) << 20;
  const int64_t used = mem.total - mem.free;
  const int64_t budget = int64_t(utilization * double(mem.total)) - used;
  if (budget < 64 * kMiB)
    throw Error(fmt::format("no device memory left for the KV cache: {} of the device's {} MiB are in use (the "
                            "model and the runtime) and --gpu-memory-utilization {} allows {} MiB; raise it, or "
                            "give --kv-memory-mb",
                            used / kMiB, mem.total / kMiB, utilization, int64_t(utilization * double(mem.total)) / kMiB));
  return budget;
}

}  // namespace oscar::engine
