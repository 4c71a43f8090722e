#include "kv/kv_cache.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "kv/bf16_cache.h"
#include "kv/page_pool.h"

namespace oscar::kv {

void KvCache::write_rows(int layer, const backend::RowPlacement& rows, const float* k, const float* v) {
  if (layer < 0 || layer >= shape().n_layers)
    throw Error(fmt::format("{} kv cache: layer {} outside [0, {})", method(), layer, shape().n_layers));
  if (rows.size() == 0) return;
  store().write_bf16(layer, rows, k, v);
}

void KvCache::write(int layer, SeqId seq, int pos, const float* k, const float* v, int n) {
  if (layer < 0 || layer >= shape().n_layers)
    throw Error(fmt::format("{} kv cache: layer {} outside [0, {})", method(), layer, shape().n_layers));
  backend::RowPlacement rows;
  place(seq, pos, n, rows);
  write_rows(layer, rows, k, v);
}

void KvCache::fill_with_rows(SeqId seq, int tokens, const float* k, const float* v, int chunk) {
  if (chunk < 1) throw Error(fmt::format("{} kv cache: fill in chunks of {} tokens", method(), chunk));
  backend::RowPlacement rows;
  while (length(seq) < tokens) {
    const int n = std::min(chunk, tokens - length(seq));
    reserve(seq, n);
    rows.clear();
    place(seq, length(seq), n, rows);
    for (int l = 0; l < shape().n_layers; ++l) write_rows(l, rows, k, v);
    commit(seq, n);
  }
}

// The one place a cache method name becomes a cache: new methods register here.
std::unique_ptr<KvCache> make_kv_cache(const KvCacheShape& shape, const KvCacheOptions& opts) {
  KvCacheShape s = shape;
  s.page_size = opts.page_size;
  const int64_t tokens = opts.max_tokens > 0 ? opts.max_tokens : 32768;
  const int64_t pages = (tokens + s.page_size - 1) / std::max(1, s.page_size);
  const int32_t n = checked_page_count(pages, tokens, "kv cache");
  if (opts.method == "bf16") return std::make_unique<Bf16KvCache>(s, n, opts.prefix_caching, opts.store);
  throw Error(fmt::format("kv cache: unknown method '{}' (known: bf16)", opts.method));
}

}  // namespace oscar::kv
