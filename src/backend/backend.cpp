#include "backend/backend.h"

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

}  // namespace oscar::backend
