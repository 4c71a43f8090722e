#include "kv/oscar_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/error.h"
#include "core/key_transform.h"
#include "core/quantizer.h"

namespace oscar::kv {

namespace {
// Pages for `tokens` plus `extra`, refused where a pool's int32 page ids cannot index them.
int32_t pages_for(int64_t tokens, int ps, int extra = 0) {
  return checked_page_count((tokens + ps - 1) / ps + extra, tokens, "kv cache");
}
}  // namespace

OscarKvCache::OscarKvCache(const KvCacheShape& shape, std::shared_ptr<const Calibration> calib,
                           const OscarCacheOptions& opts)
    : shape_(shape),
      calib_(std::move(calib)),
      opts_(opts),
      bf16_pool_(opts.label + " bf16 page pool",
                 opts.bf16_pages > 0 ? opts.bf16_pages
                                     : pages_for(opts.max_tokens, std::max(16, shape.page_size), 8)),
      quant_pool_(opts.label + " quantized page pool",
                  opts.quant_pages > 0 ? opts.quant_pages
                                       : pages_for(opts.max_tokens, std::max(16, shape.page_size), 1)) {
  const int d = shape_.head_dim, ps = shape_.page_size;
  if (shape_.n_layers <= 0 || shape_.num_kv_heads <= 0 || d <= 0 || ps <= 0 || ps % 16 != 0)
    throw Error(fmt::format("{} kv cache: bad shape (layers {}, kv heads {}, head_dim {}, page {})",
                            opts_.label, shape_.n_layers, shape_.num_kv_heads, d, ps));
  if (opts_.sink < 0 || opts_.recent < 0)
    throw Error(fmt::format("{} kv cache: negative window (sink {}, recent {})", opts_.label,
                            opts_.sink, opts_.recent));
  if (!calib_) throw Error(fmt::format("{} kv cache: no calibration", opts_.label));
  // Pages are shared by prefix only when the sink is whole pages (a page is then
  // wholly sink, middle or recent).
  prefix_ = opts_.prefix_caching && opts_.sink % ps == 0;
  if (int(calib_->layers.size()) != shape_.n_layers || calib_->head_dim() != d)
    throw Error(fmt::format("{} kv cache: calibration for {} layers x head_dim {}, cache has {} x {}",
                            opts_.label, calib_->layers.size(), calib_->head_dim(),
                            shape_.n_layers, d));
  group_ = std::min(opts_.group_size, d);
  QuantSpec spec{opts_.bits, group_, ScaleDtype::kF16};
  validate_spec(spec, d);
  const bool kchan = opts_.key_axis == KeyAxis::kChannel;
  if (opts_.key_axis != KeyAxis::kToken && !kchan)
    throw Error(fmt::format("{} kv cache: unknown key axis {}", opts_.label, int(opts_.key_axis)));
  if (kchan && ps % kKeySpan != 0)
    throw Error(fmt::format("{} kv cache: per-channel keys are quantized over spans of {} tokens, so "
                            "the page size must be a multiple of {} (got {})",
                            opts_.label, kKeySpan, kKeySpan, ps));
  // What the page store applies per layer: the key transform and the clips.
  bool identity = calib_->composition == Composition::kNone, uniform_clip = true;
  std::vector<backend::LayerQuant> lq;
  const std::vector<int> pairs = page_center_pairs(*calib_);
  if (!pairs.empty() && kchan)
    throw Error(fmt::format("{} kv cache: page centering needs per-token keys", opts_.label));
  for (const LayerCalibration& lc : calib_->layers) {
    if (lc.n_rot != 1 && lc.n_rot != shape_.num_kv_heads)
      throw Error(fmt::format("{} kv cache: calibration has {} rotations per layer for {} KV heads",
                              opts_.label, lc.n_rot, shape_.num_kv_heads));
    identity = identity && !lc.has_key_transform();
    backend::LayerQuant& q = lq.emplace_back();
    q.xf = prepare_key_transform(lc, shape_.num_kv_heads, d);
    q.center = prepare_page_center(*calib_, int(lq.size()) - 1, q.xf, pairs, shape_.num_kv_heads, d);
    if (center_freq_.empty() && !q.center.empty()) center_freq_ = q.center.freq;
    for (int h = 0; h < shape_.num_kv_heads; ++h) {
      q.k_clip.push_back(lc.k_clip_of(h));
      q.v_clip.push_back(lc.v_clip_of(h));
      uniform_clip = uniform_clip && q.k_clip[h] == q.k_clip[0] && q.v_clip[h] == q.v_clip[0];
    }
    if (kchan)
      for (int h = 0; h < shape_.num_kv_heads; ++h)
        if (lc.k_clip_of(h) < 1.0f)
          throw Error(fmt::format("{} kv cache: per-channel keys are not clipped, but the calibration "
                                  "has key clip ratio {}",
                                  opts_.label, lc.k_clip_of(h)));
  }
  if (kchan && !uniform_clip)
    throw Error(fmt::format("{} kv cache: per-channel keys with per-head clip ratios are not supported",
                            opts_.label));

  backend::PageStoreSpec sspec;
  sspec.n_layers = shape_.n_layers;
  sspec.num_kv_heads = shape_.num_kv_heads;
  sspec.head_dim = d;
  sspec.page_size = ps;
  sspec.bf16_pages = bf16_pool_.num_pages();
  sspec.quant_pages = quant_pool_.num_pages();
  sspec.bits = opts_.bits;
  sspec.group_size = group_;
  sspec.key_axis = opts_.key_axis;
  sspec.label = opts_.label + " kv cache";
  store_ = backend::make_page_store(opts_.store, sspec);
  for (backend::LayerQuant& q : lq) q.identity = identity;
  store_->set_quant(std::move(lq));
  for (int l = 0; l < shape_.n_layers; ++l) {
    bf16_pools_.push_back(store_->bf16_pool(l));
    quant_pools_.push_back(store_->quant_pool(l));
  }
  if (!pairs.empty())
    for (int l = 0; l < shape_.n_layers; ++l) centers_.push_back(store_->mid_center(l));
}

int64_t OscarKvCache::bf16_page_elems() const {
  return int64_t(shape_.num_kv_heads) * shape_.page_size * shape_.head_dim;
}

OscarKvCache::Seq& OscarKvCache::get(SeqId seq) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(fmt::format("{} kv cache: unknown sequence {}", opts_.label, seq));
  return it->second;
}
const OscarKvCache::Seq& OscarKvCache::get(SeqId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) throw Error(fmt::format("{} kv cache: unknown sequence {}", opts_.label, seq));
  return it->second;
}

