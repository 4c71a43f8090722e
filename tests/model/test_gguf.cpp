// GGUF reader: metadata of every type, dequantization of every supported type
// against (a) a per-element restatement of the block layouts and (b) values
// gguf-py (llama.cpp's Python package) produced for tests/data/model/dequant.gguf,
// and malformed files.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <string>

#include <unistd.h>

#include "core/error.h"
#include "core/half.h"
#include "core/safetensors.h"
#include "model/gguf.h"
#include "test_gguf_writer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using oscar::model::gguf::File;
using oscar::model::gguf::GgmlType;

using oscar::test::expect_error;
using oscar::test::tmp_path;

namespace {

const std::string kData = std::string(OSCAR_TEST_DATA_DIR) + "/model/";



// ---- per-element reference of the block layouts ---------------------------
float h(const uint8_t* p) { return oscar::f16_to_f32(uint16_t(p[0] | (p[1] << 8))); }

// 12 scale bytes of Q4_K/Q5_K: bytes 0-3 hold scale[0..3] in bits 0-5 and the
// top two bits of scale[4..7] in bits 6-7; bytes 4-7 the same for the mins;
// bytes 8-11 the low 4 bits of scale[4..7] (low nibble) and min[4..7] (high).
void k4_scale(const uint8_t* s, int sub, int& sc, int& mn) {
  if (sub < 4) {
    sc = s[sub] & 0x3F;
    mn = s[sub + 4] & 0x3F;
  } else {
    sc = (s[sub + 4] & 0x0F) | ((s[sub - 4] >> 6) << 4);
    mn = (s[sub + 4] >> 4) | ((s[sub] >> 6) << 4);
  }
}

float ref_elem(GgmlType t, const uint8_t* b, int e) {
  switch (t) {
    case GgmlType::kQ4_0: return float(((e < 16 ? b[2 + e] : b[2 + e - 16] >> 4) & 0xF) - 8) * h(b);
    case GgmlType::kQ4_1: return float((e < 16 ? b[4 + e] : b[4 + e - 16] >> 4) & 0xF) * h(b) + h(b + 2);
    case GgmlType::kQ5_0: {
      const uint32_t qh = b[2] | (b[3] << 8) | (b[4] << 16) | (uint32_t(b[5]) << 24);
      const int lo = (e < 16 ? b[6 + e] : b[6 + e - 16] >> 4) & 0xF;
      return float((lo | int((qh >> e) & 1) << 4) - 16) * h(b);
    }
    case GgmlType::kQ5_1: {
      const uint32_t qh = b[4] | (b[5] << 8) | (b[6] << 16) | (uint32_t(b[7]) << 24);
      const int lo = (e < 16 ? b[8 + e] : b[8 + e - 16] >> 4) & 0xF;
      return float(lo | int((qh >> e) & 1) << 4) * h(b) + h(b + 2);
    }
    case GgmlType::kQ8_0: return float(int8_t(b[2 + e])) * h(b);
    case GgmlType::kQ4_K: case GgmlType::kQ5_K: {
      const bool five = t == GgmlType::kQ5_K;
      const uint8_t* qs = b + (five ? 48 : 16);
      const int sub = e / 32, l = e % 32, chunk = e / 64;
      int q = (sub % 2 == 0 ? qs[chunk * 32 + l] : qs[chunk * 32 + l] >> 4) & 0xF;
      if (five) q |= ((b[16 + l] >> sub) & 1) << 4;
      int sc, mn;
      k4_scale(b + 4, sub, sc, mn);
      return h(b) * float(sc) * float(q) - h(b + 2) * float(mn);
    }
    case GgmlType::kQ6_K: {
      const int half = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
      const uint8_t lq = b[half * 64 + l + (quarter & 1) * 32];
      const int nib = quarter < 2 ? (lq & 0xF) : (lq >> 4);
      const int hi = (b[128 + half * 32 + l] >> (2 * quarter)) & 3;
      const int sc = int8_t(b[192 + half * 8 + quarter * 2 + l / 16]);
      return h(b + 208) * float(sc * ((nib | (hi << 4)) - 32));
    }
    default: return NAN;
  }
}

struct TypeCase { GgmlType type; std::vector<int> half_offsets; };

}  // namespace

