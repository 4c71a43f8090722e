// Calibration file round trip, corrupt/mismatched files, activation dumps.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "core/activation_dump.h"
#include "core/calibration.h"
#include "core/calibrator.h"
#include "core/error.h"
#include "core/synthetic.h"

using namespace oscar;
namespace fs = std::filesystem;

namespace {

std::string tmp(const std::string& name) {
  return (fs::temp_directory_path() / ("oscar_test_cal_" + std::to_string(::getpid()) + "_" + name))
      .string();
}

SyntheticSpec spec() {
  SyntheticSpec s;
  s.n_layers = 3;
  s.n_q_heads = 4;
  s.n_kv_heads = 2;
  s.head_dim = 64;
  s.tokens = 256;
  s.seed = 9;
  return s;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(CalibrationFile, RoundTripFromDump) {
  const std::string dump_path = tmp("dump.safetensors"), cal_path = tmp("cal.safetensors");
  auto s = spec();
  write_synthetic_dump(dump_path, s, st::Dtype::F16);
  const ActivationDump dump = ActivationDump::open(dump_path);
  EXPECT_EQ(dump.n_layers(), 3);
  EXPECT_EQ(dump.tokens(), 256);
  EXPECT_EQ(dump.n_q_heads(), 4);
  EXPECT_EQ(dump.n_kv_heads(), 2);
  EXPECT_EQ(dump.head_dim(), 64);
  EXPECT_FALSE(dump.has_o());
  for (auto gran : {Granularity::kLayer, Granularity::kHead}) {
    CalibConfig cfg;
    cfg.granularity = gran;
    Calibrator cal(cfg, 3, 4, 2, 64);
    int calls = 0;
    feed_dump(dump, cal, 0, 100, [&](int, int, uint64_t) { ++calls; });
    EXPECT_EQ(calls, 4);
    ModelFingerprint fp = dump.fingerprint();
    fp.weights_hash = "abc123";
    Calibration c = cal.finish(fp);
    c.text_hash = dump.text_hash();
    c.source = dump_path;
    write_calibration(c, cal_path);
    const Calibration r = read_calibration(cal_path);
    EXPECT_EQ(r.model.architecture, "synthetic");
    EXPECT_EQ(r.model.weights_hash, "abc123");
    EXPECT_EQ(r.model.n_layers, 3);
    EXPECT_EQ(r.granularity, gran);
    EXPECT_EQ(r.composition, Composition::kUHP);
    EXPECT_EQ(r.value_target, ValueTarget::kKeyWeighted);
    EXPECT_EQ(r.group_size, 64);  // lowered to head_dim
    EXPECT_EQ(r.calib_tokens, 256);
    EXPECT_EQ(r.text_hash, "synthetic-seed-9");
    ASSERT_EQ(r.layers.size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(r.layers[i].k_rotation, c.layers[i].k_rotation);
      EXPECT_EQ(r.layers[i].v_rotation, c.layers[i].v_rotation);
      EXPECT_EQ(r.layers[i].k_eigenvalues, c.layers[i].k_eigenvalues);
      EXPECT_EQ(r.layers[i].v_clip, c.layers[i].v_clip);
      EXPECT_EQ(r.layers[i].n_rot, gran == Granularity::kLayer ? 1 : 2);
    }
    // The accessor serves every head from a per-layer rotation.
    EXPECT_EQ(r.layers[0].k_rot(1, 64)[0],
              r.layers[0].k_rotation[(r.layers[0].n_rot - 1) * 64 * 64]);
  }
  // Feeding through the dump (f16) equals feeding the fp32 activations
  // rounded to f16 (the reader is a pure converter).
  Calibrator via_dump(CalibConfig{}, 3, 4, 2, 64), direct(CalibConfig{}, 3, 4, 2, 64);
  feed_dump(dump, via_dump, 0, 100);
  for (int l = 0; l < 3; ++l) {
    SyntheticLayer a = synthetic_layer(s, l);
    for (auto* v : {&a.q, &a.k, &a.v})
      for (float& x : *v) x = f16_to_f32(f32_to_f16(x));
    direct.add(l, a.q.data(), a.k.data(), a.v.data(), nullptr, s.tokens);
  }
  const Calibration c1 = via_dump.finish(), c2 = direct.finish();
  for (int l = 0; l < 3; ++l)
    for (size_t i = 0; i < c1.layers[l].v_rotation.size(); ++i)
      ASSERT_NEAR(c1.layers[l].v_rotation[i], c2.layers[l].v_rotation[i], 1e-5);
  fs::remove(dump_path);
  fs::remove(cal_path);
}

TEST(CalibrationFile, MismatchIsAClearError) {
  ModelFingerprint m{"llama", 4, 8, 2, 64, "hash-a"};
  const Calibration c = data_free_calibration(Composition::kHadamard, m, 1.0f, 1.0f);
  EXPECT_NO_THROW(check_calibration_matches(c, m, "c"));
  auto other = m;
  other.n_kv_heads = 4;
  EXPECT_NE(error_of([&] { check_calibration_matches(c, other, "c.st"); }).find("n_kv_heads"),
            std::string::npos);
  other = m;
  other.weights_hash = "hash-b";
  EXPECT_NE(error_of([&] { check_calibration_matches(c, other, "c.st"); }).find("weights hash"),
            std::string::npos);
  other = m;
  other.weights_hash = "";  // unknown on one side: shapes decide
  EXPECT_NO_THROW(check_calibration_matches(c, other, "c"));
  other = m;
  other.head_dim = 128;
  EXPECT_THROW(check_calibration_matches(c, other, "c"), Error);
}

TEST(CalibrationFile, CorruptFilesAreClearErrors) {
  const std::string p = tmp("bad.safetensors");
  ModelFingerprint m{"llama", 2, 4, 2, 32, ""};
  Calibration c = data_free_calibration(Composition::kRandom, m, 0.96f, 0.92f, 2, 32, 7);
  write_calibration(c, p);
  EXPECT_NO_THROW(read_calibration(p));
  // Truncated.
  fs::resize_file(p, fs::file_size(p) - 64);
  EXPECT_NE(error_of([&] { read_calibration(p); }).find(p), std::string::npos);
  // Not orthogonal.
  c.layers[1].v_rotation[3] += 0.5f;
  write_calibration(c, p);
  EXPECT_NE(error_of([&] { read_calibration(p); }).find("not orthogonal"), std::string::npos);
  c.layers[1].v_rotation[3] -= 0.5f;
  // Clip out of range.
  c.layers[0].k_clip[0] = 0.0f;
  write_calibration(c, p);
  EXPECT_NE(error_of([&] { read_calibration(p); }).find("clip"), std::string::npos);
  c.layers[0].k_clip[0] = 0.96f;
  // Non-finite.
  c.layers[0].k_rotation[0] = NAN;
  write_calibration(c, p);
  EXPECT_NE(error_of([&] { read_calibration(p); }).find("non-finite"), std::string::npos);
  // Metadata says 3 layers, file has 2.
  c.layers[0].k_rotation[0] = 1.0f;
  c.model.n_layers = 3;
  EXPECT_THROW(write_calibration(c, p), Error);  // the writer refuses too
  // Some other safetensors file.
  st::Writer w;
  float x = 1;
  w.add_f32("x", {1}, &x);
  w.write(p);
  EXPECT_NE(error_of([&] { read_calibration(p); }).find("not an OSCAR calibration"),
            std::string::npos);
  // Garbage.
  { std::ofstream(p) << "hello world, not a file format"; }
  EXPECT_THROW(read_calibration(p), Error);
  fs::remove(p);
}

TEST(ActivationDump, MalformedDumpsAreClearErrors) {
  const std::string p = tmp("dump_bad.safetensors");
  std::vector<float> q(2 * 4 * 8, 0.5f), k(2 * 2 * 8, 0.5f);
  auto write = [&](bool with_gap, bool bad_shape, bool partial_o, bool int_dtype) {
    st::Writer w;
    w.add_f32("layers.0.q", {2, 4, 8}, q.data());
    w.add_f32("layers.0.k", {2, 2, 8}, k.data());
    if (int_dtype) {
      std::vector<int32_t> iv(2 * 2 * 8);
      w.add("layers.0.v", st::Dtype::I32, {2, 2, 8}, iv.data(), iv.size() * 4);
    } else {
      w.add_f32("layers.0.v", {2, 2, 8}, k.data());
    }
    if (partial_o) w.add_f32("layers.0.o", {2, 4, 8}, q.data());
    w.add_f32("layers.1.q", {2, 4, 8}, q.data());
    w.add_f32("layers.1.k", {2, 2, 8}, k.data());
    if (bad_shape)
      w.add_f32("layers.1.v", {2, 1, 16}, k.data());
    else
      w.add_f32("layers.1.v", {2, 2, 8}, k.data());
    if (with_gap) w.add_f32("layers.3.q", {2, 4, 8}, q.data());
    w.write(p);
  };
  write(false, false, false, false);
  EXPECT_NO_THROW(ActivationDump::open(p));
  write(true, false, false, false);
  EXPECT_NE(error_of([&] { ActivationDump::open(p); }).find("layers.2.q is missing"),
            std::string::npos);
  write(false, true, false, false);
  EXPECT_NE(error_of([&] { ActivationDump::open(p); }).find("layers.1.v"), std::string::npos);
  write(false, false, true, false);
  EXPECT_NE(error_of([&] { ActivationDump::open(p); }).find("all or none"), std::string::npos);
  write(false, false, false, true);
  EXPECT_NE(error_of([&] { ActivationDump::open(p); }).find("dtype"), std::string::npos);
  // The attn-output target on a dump without o: a clear error naming the fix.
  write(false, false, false, false);
  const auto dump = ActivationDump::open(p);
  CalibConfig cfg;
  cfg.value_target = ValueTarget::kAttnOutput;
  Calibrator cal(cfg, 2, 4, 2, 8 * 4);  // shape does not matter: feed fails first
  EXPECT_NE(error_of([&] { feed_dump(dump, cal); }).find("key-weighted"), std::string::npos);
  fs::remove(p);
}