SeqId OscarKvCache::create() {
  const SeqId id = next_id_++;
  seqs_.emplace(id, Seq{});
  return id;
}

SeqId OscarKvCache::fork(SeqId src) {
  const Seq& s = get(src);
  const int ps = shape_.page_size;
  Seq d = s;
  d.reserved = 0;
  d.promised = 0;
  // Full pages are shared; a partial last page (sink or recent) is copied,
  // because the source keeps appending into it.
  const int sink_tokens = std::min(s.length, opts_.sink);
  const int recent_tokens = std::max(0, s.length - opts_.sink - s.mid_len);
  const int sink_pages = pages_for(sink_tokens, ps), recent_pages = pages_for(recent_tokens, ps);
  d.sink.resize(sink_pages);
  d.recent.resize(recent_pages);
  struct Copy {
    std::vector<int32_t>* table;
    int index;
  };
  std::vector<Copy> copies;
  if (sink_tokens % ps) copies.push_back({&d.sink, sink_pages - 1});
  if (recent_tokens % ps) copies.push_back({&d.recent, recent_pages - 1});
  std::vector<int32_t> fresh;
  try {
    for (size_t i = 0; i < copies.size(); ++i) fresh.push_back(bf16_pool_.acquire());
  } catch (...) {
    for (int32_t p : fresh) bf16_pool_.release(p);
    throw;
  }
  for (size_t i = 0; i < copies.size(); ++i) {
    const int32_t from = (*copies[i].table)[copies[i].index], to = fresh[i];
    store_->copy_bf16_page(from, to);
    (*copies[i].table)[copies[i].index] = to;
  }
  for (size_t i = 0; i < d.sink.size(); ++i)
    if (!(sink_tokens % ps && i + 1 == d.sink.size())) bf16_pool_.retain(d.sink[i]);
  for (size_t i = 0; i < d.recent.size(); ++i)
    if (!(recent_tokens % ps && i + 1 == d.recent.size())) bf16_pool_.retain(d.recent[i]);
  for (int32_t p : d.mid) quant_pool_.retain(p);
  const SeqId id = next_id_++;
  seqs_.emplace(id, std::move(d));
  return id;
}

