#include "backend/cuda/backend_cuda.h"
#include "backend/cuda/dev_mem.h"
#ifdef OSCAR_WITH_FLASHINFER
#include "backend/cuda/flashinfer/fi_attention.h"
#endif

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "backend/cuda/ops.cuh"
#include "core/error.h"
#include "core/half.h"
#include "core/quant_format.h"
#include "kernels/cuda/cache_write.h"
#include "kernels/cuda/decode_attention.h"
#include "kernels/cuda/prefill_attention.h"

namespace oscar::backend {

namespace {


using devmem::check;
using devmem::DevMem;
void check_launch(const char* what) { check(cudaGetLastError(), what); }
void check_blas(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw Error(std::string("cuda backend: cuBLAS ") + what + " failed (status " +
                std::to_string(int(s)) + ")");
}

// Host-to-device copies in this file read pageable host memory with
// cudaMemcpyAsync, which stages the data before it returns: the host buffer may
// change right after, so no stream synchronization is needed for them. None of
// them may be recorded into a step graph (a replay would not repeat the host
// side): each checks first (no_capture).
void no_capture(cudaStream_t st, const char* what) {
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(st, &cs), "capture status");
  if (cs != cudaStreamCaptureStatusNone)
    throw Error(std::string("cuda backend: ") + what + " uploads host data: not recordable in a graph");
}

class DeviceBuffer : public Buffer {
 public:
  explicit DeviceBuffer(size_t n) : mem_(std::max<size_t>(n, 1) * sizeof(float)) {
    data_ = mem_.as<float>();
    size_ = n;
  }

 private:
  DevMem mem_;
};

struct CudaWeight : PreparedWeight {
  DevMem w;     // [rows][cols] bf16 or f32
  bool bf16 = false;
  DevMem bias;  // [rows] f32, or empty
};
const CudaWeight& cw(const PreparedWeight& w) { return static_cast<const CudaWeight&>(w); }

// ---------------------------------------------------------------------------
// KV pages in device memory.
class CudaPageStore final : public PageStore {
 public:
  CudaPageStore(const PageStoreSpec& s, cudaStream_t st, std::shared_ptr<std::atomic<uint64_t>> freed)
      : PageStore(s), st_(st), freed_(std::move(freed)) {
    if (s.quant_pages > 0 && s.bits != 2)
      throw Error(s.label + ": the CUDA cache holds 2-bit codes only (this method has " +
                  std::to_string(s.bits) + ")");
    if (s.quant_pages > 0 && s.key_axis != kv::KeyAxis::kToken)
      throw Error(s.label + ": per-channel keys (kivi2) are not supported by the CUDA kernels");
    const size_t ps = size_t(s.page_size), d = size_t(s.head_dim), H = size_t(s.num_kv_heads);
    const size_t bf = size_t(s.bf16_pages) * H * ps * d * 2;  // bytes
    const size_t rows = size_t(s.quant_pages) * H * ps;
    const size_t codes = rows * size_t(packed_row_bytes(int(d), s.bits));
    const size_t params = rows * (d / size_t(std::max(1, s.group_size))) * 2 * 2;
    for (int l = 0; l < s.n_layers; ++l) {
      k_.emplace_back(bf);
      v_.emplace_back(bf);
      if (s.quant_pages > 0) {
        kc_.emplace_back(codes);
        vc_.emplace_back(codes);
        kp_.emplace_back(params);
        vp_.emplace_back(params);
      }
    }
  }

  // Step graphs may hold this store's transforms: the backend drops them all.
  ~CudaPageStore() override { ++*freed_; }

  std::string device() const override { return "cuda"; }
  kv::Bf16PagePool bf16_pool(int l) const override {
    return {k_.at(l).as<uint16_t>(), v_.at(l).as<uint16_t>()};
  }
  kv::QuantPagePool quant_pool(int l) const override {
    if (spec_.quant_pages <= 0) return {};
    return {kc_.at(l).as<uint8_t>(), vc_.at(l).as<uint8_t>(), kp_.at(l).as<uint16_t>(),
            vp_.at(l).as<uint16_t>()};
  }

  void set_quant(std::vector<LayerQuant> layers) override {
    if (int(layers.size()) != spec_.n_layers)
      throw Error(spec_.label + ": quantization for " + std::to_string(layers.size()) +
                  " layers, cache has " + std::to_string(spec_.n_layers));
    const int d = spec_.head_dim, H = spec_.num_kv_heads;
    q_.clear();
    centre_pairs_ = 0;
    centre_layers_ = DevMem();
    centre_freq_ = DevMem();
    std::vector<kernels::cuda::PageCentreLayer> centres(layers.size());
    std::vector<float> freq;  // θ_s of the pairs (empty: no page centering)
    for (const LayerQuant& lq : layers) {
      Layer L;
      L.identity = lq.identity;
      if (int(lq.k_clip.size()) != H || int(lq.v_clip.size()) != H)
        throw Error(spec_.label + ": clip ratios do not match the KV heads");
      L.clip = {lq.k_clip[0], lq.v_clip[0]};
      for (int h = 1; h < H; ++h)
        if (lq.k_clip[h] != lq.k_clip[0] || lq.v_clip[h] != lq.v_clip[0]) {
          // Per-head clip ratios (a calibration searched per head): the demotion takes them all.
          if (H > kernels::cuda::kMaxClipHeads)
            throw Error(spec_.label + ": per-head clip ratios for more than " +
                        std::to_string(kernels::cuda::kMaxClipHeads) + " KV heads are not supported by the CUDA kernels");
          L.head_clips.resize(size_t(H));
          for (int g = 0; g < H; ++g) L.head_clips[g] = {lq.k_clip[g], lq.v_clip[g]};
          break;
        }
      if (!lq.center.empty()) {
        // Page centering: u / w / mu on the device, for the attention and for the demotions'
        // per-page centres (kernels::cuda::page_centres, one launch per flush).
        L.center = lq.center;
        const size_t uw = L.center.u.size() * 4, mu = L.center.mu.size() * 4;
        const size_t S = size_t(L.center.pairs());
        if (L.center.u.size() != size_t(H) * S * d || L.center.w.size() != L.center.u.size() ||
            (!L.center.mu.empty() && L.center.mu.size() != size_t(H) * d) || L.center.freq.size() != S || int(S) > d / 2)
          throw Error(spec_.label + ": page centre of the wrong size");
        // The pairs are the calibration's, the same in every layer (core/key_transform.h).
        if (!freq.empty() && freq != L.center.freq)
          throw Error(spec_.label + ": page centre pairs differ between layers");
        freq = L.center.freq;
        L.cu = DevMem(uw);
        L.cw = DevMem(uw);
        L.cmu = DevMem(mu);
        check(cudaMemcpy(L.cu.p, L.center.u.data(), uw, cudaMemcpyHostToDevice), "upload");
        check(cudaMemcpy(L.cw.p, L.center.w.data(), uw, cudaMemcpyHostToDevice), "upload");
        check(cudaMemcpy(L.cmu.p, L.center.mu.data(), mu, cudaMemcpyHostToDevice), "upload");
      }
      if (!lq.identity) {
        L.n = lq.xf.n;
        const size_t mat = size_t(lq.xf.n) * d * d;
        if (lq.xf.key.size() != mat || lq.xf.query.size() != mat)
          throw Error(spec_.label + ": key transform of the wrong size");
        L.key = DevMem(mat * 4);
        L.query = DevMem(mat * 4);
        check(cudaMemcpy(L.key.p, lq.xf.key.data(), mat * 4, cudaMemcpyHostToDevice), "upload");
        check(cudaMemcpy(L.query.p, lq.xf.query.data(), mat * 4, cudaMemcpyHostToDevice), "upload");
        if (!lq.xf.mean.empty()) {
          if (lq.xf.mean.size() != size_t(H) * d) throw Error(spec_.label + ": key mean of the wrong size");
          L.mean = DevMem(size_t(H) * d * 4);
          check(cudaMemcpy(L.mean.p, lq.xf.mean.data(), size_t(H) * d * 4, cudaMemcpyHostToDevice),
                "upload");
        }
      }
      if (!L.center.empty()) centres[q_.size()] = {L.cu.as<float>(), L.cw.as<float>(), L.cmu.as<float>()};
      q_.push_back(std::move(L));
    }
    if (!freq.empty()) {
      centre_pairs_ = int(freq.size());
      centre_freq_ = DevMem(freq.size() * 4);
      check(cudaMemcpy(centre_freq_.p, freq.data(), freq.size() * 4, cudaMemcpyHostToDevice), "upload");
      centre_layers_ = DevMem(centres.size() * sizeof(centres[0]));
      check(cudaMemcpy(centre_layers_.p, centres.data(), centres.size() * sizeof(centres[0]),
                       cudaMemcpyHostToDevice),
            "upload");
    }
  }

