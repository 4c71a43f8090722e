#include "kv/page_pool.h"

#include <fmt/format.h>

#include <limits>

#include "core/error.h"

namespace oscar::kv {

int32_t checked_page_count(int64_t pages, int64_t tokens, const std::string& what) {
  if (pages > std::numeric_limits<int32_t>::max())
    throw OutOfMemory(fmt::format("{}: {} tokens need {} pages, more than a cache indexes ({})", what, tokens, pages,
                                  std::numeric_limits<int32_t>::max()));
  return static_cast<int32_t>(pages);
}

PagePool::PagePool(std::string name, int32_t num_pages) : name_(std::move(name)) {
  if (num_pages < 0) throw Error(fmt::format("{}: negative page count {}", name_, num_pages));
  refcount_.assign(num_pages, 0);
  lru_pos_.resize(num_pages);
  key_.assign(num_pages, 0);
  keyed_.assign(num_pages, 0);
  free_.reserve(num_pages);
  // Pushed in reverse so acquire() hands out 0, 1, 2, ... on a fresh pool.
  for (int32_t p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

void PagePool::check(int32_t page, const char* what) const {
  if (page < 0 || page >= num_pages())
    throw Error(fmt::format("{}: {} of page {} outside [0, {})", name_, what, page, num_pages()));
  if (refcount_[page] <= 0)
    throw Error(fmt::format("{}: {} of page {} that is not in use", name_, what, page));
}

int32_t PagePool::acquire() {
  int32_t p;
  if (!free_.empty()) {
    p = free_.back();
    free_.pop_back();
  } else if (!lru_.empty()) {
    p = lru_.front();  // evict the least recently used cached page
    lru_.pop_front();
    by_key_.erase(key_[p]);
    keyed_[p] = 0;
  } else {
    throw Error(fmt::format("{}: out of pages (all {} in use)", name_, num_pages()));
  }
  refcount_[p] = 1;
  return p;
}

void PagePool::retain(int32_t page) {
  if (page >= 0 && page < num_pages() && refcount_[page] == 0 && keyed_[page]) {
    lru_.erase(lru_pos_[page]);  // a cached page back in use
    refcount_[page] = 1;
    return;
  }
  check(page, "retain");
  ++refcount_[page];
}

void PagePool::release(int32_t page) {
  check(page, "release");
  if (--refcount_[page] > 0) return;
  if (keyed_[page]) {
    lru_.push_back(page);
    lru_pos_[page] = std::prev(lru_.end());
  } else {
    free_.push_back(page);
  }
}

void PagePool::set_key(int32_t page, uint64_t key) {
  check(page, "set_key");
  if (keyed_[page] || by_key_.count(key)) return;
  key_[page] = key;
  keyed_[page] = 1;
  by_key_.emplace(key, page);
}

int32_t PagePool::find(uint64_t key) const {
  auto it = by_key_.find(key);
  return it == by_key_.end() ? -1 : it->second;
}

uint64_t page_key(uint64_t prev, const int32_t* tokens, int page_size) {
  // splitmix64-style mixing of each token into the running state.
  uint64_t h = prev ^ 0x9E3779B97F4A7C15ull;
  for (int i = 0; i < page_size; ++i) {
    h ^= static_cast<uint64_t>(static_cast<uint32_t>(tokens[i])) + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    h ^= h >> 30;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 27;
    h *= 0x94D049BB133111EBull;
    h ^= h >> 31;
  }
  return h == 0 ? 1 : h;  // 0 is reserved for "no previous page"
}

int32_t PagePool::refcount(int32_t page) const {
  if (page < 0 || page >= num_pages())
    throw Error(fmt::format("{}: refcount of page {} outside [0, {})", name_, page, num_pages()));
  return refcount_[page];
}

}  // namespace oscar::kv