void OscarKvCache::release(SeqId seq) {
  Seq& s = get(seq);
  for (int32_t p : s.sink) bf16_pool_.release(p);
  for (int32_t p : s.recent) bf16_pool_.release(p);
  for (int32_t p : s.mid) quant_pool_.release(p);
  quant_promised_ -= s.promised;
  seqs_.erase(seq);
}

int OscarKvCache::length(SeqId seq) const { return get(seq).length; }

std::pair<int, int64_t> OscarKvCache::reservation(const Seq& s, int64_t end) const {
  const int ps = shape_.page_size;
  const int need_sink = pages_for(std::min<int64_t>(end, opts_.sink), ps);
  const int need_recent = pages_for(std::max<int64_t>(0, end - opts_.sink - s.mid_len), ps);
  const int more = std::max(0, need_sink - int(s.sink.size())) +
                   std::max(0, need_recent - int(s.recent.size()));
  // Demotions at commit take quantized pages (the window ends in [W, W + page)).
  const int64_t recent_after = std::max<int64_t>(0, end - opts_.sink - s.mid_len);
  const int64_t demotions =
      recent_after >= opts_.recent + ps ? (recent_after - opts_.recent) / ps : 0;
  return {more, demotions};
}

PageCounts OscarKvCache::pages_needed(SeqId seq, int n) const {
  static const Seq empty;
  auto it = seq == kNewSeq ? seqs_.end() : seqs_.find(seq);
  const Seq& s = it == seqs_.end() ? empty : it->second;
  const auto [more, demotions] = reservation(s, int64_t(s.length) + std::max(0, n));
  return {more, std::max<int64_t>(0, demotions - s.promised)};
}

PageCounts OscarKvCache::pages_to_hold(int64_t tokens, int chunk) const {
  const int ps = shape_.page_size;
  tokens = std::max<int64_t>(0, tokens);
  // Before a commit the window holds < W + page committed tokens plus one chunk;
  // the middle holds whatever was demoted by the end.
  const int64_t sink = std::min<int64_t>(tokens, opts_.sink);
  const int64_t recent = std::min<int64_t>(tokens - sink, int64_t(opts_.recent) + ps + std::max(1, chunk));
  const int64_t after = tokens - sink;
  const int64_t demoted = after >= opts_.recent + ps ? (after - opts_.recent) / ps : 0;
  return {pages_for(sink, ps) + pages_for(recent, ps) + 1, demoted};
}

PageCounts OscarKvCache::pages_free() const {
  // A BF16 prompt's backlog counts as free BF16 pages: reserve demotes it when it needs them
  // (its quantized pages are already promised).
  int64_t reclaimable = 0;
  if (opts_.prompt_bf16)
    for (const auto& [id, s] : seqs_) reclaimable += backlog(s);
  return {bf16_pool_.num_free() + reclaimable, quant_pool_.num_free() - quant_promised_};
}