  void write_bf16(int layer, const RowPlacement& rows, const float* k, const float* v) override {
    flush();
    upload_rows(rows);
    check(kernels::cuda::write_bf16_tokens(layer_view(layer), rows.size(), rows_dev_.as<int32_t>(),
                                           rows_dev_.as<int32_t>() + rows.size(), k, v, {}, st_),
          "write_bf16_tokens");
  }

  // What CudaBackend::qkv_heads_into_cache's one launch needs of a layer: its transform (null
  // matrices where it has none), its BF16 pools and the placement of `rows` on the device
  // (uploaded, and the queued demotions run, as write_bf16 does first).
  struct StepTarget {
    const float* Rq = nullptr;
    const float* Rk = nullptr;
    const float* k_mean = nullptr;
    int r_heads = 1;
    kv::Bf16PagePool pool;
    const int32_t* pages = nullptr;
    const int32_t* slots = nullptr;
  };
  StepTarget step_target(int layer, const RowPlacement& rows) {
    flush();
    upload_rows(rows);
    StepTarget t;
    if (!q_.empty() && !q_.at(layer).identity) {
      const Layer& L = q_[layer];
      t.Rq = L.query.as<float>();
      t.Rk = L.key.as<float>();
      t.k_mean = L.mean.as<float>();
      t.r_heads = L.n == 1 ? 1 : spec_.num_kv_heads;
    }
    t.pool = bf16_pool(layer);
    t.pages = rows_dev_.as<int32_t>();
    t.slots = rows_dev_.as<int32_t>() + rows.size();
    return t;
  }
  cudaStream_t stream() const { return st_; }

  kv::MidCenter mid_center(int l) const override {
    kv::MidCenter c;
    if (q_.empty() || q_.at(l).center.empty()) return c;
    const Layer& L = q_[l];
    c.pairs = L.center.pairs();
    c.u = L.cu.as<float>();
    c.w = L.cw.as<float>();
    c.mu = L.cmu.as<float>();
    return c;
  }

  void demote(int32_t src, int32_t dst, int64_t first_pos) override {
    if (q_.empty()) throw Error(spec_.label + ": demotion before set_quant");
    pending_.push_back(src);
    pending_.push_back(dst);
    pending_pos_.push_back(first_pos);
  }

  void copy_bf16_page(int32_t from, int32_t to) override {
    flush();
    const size_t pb = size_t(spec_.num_kv_heads) * spec_.page_size * spec_.head_dim * 2;
    for (int l = 0; l < spec_.n_layers; ++l) {
      check(cudaMemcpyAsync(k_[l].as<char>() + to * pb, k_[l].as<char>() + from * pb, pb,
                            cudaMemcpyDeviceToDevice, st_), "page copy");
      check(cudaMemcpyAsync(v_[l].as<char>() + to * pb, v_[l].as<char>() + from * pb, pb,
                            cudaMemcpyDeviceToDevice, st_), "page copy");
    }
  }

  void transform_keys(int layer, float* k, int n) override {
    if (q_.empty() || n == 0 || q_.at(layer).identity) return;
    const Layer& L = q_[layer];
    check(kernels::cuda::rotate_queries(k, n, spec_.num_kv_heads, spec_.head_dim, L.key.as<float>(),
                                        L.n == 1 ? 1 : spec_.num_kv_heads, k, st_, cuda_ops::pdl(),
                                        L.mean.as<float>()),
          "key transform");
  }
  void transform_queries_keys(int layer, float* q, int n_q_heads, float* k, int n) override {
    if (q_.empty() || n == 0 || q_.at(layer).identity) return;
    const Layer& L = q_[layer];
    check(kernels::cuda::rotate_queries_keys(q, n_q_heads, L.query.as<float>(), k, spec_.num_kv_heads,
                                             L.key.as<float>(), L.mean.as<float>(), n, spec_.head_dim,
                                             L.n == 1 ? 1 : spec_.num_kv_heads, st_, cuda_ops::pdl()),
          "query and key transform");
  }
  void transform_queries(int layer, float* q, int n, int n_q_heads) override {
    if (q_.empty() || n == 0 || q_.at(layer).identity) return;
    const Layer& L = q_[layer];
    check(kernels::cuda::rotate_queries(q, n, n_q_heads, spec_.head_dim, L.query.as<float>(),
                                        L.n == 1 ? 1 : spec_.num_kv_heads, q, st_, cuda_ops::pdl()),
          "query transform");
  }

  void sync() override {
    flush();
    check(cudaStreamSynchronize(st_), "sync");
  }

  void stage_rows(const RowPlacement& rows) override {
    flush();
    upload_rows(rows);
  }

 private:
  struct Layer {
    bool identity = true;
    int n = 1;
    DevMem key, query, mean;
    kernels::cuda::ClipRatios clip;
    std::vector<kernels::cuda::ClipRatios> head_clips;  // [Hkv] when they differ, else empty
    PageCenter center;    // page centering (host), empty: none
    DevMem cu, cw, cmu;   // its u / w / mu on the device
  };

  void upload_rows(const RowPlacement& rows) {
    if (rows.epoch == rows_epoch_ && rows.size() == rows_n_) return;
    no_capture(st_, "the row placement");
    const size_t n = size_t(rows.size());
    staging_.resize(2 * n);
    std::copy(rows.pages.begin(), rows.pages.end(), staging_.begin());
    std::copy(rows.slots.begin(), rows.slots.end(), staging_.begin() + n);
    if (2 * n * 4 + 4 > rows_dev_.bytes) ++*freed_;  // the placement moves: recorded writes go
    rows_dev_.ensure(2 * n * 4 + 4);
    check(cudaMemcpyAsync(rows_dev_.p, staging_.data(), 2 * n * 4, cudaMemcpyHostToDevice, st_),
          "row placement upload");
    rows_epoch_ = rows.epoch;
    rows_n_ = rows.size();
  }

  // Runs the queued demotions (every layer), in order. With page centering, the pages' key
  // centres of every layer first, in one launch on the device.
  void flush() {
    if (pending_.empty()) return;
    no_capture(st_, "a demotion list");
    const size_t n = pending_.size() / 2;
    staging_.resize(2 * n);
    for (size_t i = 0; i < n; ++i) {
      staging_[i] = pending_[2 * i];
      staging_[n + i] = pending_[2 * i + 1];
    }
    pending_.clear();
    demote_dev_.ensure(2 * n * 4);
    check(cudaMemcpyAsync(demote_dev_.p, staging_.data(), 2 * n * 4, cudaMemcpyHostToDevice, st_),
          "demotion upload");
    const int d = spec_.head_dim, H = spec_.num_kv_heads, Ln = spec_.n_layers;
    const size_t per_layer = n * size_t(H) * d;  // floats of one layer's centres
    if (centre_pairs_ > 0) {
      pos_dev_.ensure(n * 8);
      check(cudaMemcpyAsync(pos_dev_.p, pending_pos_.data(), n * 8, cudaMemcpyHostToDevice, st_),
            "demotion position upload");
      offset_dev_.ensure(size_t(Ln) * per_layer * 4);
      check(kernels::cuda::page_centres(centre_layers_.as<kernels::cuda::PageCentreLayer>(), Ln,
                                        centre_freq_.as<float>(), centre_pairs_, H, d, int(n),
                                        pos_dev_.as<int64_t>(), spec_.page_size, offset_dev_.as<float>(), st_),
            "page_centres");
    }
    pending_pos_.clear();
    for (int l = 0; l < Ln; ++l) {
      const float* off = q_[l].center.empty() ? nullptr : offset_dev_.as<float>() + size_t(l) * per_layer;
      check(kernels::cuda::demote_pages(layer_view(l), int(n), demote_dev_.as<int32_t>(),
                                        demote_dev_.as<int32_t>() + n, q_[l].clip, -1, st_, off,
                                        q_[l].head_clips.empty() ? nullptr : q_[l].head_clips.data()),
            "demote_pages");
    }
  }

