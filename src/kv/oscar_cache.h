// The OSCAR quantized KV cache (DESIGN §5): per sequence and layer a BF16 sink
// (the first S0 tokens, kept forever), a BF16 recent window (the newest W..W+page-1
// tokens) and a quantized (INT2 / INT4) middle, in pages.
//
// Life of a token: the forward rotates its key after RoPE (rotate_keys: the
// layer's key transform, core/key_transform.h, normally R_K of its KV head; the
// query gets the matching matrix in rotate_queries, so q̃·k̃ = q·k up to a shift
// shared by every key of a query row) and
// writes it, BF16, into the sink or the recent window; its value arrives
// already rotated (R_V is folded into W_v, model/fold_rotation.h). On commit,
// while the recent window holds W + page tokens, its oldest (full) page is
// clipped -> quantized -> packed into one new quantized page (demote_page) and
// the BF16 page is released: the window stays in [W, W + page) (DESIGN §5.2).
//
// Page ids: the BF16 pool (sink + recent pages) and the quantized pool (middle
// pages) are separate, each with its own reference counts; page id p is the
// same slot in every layer's arrays. Full pages are shared on fork.
//
// The rotations and clip ratios come from a Calibration (core/calibration.h):
// an OSCAR file, or a data-free one (identity for int2-naive, kivi2, Hadamard).
//
// kivi2 is this cache with sink 0, recent 128, identity rotation, no clip,
// values in groups of 32 and key_axis = kChannel: demotion quantizes each key
// channel over each 32-token span of the demoted page (paged_kv.h).
#pragma once

#include <memory>
#include <unordered_map>
#include <vector>

#include "core/calibration.h"
#include "kv/kv_cache.h"
#include "kv/page_pool.h"

namespace oscar::kv {

struct OscarCacheOptions {
  std::string label = "oscar";  // method() name
  int sink = 64;                // S0: BF16 tokens at the start
  int recent = 256;             // W: BF16 tokens at the end (window in [W, W + page))
  int bits = 2;                 // 2 or 4
  int group_size = 128;         // clamped to head_dim (values; keys too when per token)
  // Keys per token (row groups of group_size) or, for KIVI, per channel over
  // spans of kKeySpan = 32 tokens (paged_kv.h): then page_size must be a
  // multiple of 32, and keys are not clipped (key clip ratios must be >= 1).
  KeyAxis key_axis = KeyAxis::kToken;
  int32_t bf16_pages = 0;       // per layer; 0 = enough for max_tokens
  int32_t quant_pages = 0;
  int64_t max_tokens = 32768;   // page budget when the page counts are 0
  // Prefix caching (kv_cache.h): sink and recent pages in the BF16 pool, middle
  // pages in the quantized pool, each pool with its own index. Needs the sink to
  // be whole pages.
  bool prefix_caching = false;
  // BF16 prompt: while a sequence is prefilled (reservations of more than one token, until
  // its first single-token reservation), the pages that leave the recent window are not
  // demoted, so every prompt chunk reads the earlier chunks in BF16, as one whole-prompt
  // prefill would; the backlog is demoted when the prompt ends (its first decode step), or
  // earlier, oldest sequences first, when the BF16 pool runs short (reserve). The quantized
  // pages of the backlog are promised as if it had been demoted, so the demotion cannot
  // fail. Off: the classic rule, demotion at every commit (what a decode step reads).
  bool prompt_bf16 = false;
  backend::PageStoreFactory store;  // page memory; empty = host
};

class OscarKvCache : public KvCache {
 public:
  // calib: rotations and clips of every layer (must match shape: n_layers,
  // head_dim, n_kv_heads when per head). Throws oscar::Error otherwise.
  OscarKvCache(const KvCacheShape& shape, std::shared_ptr<const Calibration> calib,
               const OscarCacheOptions& opts);