KvUsage OscarKvCache::usage() const {
  KvUsage u;
  u.total = {bf16_pool_.num_pages(), quant_pool_.num_pages()};
  u.used = {bf16_pool_.num_used(), quant_pool_.num_used()};
  u.cached = {bf16_pool_.num_cached(), quant_pool_.num_cached()};
  for (const auto& [id, s] : seqs_) {
    u.sink_tokens += std::min(s.length, opts_.sink);
    u.mid_tokens += s.mid_len;
    u.recent_tokens += std::max(0, s.length - opts_.sink - s.mid_len);
  }
  u.sequences = int(seqs_.size());
  return u;
}

int OscarKvCache::mid_for_length(int64_t length) const {
  // Whole pages leave the window while it holds >= W + page tokens: it ends in [W, W + page).
  const int ps = shape_.page_size;
  const int64_t after = length - opts_.sink;
  return after >= opts_.recent + ps ? int((after - opts_.recent) / ps * ps) : 0;
}

int OscarKvCache::attach_prefix(SeqId seq, std::span<const int32_t> tokens) {
  Seq& s = get(seq);
  if (!prefix_ || tokens.empty()) return 0;
  if (s.length != 0 || s.reserved != 0 || !s.sink.empty() || !s.recent.empty())
    throw Error(fmt::format("{} kv cache: attach_prefix to sequence {} that holds tokens",
                            opts_.label, seq));
  const int ps = shape_.page_size;
  const int most = static_cast<int>((tokens.size() - 1) / ps);
  // Which versions of each matching page exist: BF16 (sink, recent) and quantized (middle).
  std::vector<uint64_t> keys;
  std::vector<int32_t> bf, qt;
  uint64_t key = 0;
  for (int j = 0; j < most; ++j) {
    key = page_key(key, tokens.data() + size_t(j) * ps, ps);
    const int32_t b = bf16_pool_.find(key), q = quant_pool_.find(key);
    if (b < 0 && q < 0) break;
    keys.push_back(key);
    bf.push_back(b);
    qt.push_back(q);
  }
  // The longest m whose state a sequence that computed m pages itself would have:
  // sink pages and the recent window in BF16, the middle quantized.
  const int sink_pages = opts_.sink / ps;
  for (int m = static_cast<int>(keys.size()); m > 0; --m) {
    const int mid = mid_for_length(int64_t(m) * ps) / ps;
    bool ok = true;
    for (int j = 0; j < m && ok; ++j)
      ok = (j >= sink_pages && j < sink_pages + mid) ? qt[j] >= 0 : bf[j] >= 0;
    if (!ok) continue;
    for (int j = 0; j < m; ++j) {
      if (j < sink_pages) {
        bf16_pool_.retain(bf[j]);
        s.sink.push_back(bf[j]);
      } else if (j < sink_pages + mid) {
        quant_pool_.retain(qt[j]);
        s.mid.push_back(qt[j]);
      } else {
        bf16_pool_.retain(bf[j]);
        s.recent.push_back(bf[j]);
      }
    }
    s.keys.assign(keys.begin(), keys.begin() + m);
    s.length = m * ps;
    s.mid_len = mid * ps;
    s.bf16_published = m;
    s.quant_published = mid;
    return s.length;
  }
  return 0;
}

void OscarKvCache::publish_prefix(SeqId seq, std::span<const int32_t> tokens) {
  if (!prefix_) return;
  Seq& s = get(seq);
  if (int64_t(tokens.size()) < s.length)
    throw Error(fmt::format("{} kv cache: publish_prefix of sequence {} with {} of its {} tokens",
                            opts_.label, seq, tokens.size(), s.length));
  const int ps = shape_.page_size;
  const int full = s.length / ps;
  for (int j = static_cast<int>(s.keys.size()); j < full; ++j)
    s.keys.push_back(page_key(j ? s.keys.back() : 0, tokens.data() + size_t(j) * ps, ps));
  const int sink_pages = opts_.sink / ps, mid_pages = s.mid_len / ps;
  // Full BF16 pages: the sink, and the recent window's (those demoted before
  // they were offered have no BF16 version left).
  for (int j = s.bf16_published; j < full; ++j) {
    if (j < sink_pages) bf16_pool_.set_key(s.sink[j], s.keys[j]);
    else if (j >= sink_pages + mid_pages) bf16_pool_.set_key(s.recent[j - sink_pages - mid_pages], s.keys[j]);
  }
  s.bf16_published = full;
  for (int m = s.quant_published; m < mid_pages; ++m) quant_pool_.set_key(s.mid[m], s.keys[sink_pages + m]);
  s.quant_published = mid_pages;
}

