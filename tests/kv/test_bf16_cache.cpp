// Page pool, block tables, reference counts and the views of the BF16 cache.
#include <gtest/gtest.h>

#include <random>
#include <set>

#include "core/error.h"
#include "core/half.h"
#include "kv/bf16_cache.h"
#include "kv/page_pool.h"

namespace oscar::kv {
namespace {

TEST(PagePool, AcquireReleaseRefcount) {
  PagePool p("test pool", 3);
  EXPECT_EQ(p.num_free(), 3);
  int32_t a = p.acquire(), b = p.acquire(), c = p.acquire();
  EXPECT_EQ(a, 0);
  EXPECT_EQ(b, 1);
  EXPECT_EQ(c, 2);
  EXPECT_THROW(p.acquire(), Error);
  p.retain(b);
  EXPECT_EQ(p.refcount(b), 2);
  p.release(b);
  EXPECT_EQ(p.num_free(), 0) << "page freed while still held";
  p.release(b);
  EXPECT_EQ(p.num_free(), 1);
  EXPECT_EQ(p.acquire(), b);
  EXPECT_THROW(p.retain(7), Error);
  p.release(a);
  EXPECT_THROW(p.release(a), Error) << "double free must be caught";
}

KvCacheShape shape(int page = 16) { return {2, 2, 64, page}; }

// Row of (layer, token, head) filled with a recognizable pattern.
std::vector<float> rows(int n, int heads, int d, float base) {
  std::vector<float> r(size_t(n) * heads * d);
  for (size_t i = 0; i < r.size(); ++i) r[i] = base + 0.001f * float(i % 977);
  return r;
}

TEST(Bf16Cache, ReserveWriteCommitAndView) {
  Bf16KvCache c(shape(16), 8);
  SeqId s = c.create();
  c.reserve(s, 37);
  EXPECT_EQ(c.block_table(s).size(), 3u);
  EXPECT_EQ(c.pool().num_used(), 3);
  auto k = rows(37, 2, 64, 1.0f), v = rows(37, 2, 64, -2.0f);
  for (int l = 0; l < 2; ++l) c.write(l, s, 0, k.data(), v.data(), 37);
  c.commit(s, 37);
  EXPECT_EQ(c.length(s), 37);
  KvBatch b;
  std::vector<SeqId> seqs = {s};
  std::vector<int> lens = {37};
  c.make_batch(seqs, lens, b);
  PagedKvView view = b.layer(1);
  EXPECT_EQ(view.total_len(0), 37);
  EXPECT_EQ(view.recent.indptr[1] - view.recent.indptr[0], 3);
  // Every token, head and channel reads back as the bf16 of what was written.
  for (int t = 0; t < 37; ++t)
    for (int h = 0; h < 2; ++h) {
      const int32_t page = view.recent.indices[t / 16];
      const int64_t off = view.bf16_row_offset(page, h, t % 16);
      for (int ch = 0; ch < 64; ++ch) {
        const size_t i = (size_t(t) * 2 + h) * 64 + ch;
        ASSERT_EQ(view.bf16.k[off + ch], f32_to_bf16(k[i])) << t << " " << h << " " << ch;
        ASSERT_EQ(view.bf16.v[off + ch], f32_to_bf16(v[i]));
      }
    }
  c.release(s);
  EXPECT_EQ(c.pool().num_used(), 0);
}

TEST(Bf16Cache, WritesOutsideReservedRoomThrow) {
  Bf16KvCache c(shape(16), 8);
  SeqId s = c.create();
  auto k = rows(5, 2, 64, 0.f);
  EXPECT_THROW(c.write(0, s, 0, k.data(), k.data(), 1), Error) << "nothing reserved";
  c.reserve(s, 4);
  EXPECT_THROW(c.write(0, s, 0, k.data(), k.data(), 5), Error);
  EXPECT_THROW(c.write(2, s, 0, k.data(), k.data(), 1), Error) << "bad layer";
  EXPECT_THROW(c.commit(s, 5), Error);
  EXPECT_THROW(c.length(99), Error);
}

TEST(Bf16Cache, ExhaustedPoolLeavesCacheUnchanged) {
  Bf16KvCache c(shape(16), 3);
  SeqId a = c.create(), b = c.create();
  c.reserve(a, 32);
  EXPECT_THROW(c.reserve(b, 20), Error);  // needs 2 pages, 1 free
  EXPECT_EQ(c.pool().num_used(), 2);
  EXPECT_TRUE(c.block_table(b).empty());
  c.reserve(b, 16);
  EXPECT_EQ(c.pool().num_used(), 3);
}

TEST(Bf16Cache, ForkSharesFullPagesAndCopiesThePartialOne) {
  Bf16KvCache c(shape(16), 16);
  SeqId a = c.create();
  c.reserve(a, 40);
  auto k = rows(40, 2, 64, 3.f), v = rows(40, 2, 64, 4.f);
  for (int l = 0; l < 2; ++l) c.write(l, a, 0, k.data(), v.data(), 40);
  c.commit(a, 40);
  SeqId b = c.fork(a);
  EXPECT_EQ(c.length(b), 40);
  const auto& ta = c.block_table(a);
  const auto& tb = c.block_table(b);
  ASSERT_EQ(tb.size(), 3u);
  EXPECT_EQ(ta[0], tb[0]);
  EXPECT_EQ(ta[1], tb[1]);
  EXPECT_NE(ta[2], tb[2]);
  EXPECT_EQ(c.pool().refcount(ta[0]), 2);
  EXPECT_EQ(c.pool().refcount(ta[2]), 1);
  // The copy holds the same rows; the two sequences then diverge independently.
  KvBatch batch;
  std::vector<SeqId> seqs = {a, b};
  std::vector<int> lens = {40, 40};
  c.make_batch(seqs, lens, batch);
  for (int l = 0; l < 2; ++l) {
    PagedKvView view = batch.layer(l);
    for (int slot = 0; slot < 8; ++slot)
      for (int h = 0; h < 2; ++h)
        for (int ch = 0; ch < 64; ++ch) {
          ASSERT_EQ(view.bf16.k[view.bf16_row_offset(ta[2], h, slot) + ch],
                    view.bf16.k[view.bf16_row_offset(tb[2], h, slot) + ch]);
          ASSERT_EQ(view.bf16.v[view.bf16_row_offset(ta[2], h, slot) + ch],
                    view.bf16.v[view.bf16_row_offset(tb[2], h, slot) + ch]);
        }
  }
  c.reserve(b, 1);
  auto kb = rows(1, 2, 64, 9.f);
  for (int l = 0; l < 2; ++l) c.write(l, b, 40, kb.data(), kb.data(), 1);
  c.commit(b, 1);
  const int used = c.pool().num_used();
  c.release(a);
  EXPECT_EQ(c.pool().num_used(), used - 1) << "only a's private page is freed";
  EXPECT_EQ(c.pool().refcount(tb[0]), 1);
  c.release(b);
  EXPECT_EQ(c.pool().num_used(), 0);
}

TEST(Bf16Cache, ForkAtPageBoundaryCopiesNothing) {
  Bf16KvCache c(shape(16), 8);
  SeqId a = c.create();
  c.reserve(a, 32);
  auto k = rows(32, 2, 64, 1.f);
  for (int l = 0; l < 2; ++l) c.write(l, a, 0, k.data(), k.data(), 32);
  c.commit(a, 32);
  const int used = c.pool().num_used();
  SeqId b = c.fork(a);
  EXPECT_EQ(c.pool().num_used(), used);
  c.reserve(b, 1);  // the fork's next token goes to a fresh page
  EXPECT_EQ(c.pool().num_used(), used + 1);
  c.release(a);
  c.release(b);
  EXPECT_EQ(c.pool().num_used(), 0);
}

TEST(Bf16Cache, RandomAllocFreeNeverLeaks) {
  // Random create/reserve/commit/fork/release; the pool's count of used pages
  // always equals the distinct pages held by live sequences.
  Bf16KvCache c(shape(16), 64);
  std::mt19937 rng(1);
  std::vector<SeqId> live;
  for (int it = 0; it < 2000; ++it) {
    const int op = rng() % 4;
    if (op == 0 || live.empty()) {
      live.push_back(c.create());
    } else if (op == 1) {
      SeqId s = live[rng() % live.size()];
      const int n = 1 + rng() % 20;
      try {
        c.reserve(s, n);
        c.commit(s, n);
      } catch (const Error&) {
      }
    } else if (op == 2) {
      try {
        live.push_back(c.fork(live[rng() % live.size()]));
      } catch (const Error&) {
      }
    } else {
      const size_t i = rng() % live.size();
      c.release(live[i]);
      live.erase(live.begin() + i);
    }
    std::set<int32_t> held;
    for (SeqId s : live)
      for (int32_t p : c.block_table(s)) held.insert(p);
    ASSERT_EQ(int(held.size()), c.pool().num_used()) << "iteration " << it;
  }
  for (SeqId s : live) c.release(s);
  EXPECT_EQ(c.pool().num_used(), 0);
}

TEST(KvCacheFactory, KnownAndUnknownMethods) {
  KvCacheOptions o;
  o.max_tokens = 100;
  auto c = make_kv_cache(shape(), o);
  EXPECT_EQ(c->method(), "bf16");
  o.method = "nope";
  EXPECT_THROW(make_kv_cache(shape(), o), Error);
  o.method = "bf16";
  o.page_size = 24;
  EXPECT_THROW(make_kv_cache(shape(), o), Error);
}

}  // namespace
}  // namespace oscar::kv
