// The OSCAR cache (kv/oscar_cache.h): region bookkeeping, page-granular
// demotion (window in [W, W + page)), stored rows equal to the reference
// quantizer on the rotated BF16 rows, fork/release page accounting, bits per
// element, and the method registry (kv/quant_methods.h).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "core/half.h"
#include "core/quantizer.h"
#include "kv/oscar_cache.h"
#include "kv/quant_methods.h"

namespace oscar::kv {
namespace {

constexpr int kL = 2, kH = 2, kD = 64, kPage = 16, kSink = 16, kRecent = 32;

ModelFingerprint fp() {
  ModelFingerprint f;
  f.architecture = "llama";
  f.n_layers = kL;
  f.n_q_heads = 4;
  f.n_kv_heads = kH;
  f.head_dim = kD;
  f.weights_hash = "test";
  return f;
}

std::unique_ptr<OscarKvCache> make(Composition comp, float kc = 0.96f, float vc = 0.92f) {
  auto c = std::make_shared<Calibration>(data_free_calibration(comp, fp(), kc, vc, 2, 64));
  OscarCacheOptions o;
  o.sink = kSink;
  o.recent = kRecent;
  o.group_size = 64;
  o.max_tokens = 1024;
  return std::make_unique<OscarKvCache>(KvCacheShape{kL, kH, kD, kPage}, c, o);
}

// Appends n tokens of random rows to seq (all layers), like the forward does.
std::vector<float> append(OscarKvCache& c, SeqId s, int n, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> k(size_t(n) * kH * kD), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  c.reserve(s, n);
  for (int l = 0; l < kL; ++l) {
    std::vector<float> kr = k;
    c.rotate_keys(l, kr.data(), n);
    c.write(l, s, c.length(s), kr.data(), v.data(), n);
  }
  c.commit(s, n);
  return k;
}

TEST(OscarCache, WindowStaysInRangeAndRegionsAddUp) {
  auto c = make(Composition::kHadamard);
  std::mt19937 rng(1);
  const SeqId s = c->create();
  for (int step = 0; step < 300; ++step) {
    append(*c, s, step % 7 == 0 ? 5 : 1, rng);  // decode steps and small chunks
    const auto r = c->regions(s);
    const int T = c->length(s);
    ASSERT_EQ(r.sink + r.mid + r.recent, T);
    ASSERT_EQ(r.sink, std::min(T, kSink));
    ASSERT_EQ(r.mid % kPage, 0);
    if (r.mid > 0) {
      ASSERT_GE(r.recent, kRecent) << "T " << T;
      ASSERT_LT(r.recent, kRecent + kPage) << "T " << T;
    } else {
      ASSERT_LT(T - r.sink, kRecent + kPage);
    }
    // True bpe from the regions, as DESIGN §5.4 with page-granular middle.
    const double want = ((r.sink + r.recent) * 16.0 + r.mid * (2.0 + 32.0 / 64)) / T;
    ASSERT_NEAR(c->bits_per_element(s), want, 1e-12);
  }
  EXPECT_GT(c->regions(s).mid, 0);
}

TEST(OscarCache, MiddleRowsAreTheReferenceQuantizerOnRotatedBf16Rows) {
  auto c = make(Composition::kHadamard);
  std::mt19937 rng(2);
  const SeqId s = c->create();
  std::vector<float> keys;
  for (int t = 0; t < 120; ++t) {
    auto k = append(*c, s, 1, rng);
    keys.insert(keys.end(), k.begin(), k.end());
  }
  const auto r = c->regions(s);
  ASSERT_GT(r.mid, 0);
  KvBatch b;
  const std::vector<SeqId> seqs{s};
  const std::vector<int> lens{c->length(s)};
  c->make_batch(seqs, lens, b);
  const PagedKvView view = b.layer(1);
  ASSERT_EQ(view.mid.len[0], r.mid);
  // Token p = sink + i of the middle, head h: the stored codes/params equal
  // clip + quantize of the rotated, BF16-rounded key.
  const QuantSpec spec{2, 64, ScaleDtype::kF16};
  std::vector<float> row(kD), deq(kD), ref(kD);
  std::vector<uint8_t> codes(kD / 4);
  std::vector<uint16_t> params(2);
  int checked = 0;
  for (int i = 0; i < r.mid; i += 7)
    for (int h = 0; h < kH; ++h) {
      const int p = kSink + i;
      std::vector<float> tok(keys.begin() + size_t(p) * kH * kD, keys.begin() + size_t(p + 1) * kH * kD);
      c->rotate_keys(1, tok.data(), 1);  // one token, all its heads
      for (int ch = 0; ch < kD; ++ch) row[ch] = bf16_to_f32(f32_to_bf16(tok[size_t(h) * kD + ch]));
      clip_row(row.data(), kD, 0.96f);
      quantize_row(row.data(), kD, spec, codes.data(), params.data());
      dequantize_row(codes.data(), params.data(), kD, spec, ref.data());
      const int32_t page = view.mid.indices[view.mid.indptr[0] + i / kPage];
      const int64_t qi = view.quant_row_index(page, h, i % kPage);
      dequantize_row(view.quant.k_codes + qi * view.row_code_bytes(),
                     view.quant.k_params + qi * view.row_groups() * 2, kD, spec, deq.data());
      for (int ch = 0; ch < kD; ++ch) ASSERT_EQ(deq[ch], ref[ch]) << "token " << p << " head " << h;
      ++checked;
    }
  EXPECT_GT(checked, 4);
}

TEST(OscarCache, QueriesAndKeysKeepTheirDotProducts) {
  auto c = make(Composition::kHadamard);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> q(4 * kD), k(kH * kD);
  for (auto& x : q) x = nd(rng);
  for (auto& x : k) x = nd(rng);
  auto qr = q, kr = k;
  c->rotate_queries(0, qr.data(), 1, 4);
  c->rotate_keys(0, kr.data(), 1);
  for (int g = 0; g < 4; ++g) {
    const int h = g / 2;
    double a = 0, b = 0, moved = 0;
    for (int i = 0; i < kD; ++i) {
      a += double(q[g * kD + i]) * k[h * kD + i];
      b += double(qr[g * kD + i]) * kr[h * kD + i];
      moved += std::fabs(qr[g * kD + i] - q[g * kD + i]);
    }
    EXPECT_NEAR(a, b, 1e-4 * (1 + std::fabs(a)));
    EXPECT_GT(moved, 1e-3);  // really rotated
  }
}

TEST(OscarCache, ForkSharesPagesAndReleaseFreesThem) {
  auto c = make(Composition::kNone, 1.0f, 1.0f);
  std::mt19937 rng(4);
  const SeqId a = c->create();
  append(*c, a, 100, rng);  // not a multiple of the page: a partial page gets copied
  const int64_t used = c->bytes_in_use();
  const SeqId b = c->fork(a);
  EXPECT_EQ(c->length(b), 100);
  EXPECT_EQ(c->regions(b).mid, c->regions(a).mid);
  const int64_t after_fork = c->bytes_in_use();
  EXPECT_GT(after_fork, used);  // the copied partial page
  append(*c, b, 40, rng);       // demotes in b only
  EXPECT_GT(c->regions(b).mid, c->regions(a).mid);
  c->release(b);
  EXPECT_EQ(c->bytes_in_use(), used);
  c->release(a);
  EXPECT_EQ(c->bytes_in_use(), 0);
  EXPECT_THROW(c->length(a), Error);
}

TEST(OscarCache, ExhaustedPoolIsAnErrorAndLeavesTheCacheUnchanged) {
  auto cal = std::make_shared<Calibration>(data_free_calibration(Composition::kNone, fp(), 1, 1, 2, 64));
  OscarCacheOptions o;
  o.sink = kSink;
  o.recent = kRecent;
  o.group_size = 64;
  o.bf16_pages = 4;
  o.quant_pages = 1;
  OscarKvCache c({kL, kH, kD, kPage}, cal, o);
  const SeqId s = c.create();
  EXPECT_THROW(c.reserve(s, 200), Error);
  EXPECT_EQ(c.bytes_in_use(), 0);
}

TEST(QuantMethods, RegistryAndBits) {
  KvMethodOptions o;
  o.model = fp();
  o.group_size = 128;
  for (const char* n : {"bf16", "int2-naive", "int2-hadamard", "int4-hadamard", "kivi2"})
    EXPECT_NO_THROW(resolve_kv_method(n, o)) << n;
  EXPECT_THROW(resolve_kv_method("int3-magic", o), Error);
  EXPECT_THROW(resolve_kv_method("oscar", o), Error);  // no calibration file
  EXPECT_THROW(resolve_kv_method("oscar=/nonexistent/calib.safetensors", o), Error);
  const KvMethod h = resolve_kv_method("int2-hadamard", o);
  EXPECT_TRUE(h.folds_values());
  EXPECT_FALSE(resolve_kv_method("int2-naive", o).folds_values());
  // 64 + 256 in BF16, the rest at 2 + 32/64 bits (G capped at d = 64).
  const int64_t T = 64 + 256 + 64 * 10;
  EXPECT_NEAR(h.bits_per_element(T, 64, 64), ((64 + 256) * 16.0 + 640 * 2.5) / T, 1e-12);
  EXPECT_EQ(resolve_kv_method("bf16", o).bits_per_element(T, 64, 64), 16.0);
  EXPECT_THROW(make_method_cache(resolve_kv_method("kivi2", o), {kL, kH, kD, kPage}, 256), Error);
}

TEST(QuantMethods, Modifiers) {
  KvMethodOptions o;
  o.model = fp();
  const KvMethod a = resolve_kv_method("int2-hadamard+clip0.9/0.8+g32", o);
  EXPECT_EQ(a.label, "int2-hadamard+clip0.9/0.8+g32");
  EXPECT_EQ(a.group_size, 32);
  for (const LayerCalibration& L : a.calib->layers) {
    EXPECT_FLOAT_EQ(L.k_clip_of(0), 0.9f);
    EXPECT_FLOAT_EQ(L.v_clip_of(1), 0.8f);
  }
  // 2 + 2*16/32 = 3 bits in the middle.
  EXPECT_NEAR(a.bits_per_element(320 + 640, 64, 64), (320 * 16.0 + 640 * 3.0) / 960, 1e-12);
  EXPECT_THROW(resolve_kv_method("int2-hadamard+clip1.5", o), Error);
  EXPECT_THROW(resolve_kv_method("int2-hadamard+g128", o), Error);  // > head_dim 64
  EXPECT_THROW(resolve_kv_method("int2-hadamard+zz", o), Error);
  EXPECT_THROW(resolve_kv_method("bf16+g32", o), Error);
}

}  // namespace
}  // namespace oscar::kv