  cudaStream_t st_;
  // Counts destroyed stores and moved placement buffers: the backend drops its graphs
  // (CudaBackend::run_graph).
  std::shared_ptr<std::atomic<uint64_t>> freed_;
  std::vector<DevMem> k_, v_, kc_, vc_, kp_, vp_;
  std::vector<Layer> q_;
  std::vector<int32_t> pending_;  // (src, dst) pairs
  std::vector<int64_t> pending_pos_;  // first position of each pending page
  int centre_pairs_ = 0;                // S of the page centering (0: none)
  DevMem centre_layers_, centre_freq_;  // [n_layers] PageCentreLayer (null u: none), [S] θ_s
  DevMem pos_dev_;                      // first positions of one flush's pages
  DevMem offset_dev_;                   // their key centres, [n_layers][n][Hkv][d]
  std::vector<int32_t> staging_;
  DevMem rows_dev_, demote_dev_;
  uint64_t rows_epoch_ = 0;
  int rows_n_ = -1;
};

// Device copies of one KvBatch's region tables (the same for every layer).
struct DeviceTables {
  DevMem mem, angles_mem;
  kv::RegionTable sink, mid, recent;
  std::vector<int32_t> host;
  // Page centering: the cache's middle-page angle table (device), copied again only when
  // its version changes (it grows a few times per run), and the batch's start rows.
  const float* angles = nullptr;
  const int32_t* angle_start = nullptr;
  uint64_t angles_version = 0;
  int batch = 0;

  void upload(const kv::KvBatch& b, cudaStream_t st) {
    batch = b.batch();
    const std::vector<int32_t>* parts[10] = {&b.sink_indptr, &b.sink_indices, &b.sink_len,
                                             &b.mid_indptr,  &b.mid_indices,  &b.mid_len,
                                             &b.recent_indptr, &b.recent_indices, &b.recent_len,
                                             &b.mid_angle_start};
    size_t off[11] = {0};
    for (int i = 0; i < 10; ++i) off[i + 1] = off[i] + parts[i]->size() + 1;  // +1: never empty
    host.assign(off[10], 0);
    for (int i = 0; i < 10; ++i) std::copy(parts[i]->begin(), parts[i]->end(), host.begin() + off[i]);
    mem.ensure(off[10] * 4);
    check(cudaMemcpyAsync(mem.p, host.data(), off[10] * 4, cudaMemcpyHostToDevice, st),
          "table upload");
    const int32_t* d = mem.as<int32_t>();
    sink = {d + off[0], d + off[1], d + off[2]};
    mid = {d + off[3], d + off[4], d + off[5]};
    recent = {d + off[6], d + off[7], d + off[8]};
    angles = nullptr;
    angle_start = nullptr;
    if (b.mid_angles && !b.mid_angles->empty()) {
      if (b.mid_angles_version == 0 || b.mid_angles_version != angles_version) {
        angles_mem.ensure(b.mid_angles->size() * 4);
        check(cudaMemcpyAsync(angles_mem.p, b.mid_angles->data(), b.mid_angles->size() * 4,
                              cudaMemcpyHostToDevice, st),
              "angle table upload");
        angles_version = b.mid_angles_version;
      }
      angles = angles_mem.as<float>();
      if (!b.mid_angle_start.empty()) angle_start = d + off[9];
    }
  }
  kv::PagedKvView apply(kv::PagedKvView v) const {
    v.sink = sink;
    v.mid = mid;
    v.recent = recent;
    if (v.center.pairs > 0) {
      v.center.angles = angles;
      v.center.angle_start = angle_start;
    }
    return v;
  }
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaBackendOptions& o) : opts_(o) {
    int n = 0;
    check(cudaGetDeviceCount(&n), "device count");
    if (o.device < 0 || o.device >= n)
      throw Error("cuda backend: device " + std::to_string(o.device) + " not present (" +
                  std::to_string(n) + " visible)");
    check(cudaSetDevice(o.device), "set device");
    check(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, o.device), "attribute");
    check(cudaStreamCreateWithFlags(&st_, cudaStreamNonBlocking), "stream");
    check_blas(cublasCreate(&blas_), "create");
    check_blas(cublasSetStream(blas_, st_), "set stream");
    check_blas(cublasSetMathMode(blas_, CUBLAS_DEFAULT_MATH), "math mode");
    // A workspace of our own, so that cuBLAS allocates nothing while a step
    // graph is recorded (as PyTorch does for the same reason).
    blas_ws_ = DevMem(size_t(32) << 20);
    check_blas(cublasSetWorkspace(blas_, blas_ws_.p, blas_ws_.bytes), "workspace");
    if (opts_.weight_dtype == WeightDtype::kQ8) opts_.weight_dtype = WeightDtype::kBf16;
    if (const char* g = std::getenv("OSCAR_CUDA_GRAPHS")) graphs_ = std::string(g) != "0";
    if (const char* g = std::getenv("OSCAR_CUDA_PENALTY_SLOTS")) pen_slots_on_ = std::string(g) != "0";
    if (const char* g = std::getenv("OSCAR_CUDA_FUSE_HEADS")) fuse_heads_ = std::string(g) != "0";
    if (const char* g = std::getenv("OSCAR_CUDA_GEMV_ROWS")) set_gemv_rows(std::atoi(g));
    if (const char* g = std::getenv("OSCAR_CUDA_GEMV_MMA_ROWS")) gemv_mma_rows_ = std::atoi(g);
    if (const char* g = std::getenv("OSCAR_CUDA_BLAS_BETA")) blas_beta_ = std::string(g) != "0";
    if (const char* g = std::getenv("OSCAR_CUDA_PREFILL_WARPS")) prefill_warps_ = std::atoi(g) == 8 ? 8 : 4;
    if (const char* g = std::getenv("OSCAR_CUDA_BF16_DECODE")) set_bf16_decode(g);
    // Query/key rotations from this many tokens on in the tiled kernel (0: never; A/B only).
    if (const char* g = std::getenv("OSCAR_CUDA_ROTATE_TILED"))
      kernels::cuda::set_rotate_tiled_min_tokens(std::max(0, std::atoi(g)));
    // The tiled rotation on the tensor cores (3xTF32): 0 never, 1 always, auto (the default) for
    // prefill-sized calls (A/B).
    if (const char* g = std::getenv("OSCAR_CUDA_ROTATE_MMA")) {
      const std::string m(g);
      kernels::cuda::set_rotate_mma(m == "0"   ? kernels::cuda::RotateMma::kOff
                                    : m == "1" ? kernels::cuda::RotateMma::kOn
                                               : kernels::cuda::RotateMma::kAuto);
    }
    // The decode planner's split (A/B only): tiles per chunk forced, or CTAs per SM aimed at.
    if (const char* g = std::getenv("OSCAR_CUDA_DECODE_TILES")) decode_tiles_ = std::max(0, std::atoi(g));
    if (const char* g = std::getenv("OSCAR_CUDA_DECODE_CTAS_PER_SM")) decode_ctas_per_sm_ = std::max(0, std::atoi(g));
    // Programmatic dependent launch of the step's small kernels and GEMVs (Hopper on);
    // OSCAR_CUDA_PDL=0 turns it off (A/B).
    int major = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, o.device), "attribute");
    const char* pdl = std::getenv("OSCAR_CUDA_PDL");
    cuda_ops::set_pdl(major >= 9 && !(pdl && std::string(pdl) == "0"));
#ifdef OSCAR_WITH_FLASHINFER
    // The BF16 prefill attention defaults to FlashInfer's where the build has it: its Hopper
    // kernel on sm_90 (H200, Qwen3-8B shapes: 32K prompt 1.53 s against our kernel's 2.47 s),
    // its FA2 kernel elsewhere (docs/gpu-engine.md). OSCAR_CUDA_PREFILL=ours selects ours.
    prefill_fi_ = major == 9 && fi::has_fa3() ? 3 : 2;