TEST(GgufDequant, EveryTypeMatchesPerElementReference) {
  const std::vector<TypeCase> cases = {
      {GgmlType::kQ4_0, {0}}, {GgmlType::kQ4_1, {0, 2}}, {GgmlType::kQ5_0, {0}}, {GgmlType::kQ5_1, {0, 2}},
      {GgmlType::kQ8_0, {0}}, {GgmlType::kQ4_K, {0, 2}}, {GgmlType::kQ5_K, {0, 2}}, {GgmlType::kQ6_K, {208}}};
  std::mt19937 rng(123);
  std::normal_distribution<float> nd(0.0f, 0.1f);
  for (const auto& c : cases) {
    const auto bl = oscar::model::gguf::block_layout(c.type);
    const int blocks = 7;
    std::vector<uint8_t> raw(size_t(bl.bytes * blocks));
    for (auto& x : raw) x = uint8_t(rng());
    for (int i = 0; i < blocks; ++i)
      for (int off : c.half_offsets) {
        const uint16_t hv = oscar::f32_to_f16(nd(rng));
        raw[size_t(i * bl.bytes + off)] = uint8_t(hv & 0xFF);
        raw[size_t(i * bl.bytes + off + 1)] = uint8_t(hv >> 8);
      }
    std::vector<float> out(size_t(bl.elems * blocks), NAN);
    oscar::model::gguf::dequantize(c.type, reinterpret_cast<const std::byte*>(raw.data()), out.data(),
                                   bl.elems * blocks);
    int nonzero = 0;
    for (int i = 0; i < blocks; ++i)
      for (int e = 0; e < bl.elems; ++e) {
        const float want = ref_elem(c.type, raw.data() + i * bl.bytes, e);
        const float got = out[size_t(i * bl.elems + e)];
        ASSERT_TRUE(std::isfinite(got)) << oscar::model::gguf::type_name(c.type) << " elem " << e;
        ASSERT_NEAR(got, want, 1e-6f * std::max(1.0f, std::fabs(want)))
            << oscar::model::gguf::type_name(c.type) << " block " << i << " elem " << e;
        nonzero += got != 0.0f;
      }
    EXPECT_GT(nonzero, bl.elems * blocks / 2) << oscar::model::gguf::type_name(c.type);
  }
}

TEST(GgufDequant, RejectsPartialBlocksAndUnknownTypes) {
  std::vector<uint8_t> raw(64);
  float out[64];
  expect_error([&] { oscar::model::gguf::dequantize(GgmlType::kQ8_0, reinterpret_cast<const std::byte*>(raw.data()), out, 33); },
               {"Q8_0"});
  expect_error([&] { oscar::model::gguf::dequantize(GgmlType::kQ2_K, reinterpret_cast<const std::byte*>(raw.data()), out, 256); },
               {"Q2_K"});
}

TEST(GgufFile, MatchesGgufPyOnEveryType) {
  const File f = File::open(kData + "dequant.gguf");
  const oscar::st::File expected = oscar::st::File::open(kData + "dequant_expected.safetensors");
  int checked = 0;
  for (const std::string& name : expected.names()) {
    const auto& info = f.at(name);
    EXPECT_EQ(info.shape, (std::vector<int64_t>{3, 512})) << name;
    const std::vector<float> got = f.read_f32(info);
    const std::vector<float> want = expected.read_f32(name);
    ASSERT_EQ(got.size(), want.size()) << name;
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << name << " " << i;
      ASSERT_NEAR(got[i], want[i], 1e-5f * std::max(1.0f, std::fabs(want[i]))) << name << " elem " << i;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 11);  // F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
}

TEST(GgufFile, MetadataOfEveryValueType) {
  const File f = File::open(kData + "dequant.gguf");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_int("test.u8"), 200);
  EXPECT_EQ(f.get_int("test.i8"), -100);
  EXPECT_EQ(f.get_int("test.u16"), 60000);
  EXPECT_EQ(f.get_int("test.i16"), -30000);
  EXPECT_EQ(f.get_int("test.u32"), 4000000000LL);
  EXPECT_EQ(f.get_int("test.i32"), -2000000000LL);
  EXPECT_EQ(f.get_int("test.u64"), int64_t{1} << 40);
  EXPECT_EQ(f.get_int("test.i64"), -(int64_t{1} << 40));
  EXPECT_DOUBLE_EQ(f.get_float("test.f32"), 1.5);
  EXPECT_DOUBLE_EQ(f.get_float("test.f64"), -2.25);
  EXPECT_TRUE(f.get_bool("test.bool", false));
  EXPECT_EQ(f.get_string("test.str"), "héllo ✓");
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  const auto* s = f.find_kv("test.arr_str");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->strs, (std::vector<std::string>{"a", "bc", "", "✓"}));
  const auto* i = f.find_kv("test.arr_int");
  ASSERT_NE(i, nullptr);
  EXPECT_EQ(i->ints, (std::vector<int64_t>{1, -2, 3}));
  const auto* fl = f.find_kv("test.arr_f32");
  ASSERT_NE(fl, nullptr);
  EXPECT_EQ(fl->floats, (std::vector<double>{0.5, -1.0}));
  expect_error([&] { f.get_int("test.str"); }, {"dequant.gguf", "test.str"});
  expect_error([&] { f.get_string("no.such.key"); }, {"dequant.gguf", "no.such.key"});
  EXPECT_EQ(f.get_int("no.such.key", 7), 7);
}

