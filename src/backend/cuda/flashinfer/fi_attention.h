// FlashInfer's BF16 paged decode (flashinfer-python 0.5.3, header-only templates) behind a small
// C++ interface, in both of its forms: the CUDA-core `BatchDecodeWithPagedKVCache` kernel and the
// tensor-core one (`use_tensor_cores=True`: its FA2 batch prefill kernel, one query row per
// request), so that the engine's BF16 baseline can run on FlashInfer's kernel instead of ours
// (docs/gpu-engine.md, "FlashInfer's BF16 decode in the engine"); and its prefill kernels (below).
// Built only when CMake is given OSCAR_FLASHINFER_INCLUDE (scripts/fetch_flashinfer.sh); nothing
// else includes FlashInfer. Every failure (an unsupported shape, a CUDA error, FlashInfer's own
// exceptions) is thrown as oscar::Error.
//
// The cache is ours: BF16 pages in the HND layout of kernels/paged_kv.h, which is FlashInfer's
// HND layout; one sequence's pages are listed by (indptr, indices) and the last page's row
// count. Queries are fp32 ([batch][num_q_heads][head_dim]), as our kernel takes them: the
// CUDA-core kernel reads them as they are, the tensor-core one needs BF16 and a small kernel
// narrows them first. FlashInfer writes its output in BF16 (its split-KV merge has no fp32
// instance for every head_dim) and a small kernel widens it to the engine's fp32 rows. RoPE is
// already applied.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "backend/cuda/dev_mem.h"

namespace oscar::backend::fi {

class BatchDecode {
 public:
  // Plans one step (valid for every layer of it): host page counts indptr_h[0..batch].
  // Unsupported: head_dim other than 64 / 128; on CUDA cores, GQA groups other than 1, 2, 3, 4, 8.
  void plan(bool tensor_cores, const int32_t* indptr_h, int batch, int num_q_heads, int num_kv_heads,
            int page_size, int head_dim, cudaStream_t stream);

  // o = softmax(sm_scale q K^T) V over each sequence's pages (device pointers; k and v are
  // the layer's page pools). Needs plan() of this step first.
  void run(const float* q, const uint16_t* k_pages, const uint16_t* v_pages, const int32_t* indptr,
           const int32_t* indices, const int32_t* last_page_len, float sm_scale, float* o, bool pdl,
           cudaStream_t stream);

 private:
  static constexpr size_t kFloatWs = size_t(128) << 20, kIntWs = size_t(8) << 20;  // FlashInfer's defaults
  devmem::DevMem float_ws_, int_ws_;
  std::unique_ptr<void, void (*)(void*)> int_host_{nullptr, [](void* p) { cudaFreeHost(p); }};  // plan staging
  devmem::DevMem q_, out_;   // BF16 queries (tensor cores), BF16 output before widening
  devmem::DevMem qo_indptr_;  // 0, 1, ..., batch (tensor cores: one query row per request)
  std::vector<int64_t> info_;  // FlashInfer's plan info, as its ToVector() writes it
  int batch_ = 0, num_q_heads_ = 0, num_kv_heads_ = 0, page_size_ = 0, head_dim_ = 0;
  bool planned_ = false, tensor_cores_ = false;
};

// FlashInfer's single-request causal prefill over the rows our prefill gathers (K, V
// [Hkv][Lt][d] BF16, the first L + n rows of each head seen; query i sees keys 0 .. L + i):
// kFa2, its FlashAttention-2 kernel (mma.sync, every sm80+ GPU), or kFa3, its Hopper kernel
// (wgmma and TMA, fi_prefill_sm90.cu, built for sm_90a). Queries fp32 [n][Hq][d] are narrowed to
// BF16 and the BF16 output widened to fp32 (two small kernels), as for the decode.
enum class PrefillKernel { kFa2, kFa3 };
class Prefill {
 public:
  void run(PrefillKernel kernel, const float* q, const uint16_t* K, const uint16_t* V, int n, int L, int Lt,
           int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, float* o, cudaStream_t stream);

 private:
  devmem::DevMem q_, o_;  // BF16 queries and output
  devmem::DevMem tmp_;    // FA2's split-KV scratch
};

// Whether this build has the FA3 kernel (fi_prefill_sm90.cu: CUTLASS headers and sm_90a).
bool has_fa3();
// fi_prefill_sm90.cu: FA3 over bf16 q [n][Hq][d], K/V [Hkv][Lt][d] (kv_len rows seen), bf16 o.
cudaError_t prefill_fa3(const void* q, const uint16_t* K, const uint16_t* V, void* o, int n, int kv_len, int Lt,
                        int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, cudaStream_t stream);

}  // namespace oscar::backend::fi
