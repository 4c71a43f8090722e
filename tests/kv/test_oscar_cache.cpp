// The OSCAR cache (kv/oscar_cache.h): region bookkeeping, page-granular
// demotion (window in [W, W + page)), stored rows equal to the reference
// quantizer on the rotated BF16 rows, fork/release page accounting, bits per
// element, and the method registry (kv/quant_methods.h); kivi2 (per-channel
// keys): demotion equals quantizing each key channel's 32-token span
// directly, clear errors for bad pages / clipped keys, bytes and bits counted.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/error.h"
#include "core/half.h"
#include "core/key_transform.h"
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

std::unique_ptr<OscarKvCache> make(Composition comp, float kc = 0.96f, float vc = 0.92f,
                                   bool prompt_bf16 = false) {
  auto c = std::make_shared<Calibration>(data_free_calibration(comp, fp(), kc, vc, 2, 64));
  OscarCacheOptions o;
  o.sink = kSink;
  o.recent = kRecent;
  o.group_size = 64;
  o.max_tokens = 1024;
  o.prompt_bf16 = prompt_bf16;
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

// Page centering's angles (kernels/paged_kv.h MidCenter): one table for every sequence of a
// batch (start row 0), row i the (cos, sin) of middle page i's centre position; a batch that
// needs no more rows gets the same table and version (a device copy stays valid), a longer
// middle a new, longer table with a new version, while an older batch keeps its own.
TEST(OscarCache, PageCentreAnglesAreOneTableThatOnlyGrows) {
  auto cal = std::make_shared<Calibration>(data_free_calibration(Composition::kHadamard, fp(), 0.96f, 0.92f, 2, 64));
  cal->rope_freq.resize(kD / 2);
  for (int j = 0; j < kD / 2; ++j) cal->rope_freq[size_t(j)] = float(std::pow(10000.0, -2.0 * j / kD));
  cal->layers[0].k_rope_mean.assign(size_t(kH) * kD, 0.0f);
  for (int j : {0, 1, 5}) {  // head 0 only, three pairs (channels j and j + d/2)
    cal->layers[0].k_rope_mean[size_t(j)] = 3.0f + float(j);
    cal->layers[0].k_rope_mean[size_t(j + kD / 2)] = -2.0f;
  }
  OscarCacheOptions o;
  o.sink = kSink;
  o.recent = kRecent;
  o.group_size = 64;
  o.max_tokens = 2048;
  OscarKvCache c(KvCacheShape{kL, kH, kD, kPage}, cal, o);
  std::mt19937 rng(3);
  const SeqId a = c.create(), b = c.create();
  for (int i = 0; i < 10; ++i) append(c, a, 40, rng);  // 400 tokens: 22 middle pages
  append(c, b, 100, rng);
  const std::vector<int> pairs = page_center_pairs(*cal);
  ASSERT_EQ(pairs, (std::vector<int>{0, 1, 5}));
  const int S = int(pairs.size());
  auto check_rows = [&](const KvBatch& kb, int most) {
    ASSERT_TRUE(kb.mid_angles);
    EXPECT_GT(kb.mid_angles_version, 0u);
    EXPECT_EQ(kb.mid_angle_start, std::vector<int32_t>(size_t(kb.batch()), 0));
    const int rows = int(kb.mid_angles->size() / (2 * size_t(S)));
    EXPECT_GE(rows, most);
    std::vector<float> freq, cs(2 * size_t(S));
    for (int j : pairs) freq.push_back(cal->rope_freq[size_t(j)]);
    for (int i = 0; i < rows; ++i) {
      center_angles(freq.data(), S, mid_page_center(kSink, i, kPage), cs.data());
      for (int k = 0; k < 2 * S; ++k) ASSERT_EQ((*kb.mid_angles)[size_t(i) * 2 * S + k], cs[size_t(k)]) << "row " << i;
    }
    const PagedKvView v0 = kb.layer(0), v1 = kb.layer(1);
    EXPECT_EQ(v0.center.pairs, S);
    EXPECT_EQ(v0.center.angles, kb.mid_angles->data());
    EXPECT_EQ(v0.center.angle_start, kb.mid_angle_start.data());
    EXPECT_EQ(v1.center.pairs, 0);  // layer 1 has no ν
  };
  const std::vector<SeqId> seqs = {a, b};
  std::vector<int> lens = {c.length(a), c.length(b)};
  KvBatch b1, b2, b3;
  c.make_batch(seqs, lens, b1);
  const int most = b1.mid_indptr[1] - b1.mid_indptr[0];
  ASSERT_GT(most, b1.mid_indptr[2] - b1.mid_indptr[1]);
  check_rows(b1, most);
  c.make_batch(seqs, lens, b2);
  EXPECT_EQ(b2.mid_angles_version, b1.mid_angles_version);
  EXPECT_EQ(b2.mid_angles.get(), b1.mid_angles.get());
  const std::vector<float> old = *b1.mid_angles;
  const int rows1 = int(old.size() / (2 * size_t(S)));
  while (c.regions(a).mid / kPage <= rows1) append(c, a, 64, rng);
  lens[0] = c.length(a);
  c.make_batch(seqs, lens, b3);
  EXPECT_GT(b3.mid_angles_version, b1.mid_angles_version);
  check_rows(b3, c.regions(a).mid / kPage);
  EXPECT_EQ(*b1.mid_angles, old);  // the older batch's table is intact
  for (size_t i = 0; i < old.size(); ++i) ASSERT_EQ((*b3.mid_angles)[i], old[i]);
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

// The middle of sequence s, layer l, as bytes: codes and params of its pages in order.
std::vector<uint8_t> middle_bytes(const OscarKvCache& c, SeqId s, int l) {
  KvBatch b;
  const std::vector<SeqId> seqs{s};
  const std::vector<int> lens{c.length(s)};
  c.make_batch(seqs, lens, b);
  const PagedKvView v = b.layer(l);
  std::vector<uint8_t> out;
  for (int i = v.mid.indptr[0]; i < v.mid.indptr[1]; ++i) {
    const int64_t r0 = v.quant_row_index(v.mid.indices[i], 0, 0), rows = int64_t(kH) * kPage;
    const uint8_t* kc = v.quant.k_codes + r0 * v.row_code_bytes();
    const uint8_t* vc = v.quant.v_codes + r0 * v.row_code_bytes();
    const auto* kp = reinterpret_cast<const uint8_t*>(v.quant.k_params + r0 * v.row_groups() * 2);
    const auto* vp = reinterpret_cast<const uint8_t*>(v.quant.v_params + r0 * v.row_groups() * 2);
    out.insert(out.end(), kc, kc + rows * v.row_code_bytes());
    out.insert(out.end(), vc, vc + rows * v.row_code_bytes());
    out.insert(out.end(), kp, kp + rows * v.row_groups() * 4);
    out.insert(out.end(), vp, vp + rows * v.row_groups() * 4);
  }
  return out;
}

TEST(OscarCache, Bf16PromptDefersDemotionToTheFirstDecodeStep) {
  auto classic = make(Composition::kHadamard);
  auto deferred_cache = make(Composition::kHadamard, 0.96f, 0.92f, /*prompt_bf16=*/true);
  OscarKvCache& deferred = *deferred_cache;
  const SeqId a = classic->create(), b = deferred.create();
  std::mt19937 r1(7), r2(7);
  // A prompt of three chunks: the deferred cache keeps every row in BF16.
  for (int chunk = 0; chunk < 3; ++chunk) {
    append(*classic, a, 40, r1);
    append(deferred, b, 40, r2);
    const auto r = deferred.regions(b);
    EXPECT_EQ(r.mid, 0) << "chunk " << chunk;
    EXPECT_EQ(r.recent, deferred.length(b) - kSink);
    // The backlog counts as free (reserve reclaims it), its quantized pages as promised.
    EXPECT_EQ(deferred.pages_free().bf16, classic->pages_free().bf16) << "chunk " << chunk;
    EXPECT_EQ(deferred.pages_free().quant, classic->pages_free().quant) << "chunk " << chunk;
  }
  ASSERT_GT(classic->regions(a).mid, 0);
  // The first decode step demotes the backlog before it reads: from then on both caches hold
  // the same regions and bit-identical middle pages.
  for (int step = 0; step < 20; ++step) {
    append(*classic, a, 1, r1);
    append(deferred, b, 1, r2);
    const auto ra = classic->regions(a), rb = deferred.regions(b);
    ASSERT_EQ(ra.mid, rb.mid) << "step " << step;
    ASSERT_EQ(ra.recent, rb.recent) << "step " << step;
  }
  for (int l = 0; l < kL; ++l) {
    const auto ma = middle_bytes(*classic, a, l), mb = middle_bytes(deferred, b, l);
    ASSERT_FALSE(ma.empty());
    EXPECT_EQ(ma, mb) << "layer " << l;
  }
  EXPECT_EQ(deferred.pages_free().bf16, classic->pages_free().bf16);
  EXPECT_EQ(deferred.pages_free().quant, classic->pages_free().quant);
  // A multi-token step after the prompt (no longer a prompt) demotes at once.
  append(*classic, a, 40, r1);
  append(deferred, b, 40, r2);
  EXPECT_EQ(deferred.regions(b).mid, classic->regions(a).mid);
}

TEST(OscarCache, Bf16PromptBacklogYieldsWhenBf16PagesRunShort) {
  auto cal = std::make_shared<Calibration>(data_free_calibration(Composition::kNone, fp(), 1, 1, 2, 64));
  OscarCacheOptions o;
  o.sink = kSink;
  o.recent = kRecent;
  o.group_size = 64;
  o.bf16_pages = 12;  // a sink page, the window (3 + 1 pages) and a 40-token chunk, twice over
  o.quant_pages = 64;
  o.prompt_bf16 = true;
  OscarKvCache c({kL, kH, kD, kPage}, cal, o);
  std::mt19937 rng(9);
  const SeqId a = c.create();
  // 10 chunks of 40 tokens: far more than 12 BF16 pages; the backlog is demoted as needed.
  for (int chunk = 0; chunk < 10; ++chunk) {
    ASSERT_NO_THROW(append(c, a, 40, rng)) << "chunk " << chunk;
    ASSERT_LE(c.usage().used.bf16, 12);
  }
  EXPECT_GT(c.regions(a).mid, 0);
  const int mid_a = c.regions(a).mid;
  // A second sequence's prompt takes the first one's backlog when it needs the pages.
  const SeqId b = c.create();
  for (int chunk = 0; chunk < 4; ++chunk) ASSERT_NO_THROW(append(c, b, 40, rng)) << "chunk " << chunk;
  EXPECT_GE(c.regions(a).mid, mid_a);
  // Both decode on; the regions end where the classic rule puts them.
  append(c, a, 1, rng);
  append(c, b, 1, rng);
  for (SeqId s : {a, b}) {
    const auto r = c.regions(s);
    EXPECT_GE(r.recent, kRecent);
    EXPECT_LT(r.recent, kRecent + kPage);
  }
  // Nothing left to reclaim: the pool is what it is.
  EXPECT_EQ(c.pages_free().bf16, 12 - c.usage().used.bf16);
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
  // kivi2: its middle is 3 bits per element (K: 2 + 32/32 per channel per 32
  // tokens, V: 2 + 32/32 per 32 channels), page-granular, no sink, W = 128.
  const KvMethod kivi = resolve_kv_method("kivi2", o);
  EXPECT_EQ(kivi.sink, 0);
  EXPECT_EQ(kivi.recent, 128);
  EXPECT_EQ(kivi.group_size, 32);
  EXPECT_FALSE(kivi.folds_values());
  EXPECT_NEAR(kivi.bits_per_element(2048, 64, 64), (1920 * 3.0 + 128 * 16.0) / 2048, 1e-12);
  EXPECT_NEAR(kivi.bits_per_element(2047, 64, 64), (1856 * 3.0 + 191 * 16.0) / 2047, 1e-12);
  EXPECT_EQ(kivi.bits_per_element(100, 64, 64), 16.0);
  // A real cache now; pages must be multiples of the 32-token key span.
  EXPECT_THROW(make_method_cache(kivi, {kL, kH, kD, kPage}, 256), Error);
  EXPECT_THROW(make_method_cache(kivi, {kL, kH, kD, 48}, 256), Error);
  auto c = make_method_cache(kivi, {kL, kH, kD, 64}, 512);
  EXPECT_EQ(c->method(), "kivi2");
}

// kivi2 through the OSCAR cache with per-channel keys.
std::unique_ptr<OscarKvCache> make_kivi(int page, int recent = 64) {
  auto c = std::make_shared<Calibration>(data_free_calibration(Composition::kNone, fp(), 1.0f, 1.0f, 2, 32));
  OscarCacheOptions o;
  o.label = "kivi2";
  o.sink = 0;
  o.recent = recent;
  o.group_size = 32;
  o.key_axis = KeyAxis::kChannel;
  o.max_tokens = 1024;
  return std::make_unique<OscarKvCache>(KvCacheShape{kL, kH, kD, page}, c, o);
}

TEST(KiviCache, DemotionQuantizesEachKeyChannelOverItsSpan) {
  // Decode token by token (and small chunks) so demotion runs at commit; the
  // stored keys of every middle page must be the reference quantizer on each
  // channel's 32 BF16-rounded values (bit for bit, codes and fp16 params),
  // the values the per-token rows of group 32.
  for (int page : {32, 64}) {
    auto c = make_kivi(page);
    std::mt19937 rng(7);
    const SeqId s = c->create();
    std::vector<float> keys, vals;
    while (c->length(s) < 300) {
      std::normal_distribution<float> nd;
      const int n = c->length(s) % 5 == 0 ? 3 : 1;
      std::vector<float> k(size_t(n) * kH * kD), v(k.size());
      for (auto& x : k) x = nd(rng) * 2.0f;
      for (auto& x : v) x = nd(rng);
      c->reserve(s, n);
      for (int l = 0; l < kL; ++l) c->write(l, s, c->length(s), k.data(), v.data(), n);
      c->commit(s, n);
      keys.insert(keys.end(), k.begin(), k.end());
      vals.insert(vals.end(), v.begin(), v.end());
      const auto r = c->regions(s);
      ASSERT_EQ(r.sink, 0);
      ASSERT_EQ(r.mid % page, 0);
      if (r.mid > 0) {
        ASSERT_TRUE(r.recent >= 64 && r.recent < 64 + page) << r.recent;
      }
      const double want = (r.recent * 16.0 + r.mid * 3.0) / c->length(s);
      ASSERT_NEAR(c->bits_per_element(s), want, 1e-12);
    }
    const auto r = c->regions(s);
    ASSERT_GE(r.mid, 192);
    KvBatch b;
    const std::vector<SeqId> seqs{s};
    const std::vector<int> lens{c->length(s)};
    c->make_batch(seqs, lens, b);
    const QuantSpec cs{2, 32, ScaleDtype::kF16}, vs{2, 32, ScaleDtype::kF16};
    std::vector<float> col(32), vrow(kD), vref(kD), vdeq(kD);
    std::vector<uint8_t> cc(8), vcodes(kD / 4);
    uint16_t par[2];
    std::vector<uint16_t> vpar(2 * kD / 32);
    int checked = 0;
    for (int l = 0; l < kL; ++l) {
      const PagedKvView view = b.layer(l);
      ASSERT_EQ(view.key_axis, KeyAxis::kChannel);
      ASSERT_EQ(view.mid.len[0], r.mid);
      for (int i0 = 0; i0 < r.mid; i0 += 32)
        for (int h = 0; h < kH; ++h) {
          const int32_t page_id = view.mid.indices[view.mid.indptr[0] + i0 / page];
          const uint16_t* sp = view.quant.k_params + view.key_span_params_offset(page_id, h, i0 % page);
          for (int ch = 0; ch < kD; ++ch) {
            for (int i = 0; i < 32; ++i)
              col[i] = bf16_to_f32(f32_to_bf16(keys[(size_t(i0 + i) * kH + h) * kD + ch]));
            quantize_row(col.data(), 32, cs, cc.data(), par);
            ASSERT_EQ(sp[2 * ch], par[0]) << "page " << page << " layer " << l << " span " << i0 << " ch " << ch;
            ASSERT_EQ(sp[2 * ch + 1], par[1]);
            for (int i = 0; i < 32; ++i) {
              const uint8_t* rc =
                  view.quant.k_codes + view.quant_row_index(page_id, h, (i0 + i) % page) * view.row_code_bytes();
              ASSERT_EQ(get_code(rc, ch, 32, 2), get_code(cc.data(), i, 32, 2));
            }
            ++checked;
          }
          // Values of the span's first token: per-token rows, group 32.
          for (int ch = 0; ch < kD; ++ch) vrow[ch] = bf16_to_f32(f32_to_bf16(vals[(size_t(i0) * kH + h) * kD + ch]));
          fake_quantize_rows(vrow.data(), 1, kD, vs, vref.data());
          const int64_t qi = view.quant_row_index(page_id, h, i0 % page);
          dequantize_row(view.quant.v_codes + qi * view.row_code_bytes(),
                         view.quant.v_params + qi * view.row_groups() * 2, kD, vs, vdeq.data());
          for (int ch = 0; ch < kD; ++ch) ASSERT_EQ(vdeq[ch], vref[ch]);
        }
    }
    EXPECT_GT(checked, 1000);
    // Fork shares the middle; release frees everything.
    const SeqId f = c->fork(s);
    EXPECT_EQ(c->regions(f).mid, r.mid);
    c->release(f);
    c->release(s);
    EXPECT_EQ(c->bytes_in_use(), 0);
  }
}

TEST(KiviCache, BadOptionsAreClearErrors) {
  // Page not a multiple of the 32-token key span.
  try {
    make_kivi(16);
    ADD_FAILURE() << "page 16 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 32"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_kivi(48), Error);
  EXPECT_NO_THROW(make_kivi(96));
  // Per-channel keys are not clipped.
  auto clipped = std::make_shared<Calibration>(data_free_calibration(Composition::kNone, fp(), 0.96f, 1.0f, 2, 32));
  OscarCacheOptions o;
  o.sink = 0;
  o.recent = 64;
  o.group_size = 32;
  o.key_axis = KeyAxis::kChannel;
  EXPECT_THROW(OscarKvCache({kL, kH, kD, 64}, clipped, o), Error);
  o.key_axis = static_cast<KeyAxis>(3);
  auto plain = std::make_shared<Calibration>(data_free_calibration(Composition::kNone, fp(), 1.0f, 1.0f, 2, 32));
  EXPECT_THROW(OscarKvCache({kL, kH, kD, 64}, plain, o), Error);
}

TEST(KiviCache, BytesInUseCountPerChannelKeyParams) {
  auto c = make_kivi(64);
  std::mt19937 rng(9);
  const SeqId s = c->create();
  append(*c, s, 64 + 64 + 10, rng);  // one page demoted (recent 64 .. 127)
  ASSERT_EQ(c->regions(s).mid, 64);
  // BF16: 2 pages (recent 74 tokens) x K,V; quantized: 1 page = codes K,V
  // (64 x 16 bytes each) + V params (64 x 2 groups x 4 bytes) + K params
  // (2 spans x 64 channels x 4 bytes), per head and layer.
  const int64_t bf = int64_t(2) * kH * 64 * kD * 2 * 2;
  const int64_t q = int64_t(kH) * (2 * 64 * 16 + 64 * 2 * 4 + 2 * 64 * 4);
  EXPECT_EQ(c->bytes_in_use(), (bf + q) * kL);
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

// +bf16L: layers kept in BF16, for the evaluation's simulation only (kL = 2 layers here).
TEST(QuantMethods, Bf16LayersModifier) {
  KvMethodOptions o;
  o.model = fp();
  const KvMethod a = resolve_kv_method("int2-hadamard+bf16L1", o);
  EXPECT_EQ(a.label, "int2-hadamard+bf16L1");
  EXPECT_EQ(a.bf16_layers, (std::vector<int>{1}));
  EXPECT_FALSE(a.bf16_layer(0));
  EXPECT_TRUE(a.bf16_layer(1));
  const KvMethod plain = resolve_kv_method("int2-hadamard", o);
  const int64_t T = 320 + 640;
  // One of two layers at 16 bits: the mean of the plain method's rate and 16.
  EXPECT_NEAR(a.bits_per_element(T, 64, 64), (plain.bits_per_element(T, 64, 64) + 16.0) / 2, 1e-12);
  EXPECT_EQ(resolve_kv_method("int2-hadamard+bf16L0-1", o).bf16_layers, (std::vector<int>{0, 1}));
  EXPECT_EQ(resolve_kv_method("int2-hadamard+bf16L1.0.1", o).bf16_layers, (std::vector<int>{0, 1}));
  EXPECT_NEAR(resolve_kv_method("int2-hadamard+bf16L0-1", o).bits_per_element(T, 64, 64), 16.0, 1e-12);
  for (const char* bad : {"int2-hadamard+bf16L2", "int2-hadamard+bf16L", "int2-hadamard+bf16L1-0",
                          "int2-hadamard+bf16Lx", "int2-hadamard+bf16L0-", "int2-hadamard+bf16L-1", "bf16+bf16L0"})
    EXPECT_THROW(resolve_kv_method(bad, o), Error) << bad;
  // The caches do not have it: a clear error, not a silently quantized layer.
  try {
    make_method_cache(a, KvCacheShape{kL, kH, kD, kPage}, 1024);
    FAIL() << "a cache for +bf16L must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("simulation"), std::string::npos) << e.what();
  }
}

// The methods of the sizing tests: this file's windows, groups of 64.
KvMethodOptions sizing_options() {
  KvMethodOptions mo;
  mo.model = fp();
  mo.sink = kSink;
  mo.recent = kRecent;
  mo.group_size = 64;
  return mo;
}

// sequences_for_bytes (the equal-memory count of `oscar bench`): B sequences of T tokens fill a
// cache sized by make_method_cache_for_bytes for B, prefill chunks of 64 then decode steps, and
// (where the middle is long enough for the count to be tight) B + 2 do not fit in the same
// bytes; the 2-bit cache holds more sequences than BF16 in the same bytes.
TEST(QuantMethods, SequencesForBytesFillTheCache) {
  const KvCacheShape shape{kL, kH, kD, kPage};
  const KvMethodOptions mo = sizing_options();
  const int chunk = 64;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> k(size_t(chunk) * kH * kD), v(k.size());
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  // Fills `seqs` sequences to `tokens` committed tokens; false when the cache runs out of pages.
  auto fill = [&](KvCache& c, int seqs, int tokens) {
    try {
      std::vector<SeqId> ids;
      for (int i = 0; i < seqs; ++i) ids.push_back(c.create());
      backend::RowPlacement rows;
      for (SeqId s : ids)
        while (c.length(s) < tokens) {
          // Prompt chunks up to the last 4 tokens, which come as decode steps.
          const int left = tokens - c.length(s);
          const int n = left > 4 ? std::min(chunk, left - 4) : 1;
          c.reserve(s, n);
          rows.clear();
          c.place(s, c.length(s), n, rows);
          for (int l = 0; l < kL; ++l) c.write_rows(l, rows, k.data(), v.data());
          c.commit(s, n);
        }
      return true;
    } catch (const Error&) {
      return false;
    }
  };
  for (const char* name : {"bf16", "int2-hadamard"}) {
    const KvMethod m = resolve_kv_method(name, mo);
    for (int tokens : {40, 200, 777}) {
      const int64_t bytes = 6 * int64_t(tokens) * bf16_page_bytes(shape) / kPage;  // ~6 BF16 sequences
      const int B = sequences_for_bytes(m, shape, bytes, tokens, chunk);
      SCOPED_TRACE(std::string(name) + ", " + std::to_string(tokens) + " tokens: " + std::to_string(B) + " sequences");
      // (Below sink + recent the 2-bit cache's windows cost more than the BF16 pages of the same
      // tokens: fewer sequences than BF16 there.)
      ASSERT_GE(B, tokens > 100 ? 4 : 1);
      if (m.kind == KvMethod::Kind::kBf16) {
        EXPECT_LE(B, 6);
      } else if (tokens > 100) {
        const int bf16_b = sequences_for_bytes(resolve_kv_method("bf16", mo), shape, bytes, tokens, chunk);
        EXPECT_GE(B, 2 * bf16_b) << "the 2-bit cache holds at least twice the sequences";
      }
      auto c = make_method_cache_for_bytes(m, shape, bytes, B, chunk);
      EXPECT_TRUE(fill(*c, B, tokens));
      // bytes_for_sequences: the least bytes (to 1 MiB) that hold B.
      const int64_t need = bytes_for_sequences(m, shape, B, tokens, chunk);
      EXPECT_GE(sequences_for_bytes(m, shape, need, tokens, chunk), B);
      EXPECT_LT(sequences_for_bytes(m, shape, need - (int64_t(1) << 20), tokens, chunk), B);
      if (tokens > 100) {
        bool more_fit = false;
        try {
          auto c2 = make_method_cache_for_bytes(m, shape, bytes, B + 2, chunk);
          more_fit = fill(*c2, B + 2, tokens);
        } catch (const Error&) {
        }
        EXPECT_FALSE(more_fit);
      }
    }
  }
  EXPECT_THROW(sequences_for_bytes(resolve_kv_method("bf16", mo), KvCacheShape{kL, kH, kD, 0}, 1 << 20, 100, chunk),
               Error);
}

// Sizes past what a cache can index are refused at once with the reason: 2^30 sequences or more
// (the count's cap), and byte budgets whose pages overflow the pools' int32 ids, as OutOfMemory
// (these used to wrap to a wrong page count, or loop forever in bytes_for_sequences).
TEST(QuantMethods, SizesPastThePoolsIndexAreRefused) {
  const KvCacheShape shape{kL, kH, kD, kPage};
  const KvMethodOptions mo = sizing_options();
  for (const char* name : {"bf16", "int2-hadamard"}) {
    SCOPED_TRACE(name);
    const KvMethod m = resolve_kv_method(name, mo);
    EXPECT_THROW(bytes_for_sequences(m, shape, 1 << 30, 200, 64), Error);
    const int B = (1 << 30) - 1;
    const int64_t need = bytes_for_sequences(m, shape, B, 200, 64);  // ~2^30 x 13 pages: past int32
    EXPECT_GT(need / bf16_page_bytes(shape), int64_t(1) << 31);
    try {
      make_method_cache_for_bytes(m, shape, need, B, 64);
      ADD_FAILURE() << "a cache of " << need << " bytes was made";
    } catch (const OutOfMemory& e) {
      EXPECT_NE(std::string(e.what()).find("more than a cache indexes"), std::string::npos) << e.what();
    }
  }
  KvCacheOptions o;
  o.max_tokens = int64_t(kPage) * (int64_t(1) << 31);
  o.page_size = kPage;
  EXPECT_THROW(make_kv_cache(shape, o), OutOfMemory);
}

}  // namespace
}  // namespace oscar::kv