TEST(GgufFile, WrittenFileRoundTripsWithAlignment) {
  for (uint32_t align : {32u, 64u}) {
    oscar::test::GgufWriter w;
    w.alignment = align;
    w.kv_str("general.architecture", "llama");
    w.kv_u32("general.alignment", align);
    w.kv_strs("tok", {"x", "yy"});
    w.kv_i32s("ty", {1, 3});
    std::vector<float> a(5 * 32), b(3);
    for (size_t k = 0; k < a.size(); ++k) a[k] = float(k) * 0.25f - 3.0f;
    b = {1.0f, -2.0f, 3.5f};
    w.tensor_f32("a", {5, 32}, a);
    w.tensor_f32("b", {3}, b);
    const std::string p = tmp_path("roundtrip.gguf");
    w.write(p);
    const File f = File::open(p);
    EXPECT_EQ(f.alignment(), align);
    EXPECT_EQ(f.at("a").shape, (std::vector<int64_t>{5, 32}));
    EXPECT_EQ(f.read_f32("a"), a);
    EXPECT_EQ(f.read_f32("b"), b);
    EXPECT_EQ(f.at("b").offset % align, 0u);
    EXPECT_EQ(f.find_kv("ty")->ints, (std::vector<int64_t>{1, 3}));
  }
}

TEST(GgufFile, MalformedFilesGiveErrorsNamingTheFile) {
  oscar::test::GgufWriter w;
  w.kv_str("general.architecture", "llama");
  w.kv_strs("tok", {"abc", "def"});
  std::vector<float> a(64, 1.0f);
  w.tensor_f32("a", {2, 32}, a);
  const std::string good = w.bytes();
  const std::string p = tmp_path("bad.gguf");

  // Truncated anywhere: header, metadata, tensor infos, data.
  for (size_t cut : {size_t(0), size_t(3), size_t(10), size_t(30), size_t(60), good.size() - 100, good.size() - 1}) {
    oscar::test::write_bytes(p, good.substr(0, cut));
    expect_error([&] { File::open(p); }, {p});
  }
  oscar::test::write_bytes(p, good);
  EXPECT_NO_THROW(File::open(p));

  std::string bad = good;
  bad[0] = 'X';
  oscar::test::write_bytes(p, bad);
  expect_error([&] { File::open(p); }, {p, "magic"});

  oscar::test::GgufWriter v1 = w;
  v1.version = 1;
  oscar::test::write_bytes(p, v1.bytes());
  expect_error([&] { File::open(p); }, {p, "version"});

  oscar::test::GgufWriter unk;
  unk.tensor("weird", {4, 32}, 99, a.data(), a.size() * sizeof(float));
  oscar::test::write_bytes(p, unk.bytes());
  expect_error([&] { File::open(p); }, {p, "weird", "unknown tensor type"});

  // A known type we do not dequantize: opens, but reading it names the type.
  oscar::test::GgufWriter q2;
  std::vector<uint8_t> blk(84, 0);
  q2.tensor("q2", {1, 256}, uint32_t(GgmlType::kQ2_K), blk.data(), blk.size());
  oscar::test::write_bytes(p, q2.bytes());
  const File fq = File::open(p);
  expect_error([&] { fq.read_f32("q2"); }, {p, "q2", "Q2_K"});

  // Absurd array length / string length must not allocate or crash.
  std::string huge = good;
  const size_t pos = huge.find("tok") + 3 + 4;  // key, then u32 array type
  uint64_t n = uint64_t(1) << 60;
  std::memcpy(&huge[pos + 4], &n, 8);
  oscar::test::write_bytes(p, huge);
  expect_error([&] { File::open(p); }, {p});

  expect_error([&] { File::open(tmp_path("does_not_exist.gguf")); }, {"does_not_exist.gguf"});
  const File f = File::open(kData + "dequant.gguf");
  expect_error([&] { f.at("nope"); }, {"dequant.gguf", "nope"});
}