#endif
    if (const char* g = std::getenv("OSCAR_CUDA_FUSED_PREFILL"); g && std::string(g) == "0") set_prefill("gemm");
    if (const char* g = std::getenv("OSCAR_CUDA_PREFILL")) set_prefill(g);
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(st_);
    clear_graphs();
    free_decode_ws();
    cublasDestroy(blas_);
    cudaStreamDestroy(st_);
  }

  std::string name() const override {
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, opts_.device);
    return std::string("cuda (") + p.name + ", " + to_string(opts_.weight_dtype) + ")";
  }

  BufferPtr alloc(size_t n) override {
    check(cudaSetDevice(opts_.device), "set device");
    return std::make_unique<DeviceBuffer>(n);
  }
  MemoryInfo device_memory() override {
    check(cudaSetDevice(opts_.device), "set device");
    size_t free = 0, total = 0;
    check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    return {int64_t(free), int64_t(total)};
  }
  double copy_bandwidth() override {
    // Device-to-device copies of 4 GiB (DESIGN §7: ~4.3 TB/s read + write on the H200),
    // timed by events on the backend's stream, best of 5 after one untimed copy.
    check(cudaSetDevice(opts_.device), "set device");
    no_capture(st_, "copy_bandwidth");
    const size_t bytes = size_t(4) << 30;
    DevMem a(bytes), b(bytes);
    check(cudaMemsetAsync(a.p, 1, bytes, st_), "bandwidth memset");
    cudaEvent_t e0, e1;
    check(cudaEventCreate(&e0), "event");
    check(cudaEventCreate(&e1), "event");
    double best = 0;
    for (int r = 0; r < 6; ++r) {
      check(cudaEventRecord(e0, st_), "event");
      check(cudaMemcpyAsync(b.p, a.p, bytes, cudaMemcpyDeviceToDevice, st_), "bandwidth copy");
      check(cudaEventRecord(e1, st_), "event");
      check(cudaEventSynchronize(e1), "event");
      float ms = 0;
      check(cudaEventElapsedTime(&ms, e0, e1), "event");
      if (r > 0 && ms > 0) best = std::max(best, 2.0 * double(bytes) / (double(ms) * 1e-3));
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return best;
  }
  void to_host(const float* src, float* dst, size_t n) override {
    no_capture(st_, "to_host");
    check(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToHost, st_), "to_host");
    check(cudaStreamSynchronize(st_), "to_host");
  }
  void from_host(const float* src, float* dst, size_t n) override {
    no_capture(st_, "from_host");
    check(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyHostToDevice, st_), "from_host");
    check(cudaStreamSynchronize(st_), "from_host");
  }

  WeightPtr prepare_linear(std::initializer_list<const Tensor*> ws,
                           std::initializer_list<const Tensor*> biases) override {
    auto w = std::make_unique<CudaWeight>();
    int64_t cols = -1, rows = 0;
    for (const Tensor* t : ws) {
      if (t->shape.size() != 2) throw Error("cuda backend: linear weight is not a matrix");
      if (cols >= 0 && t->shape[1] != cols)
        throw Error("cuda backend: stacked weights with different input columns");
      cols = t->shape[1];
      rows += t->shape[0];
    }
    w->rows = rows;
    w->cols = cols;
    w->bf16 = opts_.weight_dtype != WeightDtype::kF32;
    const size_t n = size_t(rows) * size_t(cols);
    w->w = DevMem(n * (w->bf16 ? 2 : 4));
    size_t at = 0;
    std::vector<uint16_t> tmp;
    for (const Tensor* t : ws) {
      const size_t m = t->data.size();
      if (w->bf16) {
        tmp.resize(m);
        for (size_t i = 0; i < m; ++i) tmp[i] = f32_to_bf16(t->data[i]);
        check(cudaMemcpy(w->w.as<uint16_t>() + at, tmp.data(), m * 2, cudaMemcpyHostToDevice),
              "weight upload");
      } else {
        check(cudaMemcpy(w->w.as<float>() + at, t->data.data(), m * 4, cudaMemcpyHostToDevice),
              "weight upload");
      }
      at += m;
    }
    w->bytes = int64_t(w->w.bytes);
    if (biases.size()) {
      std::vector<float> b;
      for (const Tensor* t : biases) b.insert(b.end(), t->data.begin(), t->data.end());
      if (int64_t(b.size()) != rows) throw Error("cuda backend: bias does not match the rows");
      w->bias = DevMem(b.size() * 4);
      check(cudaMemcpy(w->bias.p, b.data(), b.size() * 4, cudaMemcpyHostToDevice), "bias upload");
      w->bytes += int64_t(b.size()) * 4;
    }
    return w;
  }

  WeightPtr prepare_vector(const Tensor& v) override {
    auto w = std::make_unique<CudaWeight>();
    w->rows = 1;
    w->cols = v.numel();
    w->w = DevMem(size_t(v.numel()) * 4);
    check(cudaMemcpy(w->w.p, v.data.data(), size_t(v.numel()) * 4, cudaMemcpyHostToDevice),
          "vector upload");
    w->bytes = v.numel() * 4;
    return w;
  }

  WeightPtr prepare_embedding(const Tensor& e) override {
    // Rows are gathered, never streamed: f32, exact (as the CPU backend).
    if (e.shape.size() != 2) throw Error("cuda backend: embedding is not a matrix");
    auto w = std::make_unique<CudaWeight>();
    w->rows = e.shape[0];
    w->cols = e.shape[1];
    w->w = DevMem(size_t(e.numel()) * 4);
    check(cudaMemcpy(w->w.p, e.data.data(), size_t(e.numel()) * 4, cudaMemcpyHostToDevice),
          "embedding upload");
    w->bytes = e.numel() * 4;
    return w;
  }

  void embed(const PreparedWeight& emb, const int32_t* tokens, int n, float* x) override {
    const CudaWeight& e = cw(emb);
    for (int i = 0; i < n; ++i)
      if (tokens[i] < 0 || tokens[i] >= e.rows)
        throw Error("embedding: token id " + std::to_string(tokens[i]) + " outside vocabulary [0, " +
                    std::to_string(e.rows) + ")");
    no_capture(st_, "embed (token ids)");
    tokens_.ensure(size_t(n) * 4);
    check(cudaMemcpyAsync(tokens_.p, tokens, size_t(n) * 4, cudaMemcpyHostToDevice, st_), "tokens");
    cuda_ops::embed(e.w.p, false, tokens_.as<int32_t>(), n, int(e.cols), x, st_);
    check_launch("embed");
  }

  // y = beta y + x W^T (+ b). bf16 weights: up to gemv_rows_ rows our GEMV (fp32
  // activations as they are, bias and beta in its epilogue), beyond cuBLAS with the
  // activations rounded to bf16 (fp32 accumulation and output); f32 weights: SGEMM.
  void gemm(const CudaWeight& w, const float* x, int n, float* y, float beta) {
    const float one = 1.0f;
    const int out = int(w.rows), in = int(w.cols);
    if (uses_gemv(w, x, n)) {
      cuda_ops::gemv_bf16(w.w.as<uint16_t>(), x, n, out, in, w.bias.as<float>(), beta, y, gemv_mma_rows_, st_);
      check_launch("gemv");
      return;
    }
    if (w.bf16) {
      grow(xb_, size_t(n) * in * 2);
      cuda_ops::cast_bf16(x, xb_.as<__nv_bfloat16>(), int64_t(n) * in, st_);
      check_launch("cast");
      return gemm_from_xb(w, n, y, beta);
    }
    check_blas(cublasSgemm(blas_, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w.w.as<float>(), in, x, in, &beta,
                           y, out),
               "SGEMM");
    add_bias(w, n, y);
  }
  // y = beta y + xb_ W^T (+ b) through cuBLAS, xb_ holding the n activation rows in BF16.
  void gemm_from_xb(const CudaWeight& w, int n, float* y, float beta) {
    const float one = 1.0f;
    const int out = int(w.rows), in = int(w.cols);
    check_blas(cublasGemmEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, &one, w.w.p, CUDA_R_16BF, in, xb_.p,
                            CUDA_R_16BF, in, &beta, y, CUDA_R_32F, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
               "bf16 GEMM");
    add_bias(w, n, y);
  }
  void add_bias(const CudaWeight& w, int n, float* y) {
    if (!w.bias.p) return;
    cuda_ops::add_bias(y, w.bias.as<float>(), n, int(w.rows), st_);
    check_launch("bias");
  }
  // Whether a product of n rows goes through cuBLAS in BF16 (its input can then be
  // written in BF16 by the kernel that makes it).
  bool blas_bf16(const CudaWeight& w, const float* x, int n) const { return w.bf16 && !uses_gemv(w, x, n); }

  bool uses_gemv(const CudaWeight& w, const float* x, int n) const {
    return w.bf16 && n <= gemv_rows_ && w.cols % 8 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  }

  void linear(const PreparedWeight& pw, const float* x, int n, float* y) override {
    if (n > 0) gemm(cw(pw), x, n, y, 0.0f);
  }

  void set_gemv_rows(int rows) { gemv_rows_ = std::clamp(rows, 0, cuda_ops::kGemvMaxRows); }
  int gemv_rows() const { return gemv_rows_; }
  void set_gemv_mma_rows(int rows) { gemv_mma_rows_ = rows; }
  int gemv_mma_rows() const { return gemv_mma_rows_; }

  // y += x W^T (+ b): our GEMV adds in its epilogue. Through cuBLAS the product goes
  // accumulates into y (beta = 1), or with OSCAR_CUDA_BLAS_BETA=0 goes to tmp and a kernel adds it.
  void linear_add(const PreparedWeight& pw, const float* x, int n, float* y, float* tmp) override {
    if (n <= 0) return;
    if (blas_beta_ || uses_gemv(cw(pw), x, n)) return gemm(cw(pw), x, n, y, 1.0f);
    Backend::linear_add(pw, x, n, y, tmp);
  }

  // The norm writes the product's BF16 input itself on the cuBLAS path (one launch less).
  void rms_norm_linear(const float* x, const PreparedWeight& norm, float eps, const PreparedWeight& pw, int n,
                       float* h, float* y) override {
    const CudaWeight& w = cw(pw);
    if (n <= 0) return;
    if (!blas_bf16(w, h, n)) return Backend::rms_norm_linear(x, norm, eps, pw, n, h, y);
    if (cw(norm).cols != w.cols) throw Error("rms_norm: weight does not match the row size");
    grow(xb_, size_t(n) * w.cols * 2);
    cuda_ops::rms_norm(x, cw(norm).w.as<float>(), n, int(w.cols), eps, h, xb_.as<__nv_bfloat16>(), st_);
    check_launch("rms_norm");
    gemm_from_xb(w, n, y, 0.0f);
  }
  // Likewise the activation writes the down projection's BF16 input.
  void silu_mul_linear_add(const float* gu, int n, int inter, const PreparedWeight& pw, float* act, float* y,
                           float* tmp) override {
    const CudaWeight& w = cw(pw);
    if (n <= 0) return;
    if (!blas_bf16(w, act, n)) return Backend::silu_mul_linear_add(gu, n, inter, pw, act, y, tmp);
    if (w.cols != inter) throw Error("silu_mul_linear_add: weight does not match the FFN width");
    grow(xb_, size_t(n) * inter * 2);
    cuda_ops::silu_mul(gu, n, inter, act, xb_.as<__nv_bfloat16>(), st_);
    check_launch("silu_mul");
    if (blas_beta_) return gemm_from_xb(w, n, y, 1.0f);
    gemm_from_xb(w, n, tmp, 0.0f);
    cuda_ops::add(y, tmp, int64_t(n) * w.rows, st_);
    check_launch("add");
  }

  // qkv_heads' refusals: one QK-norm weight without the other, weights of another head size.
  static void check_qk_norms(const PreparedWeight* qn, const PreparedWeight* kn, int d) {
    if (!qn != !kn) throw Error("qkv_heads: q_norm and k_norm come together");
    if ((qn && (qn->cols != d || kn->cols != d)) || d % 2 || d / 2 > 1024)
      throw Error("qkv_heads: norm weights do not match head_dim " + std::to_string(d));
  }

  void qkv_heads(const float* qkv, int n, int Hq, int Hkv, int d, const PreparedWeight* qn,
                 const PreparedWeight* kn, float eps, const float* cos, const float* sin, float* q, float* k,
                 float* v) override {
    check_qk_norms(qn, kn, d);
    if (n <= 0) return;
    const float* tab = rope_tables(cos, sin, n, d);
    cuda_ops::qkv_heads(qkv, n, Hq, Hkv, d, qn ? cw(*qn).w.as<float>() : nullptr,
                        kn ? cw(*kn).w.as<float>() : nullptr, eps, tab, tab + size_t(n) * d / 2, q, k, v, st_);
    check_launch("qkv_heads");
  }

  // One launch instead of three (qkv_heads, the store's transform, its BF16 write) for a step
  // of few rows on a store of this backend (cuda_ops::qkv_heads_cache: the same arithmetic);
  // otherwise, or with OSCAR_CUDA_FUSE_HEADS=0, the three.
  void qkv_heads_into_cache(const float* qkv, int n, int Hq, int Hkv, int d, const PreparedWeight* qn,
                            const PreparedWeight* kn, float eps, const float* cos, const float* sin, float* q,
                            float* k, float* v, PageStore& store, int layer, const RowPlacement& rows) override {
    auto* cs = dynamic_cast<CudaPageStore*>(&store);
    if (!fuse_heads_ || !cs || cs->stream() != st_ || n <= 0 || n > cuda_ops::kQkvHeadsCacheMaxRows ||
        (d != 64 && d != 128 && d != 256))
      return Backend::qkv_heads_into_cache(qkv, n, Hq, Hkv, d, qn, kn, eps, cos, sin, q, k, v, store, layer, rows);
    check_into_cache(n, store, layer, rows);
    check_qk_norms(qn, kn, d);
    const PageStoreSpec& sp = cs->spec();
    if (Hkv != sp.num_kv_heads || d != sp.head_dim || Hq % Hkv != 0)
      throw Error("qkv_heads_into_cache: " + std::to_string(Hq) + " query / " + std::to_string(Hkv) +
                  " KV heads of " + std::to_string(d) + " channels for a cache of " + std::to_string(sp.num_kv_heads) +
                  " KV heads of " + std::to_string(sp.head_dim));
    const float* tab = rope_tables(cos, sin, n, d);
    const CudaPageStore::StepTarget t = cs->step_target(layer, rows);
    cuda_ops::QkvHeadsCache a;
    a.qkv = qkv;
    a.n = n;
    a.Hq = Hq;
    a.Hkv = Hkv;
    a.qn = qn ? cw(*qn).w.as<float>() : nullptr;
    a.kn = kn ? cw(*kn).w.as<float>() : nullptr;
    a.eps = eps;
    a.cos = tab;
    a.sin = tab + size_t(n) * d / 2;
    a.q = q;
    a.k = k;
    a.v = v;
    a.Rq = t.Rq;
    a.Rk = t.Rk;
    a.k_mean = t.k_mean;
    a.r_heads = t.r_heads;
    a.cache_k = t.pool.k;
    a.cache_v = t.pool.v;
    a.pages = t.pages;
    a.slots = t.slots;
    a.page_size = sp.page_size;
    cuda_ops::qkv_heads_cache(a, d, st_);
    check_launch("qkv_heads_into_cache");
    ++fused_heads_calls_;
  }
  void set_fuse_heads(bool on) { fuse_heads_ = on; }
  bool fuse_heads() const { return fuse_heads_; }
  int64_t fused_heads_calls() const { return fused_heads_calls_; }

  void argmax_rows(const float* x, int rows, int cols, int32_t* out) override {
    no_capture(st_, "argmax_rows");
    if (rows <= 0) return;
    const size_t ids = (size_t(rows) * 4 + 15) / 16 * 16;
    argmax_.ensure(ids + cuda_ops::argmax_scratch_bytes(rows, cols));  // (no graph reads it)
    cuda_ops::argmax_rows(x, rows, cols, static_cast<char*>(argmax_.p) + ids, argmax_.as<int32_t>(), st_);
    check_launch("argmax_rows");
    check(cudaMemcpyAsync(out, argmax_.p, size_t(rows) * 4, cudaMemcpyDeviceToHost, st_), "argmax_rows");
    check(cudaStreamSynchronize(st_), "argmax_rows");
  }

  // Every row in one launch (cuda_ops::sample_rows): the draws and the penalty ids go up, the
  // ids come back. Penalty slots (RowDraw::pen_slot) live in pen_slots_, grown to the highest
  // slot named so far (their contents kept).
  int penalty_slots() const override { return pen_slots_on_ ? kPenaltySlots : 0; }
  void sample_rows(const float* x, int rows, int cols, const RowDraw* draws, const int32_t* hist, int64_t hist_n,
                   int32_t* out) override {
    no_capture(st_, "sample_rows");
    if (rows <= 0) return;
    int top_slot = -1;
    bool counts = false;  // a row with a presence or frequency penalty: its adjusted copy in adj_
    for (int r = 0; r < rows; ++r) {
      const RowDraw& d = draws[r];
      if (d.pen_slot < -1 || d.pen_slot >= penalty_slots())
        throw Error("cuda backend: sample_rows: penalty slot " + std::to_string(d.pen_slot));
      if (d.hist_off < 0 || d.hist_len < 0 || d.hist_off + int64_t(d.hist_len) > hist_n || d.cnt_off < 0 ||
          d.cnt_len < 0 || d.cnt_off + 2 * int64_t(d.cnt_len) > hist_n)
        throw Error("cuda backend: sample_rows: row " + std::to_string(r) + "'s ids outside the " +
                    std::to_string(hist_n) + " given");
      top_slot = std::max(top_slot, d.pen_slot);
      counts = counts || ((d.presence != 0.0f || d.frequency != 0.0f) && d.mode != RowDraw::kSkip &&
                          d.mode != RowDraw::kHost);
    }
    if (counts) adj_.ensure(size_t(rows) * size_t(cols) * sizeof(float));
    const size_t slot_bytes = size_t(top_slot + 1) * cuda_ops::kPenaltySlotBytes;
    if (slot_bytes > pen_slots_.bytes) {  // grown with the slots' contents
      DevMem grown(std::max(slot_bytes, pen_slots_.bytes * 2));
      if (pen_slots_.bytes)
        check(cudaMemcpyAsync(grown.p, pen_slots_.p, pen_slots_.bytes, cudaMemcpyDeviceToDevice, st_), "sample_rows");
      check(cudaStreamSynchronize(st_), "sample_rows");  // (the old buffer is freed below)
      pen_slots_ = std::move(grown);
    }
    const size_t ids = (size_t(rows) * 4 + 15) / 16 * 16, dr = (size_t(rows) * sizeof(RowDraw) + 15) / 16 * 16;
    sample_.ensure(ids + dr + size_t(hist_n) * 4);
    auto* dd = reinterpret_cast<RowDraw*>(static_cast<char*>(sample_.p) + ids);
    auto* dh = reinterpret_cast<int32_t*>(static_cast<char*>(sample_.p) + ids + dr);
    check(cudaMemcpyAsync(dd, draws, size_t(rows) * sizeof(RowDraw), cudaMemcpyHostToDevice, st_), "sample_rows");
    if (hist_n > 0)
      check(cudaMemcpyAsync(dh, hist, size_t(hist_n) * 4, cudaMemcpyHostToDevice, st_), "sample_rows");
    cuda_ops::sample_rows(x, rows, cols, dd, dh, top_slot >= 0 ? pen_slots_.as<uint32_t>() : nullptr,
                          counts ? adj_.as<float>() : nullptr, sample_.as<int32_t>(), st_);
    check_launch("sample_rows");
    check(cudaMemcpyAsync(out, sample_.p, size_t(rows) * 4, cudaMemcpyDeviceToHost, st_), "sample_rows");
    check(cudaStreamSynchronize(st_), "sample_rows");
  }


  void rms_norm(const float* x, const PreparedWeight& pw, int rows, int dim, float eps,
                float* y) override {
    if (cw(pw).cols != dim) throw Error("rms_norm: weight does not match the row size");
    cuda_ops::rms_norm(x, cw(pw).w.as<float>(), rows, dim, eps, y, nullptr, st_);
    check_launch("rms_norm");
  }

  void stage_rope(const float* cos, const float* sin, int n, int head_dim) override {
    no_capture(st_, "stage_rope");
    const size_t m = size_t(n) * head_dim / 2;
    grow(rope_tab_, 2 * m * 4);
    check(cudaMemcpyAsync(rope_tab_.p, cos, m * 4, cudaMemcpyHostToDevice, st_), "rope");
    check(cudaMemcpyAsync(rope_tab_.as<float>() + m, sin, m * 4, cudaMemcpyHostToDevice, st_), "rope");
    rope_cos_ = cos;
    rope_n_ = n;
    rope_d_ = head_dim;
  }

  // The device copy of a step's RoPE tables (cos, then sin): the same host tables serve q
  // and k of every layer in a step, so they are uploaded once (or staged before graphs).
  const float* rope_tables(const float* cos, const float* sin, int n, int head_dim) {
    if (cos != rope_cos_ || n != rope_n_ || head_dim != rope_d_) stage_rope(cos, sin, n, head_dim);
    return rope_tab_.as<float>();
  }

  void rope(float* x, int n, int heads, int head_dim, const float* cos, const float* sin) override {
    const float* tab = rope_tables(cos, sin, n, head_dim);
    cuda_ops::rope(x, n, heads, head_dim, tab, tab + size_t(n) * head_dim / 2, st_);
    check_launch("rope");
  }

  void silu_mul(const float* gu, int n, int inter, float* out) override {
    cuda_ops::silu_mul(gu, n, inter, out, nullptr, st_);
    check_launch("silu_mul");
  }
  void add(float* x, const float* y, size_t n) override {
    cuda_ops::add(x, y, int64_t(n), st_);
    check_launch("add");
  }
  void copy_cols(const float* src, int n, int src_cols, int col0, int width, float* dst) override {
    if (n <= 0 || width <= 0) return;
    check(cudaMemcpy2DAsync(dst, size_t(width) * 4, src + col0, size_t(src_cols) * 4,
                            size_t(width) * 4, size_t(n), cudaMemcpyDeviceToDevice, st_),
          "copy_cols");
  }

  PageStoreFactory page_store_factory() override {
    cudaStream_t st = st_;
    const int dev = opts_.device;
    auto freed = stores_freed_;
    return [st, dev, freed](const PageStoreSpec& s) -> std::unique_ptr<PageStore> {
      check(cudaSetDevice(dev), "set device");
      return std::make_unique<CudaPageStore>(s, st, freed);
    };
  }

  // Step graphs: one cudaGraphExec per key, recorded by stream capture on the
  // backend's stream (docs/gpu-engine.md, "Step graphs").
  bool graphs_supported() const override { return graphs_; }

  bool run_graph(uint64_t key, const std::function<void()>& fn) override {
    if (!graphs_) {
      fn();
      return false;
    }
    // A destroyed page store may have held buffers a graph reads.
    const uint64_t freed = stores_freed_->load();
    if (freed != stores_freed_seen_) {
      clear_graphs();
      stores_freed_seen_ = freed;
    }
    if (auto it = graphs_map_.find(key); it != graphs_map_.end()) {
      check(cudaGraphLaunch(it->second, st_), "graph launch");
      return true;
    }
    // Two failed recordings of one key: it runs eagerly from then on.
    if (auto f = graph_failures_.find(key); f != graph_failures_.end() && f->second >= 2) {
      fn();
      return false;
    }
    // A bound on what the recorded graphs hold (a server sees many batch sizes: one set of
    // n_layers + 1 graphs each): past it, start over.
    if (graphs_map_.size() >= kMaxGraphs) clear_graphs();
    check(cudaSetDevice(opts_.device), "set device");
    check(cudaStreamBeginCapture(st_, cudaStreamCaptureModeThreadLocal), "begin capture");
    capturing_ = true;
    bool ok = true;
    try {
      fn();
    } catch (const std::exception&) {
      ok = false;  // not recordable (or a real error, which the eager run below raises again)
    }
    capturing_ = false;
    cudaGraph_t g = nullptr;
    cudaError_t e = cudaStreamEndCapture(st_, &g);
    cudaGraphExec_t x = nullptr;
    if (ok && e == cudaSuccess && g) e = cudaGraphInstantiate(&x, g, 0);
    if (g) cudaGraphDestroy(g);
    if (ok && e == cudaSuccess && x) {
      graphs_map_.emplace(key, x);
      check(cudaGraphLaunch(x, st_), "graph launch");
      return true;
    }
    cudaGetLastError();  // the failed capture's error is not the device's
    ++graph_failures_[key];
    fn();
    return false;
  }

  void clear_graphs() override {
    for (auto& [k, x] : graphs_map_) cudaGraphExecDestroy(x);
    graphs_map_.clear();
    graph_failures_.clear();
  }

  void begin_step(const kv::KvBatch& dec, const kv::KvBatch& pre) override {
    // The current device is per host thread: the serving loop runs steps on its own thread.
    check(cudaSetDevice(opts_.device), "set device");
    rope_cos_ = nullptr;  // new step, new tables
    dec_.upload(dec, st_);
    pre_.upload(pre, st_);
    have_plan_ = false;
    if (dec.batch() > 0) {
      kernels::cuda::HostRegions hr;
      hr.len[0] = dec.sink_len.data();
      hr.len[1] = dec.mid_len.data();
      hr.len[2] = dec.recent_len.data();
      hr.indptr[0] = dec.sink_indptr.data();
      hr.indptr[1] = dec.mid_indptr.data();
      hr.indptr[2] = dec.recent_indptr.data();
      // Page centering: a middle CTA stages the shifts of its chunk's pages, so chunks are kept
      // within the pages it has room for (at pages of 64, 32K contexts and 132 SMs the cap binds at
      // 128 sequences with 2 KV heads, 48 with 4, 32 with 8: their middles get more chunks).
      plan_centered_ = dec.centers && dec.mid_angles && !dec.mid_angles->empty();
      plan_ = kernels::cuda::plan_decode(
          dec.batch(), hr, dec.base.num_kv_heads, num_sms_, decode_tiles_, decode_ctas_per_sm_, -1.0f, -1,
          plan_centered_ ? kernels::cuda::center_max_chunk_tiles(dec.base.page_size) : 0);
      have_plan_ = true;
      plan_uploaded_ = false;
      fi_planned_ = false;
      if (bf16_flashinfer_) plan_flashinfer(dec);
    }
  }

  void decode_attention(const kv::PagedKvView& view, const float* q, int num_q_heads,
                        float sm_scale, float* o) override {
    if (!have_plan_ || view.batch != dec_.batch)
      throw Error("cuda backend: decode attention without begin_step tables for this batch");
    if (!plan_uploaded_) {
      ensure_decode_ws(plan_.num_chunks, view.batch, num_q_heads, view.head_dim);
      check(kernels::cuda::upload_plan(plan_, ws_, st_), "upload_plan");
      plan_uploaded_ = true;
    }
    kernels::cuda::DecodeParams p;
    p.kv = dec_.apply(view);
    p.q = q;
    p.num_q_heads = num_q_heads;
    p.sm_scale = sm_scale;
    p.o = o;
    const bool any_mid = view.quant.k_codes != nullptr;
    const std::string why = kernels::cuda::check_decode(p, plan_, ws_);
    if (!why.empty()) throw Error("cuda backend: decode attention: " + why);
    if (!any_mid && bf16_flashinfer_) return flashinfer_decode(p.kv, q, num_q_heads, sm_scale, o);
    check(any_mid ? kernels::cuda::decode_attention(p, plan_, ws_, st_)
                  : kernels::cuda::decode_attention_bf16(p, plan_, ws_, st_),
          "decode_attention");
  }

  // The BF16 decode on one of FlashInfer's kernels instead of ours (a comparison baseline;
  // builds with OSCAR_FLASHINFER_INCLUDE): "flashinfer" its CUDA-core decode, "flashinfer-tc"
  // its tensor-core one. Env OSCAR_CUDA_BF16_DECODE=ours|flashinfer|flashinfer-tc.
  void set_bf16_decode(const std::string& which) {
    if (which == "ours") {
      bf16_flashinfer_ = false;
      return;
    }
    if (which != "flashinfer" && which != "flashinfer-tc")
      throw Error("cuda backend: BF16 decode '" + which + "' is not one of ours, flashinfer, flashinfer-tc");
#ifdef OSCAR_WITH_FLASHINFER
    bf16_flashinfer_ = true;
    fi_tc_ = which == "flashinfer-tc";
    fi_hq_ = 0;  // plan again
#else
    throw Error("cuda backend: this build has no FlashInfer (configure with OSCAR_FLASHINFER_INCLUDE; "
                "scripts/fetch_flashinfer.sh)");
#endif
  }
  // The BF16 prefill attention: "ours" (the fused kernel), "gemm" (the GEMM path),
  // "flashinfer-fa2" / "flashinfer-fa3" (FlashInfer's kernels on the same gathered rows; builds
  // with OSCAR_FLASHINFER_INCLUDE, FA3 also with its CUTLASS headers). The default is FlashInfer's
  // where the build has it (FA3 on sm_90), else ours (constructor). Env OSCAR_CUDA_PREFILL.
  void set_prefill(const std::string& which) {
    if (which == "ours" || which == "gemm") {
      fused_prefill_ = which == "ours";
      prefill_fi_ = 0;
      return;
    }
    if (which != "flashinfer-fa2" && which != "flashinfer-fa3")
      throw Error("cuda backend: prefill '" + which + "' is not one of ours, gemm, flashinfer-fa2, flashinfer-fa3");
#ifdef OSCAR_WITH_FLASHINFER
    if (which == "flashinfer-fa3" && !fi::has_fa3())
      throw Error("cuda backend: this build has FlashInfer without its Hopper prefill (CUTLASS headers and "
                  "sm_90 in OSCAR_CUDA_ARCHS)");
    prefill_fi_ = which == "flashinfer-fa3" ? 3 : 2;
#else
    throw Error("cuda backend: this build has no FlashInfer (configure with OSCAR_FLASHINFER_INCLUDE; "
                "scripts/fetch_flashinfer.sh)");
#endif
  }
  std::string prefill_kernel() const {
    return prefill_fi_ == 3 ? "flashinfer-fa3" : prefill_fi_ == 2 ? "flashinfer-fa2" : fused_prefill_ ? "ours" : "gemm";
  }
  std::string bf16_decode() const {
    return bf16_flashinfer_ ? (fi_tc_ ? "flashinfer-tc" : "flashinfer") : "ours";
  }
  int64_t flashinfer_calls() const { return fi_calls_; }

  void prefill_attention(const kv::PagedKvView& view, int b, int L, const float* q,
                         const float* k_new, const float* v_new, int n, int Hq, float sm_scale,
                         float* o) override {
    // f32 weights: the exact mode (fp32 GEMMs, no TF32); else BF16 tensor cores.
    if (opts_.weight_dtype == WeightDtype::kF32)
      prefill<float>(view, b, L, q, k_new, v_new, n, Hq, sm_scale, o, CUDA_R_32F);
    else
      prefill<__nv_bfloat16>(view, b, L, q, k_new, v_new, n, Hq, sm_scale, o, CUDA_R_16BF);
  }

 private:
  // FlashInfer takes one page list per sequence with full pages but the last: the BF16
  // cache's (every page in the recent region, in order). Planned once per step.
  void plan_flashinfer(const kv::KvBatch& dec) {
#ifdef OSCAR_WITH_FLASHINFER
    const int B = dec.batch(), ps = dec.base.page_size;
    if (!dec.sink_indices.empty() || !dec.mid_indices.empty()) return;  // a 2-bit cache: ours runs
    for (int b = 0; b < B; ++b)
      if (dec.sink_len[b] != 0 || dec.mid_len[b] != 0) return;
    fi_last_.resize(B);
    fi_indptr_.assign(dec.recent_indptr.begin(), dec.recent_indptr.end());
    for (int b = 0; b < B; ++b) {
      const int np = dec.recent_indptr[b + 1] - dec.recent_indptr[b], len = dec.recent_len[b];
      if (np != (len + ps - 1) / ps || len <= 0)
        throw Error("cuda backend: flashinfer decode: sequence " + std::to_string(b) + " has " +
                    std::to_string(np) + " pages for " + std::to_string(len) + " tokens");
      fi_last_[b] = len - (np - 1) * ps;
    }
    fi_last_dev_.ensure(size_t(B) * 4);
    check(cudaMemcpyAsync(fi_last_dev_.p, fi_last_.data(), size_t(B) * 4, cudaMemcpyHostToDevice, st_),
          "flashinfer last pages");
    fi_hq_ = 0;  // planned at the first layer (the query heads come with it)
    fi_planned_ = true;
#else
    (void)dec;
#endif
  }

  void flashinfer_decode(const kv::PagedKvView& kv, const float* q, int num_q_heads, float sm_scale, float* o) {
#ifdef OSCAR_WITH_FLASHINFER
    if (!fi_planned_) throw Error("cuda backend: flashinfer decode: the step's cache is not all BF16");
    if (fi_hq_ != num_q_heads) {
      fi_.plan(fi_tc_, fi_indptr_.data(), kv.batch, num_q_heads, kv.num_kv_heads, kv.page_size, kv.head_dim, st_);
      fi_hq_ = num_q_heads;
    }
    fi_.run(q, kv.bf16.k, kv.bf16.v, kv.recent.indptr, kv.recent.indices, fi_last_dev_.as<int32_t>(), sm_scale, o,
            cuda_ops::pdl(), st_);
    ++fi_calls_;
#else
    (void)kv, (void)q, (void)num_q_heads, (void)sm_scale, (void)o;
    throw Error("cuda backend: this build has no FlashInfer");
#endif
  }

  // Prefill attention of one chunk (T: the GEMM input type, dt its cuBLAS name):
  // gather K, V [Hkv][L+n][d]; per query sub-chunk, S = Q K^T (queries of a GQA
  // group stacked, one batched GEMM over KV heads), causal softmax, O = P V.
  template <typename T>
  void prefill(const kv::PagedKvView& view, int b, int L, const float* q, const float* k_new,
               const float* v_new, int n, int Hq, float sm_scale, float* o, cudaDataType dt) {
    const kv::PagedKvView kv = pre_.apply(view);
    const int Hkv = kv.num_kv_heads, d = kv.head_dim, G = Hq / Hkv;
    const int Lt = L + n;
    kv_.ensure(2 * size_t(Hkv) * Lt * d * sizeof(T));
    T* K = kv_.as<T>();
    T* V = K + size_t(Hkv) * Lt * d;
    cuda_ops::gather_kv<T>(kv, b, L, k_new, v_new, Lt, K, V, st_);
    check_launch("gather_kv");
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#ifdef OSCAR_WITH_FLASHINFER
      // FlashInfer's prefill kernels on the same gathered rows (the default where the build has
      // them, set_prefill), at head_dim 128: the dim they were measured and tested at on the
      // H200 (docs/gpu-engine.md); other head dims run ours.
      if (prefill_fi_ != 0 && d == 128) {
        fi_prefill_.run(prefill_fi_ == 3 ? fi::PrefillKernel::kFa3 : fi::PrefillKernel::kFa2, q,
                        reinterpret_cast<const uint16_t*>(K), reinterpret_cast<const uint16_t*>(V), n, L, Lt, Hq, Hkv,
                        d, sm_scale, o, st_);
        return;
      }
#endif
      // The fused kernel: the scores stay on chip (kernels/cuda/prefill_attention.h).
      if (fused_prefill_ && kernels::cuda::prefill_attention_supported(d)) {
        check(kernels::cuda::prefill_attention_bf16(q, reinterpret_cast<const uint16_t*>(K),
                                                    reinterpret_cast<const uint16_t*>(V), n, L, Lt, Hq, Hkv, d,
                                                    sm_scale, o, st_, prefill_warps_),
              "prefill attention");
        return;
      }
    }
    // Query rows in sub-chunks so that the scores stay within ~512 MiB.
    const int64_t budget = int64_t(512) << 20;
    const int nc_max = int(std::clamp<int64_t>(budget / (int64_t(Hq) * Lt * 4), 1, n));
    const float one = 1.0f, zero = 0.0f;
    for (int t0 = 0; t0 < n; t0 += nc_max) {
      const int nc = std::min(nc_max, n - t0);
      const int Ls = L + t0 + nc;  // keys this sub-chunk sees
      const int rows = nc * G;
      qp_.ensure(size_t(Hkv) * rows * d * sizeof(T));
      s_.ensure(size_t(Hkv) * rows * Ls * 4);
      p_.ensure(size_t(Hkv) * rows * Ls * sizeof(T));
      op_.ensure(size_t(Hkv) * rows * d * 4);
      cuda_ops::permute_q<T>(q, t0, nc, Hq, Hkv, d, qp_.as<T>(), st_);
      check_launch("permute_q");
      check_blas(cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_T, CUBLAS_OP_N, Ls, rows, d, &one, K, dt,
                                            d, int64_t(Lt) * d, qp_.p, dt, d, int64_t(rows) * d,
                                            &zero, s_.p, CUDA_R_32F, Ls, int64_t(rows) * Ls, Hkv,
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "scores");
      cuda_ops::causal_softmax<T>(s_.as<float>(), Hkv, nc, G, Ls, L, t0, sm_scale, p_.as<T>(), st_);
      check_launch("softmax");
      check_blas(cublasGemmStridedBatchedEx(blas_, CUBLAS_OP_N, CUBLAS_OP_N, d, rows, Ls, &one, V, dt,
                                            d, int64_t(Lt) * d, p_.p, dt, Ls, int64_t(rows) * Ls,
                                            &zero, op_.p, CUDA_R_32F, d, int64_t(rows) * d, Hkv,
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "values");
      cuda_ops::unpermute_o(op_.as<float>(), t0, nc, Hq, Hkv, d, o, st_);
      check_launch("unpermute_o");
    }
  }

  // Grows a buffer that step graphs may use: graphs that baked in the old
  // address are dropped; never while recording (the eager run grows it).
  void grow(DevMem& m, size_t n) {
    if (n <= m.bytes) return;
    if (capturing_) throw Error("cuda backend: buffer growth while recording a graph");
    clear_graphs();
    m.ensure(n);
  }

  void ensure_decode_ws(int chunks, int batch, int hq, int d) {
    if (ws_.capacity >= chunks && ws_.max_batch >= batch && ws_.max_q_heads >= hq && ws_.head_dim == d) return;
    check(cudaStreamSynchronize(st_), "workspace");
    free_decode_ws();
    ws_ = kernels::cuda::alloc_decode_workspace(std::max(chunks, 2 * ws_cap_hint_), std::max(batch, 8), hq, d);
    ws_cap_hint_ = std::max(chunks, ws_cap_hint_);
  }
  void free_decode_ws() {
    if (ws_.capacity) kernels::cuda::free_decode_workspace(ws_);
    ws_ = {};
  }

  CudaBackendOptions opts_;
  int num_sms_ = 0;
  cudaStream_t st_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  DevMem blas_ws_;
  static constexpr size_t kMaxGraphs = 8192;
  // Linear layers of at most this many rows use gemv_bf16: it beats cuBLAS at 1 row only
  // (H200, Qwen3-8B shapes: 4.10 vs 4.32 ms for a step's linear layers; 2 rows 4.69 vs 4.34).
  int gemv_rows_ = 1;
  // From this many rows on the GEMV runs on the tensor cores (gemv_mma_k), below on
  // the CUDA cores (gemv_bf16_k); env OSCAR_CUDA_GEMV_MMA_ROWS.
  int gemv_mma_rows_ = 2;
  bool blas_beta_ = true;  // residual adds through cuBLAS's beta = 1 (OSCAR_CUDA_BLAS_BETA=0: tmp + add kernel)
  bool graphs_ = true, capturing_ = false;  // OSCAR_CUDA_GRAPHS=0: eager steps
  std::unordered_map<uint64_t, cudaGraphExec_t> graphs_map_;
  std::unordered_map<uint64_t, int> graph_failures_;
  std::shared_ptr<std::atomic<uint64_t>> stores_freed_ = std::make_shared<std::atomic<uint64_t>>(0);
  uint64_t stores_freed_seen_ = 0;
  bool fuse_heads_ = true;      // qkv_heads_into_cache in one launch (OSCAR_CUDA_FUSE_HEADS)
  int64_t fused_heads_calls_ = 0;  // ... launches of it (tests)
  bool fused_prefill_ = true;  // BF16 prefill through the fused kernel (else the GEMM path)
  int prefill_warps_ = 4;      // its CTA: 4 or 8 warps of 16 query rows
  DevMem argmax_;
  DevMem sample_;  // sample_rows: ids, the draws, the penalty ids
  static constexpr int kPenaltySlots = 4096;  // at most 128 MiB (32 KB each), allocated as named
  DevMem pen_slots_;
  DevMem adj_;  // sample_rows: the adjusted logits of rows with a presence / frequency penalty
  bool pen_slots_on_ = true;  // OSCAR_CUDA_PENALTY_SLOTS=0: none (the ids whole every step; A/B)
  DevMem tokens_, xb_, rope_tab_, kv_, qp_, s_, p_, op_;
  const float* rope_cos_ = nullptr;
  int rope_n_ = 0, rope_d_ = 0;
  DeviceTables dec_, pre_;
  kernels::cuda::DecodePlan plan_;
  bool have_plan_ = false, plan_uploaded_ = false;
  kernels::cuda::DecodeWorkspace ws_{};
  int ws_cap_hint_ = 0;
  bool plan_centered_ = false;  // this step's view has page centres (begin_step)
  int decode_tiles_ = 0, decode_ctas_per_sm_ = 0;  // plan_decode's knobs (0: its defaults)
  bool bf16_flashinfer_ = false;  // BF16 decode on FlashInfer's kernel (set_bf16_decode)
  bool fi_tc_ = false;            // its tensor-core decode
  bool fi_planned_ = false;
  int fi_hq_ = 0;
  int64_t fi_calls_ = 0;
  std::vector<int32_t> fi_last_, fi_indptr_;  // this step's last-page rows and page counts (host)
  DevMem fi_last_dev_;
  int prefill_fi_ = 0;  // 2: FlashInfer FA2, 3: FA3 (set_prefill)