  const KvCacheShape& shape() const override { return shape_; }
  std::string method() const override { return opts_.label; }
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
  PageCounts pages_free() const override;
  PageCounts pages_to_hold(int64_t tokens, int chunk) const override;
  KvUsage usage() const override;
  int attach_prefix(SeqId seq, std::span<const int32_t> tokens) override;
  void publish_prefix(SeqId seq, std::span<const int32_t> tokens) override;
  bool prefix_caching() const override { return prefix_; }
  bool prefix_unsettled(SeqId seq) const override;
  int64_t bytes_in_use() const override;

  // Region sizes of a sequence's committed tokens (tests, reports).
  struct Regions {
    int sink = 0, mid = 0, recent = 0;
  };
  Regions regions(SeqId seq) const;
  // True bits per cached element of the sequence (DESIGN §5.4): BF16 rows at
  // 16, quantized rows at bits + 2*16/group (keys per channel: bits + 2*16/32,
  // one fp16 pair per channel per 32 tokens), K and V averaged.
  double bits_per_element(SeqId seq) const;
  // Bits per element of a quantized (middle) token, K and V averaged.
  double middle_bits_per_element() const;
  const OscarCacheOptions& options() const { return opts_; }
  int group_size() const { return group_; }

 private:
  struct Seq {
    std::vector<int32_t> sink, mid, recent;  // page ids (bf16, quant, bf16)
    int length = 0, reserved = 0;
    int mid_len = 0;  // tokens in the middle (a multiple of the page size)
    int promised = 0; // quantized pages its commit may still take (reserved demotions)
    std::vector<uint64_t> keys;  // prefix caching: keys of the first full pages
    int bf16_published = 0;      // full pages [0, n) offered to the BF16 index
    int quant_published = 0;     // middle pages [0, n) offered to the quantized index
    bool prompt = true;          // prompt_bf16: no single-token reservation yet (demotion deferred)
  };
  // Middle tokens of a sequence holding `length` committed tokens (the commit rule).
  int mid_for_length(int64_t length) const;
  // New BF16 pages and total demotions a reservation of tokens up to `end` implies.
  std::pair<int, int64_t> reservation(const Seq& s, int64_t end) const;
  Seq& get(SeqId seq);
  const Seq& get(SeqId seq) const;
  // (bf16 page, slot) of position p of a sequence (p in the sink or recent window).
  std::pair<int32_t, int> slot_of(const Seq& s, int p) const;
  void demote_one(Seq& s);
  // Demotes every page that has left the recent window (the window ends in [W, W + page)).
  void demote_due(Seq& s);
  // Full pages beyond the recent window that a BF16 prompt has kept (0 without deferral).
  int backlog(const Seq& s) const;
  // Demotes deferred backlogs, the given sequence's first, until `pages` BF16 pages are free.
  void reclaim_bf16(Seq& first, int pages);
  int64_t bf16_page_elems() const;

  KvCacheShape shape_;
  std::shared_ptr<const Calibration> calib_;
  OscarCacheOptions opts_;
  int group_ = 128;
  bool prefix_ = false;
  PagePool bf16_pool_, quant_pool_;
  std::unique_ptr<backend::PageStore> store_;                    // the pages (host or device)
  std::vector<Bf16PagePool> bf16_pools_;
  std::vector<QuantPagePool> quant_pools_;
  // Page centering (core/key_transform.h): per layer the store's u / w / mu, the pairs'
  // frequencies, and the (cos, sin) of middle page i (positions sink + i·page + (page−1)/2,
  // the same for every sequence): a table that make_batch replaces by a longer one when a
  // sequence outgrows it (batches keep theirs alive), with a process-wide version.
  std::vector<MidCenter> centers_;
  std::vector<float> center_freq_;
  mutable std::shared_ptr<const std::vector<float>> center_angles_;
  mutable uint64_t center_angles_version_ = 0;
  std::unordered_map<SeqId, Seq> seqs_;
  int64_t quant_promised_ = 0;  // sum of Seq::promised: quantized pages kept for commits
  SeqId next_id_ = 0;
};

}  // namespace oscar::kv
