// The BF16 paged KV cache: every token of every sequence in BF16 pages (exposed
// to kernels as the "recent" region; sink and middle are empty). The baseline
// every quantized method is compared against.
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "kv/kv_cache.h"
#include "kv/page_pool.h"

namespace oscar::kv {

class Bf16KvCache : public KvCache {
 public:
  Bf16KvCache(const KvCacheShape& shape, int32_t num_pages, bool prefix_caching = false,
              const backend::PageStoreFactory& store = {});

  const KvCacheShape& shape() const override { return shape_; }
  std::string method() const override { return "bf16"; }
  SeqId create() override;
  SeqId fork(SeqId src) override;
  void release(SeqId seq) override;
  int length(SeqId seq) const override;
  void reserve(SeqId seq, int n) override;
  void place(SeqId seq, int pos, int n, backend::RowPlacement& rows) const override;
  backend::PageStore& store() const override { return *store_; }
  void commit(SeqId seq, int n) override;
  void make_batch(std::span<const SeqId> seqs, std::span<const int> lens,
                  KvBatch& out) const override;
  PageCounts pages_needed(SeqId seq, int n) const override;
  PageCounts pages_free() const override { return {pool_.num_free(), 0}; }
  PageCounts pages_to_hold(int64_t tokens, int chunk) const override {
    return {(tokens + shape_.page_size - 1) / shape_.page_size, 0};
  }
  KvUsage usage() const override;
  int attach_prefix(SeqId seq, std::span<const int32_t> tokens) override;
  void publish_prefix(SeqId seq, std::span<const int32_t> tokens) override;
  bool prefix_caching() const override { return prefix_; }
  int64_t bytes_in_use() const override;

  const PagePool& pool() const { return pool_; }
  // Page ids of a sequence (block table), for tests.
  const std::vector<int32_t>& block_table(SeqId seq) const;

 private:
  struct Seq {
    std::vector<int32_t> pages;  // block table
    int length = 0;              // committed tokens
    int reserved = 0;            // tokens the pages may hold beyond `length`
    std::vector<uint64_t> keys;  // prefix caching: keys of the first full pages
  };
  Seq& get(SeqId seq);
  const Seq& get(SeqId seq) const;
  int64_t page_elems() const {
    return int64_t(shape_.num_kv_heads) * shape_.page_size * shape_.head_dim;
  }

  KvCacheShape shape_;
  bool prefix_ = false;
  PagePool pool_;
  std::unique_ptr<backend::PageStore> store_;  // the pages
  std::vector<Bf16PagePool> pools_;   // [n_layers] pointers into the store
  std::unordered_map<SeqId, Seq> seqs_;
  SeqId next_id_ = 0;
};

}  // namespace oscar::kv
