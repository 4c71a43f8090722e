// A cache-blocked fp32 GEMM for the CPU ops with many rows: the prefill
// linears (ops_gemv.h routes n >= kGemmMinRows here) and the score / value
// products of the calibration forward's exact causal attention.
//
//   C[m][n] = alpha · Σ_k A[m][k] · B(k, n)  (+ bias[n])      (or C += … when accumulate)
//   A row-major with row stride lda; B(k, n) = B[n·ldb + k] when b_nk (weights
//   [out][in], keys [t][d]), else B[k·ldb + n] (values [t][d]).
//
// AVX-512 (runtime-detected): B is packed into 32-column panels (in column
// chunks of <= 8 MiB), A is read in place in 14-row tiles (packed only when its
// row stride is a multiple of 4 KiB, or for a partial tile), passes are <= 256
// deep, and a 14×32 register tile (28 zmm accumulators) runs over each pair;
// fp32 accumulation. Without AVX-512, gemm_f32/gemm_bf16w call OpenBLAS and
// gemm_packed runs plain loops. Threads: the op pool (ops_threads.h) pulls M
// blocks (or column-panel groups when M is short) from a counter; a call from
// inside a pool worker runs on that thread.
#pragma once

#include <cstddef>
#include <cstdint>

namespace oscar::backend::cpu {

void gemm_f32(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
              int64_t ldb, bool b_nk, float* C, int64_t ldc, float alpha = 1.0f,
              const float* bias = nullptr, bool accumulate = false);
// Same with bf16 B (raw bits), b_nk layout only (bf16 weights [out][in]).
void gemm_bf16w(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const uint16_t* B,
                int64_t ldb, float* C, int64_t ldc, const float* bias = nullptr);

// B packed once and used by several products (attention: the keys and values
// of a KV head serve every query block and every query head of its group).
// gemm_packed may use a leading part: columns [0, N) and depth [0, K).
class PackedB {
 public:
  PackedB() = default;
  PackedB(const PackedB&) = delete;
  PackedB& operator=(const PackedB&) = delete;
  ~PackedB();
  // B(k, n) as in gemm_f32, n < N, k < K. Reuses the buffer when large enough.
  void pack(const float* B, int64_t ldb, bool b_nk, int64_t N, int64_t K);

 private:
  friend void gemm_packed(int64_t, int64_t, int64_t, const float*, int64_t, const PackedB&,
                          float*, int64_t, float, const float*, bool);
  float* data_ = nullptr;
  size_t cap_ = 0;
  int64_t N_ = 0, K_ = 0;
};
void gemm_packed(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const PackedB& B,
                 float* C, int64_t ldc, float alpha = 1.0f, const float* bias = nullptr,
                 bool accumulate = false);

// One softmax row in base 2: s[j] = 2^(s[j] - max) / Σ for j < len (max and
// Σ over [0, len)), s[j] = 0 for len <= j < width. len >= 1. Results below
// 2^-126 (before normalization) are flushed to 0 on the AVX-512 path.
void softmax_exp2_row(float* s, int len, int width);
// The same without the division: returns Σ (fp64) and leaves 2^(s[j] - max)
// (attention divides its output rows instead of the longer score rows).
double exp2_row(float* s, int len, int width);

// Scalar reference of gemm_f32 (fp32 accumulation in k order; tests).
void gemm_f32_ref(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
                  int64_t ldb, bool b_nk, float* C, int64_t ldc, float alpha = 1.0f,
                  const float* bias = nullptr, bool accumulate = false);

// Whether gemm_f32 takes the AVX-512 path on this CPU.
bool gemm_avx512();
// Tests: on = use the portable paths (OpenBLAS for gemm_f32/gemm_bf16w, plain
// loops for gemm_packed and the softmax rows) even on an AVX-512 CPU. Not
// thread-safe; call between products.
void gemm_force_portable(bool on);

}  // namespace oscar::backend::cpu
