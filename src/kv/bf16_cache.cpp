#include "kv/bf16_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/half.h"

namespace oscar::kv {

static void validate_shape(const KvCacheShape& s) {
  if (s.n_layers <= 0 || s.num_kv_heads <= 0 || s.head_dim <= 0)
    throw Error(fmt::format("kv cache: bad shape (layers {}, kv heads {}, head_dim {})",
                            s.n_layers, s.num_kv_heads, s.head_dim));
  if (s.page_size <= 0 || s.page_size % 16 != 0)
    throw Error(fmt::format("kv cache: page size {} is not a positive multiple of 16", s.page_size));
}

Bf16KvCache::Bf16KvCache(const KvCacheShape& shape, int32_t num_pages, bool prefix_caching,
                         const backend::PageStoreFactory& store)
    : shape_((validate_shape(shape), shape)), prefix_(prefix_caching),
      pool_("bf16 page pool", num_pages) {
  backend::PageStoreSpec spec;
  spec.n_layers = shape_.n_layers;
  spec.num_kv_heads = shape_.num_kv_heads;
  spec.head_dim = shape_.head_dim;
  spec.page_size = shape_.page_size;
  spec.bf16_pages = num_pages;
  spec.group_size = std::min(128, shape_.head_dim);
  spec.label = "bf16 kv cache";
  store_ = backend::make_page_store(store, spec);
  for (int l = 0; l < shape_.n_layers; ++l) pools_.push_back(store_->bf16_pool(l));
}

Bf16KvCache::Seq& Bf16KvCache::get(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(fmt::format("bf16 kv cache: unknown sequence {}", seq));
  return it->second;
}
const Bf16KvCache::Seq& Bf16KvCache::get(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(fmt::format("bf16 kv cache: unknown sequence {}", seq));
  return it->second;
}

SeqId Bf16KvCache::create() {
  SeqId id = next_id_++;
  seqs_.emplace(id, Seq{});
  return id;
}

SeqId Bf16KvCache::fork(SeqId src) {
  const Seq& s = get(src);
  const int ps = shape_.page_size;
  const int full = s.length / ps;
  const int partial = s.length % ps;
  Seq d;
  d.length = s.length;
  // Acquire the copy of the partial page first: if the pool is empty nothing changed.
  int32_t copy = partial ? pool_.acquire() : -1;
  for (int i = 0; i < full; ++i) {
    pool_.retain(s.pages[i]);
    d.pages.push_back(s.pages[i]);
  }
  if (partial) {
    // The source keeps appending into its last page, so the fork gets its own copy.
    store_->copy_bf16_page(s.pages[full], copy);
    d.pages.push_back(copy);
  }
  SeqId id = next_id_++;
  seqs_.emplace(id, std::move(d));
  return id;
}

void Bf16KvCache::release(SeqId seq) {
  Seq& s = get(seq);
  for (int32_t p : s.pages) pool_.release(p);
  seqs_.erase(seq);
}

int Bf16KvCache::length(SeqId seq) const { return get(seq).length; }

void Bf16KvCache::reserve(SeqId seq, int n) {
  if (n < 0) throw Error(fmt::format("bf16 kv cache: reserve of {} tokens", n));
  Seq& s = get(seq);
  const int64_t need_tokens = int64_t(s.length) + n;
  const int64_t need_pages = (need_tokens + shape_.page_size - 1) / shape_.page_size;
  std::vector<int32_t> fresh;
  try {
    while (int64_t(s.pages.size() + fresh.size()) < need_pages) fresh.push_back(pool_.acquire());
  } catch (...) {
    for (int32_t p : fresh) pool_.release(p);
    throw;
  }
  s.pages.insert(s.pages.end(), fresh.begin(), fresh.end());
  s.reserved = std::max(s.reserved, n);
}

void Bf16KvCache::place(SeqId seq, int pos, int n, backend::RowPlacement& rows) const {
  const Seq& s = get(seq);
  if (n < 0 || pos < s.length || int64_t(pos) + n > int64_t(s.length) + s.reserved)
    throw Error(fmt::format("bf16 kv cache: write of tokens [{}, {}) to sequence {} outside its "
                            "reserved room [{}, {})",
                            pos, pos + n, seq, s.length, s.length + s.reserved));
  const int ps = shape_.page_size;
  for (int t = 0; t < n; ++t) {
    const int p = pos + t;
    const int32_t page = s.pages[p / ps];
    if (pool_.refcount(page) != 1)
      throw Error(fmt::format("bf16 kv cache: write into shared page {} of sequence {}", page, seq));
    rows.pages.push_back(page);
    rows.slots.push_back(p % ps);
  }
}

void Bf16KvCache::commit(SeqId seq, int n) {
  Seq& s = get(seq);
  if (n < 0 || n > s.reserved)
    throw Error(fmt::format("bf16 kv cache: commit of {} tokens to sequence {} with {} reserved", n,
                            seq, s.reserved));
  s.length += n;
  s.reserved -= n;
}

void Bf16KvCache::make_batch(std::span<const SeqId> seqs, std::span<const int> lens,
                             KvBatch& out) const {
  if (seqs.size() != lens.size())
    throw Error(fmt::format("bf16 kv cache: batch of {} sequences with {} lengths", seqs.size(),
                            lens.size()));
  const int B = static_cast<int>(seqs.size());
  const int ps = shape_.page_size;
  out.base = PagedKvView{};
  out.base.batch = B;
  out.base.num_kv_heads = shape_.num_kv_heads;
  out.base.head_dim = shape_.head_dim;
  out.base.page_size = ps;
  out.base.group_size = std::min(128, shape_.head_dim);  // unused (no middle), but must validate
  out.bf16_pools = &pools_;
  out.quant_pools = nullptr;
  out.sink_indptr.assign(B + 1, 0);
  out.sink_indices.clear();
  out.sink_len.assign(B, 0);
  out.mid_indptr.assign(B + 1, 0);
  out.mid_indices.clear();
  out.mid_len.assign(B, 0);
  out.recent_indptr.assign(1, 0);
  out.recent_indices.clear();
  out.recent_len.clear();
  for (int b = 0; b < B; ++b) {
    const Seq& s = get(seqs[b]);
    const int len = lens[b];
    if (len < 0 || int64_t(len) > int64_t(s.length) + s.reserved)
      throw Error(fmt::format("bf16 kv cache: batch length {} for sequence {} outside [0, {}]", len,
                              seqs[b], s.length + s.reserved));
    const int np = (len + ps - 1) / ps;
    out.recent_indices.insert(out.recent_indices.end(), s.pages.begin(), s.pages.begin() + np);
    out.recent_indptr.push_back(static_cast<int32_t>(out.recent_indices.size()));
    out.recent_len.push_back(len);
  }
  // Tables must never be null pointers, even for an empty batch.
  if (out.sink_indices.empty()) out.sink_indices.reserve(1);
  if (out.mid_indices.empty()) out.mid_indices.reserve(1);
  if (out.recent_indices.empty()) out.recent_indices.reserve(1);
}

PageCounts Bf16KvCache::pages_needed(SeqId seq, int n) const {
  int64_t len = 0, have = 0;
  if (seq != kNewSeq) {
    auto it = seqs_.find(seq);
    if (it != seqs_.end()) {
      len = it->second.length;
      have = int64_t(it->second.pages.size());
    }
  }
  const int64_t ps = shape_.page_size;
  return {std::max<int64_t>(0, (len + std::max(0, n) + ps - 1) / ps - have), 0};
}

KvUsage Bf16KvCache::usage() const {
  KvUsage u;
  u.total = {pool_.num_pages(), 0};
  u.used = {pool_.num_used(), 0};
  u.cached = {pool_.num_cached(), 0};
  for (const auto& [id, s] : seqs_) u.recent_tokens += s.length;
  u.sequences = int(seqs_.size());
  return u;
}

int Bf16KvCache::attach_prefix(SeqId seq, std::span<const int32_t> tokens) {
  Seq& s = get(seq);
  if (!prefix_ || tokens.empty()) return 0;
  if (s.length != 0 || !s.pages.empty() || s.reserved != 0)
    throw Error(fmt::format("bf16 kv cache: attach_prefix to sequence {} that holds tokens", seq));
  const int ps = shape_.page_size;
  const int most = static_cast<int>((tokens.size() - 1) / ps);
  uint64_t key = 0;
  for (int j = 0; j < most; ++j) {
    key = page_key(key, tokens.data() + size_t(j) * ps, ps);
    const int32_t p = pool_.find(key);
    if (p < 0) break;
    pool_.retain(p);
    s.pages.push_back(p);
    s.keys.push_back(key);
  }
  s.length = static_cast<int>(s.pages.size()) * ps;
  return s.length;
}

void Bf16KvCache::publish_prefix(SeqId seq, std::span<const int32_t> tokens) {
  if (!prefix_) return;
  Seq& s = get(seq);
  if (int64_t(tokens.size()) < s.length)
    throw Error(fmt::format("bf16 kv cache: publish_prefix of sequence {} with {} of its {} tokens",
                            seq, tokens.size(), s.length));
  const int ps = shape_.page_size;
  for (int j = static_cast<int>(s.keys.size()); j < s.length / ps; ++j) {
    const uint64_t key = page_key(j ? s.keys.back() : 0, tokens.data() + size_t(j) * ps, ps);
    s.keys.push_back(key);
    pool_.set_key(s.pages[j], key);
  }
}

int64_t Bf16KvCache::bytes_in_use() const {
  return int64_t(pool_.num_used()) * page_elems() * 2 /*K,V*/ * 2 /*bytes*/ * shape_.n_layers;
}

const std::vector<int32_t>& Bf16KvCache::block_table(SeqId seq) const { return get(seq).pages; }

}  // namespace oscar::kv
