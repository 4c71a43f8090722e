// The page pool's prefix-cache side (kv/page_pool.h): keyed pages stay cached
// after their last holder leaves, come back by key, and are evicted least
// recently released first when a page is needed; unkeyed pages are simply freed.
#include <gtest/gtest.h>

#include "core/error.h"
#include "kv/page_pool.h"

namespace oscar::kv {
namespace {

TEST(PagePool, CachedPagesComeBackByKeyAndAreEvictedLeastRecentlyReleasedFirst) {
  PagePool p("test pool", 3);
  const int32_t a = p.acquire(), b = p.acquire(), c = p.acquire();
  EXPECT_EQ(p.num_free(), 0);
  EXPECT_THROW(p.acquire(), Error);
  p.set_key(a, 11);
  p.set_key(b, 22);
  p.set_key(c, 11);  // key taken by a: c stays unkeyed
  EXPECT_FALSE(p.has_key(c));
  EXPECT_EQ(p.find(11), a);
  p.release(b);  // cached first
  p.release(a);  // cached second
  p.release(c);  // unkeyed: free
  EXPECT_EQ(p.num_free(), 3);
  EXPECT_EQ(p.num_cached(), 2);
  EXPECT_EQ(p.find(22), b);
  // A cached page goes back into use through retain.
  p.retain(a);
  EXPECT_EQ(p.refcount(a), 1);
  EXPECT_EQ(p.num_cached(), 1);
  // acquire: the never-keyed page first, then evicts the oldest cached (b).
  EXPECT_EQ(p.acquire(), c);
  EXPECT_EQ(p.acquire(), b);
  EXPECT_EQ(p.find(22), -1);
  EXPECT_FALSE(p.has_key(b));
  EXPECT_EQ(p.find(11), a);  // still in use, still findable
  EXPECT_THROW(p.acquire(), Error);
  p.release(a);  // keyed: cached again
  p.release(b);
  p.release(c);
  EXPECT_EQ(p.num_cached(), 1);
  EXPECT_EQ(p.num_free(), 3);
  EXPECT_THROW(p.release(b), Error);  // not in use
}

TEST(PagePool, PageKeysChainOverTokens) {
  const int32_t t1[4] = {1, 2, 3, 4}, t2[4] = {1, 2, 3, 5};
  const uint64_t k1 = page_key(0, t1, 4), k2 = page_key(0, t2, 4);
  EXPECT_NE(k1, k2);
  EXPECT_NE(page_key(k1, t1, 4), page_key(k2, t1, 4));  // same page after different prefixes
  EXPECT_EQ(page_key(k1, t2, 4), page_key(page_key(0, t1, 4), t2, 4));
  EXPECT_NE(k1, 0u);
}

}  // namespace
}  // namespace oscar::kv
