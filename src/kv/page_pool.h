// A pool of fixed-size pages identified by int32 ids, with reference counts.
//
// The pool only hands out ids; the bytes live in per-layer arrays owned by the
// cache (page id p is the same slot in every layer's array, so one block table
// serves all layers, as in vLLM). Reference counts let several sequences share a
// page (fork / prefix sharing): a page returns to the free list when its last
// holder releases it.
#pragma once

#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

namespace oscar::kv {

// `pages` as a pool's page count; throws oscar::OutOfMemory naming `what` and `tokens` where the
// int32 page ids cannot index that many.
int32_t checked_page_count(int64_t pages, int64_t tokens, const std::string& what);

class PagePool {
 public:
  // `name` appears in error messages ("bf16 page pool: out of pages ...").
  PagePool(std::string name, int32_t num_pages);

  int32_t num_pages() const { return static_cast<int32_t>(refcount_.size()); }
  // Pages acquire() can hand out: never used, or cached without holders.
  int32_t num_free() const { return static_cast<int32_t>(free_.size() + lru_.size()); }
  int32_t num_used() const { return num_pages() - num_free(); }
  int32_t num_cached() const { return static_cast<int32_t>(lru_.size()); }

  // Takes a free page (refcount 1): a never-keyed one first, else the least
  // recently used cached page (its key is dropped). Throws oscar::Error when none.
  int32_t acquire();
  // Adds a holder to a page in use, or takes a cached page (found by key) back into use.
  void retain(int32_t page);
  // Drops a holder. At zero the page is free again, or, when it has a key,
  // cached: kept with its contents until acquire() needs it.
  void release(int32_t page);
  int32_t refcount(int32_t page) const;

  // Prefix caching: `key` names the contents of a page in use (a hash of every
  // token up to the page's end). A key another page already holds stays with that page.
  void set_key(int32_t page, uint64_t key);
  bool has_key(int32_t page) const { return keyed_[page]; }
  // The page holding `key` (in use or cached), or -1.
  int32_t find(uint64_t key) const;

 private:
  void check(int32_t page, const char* what) const;
  std::string name_;
  std::vector<int32_t> refcount_;  // [num_pages]
  std::vector<int32_t> free_;      // stack of never-keyed free ids (lowest id popped first)
  // Cached pages (keyed, no holder), least recently released first.
  std::list<int32_t> lru_;
  std::vector<std::list<int32_t>::iterator> lru_pos_;  // [num_pages], valid when cached
  std::vector<uint64_t> key_;                          // [num_pages]
  std::vector<char> keyed_;                            // [num_pages]
  std::unordered_map<uint64_t, int32_t> by_key_;
};

// The key of a page of `page_size` tokens following a page with key `prev`
// (0 for the first page): a 64-bit hash chain over token ids.
uint64_t page_key(uint64_t prev, const int32_t* tokens, int page_size);

}  // namespace oscar::kv
