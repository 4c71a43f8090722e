// What `oscar generate` and `oscar serve` both assemble from a model path and a
// KV method name: tokenizer, backend (CPU or CUDA), model (R_V folded into W_v / W_o for
// the quantized methods that rotate values) and the resolved method.
#pragma once

#include <memory>
#include <string>

#include "kv/quant_methods.h"
#include "backend/backend.h"
#include "model/forward.h"
#include "model/tokenizer.h"

namespace oscar::engine {

struct SessionOptions {
  std::string model;             // GGUF file or Hugging Face directory
  std::string kv = "bf16";       // KV method name (kv/quant_methods.h)
  std::string calib;             // calibration file for calibrated methods
  std::string weights = "bf16";  // weight storage on the backend
  int threads = 0;               // 0 = all cores
  std::string device = "cpu";    // cpu | cuda | cuda:N
};

struct Session {
  model::Tokenizer tok;
  std::unique_ptr<backend::Backend> backend;
  std::unique_ptr<model::Model> model;  // uses *backend
  kv::KvMethod method;                  // default (bf16) when kv == "bf16"
};

// The backend for a device name (cpu, cuda, cuda:N); throws oscar::Error for an
// unknown name or CUDA in a build without it.
std::unique_ptr<backend::Backend> make_backend(const std::string& device, backend::WeightDtype weights,
                                             int threads);

// A model prepared on a new backend for one KV method: R_V folded into W_v /
// W_o when the method rotates values (on `w`, which the caller hands over).
struct PreparedModel {
  std::unique_ptr<backend::Backend> backend;
  std::unique_ptr<model::Model> model;  // uses *backend
};
PreparedModel prepare_model(model::ModelWeights w, const kv::KvMethod& method,
                            const std::string& device, backend::WeightDtype weights, int threads);

// The KV page budget a GPU server takes when none is given (vLLM's --gpu-memory-utilization):
// `utilization` of the device's `total` bytes, less what is already in use (`total - free`: the
// weights and the runtime's own). What stays outside it is the room for the activations and the
// kernels' scratch, which grow with the first steps. Throws oscar::Error where nothing is left
// (the reason names the numbers) or utilization is outside (0, 1].
int64_t gpu_kv_budget(backend::Backend::MemoryInfo mem, double utilization);

// Loads and prepares; the dense weights are freed before it returns. Throws
// oscar::Error (unknown method, calibration for another model, bad files).
Session open_session(const SessionOptions& o);

}  // namespace oscar::engine
