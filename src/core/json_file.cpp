#include "core/json_file.h"

#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include "core/error.h"

namespace oscar {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("{}: cannot open", path));
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return nlohmann::json::parse(ss.str());
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: invalid JSON: {}", path, e.what()));
  }
}

}  // namespace oscar
