// The KV cache interface the model runs against. Implementations: BF16 (all
// tokens in BF16 pages, kv/bf16_cache.h) and the OSCAR INT2 cache (sink/recent
// BF16 windows + INT2 middle, DESIGN §5), selected by name (`--kv`).
//
// Life of one forward step over a batch of sequences (model/forward.cpp):
//   reserve(seq, n)             pages for the n new tokens, in every layer, up front,
//                               so a step never fails half way through the layers;
//   per layer:
//     rotate_keys / rotate_queries   into the basis rows are stored in (R_K hook);
//     write_rows(layer, rows, k, v)  stores the step's new rows (placed once per step
//                                    by place(); pending, not yet committed);
//     make_batch(...).layer(l)       the PagedKvView the attention kernels read;
//   commit(seq, n)              the rows are final (the INT2 cache demotes here).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/paged_kv.h"
#include "backend/page_store.h"

namespace oscar::kv {

using SeqId = int32_t;

struct KvCacheShape {
  int n_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int page_size = 64;  // tokens per page, a multiple of 16
};

// Pages of the two pools (BF16: sink and recent windows, or every token of the
// BF16 cache; quantized: the middle).
struct PageCounts {
  int64_t bf16 = 0, quant = 0;
  bool fits_in(const PageCounts& free) const { return bf16 <= free.bf16 && quant <= free.quant; }
  PageCounts& operator+=(const PageCounts& o) {
    bf16 += o.bf16;
    quant += o.quant;
    return *this;
  }
};

// What the cache holds now (for /metrics and reports).
struct KvUsage {
  PageCounts total, used;   // pool sizes and pages in use (a shared page counts once)
  PageCounts cached;        // prefix cache: pages kept without holders (counted free)
  int64_t sink_tokens = 0, mid_tokens = 0, recent_tokens = 0;  // committed, summed over sequences
  int sequences = 0;
};

class KvCache {
 public:
  // pages_needed's stand-in for a sequence not created yet.
  static constexpr SeqId kNewSeq = -1;

  virtual ~KvCache() = default;

  virtual const KvCacheShape& shape() const = 0;
  virtual std::string method() const = 0;  // "bf16", "oscar", ...

  // A new empty sequence.
  virtual SeqId create() = 0;
  // A new sequence holding the same committed tokens as `src`; full pages are
  // shared by reference count, the partial last page is copied.
  virtual SeqId fork(SeqId src) = 0;
  // Frees the sequence and drops its page references.
  virtual void release(SeqId seq) = 0;
  // Committed tokens of the sequence.
  virtual int length(SeqId seq) const = 0;

  // Makes room for tokens [length, length + n) in every layer. Throws
  // oscar::Error when the pool is exhausted; the cache is unchanged then.
  virtual void reserve(SeqId seq, int n) = 0;
  // Where the rows of tokens [pos, pos + n) of `seq` go (the same in every
  // layer): appends n entries to `rows`. pos >= length(seq) and within the
  // reserved room, the pages not shared; oscar::Error otherwise.
  virtual void place(SeqId seq, int pos, int n, backend::RowPlacement& rows) const = 0;
  // Stores one layer's rows of a step, placed by place():
  // k, v [rows.size()][num_kv_heads][head_dim] f32 in the store's memory (the
  // backend's buffers), keys after RoPE and already in the storage basis
  // (rotate_keys).
  void write_rows(int layer, const backend::RowPlacement& rows, const float* k, const float* v);
  // One sequence's rows of one layer (place + write_rows): tests, simple callers.
  void write(int layer, SeqId seq, int pos, const float* k, const float* v, int n);
  // Extends `seq` to `tokens` committed tokens with the rows k / v ([chunk][num_kv_heads][head_dim]
  // each, in the store's memory) in every layer, `chunk` tokens per reserve / write / commit:
  // contexts for benchmarks, through the forward's write and demotion path.
  void fill_with_rows(SeqId seq, int tokens, const float* k, const float* v, int chunk);
  // Tokens [length, length + n) are final in every layer.
  virtual void commit(SeqId seq, int n) = 0;

