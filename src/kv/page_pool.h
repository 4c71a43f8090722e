// A pool of fixed-size pages identified by int32 ids, with reference counts.
//
// The pool only hands out ids; the bytes live in per-layer arrays owned by the
// cache (page id p is the same slot in every layer's array, so one block table
// serves all layers, as in vLLM). Reference counts let several sequences share a
// page (fork / prefix sharing): a page returns to the free list when its last
// holder releases it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace oscar::kv {

class PagePool {
 public:
  // `name` appears in error messages ("bf16 page pool: out of pages ...").
  PagePool(std::string name, int32_t num_pages);

  int32_t num_pages() const { return static_cast<int32_t>(refcount_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_.size()); }
  int32_t num_used() const { return num_pages() - num_free(); }

  // Takes a free page (refcount 1). Throws oscar::Error when none is left.
  int32_t acquire();
  // Adds a holder to a page in use.
  void retain(int32_t page);
  // Drops a holder; the page is free again when the count reaches zero.
  void release(int32_t page);
  int32_t refcount(int32_t page) const;

 private:
  void check(int32_t page, const char* what) const;
  std::string name_;
  std::vector<int32_t> refcount_;  // [num_pages]
  std::vector<int32_t> free_;      // stack of free ids (lowest id popped first)
};

}  // namespace oscar::kv
