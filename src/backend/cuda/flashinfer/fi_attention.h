// FlashInfer's BF16 paged decode (flashinfer-python 0.5.3, header-only templates) behind a small
// C++ interface, in both of its forms: the CUDA-core `BatchDecodeWithPagedKVCache` kernel and the
// tensor-core one (`use_tensor_cores=True`: its FA2 batch prefill kernel, one query row per
// request), so that the
// engine's BF16 baseline can run on FlashInfer's kernel instead of ours (docs/gpu-engine.md,
// "FlashInfer's BF16 decode in the engine"). Built only when CMake is given
// OSCAR_FLASHINFER_INCLUDE (scripts/fetch_flashinfer.sh); nothing else includes FlashInfer.
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
#include <string>
#include <vector>

namespace oscar::backend::fi {

class BatchDecode {
 public:
  BatchDecode() = default;
  ~BatchDecode();
  BatchDecode(const BatchDecode&) = delete;
  BatchDecode& operator=(const BatchDecode&) = delete;

  // Plans one step (valid for every layer of it): host page counts indptr_h[0..batch].
  // Returns an empty string, or why the shape is not supported (head_dim 64 / 128, GQA
  // group 1, 2, 3, 4 or 8) or the CUDA error.
  std::string plan(bool tensor_cores, const int32_t* indptr_h, int batch, int num_q_heads, int num_kv_heads,
                   int page_size, int head_dim, cudaStream_t stream);

  // o = softmax(sm_scale q K^T) V over each sequence's pages (device pointers; k and v are
  // the layer's page pools). Needs plan() of this step first.
  std::string run(const float* q, const uint16_t* k_pages, const uint16_t* v_pages, const int32_t* indptr,
                  const int32_t* indices, const int32_t* last_page_len, float sm_scale, float* o, bool pdl,
                  cudaStream_t stream);

 private:
  void* float_ws_ = nullptr;
  void* int_ws_ = nullptr;
  void* int_host_ = nullptr;  // page-locked staging of the plan
  void* out_ = nullptr;       // BF16 output before widening
  size_t out_elems_ = 0;
  size_t float_bytes_ = 0, int_bytes_ = 0;
  void* q_ = nullptr;         // BF16 queries (tensor cores)
  size_t q_elems_ = 0;
  void* qo_indptr_ = nullptr;  // 0, 1, ..., batch (tensor cores: one query row per request)
  int qo_indptr_n_ = 0;
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
  Prefill() = default;
  ~Prefill();
  Prefill(const Prefill&) = delete;
  Prefill& operator=(const Prefill&) = delete;
  std::string run(PrefillKernel kernel, const float* q, const uint16_t* K, const uint16_t* V, int n, int L, int Lt,
                  int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, float* o, cudaStream_t stream);

 private:
  void* q_ = nullptr;  // BF16 queries
  void* o_ = nullptr;  // BF16 output
  void* tmp_ = nullptr;
  size_t elems_ = 0;
};

// Whether this build has the FA3 kernel (fi_prefill_sm90.cu: CUTLASS headers and sm_90a).
bool has_fa3();
// fi_prefill_sm90.cu: FA3 over bf16 q [n][Hq][d], K/V [Hkv][Lt][d] (kv_len rows seen), bf16 o.
cudaError_t prefill_fa3(const void* q, const uint16_t* K, const uint16_t* V, void* o, int n, int kv_len, int Lt,
                        int num_q_heads, int num_kv_heads, int head_dim, float sm_scale, cudaStream_t stream);

}  // namespace oscar::backend::fi
