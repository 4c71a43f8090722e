// The boundary between the model code (model/forward.cpp) and the hardware
// (DESIGN §8: backend/ sits below kv/ and model/ and includes neither).
//
// The forward pass only calls these ops on buffers the backend allocated and on
// weights the backend prepared, so a CUDA backend can implement the same
// interface (device buffers, device weights) without touching the model code.
// Host data crosses the boundary only where written below (token ids,
// positions, logits read-back). Implementations: backend/cpu/backend_cpu.h (CPU),
// backend/cuda/backend_cuda.h (CUDA).
//
// Shapes are row-major; `n` is the number of token rows in the step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>

#include "backend/page_store.h"
#include "backend/sample.h"
#include "core/tensor.h"
#include "kernels/paged_kv.h"

namespace oscar::backend {

// How the backend keeps matrix weights. bf16 halves the bytes a decode step
// streams (decode is memory-bound); q8 (int8, fp32 scale per 32 weights)
// streams 0.56x of bf16; f32 is exact (golden-logit tests).
enum class WeightDtype { kF32, kBf16, kQ8 };
const char* to_string(WeightDtype d);
WeightDtype weight_dtype_from_string(const std::string& s);  // "f32" | "bf16" | "q8", throws otherwise

// A weight prepared by a backend (converted, packed, uploaded).
struct PreparedWeight {
  virtual ~PreparedWeight() = default;
  int64_t rows = 0, cols = 0;  // matrices: [rows = out][cols = in]; vectors: rows = 1
  int64_t bytes = 0;           // storage the backend holds for it
};
using WeightPtr = std::unique_ptr<PreparedWeight>;

// Activation memory owned by a backend.
class Buffer {
 public:
  virtual ~Buffer() = default;
  float* data() const { return data_; }
  size_t size() const { return size_; }

 protected:
  float* data_ = nullptr;
  size_t size_ = 0;
};
using BufferPtr = std::unique_ptr<Buffer>;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // --- memory
  virtual BufferPtr alloc(size_t n_floats) = 0;
  virtual void to_host(const float* src, float* host_dst, size_t n) = 0;
  virtual void from_host(const float* host_src, float* dst, size_t n) = 0;
  // Read + write bytes per second of a large copy in this backend's memory, measured now
  // (best of a few; a copy far larger than the caches): the bandwidth a memory-bound step
  // is measured against (the roofline of `oscar bench`, DESIGN §7). Takes ~0.1-1 s.
  virtual double copy_bandwidth() = 0;
  // Free and total bytes of the device memory this backend allocates from (cudaMemGetInfo),
  // or {0, 0} where there is no such fixed pool (the CPU: host memory).
  struct MemoryInfo {
    int64_t free = 0, total = 0;
  };
  virtual MemoryInfo device_memory() { return {}; }

  // --- weights
  // Linear layer y = x W^T (+ b): w [out][in] (HF layout), bias [out] or nullptr.
  // Several matrices with the same `in` may be stacked into one (fused QKV,
  // gate+up): pass them in order, the output columns follow the same order.
  virtual WeightPtr prepare_linear(std::initializer_list<const Tensor*> ws,
                                   std::initializer_list<const Tensor*> biases) = 0;
  virtual WeightPtr prepare_vector(const Tensor& v) = 0;     // norms: [dim]
  virtual WeightPtr prepare_embedding(const Tensor& e) = 0;  // [vocab][hidden]

  // --- ops
  // x[i] = emb[tokens[i]] for i < n; tokens on the host. x [n][hidden].
  virtual void embed(const PreparedWeight& emb, const int32_t* host_tokens, int n, float* x) = 0;
  // y = x W^T + b. x [n][in], y [n][out] (y must not alias x).
  virtual void linear(const PreparedWeight& w, const float* x, int n, float* y) = 0;
  // RMSNorm over rows of `dim`: y[r] = x[r] / rms(x[r]) * w. x, y [rows][dim] (may alias).
  virtual void rms_norm(const float* x, const PreparedWeight& w, int rows, int dim, float eps,
                        float* y) = 0;
  // Rotate-half RoPE in place on x [n][heads][head_dim] with the step's tables
  // cos, sin [n][head_dim/2] (host, kernels/cpu/rope.h; computed once per step).
  virtual void rope(float* x, int n, int heads, int head_dim, const float* host_cos,
                    const float* host_sin) = 0;
  // out = silu(gu[:, :inter]) * gu[:, inter:]. gu [n][2*inter], out [n][inter].
  virtual void silu_mul(const float* gu, int n, int inter, float* out) = 0;
  // x += y, both [n].
  virtual void add(float* x, const float* y, size_t n) = 0;
  // Copies columns [col0, col0+width) of src [n][src_cols] into dst [n][width].
  virtual void copy_cols(const float* src, int n, int src_cols, int col0, int width,
                         float* dst) = 0;

