#include "kv/page_pool.h"

#include <fmt/format.h>

#include "core/error.h"

namespace oscar::kv {

PagePool::PagePool(std::string name, int32_t num_pages) : name_(std::move(name)) {
  if (num_pages < 0) throw Error(fmt::format("{}: negative page count {}", name_, num_pages));
  refcount_.assign(num_pages, 0);
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
  if (free_.empty())
    throw Error(fmt::format("{}: out of pages (all {} in use)", name_, num_pages()));
  int32_t p = free_.back();
  free_.pop_back();
  refcount_[p] = 1;
  return p;
}

void PagePool::retain(int32_t page) {
  check(page, "retain");
  ++refcount_[page];
}

void PagePool::release(int32_t page) {
  check(page, "release");
  if (--refcount_[page] == 0) free_.push_back(page);
}

int32_t PagePool::refcount(int32_t page) const {
  if (page < 0 || page >= num_pages())
    throw Error(fmt::format("{}: refcount of page {} outside [0, {})", name_, page, num_pages()));
  return refcount_[page];
}

}  // namespace oscar::kv