#ifdef OSCAR_WITH_FLASHINFER
  fi::BatchDecode fi_;
  fi::Prefill fi_prefill_;
#endif
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions& opts) {
  return std::make_unique<CudaBackend>(opts);
}

namespace {
CudaBackend& as_cuda(Backend& be) {
  auto* c = dynamic_cast<CudaBackend*>(&be);
  if (!c) throw Error("not a CUDA backend");
  return *c;
}
}  // namespace

void set_cuda_gemv_rows(Backend& be, int rows) { as_cuda(be).set_gemv_rows(rows); }
void set_cuda_fuse_heads(Backend& be, bool on) { as_cuda(be).set_fuse_heads(on); }
bool cuda_fuse_heads(Backend& be) { return as_cuda(be).fuse_heads(); }
int64_t cuda_fused_heads_calls(Backend& be) { return as_cuda(be).fused_heads_calls(); }
int cuda_gemv_rows(Backend& be) { return as_cuda(be).gemv_rows(); }
void set_cuda_gemv_mma_min_rows(Backend& be, int rows) { as_cuda(be).set_gemv_mma_rows(rows); }
int cuda_gemv_mma_min_rows(Backend& be) { return as_cuda(be).gemv_mma_rows(); }
void set_cuda_bf16_decode(Backend& be, const std::string& which) { as_cuda(be).set_bf16_decode(which); }
std::string cuda_bf16_decode(Backend& be) { return as_cuda(be).bf16_decode(); }
int64_t cuda_flashinfer_calls(Backend& be) { return as_cuda(be).flashinfer_calls(); }
void set_cuda_prefill(Backend& be, const std::string& which) { as_cuda(be).set_prefill(which); }
std::string cuda_prefill(Backend& be) { return as_cuda(be).prefill_kernel(); }
bool cuda_has_flashinfer() {
#ifdef OSCAR_WITH_FLASHINFER
  return true;
#else
  return false;
#endif
}

bool cuda_device_available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

}  // namespace oscar::backend