  // Tables exposing sequence seqs[b] with its first lens[b] tokens (written rows,
  // committed or pending) as batch row b.
  virtual void make_batch(std::span<const SeqId> seqs, std::span<const int> lens,
                          KvBatch& out) const = 0;

  // Rotation hook (DESIGN §3.5): keys after RoPE and queries are rotated by R_K
  // of their KV head before they meet. Identity here; the OSCAR cache overrides.
  // k: [n][num_kv_heads][head_dim]; q: [n][n_q_heads][head_dim] (GQA: query head
  // g belongs to KV head g / (n_q_heads / num_kv_heads)).
  // Both run in the page store (on its device).
  void rotate_keys(int layer, float* k, int n) const { store().transform_keys(layer, k, n); }
  void rotate_queries(int layer, float* q, int n, int n_q_heads) const {
    store().transform_queries(layer, q, n, n_q_heads);
  }
  // Both of one step's rows (what the forward calls: one launch on a device store).
  void rotate_queries_keys(int layer, float* q, int n_q_heads, float* k, int n) const {
    store().transform_queries_keys(layer, q, n_q_heads, k, n);
  }
  // The page memory and the operations on it (backend/page_store.h).
  virtual backend::PageStore& store() const = 0;

  // Admission control (never throws for a live or kNewSeq id): the pages that
  // reserve(seq, n) would take now, counting the quantized pages its commit will
  // demote into, and the pages free for new reservations. A step whose summed
  // needs fit in pages_free() cannot fail for lack of pages.
  virtual PageCounts pages_needed(SeqId seq, int n) const = 0;
  virtual PageCounts pages_free() const = 0;
  // The most pages one sequence of `tokens` tokens ever holds when it is
  // written `chunk` tokens per step (a request that needs more than the whole
  // cache can never run).
  virtual PageCounts pages_to_hold(int64_t tokens, int chunk) const = 0;
  bool can_reserve(SeqId seq, int n) const { return pages_needed(seq, n).fits_in(pages_free()); }
  virtual KvUsage usage() const = 0;

  // Prefix caching (on when the cache was made with KvCacheOptions::prefix_caching).
  // Full committed pages are indexed by a hash chain of the tokens up to their
  // end; a page whose last holder leaves stays cached until its slot is needed
  // (least recently used first).
  //
  // attach_prefix: `seq` is new (nothing written); takes the longest run of
  // cached pages that begins `tokens`, leaving at least the last token to be
  // computed (its logits are needed), and returns the tokens now committed.
  virtual int attach_prefix(SeqId seq, std::span<const int32_t> tokens) { return 0; }
  // Indexes the full committed pages of `seq`; tokens: at least its committed ones.
  virtual void publish_prefix(SeqId seq, std::span<const int32_t> tokens) {}
  virtual bool prefix_caching() const { return false; }
  // True while pages `seq` publishes are not yet in the form attach_prefix gives another
  // sequence (the OSCAR cache's BF16 prompt, whose middle is demoted at its first decode step):
  // a scheduler waiting for a shared prefix waits for this too.
  virtual bool prefix_unsettled(SeqId seq) const { return false; }

  // Bytes of page storage held by live pages (for reports).
  virtual int64_t bytes_in_use() const = 0;
};

struct KvCacheOptions {
  std::string method = "bf16";
  int page_size = 64;
  int64_t max_tokens = 0;  // page budget in tokens over all sequences; 0 = 32K tokens
  bool prefix_caching = false;
  backend::PageStoreFactory store;  // page memory; empty = host
};

// Creates a cache by method name; throws oscar::Error for an unknown name.
std::unique_ptr<KvCache> make_kv_cache(const KvCacheShape& shape, const KvCacheOptions& opts);

}  // namespace oscar::kv
