// Page memory of a paged KV cache and the few operations that touch it: the
// backend's side of a cache (DESIGN §8: backend/ below kv/).
//
// The caches (kv/bf16_cache.h, kv/oscar_cache.h) keep the bookkeeping: page
// ids, region tables, reference counts, which rows go where and when a page
// is demoted. Every byte of page storage, and every operation that reads or
// writes it, belongs to a PageStore, which a backend provides: host memory
// with the CPU kernels (make_host_page_store, the default and the
// specification, backend/host_page_store.cpp), or device memory with the CUDA
// kernels (backend/cuda/backend_cuda.cu). The K/V rows and queries the store receives
// live in the same memory as the pages (the backend's activation buffers).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/key_transform.h"
#include "kernels/paged_kv.h"

namespace oscar::backend {

// Shapes of the pools a cache needs.
struct PageStoreSpec {
  int n_layers = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int page_size = 64;
  int32_t bf16_pages = 0;   // per layer
  int32_t quant_pages = 0;  // per layer; 0 = no quantized pool
  int bits = 2;             // quantized pool: bits per code
  int group_size = 128;     // quantized pool: channels per (scale, min)
  kv::KeyAxis key_axis = kv::KeyAxis::kToken;
  std::string label = "kv";  // for messages
};

// Where the rows of one step go: row i of the step's K/V buffers is stored in
// BF16 page pages[i], slot slots[i] (the same in every layer). Filled by
// KvCache::place; `epoch` changes on every clear() so that a device store
// uploads a placement once per step, not once per layer.
struct RowPlacement {
  std::vector<int32_t> pages, slots;
  uint64_t epoch = next_epoch();
  void clear() {
    pages.clear();
    slots.clear();
    epoch = next_epoch();
  }
  int size() const { return static_cast<int>(pages.size()); }

 private:
  static uint64_t next_epoch() {
    static std::atomic<uint64_t> e{0};
    return ++e;
  }
};

// The quantization a cache applies per layer: the key transform (keys and
// queries into the storage basis, core/key_transform.h) and the clip ratios of
// demotion, per KV head.
struct LayerQuant {
  bool identity = true;  // no key transform (keys and queries pass unchanged)
  KeyTransform xf;
  std::vector<float> k_clip, v_clip;  // [num_kv_heads]
  PageCenter center;  // page centering of demoted keys (core/key_transform.h); empty: none
};

class PageStore {
 public:
  explicit PageStore(const PageStoreSpec& spec) : spec_(spec), id_(next_id()) {}
  virtual ~PageStore() = default;
  const PageStoreSpec& spec() const { return spec_; }
  // Unique over the process's life (never reused): recorded step graphs that
  // read this store's transforms are keyed by it (Backend::run_graph).
  uint64_t id() const { return id_; }
  // "cpu" or "cuda": where the pages (and the rows handed in) live.
  virtual std::string device() const = 0;

  // The pools of one layer (pointers into the store's memory).
  virtual kv::Bf16PagePool bf16_pool(int layer) const = 0;
  virtual kv::QuantPagePool quant_pool(int layer) const = 0;
  // The view of one layer's pools (shapes and format from the spec, no region
  // tables): what the cache-write and demotion kernels take.
  kv::PagedKvView layer_view(int layer) const {
    kv::PagedKvView v;
    v.num_kv_heads = spec_.num_kv_heads;
    v.head_dim = spec_.head_dim;
    v.page_size = spec_.page_size;
    v.bits = spec_.bits;
    v.group_size = spec_.group_size;
    v.key_axis = spec_.key_axis;
    v.bf16 = bf16_pool(layer);
    v.quant = quant_pool(layer);
    return v;
  }

  // Sets the per-layer quantization ([n_layers]); a quantized cache calls it
  // once before any demotion or transform. Throws oscar::Error for what the
  // store cannot do (e.g. per-head clips on a device without them).
  virtual void set_quant(std::vector<LayerQuant> layers) = 0;

  // Rows of one layer into their BF16 slots (round to nearest even):
  // k, v [rows.size()][num_kv_heads][head_dim] f32, keys already transformed.
  virtual void write_bf16(int layer, const RowPlacement& rows, const float* k, const float* v) = 0;
  // BF16 page src -> quantized page dst in every layer: clip, quantize, pack
  // (rows are already in the storage basis). first_pos is the sequence position of the
  // page's first token: with page centering the keys are quantized around the centre
  // δ_h(first_pos + (page_size − 1)/2) (kernels/paged_kv.h). A device store may queue it; it
  // runs before any later operation of the store reads or writes pages.
  virtual void demote(int32_t src, int32_t dst, int64_t first_pos) = 0;
  // The page centering of one layer as the kernels read it (u / w / mu in the store's
  // memory; angles unset), or pairs == 0.
  virtual kv::MidCenter mid_center(int layer) const = 0;
  // Copies BF16 page `from` to page `to` in every layer (fork of a partial page).
  virtual void copy_bf16_page(int32_t from, int32_t to) = 0;
  // Keys / queries into the storage basis, in place (set_quant's transforms).
  // k [n][num_kv_heads][head_dim]; q [n][n_q_heads][head_dim].
  virtual void transform_keys(int layer, float* k, int n) = 0;
  virtual void transform_queries(int layer, float* q, int n, int n_q_heads) = 0;
  // Both of one step (a device store does them in one launch).
  virtual void transform_queries_keys(int layer, float* q, int n_q_heads, float* k, int n) {
    transform_keys(layer, k, n);
    transform_queries(layer, q, n, n_q_heads);
  }
  // Waits until queued work is done (host reads of device pages, tests).
  virtual void sync() {}
  // Does now the host side of this step's writes: uploads the placement and runs
  // the queued demotions, so that write_bf16 with the same placement is device work
  // alone (recordable in a step graph, Backend::run_graph). Host store: nothing.
  virtual void stage_rows(const RowPlacement& rows) {}

 protected:
  PageStoreSpec spec_;

 private:
  static uint64_t next_id() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }
  uint64_t id_;
};

// Makes the store of a cache; empty means host memory (make_host_page_store).
using PageStoreFactory = std::function<std::unique_ptr<PageStore>(const PageStoreSpec&)>;

// Host memory and the CPU kernels (kernels/cpu/cache_write.h, kernels/cpu/key_transform.h).
// Pages are left uninitialized so untouched pages cost no physical memory.
std::unique_ptr<PageStore> make_host_page_store(const PageStoreSpec& spec);

// The factory's store, or the host store when the factory is empty.
std::unique_ptr<PageStore> make_page_store(const PageStoreFactory& f, const PageStoreSpec& spec);

}  // namespace oscar::backend
