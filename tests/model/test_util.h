// Helpers shared by the model tests (loaders, tokenizer).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"

namespace oscar::test {

// A path in a per-process scratch folder (ctest runs each test in its own process).
inline std::string tmp_path(const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("oscar_test_model_" + std::to_string(::getpid()));
  std::filesystem::create_directories(d);
  return (d / name).string();
}

// Expects `f` to throw oscar::Error whose message contains every needle.
template <typename F>
void expect_error(F&& f, std::vector<std::string> needles) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning " << needles[0];
  } catch (const oscar::Error& e) {
    const std::string m = e.what();
    for (const auto& n : needles) EXPECT_NE(m.find(n), std::string::npos) << "message: " << m;
  }
}

}  // namespace oscar::test
