// The one exception type of the project. Messages name the file/object and the
// problem ("calib.safetensors: truncated header (12 of 4096 bytes)").
#pragma once

#include <stdexcept>
#include <string>

namespace oscar {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace oscar