  // Fused forms of the ops above. The defaults compose those ops (the CPU
  // backend keeps them, so its results are the specification); a device backend
  // overrides them to save launches and memory passes, within the tolerances
  // its tests state.
  // y += x W^T (+ b): the residual add of o_proj and down_proj. tmp [n][out] is
  // scratch the default uses (y, x, tmp distinct).
  virtual void linear_add(const PreparedWeight& w, const float* x, int n, float* y, float* tmp);
  // h = RMSNorm(x) with norm (dim = w's input width), then y = h W^T (+ b): a layer's
  // norm and the projection after it (h is written: the dense forward's hooks see it).
  virtual void rms_norm_linear(const float* x, const PreparedWeight& norm, float eps, const PreparedWeight& w,
                               int n, float* h, float* y);
  // act = SiLU(g) * u from gu [n][2 inter] (gate columns, then up), then y += act W^T:
  // the FFN's activation and down projection (tmp as linear_add's).
  virtual void silu_mul_linear_add(const float* gu, int n, int inter, const PreparedWeight& w, float* act,
                                   float* y, float* tmp);
  // The attention inputs from the fused projection's rows qkv [n][(Hq + 2 Hkv) d]:
  // q [n][Hq d], k, v [n][Hkv d]; q and k RMS-normed per head with q_norm / k_norm
  // when given (Qwen3; both or neither), then RoPE on q and k (tables as rope()).
  virtual void qkv_heads(const float* qkv, int n, int Hq, int Hkv, int d, const PreparedWeight* q_norm,
                         const PreparedWeight* k_norm, float eps, const float* host_cos,
                         const float* host_sin, float* q, float* k, float* v);
  // A step's attention inputs into its cache: qkv_heads, then the store's transform of q and k
  // (PageStore::transform_queries_keys of `layer`) and the BF16 write of the k / v rows where
  // `rows` places them (PageStore::write_bf16; rows.size() == n). q, k, v are left as the three
  // calls leave them. The CUDA backend does the three in one launch for a step of few rows on a
  // store of its own.
  virtual void qkv_heads_into_cache(const float* qkv, int n, int Hq, int Hkv, int d, const PreparedWeight* q_norm,
                                    const PreparedWeight* k_norm, float eps, const float* host_cos,
                                    const float* host_sin, float* q, float* k, float* v, PageStore& store,
                                    int layer, const RowPlacement& rows);
  // host_out[r] = argmax of row r of x [rows][cols] (ties: the lowest index; NaN never
  // wins; a row of NaN gives 0): greedy decoding without reading the logits back.
  virtual void argmax_rows(const float* x, int rows, int cols, int32_t* host_out);
  // host_out[r] = the token row r of x [rows][cols] yields under draws[r] (backend/sample.h),
  // or kDrawHost / kDrawNaN / kDrawSkipped; hist[0, hist_n) (host) holds the penalized rows'
  // ids. The default (the CPU backend's) takes the argmax rows without a penalty by argmax_rows
  // and answers kDrawHost for every other row: the engine's host sampler draws those (it is the
  // faster one on a CPU). A device backend draws them where the logits are; it may still answer
  // kDrawHost for a row it cannot draw, never a different token.
  virtual void sample_rows(const float* x, int rows, int cols, const RowDraw* draws, const int32_t* hist,
                           int64_t hist_n, int32_t* host_out);
  // Penalty slots this backend keeps for sample_rows (RowDraw::pen_slot): a penalized row's
  // distinct ids stay where the draws run, so a step sends only a row's new ids instead of all of
  // them. 0 (the default): none, every row's ids come with every call.
  virtual int penalty_slots() const { return 0; }

  // --- KV pages
  // The page memory of the caches this backend runs with; empty = host memory
  // (backend/page_store.h). A device backend's caches must be made with it.
  virtual backend::PageStoreFactory page_store_factory() { return {}; }
  // Once per forward step, before the layers: the step's decode batch (one new
  // token per sequence, its row already stored when attention runs) and
  // prefill batch (chunks, tables over the cached tokens only). The tables are
  // the same for every layer (KvBatch::layer changes only the pools); a device
  // backend uploads and plans them here.
  virtual void begin_step(const kv::KvBatch& decode, const kv::KvBatch& prefill) {}

  // --- step graphs (decode steps; a backend without them runs everything eagerly)
  // True when run_graph records and replays (CUDA graphs).
  virtual bool graphs_supported() const { return false; }
  // Runs fn, or replays the device work fn issued the first time it ran under
  // `key`. fn may only call ops whose device work is the same at every replay:
  // fixed buffer addresses and shapes, device inputs already in place (stage
  // host data first: stage_rope), no host reads or uploads. Where recording
  // fails (an op that cannot be recorded, a buffer that has to grow) fn runs
  // eagerly instead, so a wrong key costs speed, never correctness of the call
  // itself; the caller's key must change whenever the work would. Returns true
  // when the work ran from a graph.
  virtual bool run_graph(uint64_t key, const std::function<void()>& fn) {
    fn();
    return false;
  }
  // Forgets every recorded graph (buffers they use were moved or freed).
  virtual void clear_graphs() {}
  // Uploads a step's RoPE tables (host, as rope()) ahead of graphs that apply
  // them: later rope() calls with the same pointers and sizes use this upload.
  virtual void stage_rope(const float* host_cos, const float* host_sin, int n, int head_dim) {}

  // Attention over the paged cache (contracts: kernels/cpu/attention.h).
  // q [batch][Hq][d] -> o [batch][Hq][d]
  virtual void decode_attention(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                                float sm_scale, float* o) = 0;
  // Chunk of batch row b: q [n][Hq][d], k_new/v_new [n][Hkv][d] -> o [n][Hq][d]. A backend may read
  // the chunk's own rows at the precision the cache stores them (BF16; the CPU backend does with
  // reduced-precision weights), so that a prompt's logits do not depend on its chunking.
  virtual void prefill_attention(const kv::PagedKvView& kv, int b, int cached_len,
                                 const float* q, const float* k_new, const float* v_new, int n,
                                 int num_q_heads, float sm_scale, float* o) = 0;

 protected:
  // qkv_heads_into_cache's refusals (oscar::Error): a placement of other than n rows, a layer
  // outside the store. Overrides check the same before they write anything.
  static void check_into_cache(int n, const PageStore& store, int layer, const RowPlacement& rows);
};

}  // namespace oscar::backend
