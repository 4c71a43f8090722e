// Shared by the libFuzzer targets: each input is written to a file in a private
// tmpfs directory (the readers under test take paths and mmap them), and the
// only exception a reader may throw is oscar::Error (a clear message naming the
// file). Anything else — a crash, a sanitizer report, std::bad_alloc, a
// json/std exception escaping — is a finding: libFuzzer stops and keeps the input.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>

namespace oscar::fuzz {

// A per-process directory under /dev/shm (or $TMPDIR when /dev/shm is absent),
// removed at exit.
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    namespace fs = std::filesystem;
    fs::path base = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
    fs::path d = base / ("oscar-fuzz-" + std::to_string(::getpid()));
    fs::create_directories(d);
    static const std::string keep = d.string();
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(keep, ec);
    });
    return d;
  }();
  return dir;
}

// Writes `data` to scratch_dir()/name and returns the path.
inline std::string write_input(const uint8_t* data, size_t size, const std::string& name) {
  const std::string path = (scratch_dir() / name).string();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) std::abort();
  if (size && std::fwrite(data, 1, size, f) != size) std::abort();
  std::fclose(f);
  return path;
}

// The source tree's test data (the fixed tokenizer of the round-trip target).
inline std::string source_dir() {
  if (const char* s = std::getenv("OSCAR_SOURCE_DIR")) return s;
  return OSCAR_SOURCE_DIR;
}

}  // namespace oscar::fuzz
