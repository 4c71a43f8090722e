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
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/bf16x4.cuh"

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

using devmem::check;

// The default variant's parameters, the same in every Params struct above (the rest stays as
// value-initialized: null pointers, no lse, no partition until FlashInfer sets it).
template <typename P>
void set_variant(P& p, float sm_scale) {
  p.sm_scale = sm_scale;
  p.rope_rcp_scale = 1.0;  // (read only with RoPE in the kernel, which is off)
  p.rope_rcp_theta = 1.0 / 1e4;
  p.window_left = -1;
}

// FlashInfer writes BF16; the engine's next layer reads fp32. The tensor-core kernels read
// BF16 queries.
// (Four elements per thread where n % 4 == 0 and the rows are aligned: 16-byte fp32 and 8-byte
// BF16 accesses; the scalar kernels ran at ~half the copy bandwidth.)
__global__ void widen(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __bfloat162float(x[i]);
}
__global__ void narrow(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16(x[i]);
}
__global__ void widen4(const __nv_bfloat16* __restrict__ x, float* __restrict__ y, int n4) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  reinterpret_cast<float4*>(y)[i] = oscar::kernels::cuda::unpack_bf16x4(reinterpret_cast<const uint2*>(x)[i]);
}
__global__ void narrow4(const float* __restrict__ x, __nv_bfloat16* __restrict__ y, int n4) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n4) return;
  reinterpret_cast<uint2*>(y)[i] = oscar::kernels::cuda::pack_bf16x4(reinterpret_cast<const float4*>(x)[i]);
}
bool vec4(const void* f32, const void* bf16, size_t n) {
  return n % 4 == 0 && reinterpret_cast<uintptr_t>(f32) % 16 == 0 && reinterpret_cast<uintptr_t>(bf16) % 8 == 0;
}
void widen_rows(const __nv_bfloat16* x, float* y, size_t n, cudaStream_t st) {
  if (vec4(y, x, n))
    widen4<<<unsigned((n / 4 + 255) / 256), 256, 0, st>>>(x, y, int(n / 4));
  else
    widen<<<unsigned((n + 255) / 256), 256, 0, st>>>(x, y, int(n));
  check(cudaGetLastError(), "flashinfer: widen");
}
void narrow_rows(const float* x, __nv_bfloat16* y, size_t n, cudaStream_t st) {
  if (vec4(x, y, n))
    narrow4<<<unsigned((n / 4 + 255) / 256), 256, 0, st>>>(x, y, int(n / 4));
  else
    narrow<<<unsigned((n + 255) / 256), 256, 0, st>>>(x, y, int(n));
  check(cudaGetLastError(), "flashinfer: narrow");
}

