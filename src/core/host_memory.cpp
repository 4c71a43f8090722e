#include "core/host_memory.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>

#include <fmt/format.h>

#include "core/error.h"

namespace oscar {

namespace {

// A number from a one-line file ("max" or absent: nothing).
bool read_u64(const char* path, uint64_t& out) {
  std::ifstream in(path);
  std::string s;
  if (!(in >> s) || s.empty() || !std::isdigit(static_cast<unsigned char>(s[0]))) return false;
  out = std::strtoull(s.c_str(), nullptr, 10);
  return true;
}

}  // namespace

uint64_t parse_byte_size(const std::string& s) {
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    throw Error(fmt::format("'{}' is not a size (bytes, or a number with K, M or G)", s));
  }
  std::string unit = s.substr(pos);
  double mul = 1;
  if (unit == "K" || unit == "k") mul = 1024.0;
  else if (unit == "M" || unit == "m") mul = 1024.0 * 1024;
  else if (unit == "G" || unit == "g") mul = 1024.0 * 1024 * 1024;
  else if (!unit.empty()) throw Error(fmt::format("'{}' is not a size (bytes, or a number with K, M or G)", s));
  const double b = v * mul;
  if (!(b >= 0) || b > 1.8e19) throw Error(fmt::format("'{}' is not a size (bytes, or a number with K, M or G)", s));
  return static_cast<uint64_t>(b);
}

uint64_t host_memory_available() {
  uint64_t avail = std::numeric_limits<uint64_t>::max();
  std::ifstream mi("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (mi >> key >> kb >> unit)
    if (key == "MemAvailable:") {
      avail = std::min(avail, kb * 1024);
      break;
    }
  uint64_t max = 0, cur = 0;
  if (read_u64("/sys/fs/cgroup/memory.max", max) && read_u64("/sys/fs/cgroup/memory.current", cur))
    avail = std::min(avail, max > cur ? max - cur : 0);
  if (const char* cap = std::getenv("OSCAR_HOST_MEMORY_LIMIT"); cap != nullptr && *cap != '\0')
    avail = std::min(avail, parse_byte_size(cap));
  return avail;
}

std::string format_bytes(uint64_t b) {
  const double x = static_cast<double>(b);
  if (x >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", x / (1024.0 * 1024 * 1024));
  if (x >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", x / (1024.0 * 1024));
  return fmt::format("{} B", b);
}

}  // namespace oscar
