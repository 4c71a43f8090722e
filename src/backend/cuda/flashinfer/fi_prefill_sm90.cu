// FlashInfer's Hopper (FA3: wgmma, TMA, warp-specialized) single prefill over our gathered BF16
// rows (fi_attention.h). Its own translation unit: it needs CUTLASS's headers (shipped in the same
// wheel) and sm_90a. The Params struct is what FlashInfer's JIT generates for an sm90 single
// prefill module with the default variant.
#include <flashinfer/attention/hopper/prefill_sm90.cuh>
#include <flashinfer/attention/hopper/variants.cuh>
#include <flashinfer/cutlass_utils.cuh>

#include "backend/cuda/flashinfer/fi_attention.h"

namespace oscar::backend::fi {
namespace {

using namespace flashinfer;

struct Sm90Params {
  using DTypeQ = cutlass_dtype_t<__nv_bfloat16>;
  using DTypeKV = cutlass_dtype_t<__nv_bfloat16>;
  using DTypeO = cutlass_dtype_t<__nv_bfloat16>;
  using IdType = cutlass_dtype_t<int32_t>;

  DTypeQ* q_ptr;
  DTypeKV* k_ptr;
  DTypeKV* v_ptr;
  DTypeO* o_ptr;
  float* lse_ptr;

  struct AdditionalParams {
    double logits_soft_cap;
    double sm_scale;
  } additional_params;

  int64_t q_stride_n;
  int64_t k_stride_n;
  int64_t v_stride_n;
  int64_t o_stride_n;
  int64_t q_stride_h;
  int64_t k_stride_h;
  int64_t v_stride_h;
  int64_t o_stride_h;

  int qo_len;
  int kv_len;
  int head_dim;
  int num_qo_heads;
  int num_kv_heads;
  int group_size;
  int window_left;

  bool causal;
};

}  // namespace

cudaError_t prefill_fa3(const void* q, const uint16_t* K, const uint16_t* V, void* o, int n, int kv_len, int Lt,
                        int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, cudaStream_t stream) {
  Sm90Params p{};
  p.q_ptr = static_cast<Sm90Params::DTypeQ*>(const_cast<void*>(q));
  p.k_ptr = reinterpret_cast<Sm90Params::DTypeKV*>(const_cast<uint16_t*>(K));
  p.v_ptr = reinterpret_cast<Sm90Params::DTypeKV*>(const_cast<uint16_t*>(V));
  p.o_ptr = static_cast<Sm90Params::DTypeO*>(o);
  p.lse_ptr = nullptr;
  p.additional_params.logits_soft_cap = 0.0;
  p.additional_params.sm_scale = sm_scale;
  p.q_stride_n = int64_t(num_q_heads) * head_dim;
  p.q_stride_h = head_dim;
  p.o_stride_n = p.q_stride_n;
  p.o_stride_h = p.q_stride_h;
  p.k_stride_n = head_dim;
  p.k_stride_h = int64_t(Lt) * head_dim;
  p.v_stride_n = p.k_stride_n;
  p.v_stride_h = p.k_stride_h;
  p.qo_len = n;
  p.kv_len = kv_len;
  p.head_dim = head_dim;
  p.num_qo_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.group_size = num_q_heads / num_kv_heads;
  p.window_left = -1;
  p.causal = true;
  using Variant = DefaultAttention</*use_logits_soft_cap=*/false>;
  if (head_dim == 64)
    return SinglePrefillWithKVCacheDispatched<64, 64, MaskMode::kCausal, false, Variant, Sm90Params>(p, stream);
  if (head_dim == 128)
    return SinglePrefillWithKVCacheDispatched<128, 128, MaskMode::kCausal, false, Variant, Sm90Params>(p, stream);
  return cudaErrorInvalidValue;
}

}  // namespace oscar::backend::fi