bool OscarKvCache::prefix_unsettled(SeqId seq) const {
  auto it = seqs_.find(seq);
  return prefix_ && opts_.prompt_bf16 && it != seqs_.end() && it->second.prompt;
}

void OscarKvCache::reserve(SeqId seq, int n) {
  if (n < 0) throw Error(fmt::format("{} kv cache: reserve of {} tokens", opts_.label, n));
  Seq& s = get(seq);
  // A BF16 prompt ends at the first single-token reservation (the first decode step): its
  // backlog is demoted before the step reads the cache. (The quantized pages are promised.)
  if (opts_.prompt_bf16 && s.prompt && n == 1) {
    s.prompt = false;
    demote_due(s);
  }
  const int64_t end = int64_t(s.length) + n;
  const int need_sink = pages_for(std::min<int64_t>(end, opts_.sink), shape_.page_size);
  const auto [more, demotions] = reservation(s, end);
  // Quantized pages for the demotions are promised now (to this sequence, over
  // every other sequence's promises), so commit cannot fail.
  const int64_t extra = std::max<int64_t>(0, demotions - s.promised);
  if (extra > quant_pool_.num_free() - quant_promised_)
    throw Error(fmt::format("{}: out of pages ({} needed for demotion, {} free)",
                            opts_.label + " quantized page pool", extra,
                            quant_pool_.num_free() - quant_promised_));
  // Deferred backlogs yield their BF16 pages when the pool runs short. (The counts above do
  // not change: a demotion moves whole pages from the window to the middle.)
  if (more > 0) reclaim_bf16(s, more);
  std::vector<int32_t> fresh;
  try {
    for (int i = 0; i < more; ++i) fresh.push_back(bf16_pool_.acquire());
  } catch (...) {
    for (int32_t p : fresh) bf16_pool_.release(p);
    throw;
  }
  size_t f = 0;
  while (int(s.sink.size()) < need_sink) s.sink.push_back(fresh[f++]);
  while (f < fresh.size()) s.recent.push_back(fresh[f++]);
  s.promised += int(extra);
  quant_promised_ += extra;
  s.reserved = std::max(s.reserved, n);
}

std::pair<int32_t, int> OscarKvCache::slot_of(const Seq& s, int p) const {
  const int ps = shape_.page_size;
  if (p < opts_.sink) return {s.sink[p / ps], p % ps};
  const int r = p - opts_.sink - s.mid_len;
  return {s.recent[r / ps], r % ps};
}

void OscarKvCache::place(SeqId seq, int pos, int n, backend::RowPlacement& rows) const {
  const Seq& s = get(seq);
  if (n < 0 || pos < s.length || int64_t(pos) + n > int64_t(s.length) + s.reserved)
    throw Error(fmt::format("{} kv cache: write of tokens [{}, {}) to sequence {} outside its "
                            "reserved room [{}, {})",
                            opts_.label, pos, pos + n, seq, s.length, s.length + s.reserved));
  for (int t = 0; t < n; ++t) {
    auto [page, slot] = slot_of(s, pos + t);
    if (bf16_pool_.refcount(page) != 1)
      throw Error(fmt::format("{} kv cache: write into shared page {} of sequence {}", opts_.label,
                              page, seq));
    rows.pages.push_back(page);
    rows.slots.push_back(slot);
  }
}

void OscarKvCache::demote_one(Seq& s) {
  const int32_t src = s.recent.front();
  const int32_t dst = quant_pool_.acquire();
  // The page's first position: the middle starts after the sink (opts_.sink tokens).
  store_->demote(src, dst, int64_t(opts_.sink) + s.mid_len);
  bf16_pool_.release(src);
  s.recent.erase(s.recent.begin());
  s.mid.push_back(dst);
  s.mid_len += shape_.page_size;
}