// Runs one FlashInfer call: its status, and its own exceptions (FLASHINFER_ERROR), as oscar::Error.
template <typename F>
void guarded(const char* what, F&& f) {
  cudaError_t s = cudaSuccess;
  try {
    s = f();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(std::string("cuda backend: ") + what + ": " + e.what());
  }
  check(s, what);
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

void BatchDecode::plan(bool tensor_cores, const int32_t* indptr_h, int batch, int num_q_heads, int num_kv_heads,
                       int page_size, int head_dim, cudaStream_t stream) {
  planned_ = false;
  if (batch <= 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || page_size <= 0)
    throw Error("cuda backend: flashinfer decode: bad shape");
  const int g = num_q_heads / num_kv_heads;
  if (!tensor_cores && !(g == 1 || g == 2 || g == 3 || g == 4 || g == 8))
    throw Error("cuda backend: flashinfer decode: GQA group " + std::to_string(g) + " not supported (1, 2, 3, 4, 8)");
  if (head_dim != 64 && head_dim != 128)
    throw Error("cuda backend: flashinfer decode: head_dim " + std::to_string(head_dim) +
                " not instantiated (64, 128)");
  float_ws_.ensure(kFloatWs);
  int_ws_.ensure(kIntWs);
  if (!int_host_) {
    void* h = nullptr;
    check(cudaMallocHost(&h, kIntWs), "flashinfer workspace");
    int_host_.reset(h);
  }
  // The page-locked staging buffer is written by the host and copied asynchronously:
  // the previous step's copy must be done before it is overwritten.
  check(cudaStreamSynchronize(stream), "flashinfer plan");
  std::vector<int32_t> indptr(indptr_h, indptr_h + batch + 1);
  if (tensor_cores) {
    std::vector<int32_t> qo(size_t(batch) + 1);
    for (int i = 0; i <= batch; ++i) qo[size_t(i)] = i;
    qo_indptr_.ensure(qo.size() * 4);
    check(cudaMemcpyAsync(qo_indptr_.p, qo.data(), qo.size() * 4, cudaMemcpyHostToDevice, stream), "flashinfer plan");
    PrefillPlanInfo info;
    guarded("flashinfer plan", [&] {
      return PrefillPlan<int32_t>(float_ws_.p, kFloatWs, int_ws_.p, int_host_.get(), kIntWs, info, qo.data(),
                                  indptr.data(), uint32_t(batch), uint32_t(batch), uint32_t(num_q_heads),
                                  uint32_t(num_kv_heads), uint32_t(head_dim), uint32_t(head_dim), uint32_t(page_size),
                                  /*enable_cuda_graph=*/false, /*sizeof_dtype_o=*/2, /*window_left=*/-1,
                                  /*fixed_split_size=*/-1, /*disable_split_kv=*/false, /*num_colocated_ctas=*/0,
                                  stream);
    });
    info_ = info.ToVector();
    // The qo_indptr upload above reads the host vector: done before it goes.
    check(cudaStreamSynchronize(stream), "flashinfer plan");
  } else {
    DecodePlanInfo info;
    guarded("flashinfer plan", [&] {
      return head_dim == 64 ? plan_d<64>(float_ws_.p, kFloatWs, int_ws_.p, int_host_.get(), kIntWs, info,
                                         indptr.data(), batch, num_q_heads, num_kv_heads, page_size, stream)
                            : plan_d<128>(float_ws_.p, kFloatWs, int_ws_.p, int_host_.get(), kIntWs, info,
                                          indptr.data(), batch, num_q_heads, num_kv_heads, page_size, stream);
    });
    info_ = info.ToVector();
  }
  batch_ = batch;
  num_q_heads_ = num_q_heads;
  num_kv_heads_ = num_kv_heads;
  page_size_ = page_size;
  head_dim_ = head_dim;
  tensor_cores_ = tensor_cores;
  planned_ = true;
}

void BatchDecode::run(const float* q, const uint16_t* k_pages, const uint16_t* v_pages, const int32_t* indptr,
                      const int32_t* indices, const int32_t* last_page_len, float sm_scale, float* o, bool pdl,
                      cudaStream_t stream) {
  if (!planned_) throw Error("cuda backend: flashinfer decode: run before plan");
  const size_t n = size_t(batch_) * num_q_heads_ * head_dim_;
  out_.ensure(n * 2);
  auto* ob = out_.as<__nv_bfloat16>();
  auto* kd = reinterpret_cast<__nv_bfloat16*>(const_cast<uint16_t*>(k_pages));
  auto* vd = reinterpret_cast<__nv_bfloat16*>(const_cast<uint16_t*>(v_pages));
  const paged_kv_t<__nv_bfloat16, int32_t> kv(
      uint32_t(num_kv_heads_), uint32_t(page_size_), uint32_t(head_dim_), uint32_t(batch_), QKVLayout::kHND, kd, vd,
      const_cast<int32_t*>(indices), const_cast<int32_t*>(indptr), const_cast<int32_t*>(last_page_len));
  auto* iw = int_ws_.p;
  if (tensor_cores_) {
    PrefillPlanInfo info;
    info.FromVector(info_);
    q_.ensure(n * 2);
    narrow_rows(q, q_.as<__nv_bfloat16>(), n, stream);
    PagedParams p{};
    set_variant(p, sm_scale);
    p.q = q_.as<__nv_bfloat16>();
    p.paged_kv = kv;
    p.q_indptr = qo_indptr_.as<int32_t>();
    p.o = ob;
    p.group_size = uint_fastdiv(uint32_t(num_q_heads_ / num_kv_heads_));
    p.num_qo_heads = uint32_t(num_q_heads_);
    p.q_stride_n = num_q_heads_ * head_dim_;
    p.q_stride_h = head_dim_;
    p.request_indices = GetPtrFromBaseOffset<int32_t>(iw, info.request_indices_offset);
    p.qo_tile_indices = GetPtrFromBaseOffset<int32_t>(iw, info.qo_tile_indices_offset);
    p.kv_tile_indices = GetPtrFromBaseOffset<int32_t>(iw, info.kv_tile_indices_offset);
    p.o_indptr = GetPtrFromBaseOffset<int32_t>(iw, info.o_indptr_offset);
    p.kv_chunk_size_ptr = GetPtrFromBaseOffset<int32_t>(iw, info.kv_chunk_size_ptr_offset);
    p.padded_batch_size = uint32_t(info.padded_batch_size);
    p.max_total_num_rows = uint32_t(info.total_num_rows);
    __nv_bfloat16* tmp_v = nullptr;
    float* tmp_s = nullptr;
    if (info.split_kv) {
      p.merge_indptr = GetPtrFromBaseOffset<int32_t>(iw, info.merge_indptr_offset);
      tmp_v = GetPtrFromBaseOffset<__nv_bfloat16>(float_ws_.p, info.v_offset);
      tmp_s = GetPtrFromBaseOffset<float>(float_ws_.p, info.s_offset);
    }
    auto go = [&](auto tile, auto d) {
      constexpr uint32_t T = decltype(tile)::value, D = decltype(d)::value;
      return BatchPrefillWithPagedKVCacheDispatched<T, D, D, kPos, /*fp16_qk_reduction=*/false, MaskMode::kNone,
                                                    Variant, PagedParams>(p, tmp_v, tmp_s, pdl, stream);
    };
    using C16 = std::integral_constant<uint32_t, 16>;
    using C64 = std::integral_constant<uint32_t, 64>;
    using C128 = std::integral_constant<uint32_t, 128>;
    const int64_t tile = info.cta_tile_q;
    if (tile != 16 && tile != 64 && tile != 128)
      throw Error("cuda backend: flashinfer decode: query tile " + std::to_string(tile) + " not instantiated");
    guarded("flashinfer decode", [&] {
      if (head_dim_ == 64) return tile == 16 ? go(C16{}, C64{}) : tile == 64 ? go(C64{}, C64{}) : go(C128{}, C64{});
      return tile == 16 ? go(C16{}, C128{}) : tile == 64 ? go(C64{}, C128{}) : go(C128{}, C128{});
    });
  } else {
    DecodePlanInfo info;
    info.FromVector(info_);
    Params p{};
    set_variant(p, sm_scale);
    p.q = const_cast<float*>(q);
    p.paged_kv = kv;
    p.o = ob;
    p.num_qo_heads = uint32_t(num_q_heads_);
    p.q_stride_n = num_q_heads_ * head_dim_;
    p.q_stride_h = head_dim_;
    p.enable_pdl = pdl;
    p.request_indices = GetPtrFromBaseOffset<int32_t>(iw, info.request_indices_offset);
    p.kv_tile_indices = GetPtrFromBaseOffset<int32_t>(iw, info.kv_tile_indices_offset);
    p.o_indptr = GetPtrFromBaseOffset<int32_t>(iw, info.o_indptr_offset);
    p.kv_chunk_size_ptr = GetPtrFromBaseOffset<int32_t>(iw, info.kv_chunk_size_ptr_offset);
    p.padded_batch_size = uint32_t(info.padded_batch_size);
    __nv_bfloat16* tmp_v = nullptr;
    float* tmp_s = nullptr;
    if (info.split_kv) {
      tmp_v = GetPtrFromBaseOffset<__nv_bfloat16>(float_ws_.p, info.v_offset);
      tmp_s = GetPtrFromBaseOffset<float>(float_ws_.p, info.s_offset);
    }
    guarded("flashinfer decode", [&] {
      return head_dim_ == 64
                 ? BatchDecodeWithPagedKVCacheDispatched<64, kPos, Variant, Params>(p, tmp_v, tmp_s, pdl, stream)
                 : BatchDecodeWithPagedKVCacheDispatched<128, kPos, Variant, Params>(p, tmp_v, tmp_s, pdl, stream);
    });
  }
  widen_rows(ob, o, n, stream);
}

void Prefill::run(PrefillKernel kernel, const float* q, const uint16_t* K, const uint16_t* V, int n, int L, int Lt,
                  int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, float* o, cudaStream_t stream) {
  if (n <= 0) return;
  if (Lt < L + n || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0)
    throw Error("cuda backend: flashinfer prefill: bad shape");
  if (head_dim != 64 && head_dim != 128)
    throw Error("cuda backend: flashinfer prefill: head_dim " + std::to_string(head_dim) +
                " not instantiated (64, 128)");
  const size_t rows = size_t(n) * num_q_heads * head_dim;
  if (rows > 0x7fffffff) throw Error("cuda backend: flashinfer prefill: chunk too large");
  q_.ensure(rows * 2);
  o_.ensure(rows * 2);
  tmp_.ensure(size_t(32) << 20);  // the size FlashInfer's Python wrapper gives it
  auto* qb = q_.as<__nv_bfloat16>();
  auto* ob = o_.as<__nv_bfloat16>();
  narrow_rows(q, qb, rows, stream);
  // K, V [Hkv][Lt][d]: the keys this chunk sees are the first L + n rows of each head; the
  // causal mask is bottom-right aligned (query i sees keys 0 .. L + i), as ours.
  const uint32_t kv_len = uint32_t(L + n);
  if (kernel == PrefillKernel::kFa3) {
    guarded("flashinfer prefill", [&] {
      return prefill_fa3(qb, K, V, ob, n, int(kv_len), Lt, num_q_heads, num_kv_heads, head_dim, sm_scale, stream);
    });
  } else {
    PrefillParams p{};
    set_variant(p, sm_scale);
    p.q = qb;
    p.k = reinterpret_cast<__nv_bfloat16*>(const_cast<uint16_t*>(K));
    p.v = reinterpret_cast<__nv_bfloat16*>(const_cast<uint16_t*>(V));
    p.o = ob;
    p.group_size = uint_fastdiv(uint32_t(num_q_heads / num_kv_heads));
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
    auto* tmp = tmp_.as<__nv_bfloat16>();
    guarded("flashinfer prefill", [&] {
      return head_dim == 64
                 ? SinglePrefillWithKVCacheDispatched<64, 64, kPos, false, MaskMode::kCausal, Variant, PrefillParams>(
                       p, tmp, stream)
                 : SinglePrefillWithKVCacheDispatched<128, 128, kPos, false, MaskMode::kCausal, Variant,
                                                      PrefillParams>(p, tmp, stream);
    });
  }
  widen_rows(ob, o, rows, stream);
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

}  // namespace oscar::backend::fi
