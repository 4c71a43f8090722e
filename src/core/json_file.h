// Reading a JSON file with errors that name the file.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "core/error.h"

namespace oscar {

// Parses the whole file; throws oscar::Error("<path>: cannot open" / "<path>: invalid JSON: ...").
nlohmann::json read_json_file(const std::string& path);

// The integer in `v`, which must be a JSON integer in [lo, hi]; otherwise
// oscar::Error naming `what` (e.g. "tokenizer.json: token id of 'abc'"). Floats,
// strings and out-of-range values are refused instead of converted (a float
// outside int's range is undefined behaviour, a large integer would wrap).
template <class Json>
int64_t json_int(const Json& v, int64_t lo, int64_t hi, const std::string& what) {
  bool ok = v.is_number_integer();
  int64_t x = 0;
  if (ok && v.is_number_unsigned()) {
    const uint64_t u = v.template get<uint64_t>();
    ok = u <= static_cast<uint64_t>(INT64_MAX);
    x = static_cast<int64_t>(u);
  } else if (ok) {
    x = v.template get<int64_t>();
  }
  if (!ok || x < lo || x > hi)
    throw Error(fmt::format("{} must be an integer in [{}, {}] (got {})", what, lo, hi, v.dump()));
  return x;
}

}  // namespace oscar