void OscarKvCache::demote_due(Seq& s) {
  const int ps = shape_.page_size;
  while (s.length - opts_.sink - s.mid_len >= opts_.recent + ps) {
    // The promise is released before the page is taken, so the pool check in
    // acquire sees it free.
    if (s.promised > 0) {
      --s.promised;
      --quant_promised_;
    }
    demote_one(s);
  }
}

int OscarKvCache::backlog(const Seq& s) const {
  if (!opts_.prompt_bf16 || !s.prompt) return 0;
  // The pages demote_due would demote now (the commit rule of mid_for_length).
  return (mid_for_length(s.length) - s.mid_len) / shape_.page_size;
}

void OscarKvCache::reclaim_bf16(Seq& first, int pages) {
  if (bf16_pool_.num_free() >= pages) return;
  if (backlog(first) > 0) demote_due(first);
  // Then the other sequences' backlogs, oldest first (ids grow with creation).
  std::vector<SeqId> ids;
  for (const auto& [id, s] : seqs_)
    if (&s != &first && backlog(s) > 0) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  for (SeqId id : ids) {
    if (bf16_pool_.num_free() >= pages) return;
    demote_due(seqs_.at(id));
  }
}

void OscarKvCache::commit(SeqId seq, int n) {
  Seq& s = get(seq);
  if (n < 0 || n > s.reserved)
    throw Error(fmt::format("{} kv cache: commit of {} tokens to sequence {} with {} reserved",
                            opts_.label, n, seq, s.reserved));
  s.length += n;
  s.reserved -= n;
  // Page-granular demotion: the window ends in [W, W + page); a BF16 prompt defers it.
  if (!(opts_.prompt_bf16 && s.prompt)) demote_due(s);
}

OscarKvCache::Regions OscarKvCache::regions(SeqId seq) const {
  const Seq& s = get(seq);
  Regions r;
  r.sink = std::min(s.length, opts_.sink);
  r.mid = s.mid_len;
  r.recent = std::max(0, s.length - opts_.sink - s.mid_len);
  return r;
}

double OscarKvCache::bits_per_element(SeqId seq) const {
  const Regions r = regions(seq);
  const int T = r.sink + r.mid + r.recent;
  if (T == 0) return 16.0;
  return ((r.sink + r.recent) * 16.0 + r.mid * middle_bits_per_element()) / T;
}

double OscarKvCache::middle_bits_per_element() const {
  const double v = row_bits_per_element(opts_.bits, group_, ScaleDtype::kF16);
  const double k = opts_.key_axis == KeyAxis::kChannel
                       ? row_bits_per_element(opts_.bits, kKeySpan, ScaleDtype::kF16)
                       : v;
  return 0.5 * (k + v);
}

