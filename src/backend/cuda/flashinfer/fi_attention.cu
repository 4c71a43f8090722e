// FlashInfer's decode kernels over our BF16 pages and its FA2 single prefill over our gathered rows
// (fi_attention.h). The Params struct is what FlashInfer's JIT generates for a batch decode
// module (its batch_decode_customize_config template), written out here for one configuration:
// no positional encoding in the kernel, no sliding window, no logits cap, no ALiBi.
#include "backend/cuda/flashinfer/fi_attention.h"

#include <flashinfer/attention/decode.cuh>
#include <flashinfer/attention/prefill.cuh>
#include <flashinfer/attention/scheduler.cuh>
#include <flashinfer/attention/variants.cuh>

#include <exception>
#include <type_traits>
#include <vector>

namespace oscar::backend::fi {
namespace {

using namespace flashinfer;

struct Params {
  using DTypeQ = float;
  using DTypeKV = __nv_bfloat16;
  using DTypeO = __nv_bfloat16;  // its split-KV merge is not instantiable for fp32 at every head_dim
  using IdType = int32_t;

  DTypeQ* q;
  paged_kv_t<DTypeKV, IdType> paged_kv;
  DTypeO* o;
  float* lse;

  float* maybe_alibi_slopes;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;

  uint32_t padded_batch_size;
  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;
  bool enable_pdl;

  IdType* request_indices;
  IdType* kv_tile_indices;
  IdType* o_indptr;
  IdType* kv_chunk_size_ptr;
  bool* block_valid_mask;
  bool partition_kv;

  __host__ __device__ __forceinline__ int32_t get_qo_len(int32_t) const { return 1; }
  __host__ __device__ __forceinline__ int32_t get_kv_len(int32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};

// The tensor-core decode (FlashInfer's `use_tensor_cores=True`): its FA2 batch prefill kernel with
// one query row per request and no mask. Its MMAs take BF16 queries.
struct PagedParams {
  using DTypeQ = __nv_bfloat16;
  using DTypeKV = __nv_bfloat16;
  using DTypeO = __nv_bfloat16;
  using IdType = int32_t;

  DTypeQ* q;
  paged_kv_t<DTypeKV, IdType> paged_kv;
  IdType* q_indptr;
  DTypeO* o;
  float* lse;
  uint_fastdiv group_size;

  uint8_t* maybe_custom_mask;
  float* maybe_alibi_slopes;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;

  uint32_t num_qo_heads;
  IdType q_stride_n;
  IdType q_stride_h;
  int32_t window_left;

  IdType* request_indices;
  IdType* qo_tile_indices;
  IdType* kv_tile_indices;
  IdType* merge_indptr;
  IdType* o_indptr;
  bool* block_valid_mask;
  IdType* kv_chunk_size_ptr;
  uint32_t max_total_num_rows;
  uint32_t* total_num_rows;
  uint32_t padded_batch_size;
  bool partition_kv;

  __host__ __device__ __forceinline__ uint32_t get_qo_len(uint32_t batch_idx) const {
    return q_indptr[batch_idx + 1] - q_indptr[batch_idx];
  }
  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t batch_idx) const {
    return paged_kv.get_length(batch_idx);
  }
};

// FA2 single prefill (FlashInfer's single_prefill_customize_config, default variant).
struct PrefillParams {
  using DTypeQ = __nv_bfloat16;
  using DTypeKV = __nv_bfloat16;
  using DTypeO = __nv_bfloat16;
  using IdType = int32_t;
  DTypeQ* q;
  DTypeKV* k;
  DTypeKV* v;
  DTypeO* o;
  float* lse;
  uint_fastdiv group_size;

  uint8_t* maybe_custom_mask;
  float* maybe_alibi_slopes;
  double logits_soft_cap;
  double sm_scale;
  double rope_rcp_scale;
  double rope_rcp_theta;

