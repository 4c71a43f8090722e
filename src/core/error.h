// The project's exception type. Messages name the file/object and the problem
// ("calib.safetensors: truncated header (12 of 4096 bytes)").
#pragma once

#include <stdexcept>
#include <string>

namespace oscar {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The memory asked for is not there: a device allocation that failed, or more pages than a
// pool's int32 ids index. Callers that size things by trying (a benchmark's largest batch)
// tell it from other failures by its type.
struct OutOfMemory : Error {
  using Error::Error;
};

}  // namespace oscar