void OscarKvCache::make_batch(std::span<const SeqId> seqs, std::span<const int> lens,
                              KvBatch& out) const {
  if (seqs.size() != lens.size())
    throw Error(fmt::format("{} kv cache: batch of {} sequences with {} lengths", opts_.label,
                            seqs.size(), lens.size()));
  const int B = static_cast<int>(seqs.size());
  const int ps = shape_.page_size;
  out.base = store_->layer_view(0);
  out.base.batch = B;
  out.base.bf16 = {};
  out.base.quant = {};
  out.bf16_pools = &bf16_pools_;
  out.quant_pools = &quant_pools_;
  for (auto* v : {&out.sink_indptr, &out.mid_indptr, &out.recent_indptr}) v->assign(1, 0);
  for (auto* v : {&out.sink_indices, &out.mid_indices, &out.recent_indices, &out.sink_len,
                  &out.mid_len, &out.recent_len})
    v->clear();
  for (int b = 0; b < B; ++b) {
    const Seq& s = get(seqs[b]);
    const int len = lens[b];
    if (len < 0 || int64_t(len) > int64_t(s.length) + s.reserved)
      throw Error(fmt::format("{} kv cache: batch length {} for sequence {} outside [0, {}]",
                              opts_.label, len, seqs[b], s.length + s.reserved));
    const int sink = std::min(len, opts_.sink);
    const int mid = std::clamp(len - opts_.sink, 0, s.mid_len);
    const int recent = std::max(0, len - opts_.sink - s.mid_len);
    out.sink_indices.insert(out.sink_indices.end(), s.sink.begin(), s.sink.begin() + pages_for(sink, ps));
    out.mid_indices.insert(out.mid_indices.end(), s.mid.begin(), s.mid.begin() + pages_for(mid, ps));
    out.recent_indices.insert(out.recent_indices.end(), s.recent.begin(),
                              s.recent.begin() + pages_for(recent, ps));
    out.sink_indptr.push_back(int32_t(out.sink_indices.size()));
    out.mid_indptr.push_back(int32_t(out.mid_indices.size()));
    out.recent_indptr.push_back(int32_t(out.recent_indices.size()));
    out.sink_len.push_back(sink);
    out.mid_len.push_back(mid);
    out.recent_len.push_back(recent);
  }
  // Page centering: middle page i of every sequence has the same centre position, so every
  // sequence reads one table from row 0. The table only grows (to twice its rows, a new table
  // with a new version), so a device copy of it is refreshed a few times per run, not per step.
  out.centers = centers_.empty() ? nullptr : &centers_;
  out.mid_angles.reset();
  out.mid_angles_version = 0;
  out.mid_angle_start.clear();
  if (!centers_.empty()) {
    const int S = int(center_freq_.size());
    int most = 0;
    for (int b = 0; b < B; ++b) most = std::max(most, out.mid_indptr[b + 1] - out.mid_indptr[b]);
    const size_t have = center_angles_ ? center_angles_->size() / (2 * size_t(S)) : 0;
    if (!center_angles_ || size_t(most) > have) {
      static std::atomic<uint64_t> versions{0};
      const size_t rows = std::max<size_t>({size_t(most), 2 * have, 16});
      auto t = std::make_shared<std::vector<float>>(rows * 2 * size_t(S));
      if (center_angles_) std::copy(center_angles_->begin(), center_angles_->end(), t->begin());
      for (size_t i = have; i < rows; ++i)
        center_angles(center_freq_.data(), S, mid_page_center(opts_.sink, int64_t(i), ps),
                      t->data() + i * 2 * S);
      center_angles_ = std::move(t);
      center_angles_version_ = ++versions;
    }
    out.mid_angles = center_angles_;
    out.mid_angles_version = center_angles_version_;
    out.mid_angle_start.assign(size_t(B), 0);
  }
  // Tables must never be null pointers, even when empty.
  for (auto* v : {&out.sink_indices, &out.mid_indices, &out.recent_indices})
    if (v->empty()) v->reserve(1);
  for (auto* v : {&out.sink_len, &out.mid_len, &out.recent_len})
    if (v->empty()) v->reserve(1);
}

int64_t OscarKvCache::bytes_in_use() const {
  const int d = shape_.head_dim;
  const int64_t bf = int64_t(bf16_pool_.num_used()) * bf16_page_elems() * 2 * 2;
  // Per quantized page and head: K and V codes, V params, K params (per row
  // groups, or per channel per span of kKeySpan slots).
  const int ps = shape_.page_size;
  const int64_t vparams = int64_t(ps) * (d / group_) * 2 * 2;
  const int64_t kparams = opts_.key_axis == KeyAxis::kChannel ? int64_t(ps / kKeySpan) * d * 2 * 2 : vparams;
  const int64_t qpage = 2 * int64_t(ps) * packed_row_bytes(d, opts_.bits) + vparams + kparams;
  const int64_t q = int64_t(quant_pool_.num_used()) * shape_.num_kv_heads * qpage;
  return (bf + q) * shape_.n_layers;
}

}  // namespace oscar::kv
