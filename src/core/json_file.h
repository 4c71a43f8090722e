// Reading a JSON file with errors that name the file.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace oscar {

// Parses the whole file; throws oscar::Error("<path>: cannot open" / "<path>: invalid JSON: ...").
nlohmann::json read_json_file(const std::string& path);

}  // namespace oscar
