// safetensors reader/writer: round trip, conversions, and every kind of
// broken file is a clear oscar::Error.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "core/safetensors.h"

using namespace oscar;
namespace fs = std::filesystem;

namespace {

std::string tmp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("oscar_test_st_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

void write_raw(const std::string& path, const std::string& header, const std::string& data,
               int64_t len_override = -1) {
  std::ofstream f(path, std::ios::binary);
  uint64_t n = len_override >= 0 ? static_cast<uint64_t>(len_override) : header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f << header << data;
}

std::string error_of(const std::string& path) {
  try {
    st::File::open(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Safetensors, RoundTripAllDtypes) {
  const std::string p = tmp_path("rt.safetensors");
  st::Writer w;
  std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, -1e-3f};
  w.add_f32("a", {2, 3}, a.data());
  std::vector<uint16_t> h = {f32_to_f16(0.5f), f32_to_f16(-3.0f)};
  w.add("h", st::Dtype::F16, {2}, h.data(), 4);
  std::vector<uint16_t> b = {f32_to_bf16(1.0f), f32_to_bf16(-256.0f), f32_to_bf16(0.125f)};
  w.add("b", st::Dtype::BF16, {3}, b.data(), 6);
  std::vector<double> dd = {3.0, -0.5};
  w.add("d", st::Dtype::F64, {1, 2}, dd.data(), 16);
  std::vector<uint8_t> u = {1, 2, 3};
  w.add("u", st::Dtype::U8, {3}, u.data(), 3);
  w.add("empty", st::Dtype::I32, {0, 4}, nullptr, 0);
  w.set_metadata("format", "oscar-test");
  w.set_metadata("k", "v");
  w.write(p);

  auto f = st::File::open(p);
  EXPECT_EQ(f.metadata().at("format"), "oscar-test");
  EXPECT_EQ(f.meta("missing", "fb"), "fb");
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b", "d", "empty", "h", "u"}));
  EXPECT_EQ(f.at("a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(f.read_f32("a"), a);
  EXPECT_EQ(f.read_f32("h"), (std::vector<float>{0.5f, -3.0f}));
  EXPECT_EQ(f.read_f32("b"), (std::vector<float>{1.0f, -256.0f, 0.125f}));
  EXPECT_EQ(f.read_f32("d"), (std::vector<float>{3.0f, -0.5f}));
  EXPECT_EQ(std::memcmp(f.data(f.at("u")), u.data(), 3), 0);
  EXPECT_EQ(f.at("empty").numel(), 0);
  EXPECT_EQ(f.find("nope"), nullptr);
  EXPECT_THROW(f.at("nope"), Error);
  EXPECT_THROW(f.read_f32("u"), Error);  // not a float dtype
  // Natural alignment: f64 and f32 data are aligned in the mapping.
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data(f.at("d"))) % 8, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.data(f.at("a"))) % 4, 0u);
  std::vector<float> part(2);
  f.read_f32_range(f.at("a"), 3, 2, part.data());
  EXPECT_EQ(part, (std::vector<float>{0.0f, 7.0f}));
  EXPECT_THROW(f.read_f32_range(f.at("a"), 5, 2, part.data()), Error);
  st::File moved = std::move(f);
  EXPECT_EQ(moved.read_f32("a"), a);
  EXPECT_FALSE(fs::exists(p + ".tmp"));
  fs::remove(p);
}

TEST(Safetensors, WriterRejectsBadInput) {
  st::Writer w;
  float x[4] = {};
  EXPECT_THROW(w.add("x", st::Dtype::F32, {2, 2}, x, 12), Error);  // size mismatch
  w.add("x", st::Dtype::F32, {2, 2}, x, 16);
  EXPECT_THROW(w.add("x", st::Dtype::F32, {4}, x, 16), Error);  // duplicate
  EXPECT_THROW(w.add("__metadata__", st::Dtype::F32, {4}, x, 16), Error);
  EXPECT_THROW(w.add("neg", st::Dtype::F32, {-4}, x, 16), Error);
  EXPECT_THROW(w.write("/nonexistent-dir/x.safetensors"), Error);
}

TEST(Safetensors, BrokenFilesAreClearErrors) {
  const std::string p = tmp_path("bad.safetensors");
  auto expect_err = [&](const std::string& needle) {
    const std::string msg = error_of(p);
    EXPECT_NE(msg.find(p), std::string::npos) << msg;  // names the file
    EXPECT_NE(msg.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << msg;
  };
  EXPECT_NE(error_of(tmp_path("does-not-exist")).find("cannot open"), std::string::npos);

  { std::ofstream(p, std::ios::binary) << "abc"; }
  expect_err("only 3 bytes");
  write_raw(p, "{}", "", 1000);
  expect_err("truncated header");
  write_raw(p, "{}", "", int64_t(1) << 40);
  expect_err("exceeds");
  write_raw(p, "{\"a\": {\"dtype\": \"F32\"", "");
  expect_err("not valid JSON");
  write_raw(p, "[1,2]", "");
  expect_err("not an object");
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", "1234");
  expect_err("beyond the data block");
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", "12345678");
  expect_err("needs 12");
  write_raw(p, R"({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", "12345678");
  expect_err("unsupported dtype");
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", "12345678");
  expect_err("negative");
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", "12345678");
  expect_err("reversed");
  write_raw(p, R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                   "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
            "12345678");
  expect_err("overlap");
  write_raw(p, R"({"__metadata__": {"x": 3}})", "");
  expect_err("not a string");
  write_raw(p,
            R"({"a": {"dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 8]}})",
            "12345678");
  expect_err("overflows");

  // A valid file cut short is caught.
  st::Writer w;
  std::vector<float> big(1000, 1.0f);
  w.add_f32("big", {1000}, big.data());
  w.write(p);
  fs::resize_file(p, fs::file_size(p) - 100);
  expect_err("beyond the data block");
  fs::remove(p);
}
