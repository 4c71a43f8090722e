#include "engine/session.h"

#include "model/backend_cpu.h"
#include "model/fold_rotation.h"
#include "model/loader.h"

namespace oscar::engine {

Session open_session(const SessionOptions& o) {
  Session s{model::load_tokenizer(o.model), nullptr, nullptr, {}};
  model::ModelWeights w = model::load_model(o.model);
  if (o.kv != "bf16") {
    kv::KvMethodOptions mo;
    mo.calib_path = o.calib;
    mo.model = model::model_fingerprint(w);
    s.method = kv::resolve_kv_method(o.kv, mo);
    if (s.method.folds_values()) model::fold_value_rotation(w, *s.method.calib);
  }
  s.backend = model::make_cpu_backend({model::weight_dtype_from_string(o.weights), o.threads});
  s.model = std::make_unique<model::Model>(w, *s.backend);
  return s;  // the dense fp32 weights go here; the backend keeps its own copy
}

}  // namespace oscar::engine