  uint32_t qo_len;
  uint32_t kv_len;
  uint32_t num_qo_heads;
  uint32_t num_kv_heads;
  uint32_t q_stride_n;
  uint32_t q_stride_h;
  uint32_t k_stride_n;
  uint32_t k_stride_h;
  uint32_t v_stride_n;
  uint32_t v_stride_h;
  uint32_t head_dim;
  int32_t window_left;

  bool partition_kv;

  __host__ __device__ __forceinline__ uint32_t get_qo_len(uint32_t) const { return qo_len; }
  __host__ __device__ __forceinline__ uint32_t get_kv_len(uint32_t) const { return kv_len; }
};

using Variant = DefaultAttention</*custom_mask=*/false, /*sliding_window=*/false, /*soft_cap=*/false,
                                 /*alibi=*/false>;
constexpr PosEncodingMode kPos = PosEncodingMode::kNone;

// FlashInfer writes BF16; the engine's next layer reads fp32.
__global__ void widen(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __bfloat162float(x[i]);
}

__global__ void narrow(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(x[i]);
}

std::string err(cudaError_t e, const char* what) {
  return e == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(e);
}

template <uint32_t D>
cudaError_t plan_d(void* fws, size_t fbytes, void* iws, void* ih, size_t ibytes, DecodePlanInfo& info,
                   int32_t* indptr_h, uint32_t batch, uint32_t hq, uint32_t hkv, uint32_t ps, cudaStream_t st) {
  cudaError_t status = cudaErrorInvalidValue;
  DISPATCH_GQA_GROUP_SIZE(hq / hkv, GROUP_SIZE, {
    auto est = BatchDecodeWithPagedKVCacheWorkEstimationDispatched<GROUP_SIZE, D, kPos, Variant, Params>;
    status = DecodePlan<D, kPos, Variant, Params>(fws, fbytes, iws, ih, ibytes, info, indptr_h, batch, hq, ps,
                                                 /*enable_cuda_graph=*/false, st, est);
  });
  return status;
}

}  // namespace

BatchDecode::~BatchDecode() {
  if (float_ws_) cudaFree(float_ws_);
  if (int_ws_) cudaFree(int_ws_);
  if (int_host_) cudaFreeHost(int_host_);
  if (out_) cudaFree(out_);
  if (q_) cudaFree(q_);
  if (qo_indptr_) cudaFree(qo_indptr_);
}

std::string BatchDecode::plan(bool tensor_cores, const int32_t* indptr_h, int batch, int num_q_heads,
                              int num_kv_heads, int page_size, int head_dim, cudaStream_t stream) {
  planned_ = false;
  if (batch <= 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || page_size <= 0)
    return "flashinfer decode: bad shape";
  const int g = num_q_heads / num_kv_heads;
  if (!tensor_cores && !(g == 1 || g == 2 || g == 3 || g == 4 || g == 8))
    return "flashinfer decode: GQA group " + std::to_string(g) + " not supported (1, 2, 3, 4, 8)";
  if (head_dim != 64 && head_dim != 128)
    return "flashinfer decode: head_dim " + std::to_string(head_dim) + " not instantiated (64, 128)";
  if (!float_ws_ || !int_ws_ || !int_host_) {  // FlashInfer's own defaults are 128 MB and 8 MB
    float_bytes_ = size_t(128) << 20;
    int_bytes_ = size_t(8) << 20;
    // What was allocated is kept; a failed one stays null and the next plan tries again.
    auto get = [](void*& p, cudaError_t r) {
      if (r != cudaSuccess) p = nullptr;
      return err(r, "flashinfer workspace");
    };
    std::string e = float_ws_ ? "" : get(float_ws_, cudaMalloc(&float_ws_, float_bytes_));
    if (e.empty() && !int_ws_) e = get(int_ws_, cudaMalloc(&int_ws_, int_bytes_));
    if (e.empty() && !int_host_) e = get(int_host_, cudaMallocHost(&int_host_, int_bytes_));
    if (!e.empty()) return e;
  }
  // The page-locked staging buffer is written by the host and copied asynchronously:
  // the previous step's copy must be done before it is overwritten.
  if (std::string e = err(cudaStreamSynchronize(stream), "flashinfer plan"); !e.empty()) return e;
  std::vector<int32_t> indptr(indptr_h, indptr_h + batch + 1);
  try {
    if (tensor_cores) {
      std::vector<int32_t> qo(size_t(batch) + 1);
      for (int i = 0; i <= batch; ++i) qo[size_t(i)] = i;
      if (batch + 1 > qo_indptr_n_) {
        if (qo_indptr_) cudaFree(qo_indptr_);
        qo_indptr_ = nullptr;
        qo_indptr_n_ = 0;
        if (std::string e = err(cudaMalloc(&qo_indptr_, size_t(batch + 1) * 4), "flashinfer plan"); !e.empty())
          return e;
        qo_indptr_n_ = batch + 1;
      }
      if (std::string e = err(cudaMemcpyAsync(qo_indptr_, qo.data(), qo.size() * 4, cudaMemcpyHostToDevice, stream),
                              "flashinfer plan");
          !e.empty())
        return e;
      PrefillPlanInfo info;
      const cudaError_t s = PrefillPlan<int32_t>(
          float_ws_, float_bytes_, int_ws_, int_host_, int_bytes_, info, qo.data(), indptr.data(), uint32_t(batch),
          uint32_t(batch), uint32_t(num_q_heads), uint32_t(num_kv_heads), uint32_t(head_dim), uint32_t(head_dim),
          uint32_t(page_size), /*enable_cuda_graph=*/false, /*sizeof_dtype_o=*/2, /*window_left=*/-1,
          /*fixed_split_size=*/-1, /*disable_split_kv=*/false, /*num_colocated_ctas=*/0, stream);
      if (s != cudaSuccess) return err(s, "flashinfer plan");
      info_ = info.ToVector();
      // The qo_indptr upload above reads the host vector: done before it goes.
      if (std::string e = err(cudaStreamSynchronize(stream), "flashinfer plan"); !e.empty()) return e;
    } else {
      DecodePlanInfo info;
      const cudaError_t s =
          head_dim == 64
              ? plan_d<64>(float_ws_, float_bytes_, int_ws_, int_host_, int_bytes_, info, indptr.data(), batch,
                           num_q_heads, num_kv_heads, page_size, stream)
              : plan_d<128>(float_ws_, float_bytes_, int_ws_, int_host_, int_bytes_, info, indptr.data(), batch,
                            num_q_heads, num_kv_heads, page_size, stream);
      if (s != cudaSuccess) return err(s, "flashinfer plan");
      info_ = info.ToVector();
    }
  } catch (const std::exception& e) {
    return std::string("flashinfer plan: ") + e.what();
  }
  batch_ = batch;
  num_q_heads_ = num_q_heads;
  num_kv_heads_ = num_kv_heads;
  page_size_ = page_size;
  head_dim_ = head_dim;
  tensor_cores_ = tensor_cores;
  planned_ = true;
  return {};
}

std::string BatchDecode::run(const float* q, const uint16_t* k_pages, const uint16_t* v_pages,
                             const int32_t* indptr, const int32_t* indices, const int32_t* last_page_len,
                             float sm_scale, float* o, bool pdl, cudaStream_t stream) {
  if (!planned_) return "flashinfer decode: run before plan";
  const size_t n = size_t(batch_) * num_q_heads_ * head_dim_;
  const unsigned blocks = unsigned((n + 255) / 256);
  if (n > out_elems_) {
    if (out_) cudaFree(out_);
    if (q_) cudaFree(q_);
    out_ = q_ = nullptr;
    out_elems_ = 0;
    if (std::string e = err(cudaMalloc(&out_, n * 2), "flashinfer output"); !e.empty()) return e;
    if (std::string e = err(cudaMalloc(&q_, n * 2), "flashinfer queries"); !e.empty()) return e;
    out_elems_ = n;
  }
  auto* ob = static_cast<__nv_bfloat16*>(out_);
  auto* kd = reinterpret_cast<__nv_bfloat16*>(const_cast<uint16_t*>(k_pages));
  auto* vd = reinterpret_cast<__nv_bfloat16*>(const_cast<uint16_t*>(v_pages));
  const paged_kv_t<__nv_bfloat16, int32_t> kv(
      uint32_t(num_kv_heads_), uint32_t(page_size_), uint32_t(head_dim_), uint32_t(batch_), QKVLayout::kHND, kd, vd,
      const_cast<int32_t*>(indices), const_cast<int32_t*>(indptr), const_cast<int32_t*>(last_page_len));
  try {
    cudaError_t s = cudaSuccess;
    if (tensor_cores_) {
      PrefillPlanInfo info;
      info.FromVector(info_);
      auto* qb = static_cast<__nv_bfloat16*>(q_);
      narrow<<<blocks, 256, 0, stream>>>(q, qb, int(n));
      if (std::string e = err(cudaGetLastError(), "flashinfer queries"); !e.empty()) return e;
      PagedParams p{};
      p.q = qb;
      p.paged_kv = kv;
      p.q_indptr = static_cast<int32_t*>(qo_indptr_);
      p.o = ob;
      p.lse = nullptr;
      p.group_size = uint_fastdiv(uint32_t(num_q_heads_ / num_kv_heads_));
      p.maybe_custom_mask = nullptr;
      p.maybe_alibi_slopes = nullptr;
      p.logits_soft_cap = 0.0;
      p.sm_scale = sm_scale;
      p.rope_rcp_scale = 1.0;
      p.rope_rcp_theta = 1.0 / 1e4;
      p.num_qo_heads = uint32_t(num_q_heads_);
      p.q_stride_n = num_q_heads_ * head_dim_;
      p.q_stride_h = head_dim_;
      p.window_left = -1;
      p.request_indices = GetPtrFromBaseOffset<int32_t>(int_ws_, info.request_indices_offset);
      p.qo_tile_indices = GetPtrFromBaseOffset<int32_t>(int_ws_, info.qo_tile_indices_offset);
      p.kv_tile_indices = GetPtrFromBaseOffset<int32_t>(int_ws_, info.kv_tile_indices_offset);
      p.o_indptr = GetPtrFromBaseOffset<int32_t>(int_ws_, info.o_indptr_offset);
      p.kv_chunk_size_ptr = GetPtrFromBaseOffset<int32_t>(int_ws_, info.kv_chunk_size_ptr_offset);
      p.merge_indptr = nullptr;
      p.block_valid_mask = nullptr;
      p.total_num_rows = nullptr;
      p.padded_batch_size = uint32_t(info.padded_batch_size);
      p.max_total_num_rows = uint32_t(info.total_num_rows);
      p.partition_kv = false;
      __nv_bfloat16* tmp_v = nullptr;
      float* tmp_s = nullptr;
      if (info.split_kv) {
        p.merge_indptr = GetPtrFromBaseOffset<int32_t>(int_ws_, info.merge_indptr_offset);
        tmp_v = GetPtrFromBaseOffset<__nv_bfloat16>(float_ws_, info.v_offset);
        tmp_s = GetPtrFromBaseOffset<float>(float_ws_, info.s_offset);
      }
      auto go = [&](auto tile, auto d) {
        constexpr uint32_t T = decltype(tile)::value, D = decltype(d)::value;
        return BatchPrefillWithPagedKVCacheDispatched<T, D, D, kPos, /*fp16_qk_reduction=*/false, MaskMode::kNone,
                                                      Variant, PagedParams>(p, tmp_v, tmp_s, pdl, stream);
      };
      using C16 = std::integral_constant<uint32_t, 16>;
      using C64 = std::integral_constant<uint32_t, 64>;
      using C128 = std::integral_constant<uint32_t, 128>;
      using D64 = std::integral_constant<uint32_t, 64>;
      using D128 = std::integral_constant<uint32_t, 128>;
      const int64_t tile = info.cta_tile_q;
      if (tile != 16 && tile != 64 && tile != 128)
        return "flashinfer decode: query tile " + std::to_string(tile) + " not instantiated";
      if (head_dim_ == 64)
        s = tile == 16 ? go(C16{}, D64{}) : tile == 64 ? go(C64{}, D64{}) : go(C128{}, D64{});
      else
        s = tile == 16 ? go(C16{}, D128{}) : tile == 64 ? go(C64{}, D128{}) : go(C128{}, D128{});
    } else {
      DecodePlanInfo info;
      info.FromVector(info_);
      Params p{};
      p.q = const_cast<float*>(q);
      p.paged_kv = kv;
      p.o = ob;
      p.lse = nullptr;
      p.maybe_alibi_slopes = nullptr;
      p.logits_soft_cap = 0.0;
      p.sm_scale = sm_scale;
      p.rope_rcp_scale = 1.0;
      p.rope_rcp_theta = 1.0 / 1e4;
      p.num_qo_heads = uint32_t(num_q_heads_);
      p.q_stride_n = num_q_heads_ * head_dim_;
      p.q_stride_h = head_dim_;
      p.window_left = -1;
      p.enable_pdl = pdl;
      p.request_indices = GetPtrFromBaseOffset<int32_t>(int_ws_, info.request_indices_offset);
      p.kv_tile_indices = GetPtrFromBaseOffset<int32_t>(int_ws_, info.kv_tile_indices_offset);
      p.o_indptr = GetPtrFromBaseOffset<int32_t>(int_ws_, info.o_indptr_offset);
      p.kv_chunk_size_ptr = GetPtrFromBaseOffset<int32_t>(int_ws_, info.kv_chunk_size_ptr_offset);
      p.block_valid_mask = nullptr;
      p.partition_kv = false;
      p.padded_batch_size = uint32_t(info.padded_batch_size);
      __nv_bfloat16* tmp_v = nullptr;
      float* tmp_s = nullptr;
      if (info.split_kv) {
        tmp_v = GetPtrFromBaseOffset<__nv_bfloat16>(float_ws_, info.v_offset);
        tmp_s = GetPtrFromBaseOffset<float>(float_ws_, info.s_offset);
      }
      s = head_dim_ == 64
              ? BatchDecodeWithPagedKVCacheDispatched<64, kPos, Variant, Params>(p, tmp_v, tmp_s, pdl, stream)
              : BatchDecodeWithPagedKVCacheDispatched<128, kPos, Variant, Params>(p, tmp_v, tmp_s, pdl, stream);
    }
    if (s != cudaSuccess) return err(s, "flashinfer decode");
  } catch (const std::exception& e) {
    return std::string("flashinfer decode: ") + e.what();
  }
  widen<<<blocks, 256, 0, stream>>>(ob, o, int(n));
  return err(cudaGetLastError(), "flashinfer output");
}

void narrow_rows(const float* x, __nv_bfloat16* y, size_t n, cudaStream_t st) {
  narrow<<<unsigned((n + 255) / 256), 256, 0, st>>>(x, y, int(n));
}
void widen_rows(const __nv_bfloat16* x, float* y, size_t n, cudaStream_t st) {
  widen<<<unsigned((n + 255) / 256), 256, 0, st>>>(x, y, int(n));
}

std::string Prefill::run(PrefillKernel kernel, const float* q, const uint16_t* K, const uint16_t* V, int n, int L,
                         int Lt, int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, float* o,
                         cudaStream_t stream) {
  if (n <= 0) return {};
  if (Lt < L + n || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0)
    return "flashinfer prefill: bad shape";
  if (head_dim != 64 && head_dim != 128)
    return "flashinfer prefill: head_dim " + std::to_string(head_dim) + " not instantiated (64, 128)";
  const size_t rows = size_t(n) * num_q_heads * head_dim;
  if (rows > 0x7fffffff) return "flashinfer prefill: chunk too large";
  if (rows > elems_) {
    if (q_) cudaFree(q_);
    if (o_) cudaFree(o_);
    q_ = o_ = nullptr;
    elems_ = 0;
    if (std::string e = err(cudaMalloc(&q_, rows * 2), "flashinfer prefill"); !e.empty()) return e;
    if (std::string e = err(cudaMalloc(&o_, rows * 2), "flashinfer prefill"); !e.empty()) return e;
    elems_ = rows;
  }
  if (!tmp_) {  // FA2's split-KV scratch, the size FlashInfer's Python wrapper gives it
    if (std::string e = err(cudaMalloc(&tmp_, size_t(32) << 20), "flashinfer prefill"); !e.empty()) return e;
  }
  auto* qb = static_cast<__nv_bfloat16*>(q_);
  auto* ob = static_cast<__nv_bfloat16*>(o_);
  narrow_rows(q, qb, rows, stream);
  if (std::string e = err(cudaGetLastError(), "flashinfer prefill"); !e.empty()) return e;
  // K, V [Hkv][Lt][d]: the keys this chunk sees are the first L + n rows of each head; the
  // causal mask is bottom-right aligned (query i sees keys 0 .. L + i), as ours.
  const uint32_t kv_len = uint32_t(L + n);
  try {
    cudaError_t s = cudaSuccess;
    if (kernel == PrefillKernel::kFa3) {
      s = prefill_fa3(qb, K, V, ob, n, int(kv_len), Lt, num_q_heads, num_kv_heads, head_dim, sm_scale, stream);
    } else {
      PrefillParams p{};
      p.q = qb;
      p.k = reinterpret_cast<__nv_bfloat16*>(const_cast<uint16_t*>(K));
      p.v = reinterpret_cast<__nv_bfloat16*>(const_cast<uint16_t*>(V));
      p.o = ob;
      p.lse = nullptr;
      p.group_size = uint_fastdiv(uint32_t(num_q_heads / num_kv_heads));
      p.maybe_custom_mask = nullptr;
      p.maybe_alibi_slopes = nullptr;
      p.logits_soft_cap = 0.0;
      p.sm_scale = sm_scale;
      p.rope_rcp_scale = 1.0;
      p.rope_rcp_theta = 1.0 / 1e4;
      p.qo_len = uint32_t(n);
      p.kv_len = kv_len;
      p.num_qo_heads = uint32_t(num_q_heads);
      p.num_kv_heads = uint32_t(num_kv_heads);
      p.q_stride_n = uint32_t(num_q_heads * head_dim);
      p.q_stride_h = uint32_t(head_dim);
      p.k_stride_n = uint32_t(head_dim);
      p.k_stride_h = uint32_t(Lt) * uint32_t(head_dim);
      p.v_stride_n = p.k_stride_n;
      p.v_stride_h = p.k_stride_h;
      p.head_dim = uint32_t(head_dim);
      p.window_left = -1;
      p.partition_kv = false;
      auto* tmp = static_cast<__nv_bfloat16*>(tmp_);
      s = head_dim == 64
              ? SinglePrefillWithKVCacheDispatched<64, 64, kPos, false, MaskMode::kCausal, Variant, PrefillParams>(
                    p, tmp, stream)
              : SinglePrefillWithKVCacheDispatched<128, 128, kPos, false, MaskMode::kCausal, Variant, PrefillParams>(
                    p, tmp, stream);
    }
    if (s != cudaSuccess) return err(s, "flashinfer prefill");
  } catch (const std::exception& e) {
    return std::string("flashinfer prefill: ") + e.what();
  }
  widen_rows(ob, o, rows, stream);
  return err(cudaGetLastError(), "flashinfer prefill");
}

#ifdef OSCAR_WITH_FLASHINFER_SM90
bool has_fa3() { return true; }
#else
// Built without CUTLASS's headers or for another architecture: no FA3.
bool has_fa3() { return false; }
cudaError_t prefill_fa3(const void*, const uint16_t*, const uint16_t*, void*, int, int, int, int, int, int, float,
                        cudaStream_t) {
  return cudaErrorNotSupported;
}
#endif

Prefill::~Prefill() {
  if (q_) cudaFree(q_);
  if (o_) cudaFree(o_);
  if (tmp_) cudaFree(tmp_);
}

}  // namespace oscar::backend::fi
