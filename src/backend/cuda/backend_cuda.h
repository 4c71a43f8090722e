// The CUDA backend: the forward's operations (backend/backend.h) on one GPU,
// weights and activations in device memory, and the KV page stores of its
// caches in device memory (backend/page_store.h) driven by the CUDA cache-write
// and decode kernels (kernels/cuda).
//
//   linear          one row: our GEMV (BF16 weights, fp32 activations and
//                   accumulation, bias / residual in its epilogue); more rows:
//                   cuBLAS, BF16 weights x activations rounded to BF16, fp32
//                   accumulation and output (weights f32: SGEMM, no TF32)
//   norms, RoPE,    small fp32 kernels (ops.cu)
//   SwiGLU, embed
//   decode          kernels/cuda/decode_attention (one plan per step, shared
//                   by every layer; BF16-only instance when no middle)
//   prefill         the chunk's queries against the sequence's cached rows
//                   (BF16 and dequantized INT2, gathered) and its own rows:
//                   FlashInfer's FA3 / FA2 kernel in builds with its headers
//                   (head_dim 128), else our fused kernel (kernels/cuda/prefill_attention);
//                   f32 weights: two GEMMs around a causal softmax (exact mode)
//   KV pages        cudaMalloc'd pools; rows written by write_bf16_tokens,
//                   pages demoted by demote_pages, keys/queries transformed
//                   by rotate_queries (+ the key centering); a decode step's
//                   heads, transforms and row writes in one launch
//                   (qkv_heads_into_cache)
//
// Supported caches: bf16 and the 2-bit per-token methods (oscar, int2-hadamard,
// int2-naive), with one clip ratio per layer or per KV head (up to 128 heads);
// kivi2 (per-channel keys) and INT4 are refused with a clear error. This header compiles without
// nvcc; make_cuda_backend throws when the build has no CUDA.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "backend/backend.h"

namespace oscar::backend {

struct CudaBackendOptions {
  WeightDtype weight_dtype = WeightDtype::kBf16;  // q8 is stored as bf16
  int device = 0;
};

// Throws oscar::Error when there is no usable GPU (or no CUDA in the build).
std::unique_ptr<Backend> make_cuda_backend(const CudaBackendOptions& opts = {});

// Linear layers of at most `rows` (0..8) activation rows use our GEMV (bf16 weights,
// fp32 activations) instead of cuBLAS; default 1, env OSCAR_CUDA_GEMV_ROWS. For A/B runs.
void set_cuda_gemv_rows(Backend& be, int rows);
int cuda_gemv_rows(Backend& be);
// From this many rows on (default 2) that GEMV runs on the tensor cores (x rounded to
// BF16), below on the CUDA cores (x in fp32); env OSCAR_CUDA_GEMV_MMA_ROWS.
inline constexpr int kCudaGemvNever = 9;  // a min_rows the tensor-core GEMV never reaches
void set_cuda_gemv_mma_min_rows(Backend& be, int rows);
int cuda_gemv_mma_min_rows(Backend& be);

// A step's attention inputs into the cache (Backend::qkv_heads_into_cache: the head split with
// QK-norm and RoPE, the key / query transform, the BF16 write of the new rows) in one launch for
// steps of up to 64 rows, the default, or as three (off; env OSCAR_CUDA_FUSE_HEADS=0). For A/B
// runs and the test that compares the two.
void set_cuda_fuse_heads(Backend& be, bool on);
bool cuda_fuse_heads(Backend& be);
int64_t cuda_fused_heads_calls(Backend& be);  // the one-launch calls so far

// The BF16 cache's decode attention on our kernel ("ours", the default) or on FlashInfer's
// CUDA-core ("flashinfer") or tensor-core ("flashinfer-tc") decode: the comparison baseline of
// docs/gpu-engine.md, in builds configured with OSCAR_FLASHINFER_INCLUDE (else this throws);
// env OSCAR_CUDA_BF16_DECODE. 2-bit caches always run ours. cuda_flashinfer_calls counts the
// layers FlashInfer has decoded.
void set_cuda_bf16_decode(Backend& be, const std::string& which);
std::string cuda_bf16_decode(Backend& be);
int64_t cuda_flashinfer_calls(Backend& be);
bool cuda_has_flashinfer();
// The BF16 prefill attention: "ours" (the fused kernel, the default), "gemm" (two cuBLAS GEMMs
// around a causal softmax), "flashinfer-fa2" / "flashinfer-fa3" (FlashInfer's FlashAttention-2
// and Hopper kernels on the same gathered rows: the comparison of docs/gpu-engine.md; FlashInfer
// builds only). Env OSCAR_CUDA_PREFILL (OSCAR_CUDA_FUSED_PREFILL=0 is "gemm").
void set_cuda_prefill(Backend& be, const std::string& which);
std::string cuda_prefill(Backend& be);

// True when the build has CUDA and a device is visible.
bool cuda_device_available();

}  // namespace oscar::backend
