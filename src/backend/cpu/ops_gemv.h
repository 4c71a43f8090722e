// Matrix products of the linear layers on the CPU, for few token rows (decode)
// and many (prefill).
//
//   y[t][r] = sum_c x[t][c] * W[r][c] (+ bias[r])   x [n][in], W [out][in], y [n][out]
//
// W is f32 or bf16 (raw bits). fp32 accumulation always. Small n runs our own
// multithreaded GEMV (each weight row is streamed once for all n rows: decode is
// memory-bound); large n goes to the blocked GEMM of ops_gemm.h (bf16 weights
// are widened to f32 while packing, so the bf16 copy is the only one kept).
#pragma once

#include <cstdint>

namespace oscar::backend::cpu {

// Token rows from which linear_* switch to the blocked GEMM. Below, the GEMV reads each weight
// once per call without packing: faster for decode batches up to 128 rows, level at 128
// (docs/engine.md, "blocked GEMM").
inline constexpr int kGemmMinRows = 128;

// Token rows from which linear_bf16 runs on AMX tiles where the CPU has them (ops_amx.h; the
// activations then rounded to BF16): kGemmMinRows, or OSCAR_CPU_AMX_MIN_ROWS. Below 128 rows the
// GEMV sums every output in the same order whatever the batch, so a request's greedy tokens do not
// depend on what runs beside it; a lower threshold trades that for 2-7x faster batched linears.
int amx_min_rows();

void linear_f32(const float* w, int64_t out, int64_t in, const float* bias, const float* x, int n,
                float* y);
void linear_bf16(const uint16_t* w, int64_t out, int64_t in, const float* bias, const float* x,
                 int n, float* y);

// Scalar references (tests): same contract, no threads, no SIMD, no BLAS.
void linear_f32_ref(const float* w, int64_t out, int64_t in, const float* bias, const float* x,
                    int n, float* y);
void linear_bf16_ref(const uint16_t* w, int64_t out, int64_t in, const float* bias,
                     const float* x, int n, float* y);

// "avx512", "avx2" or "scalar": the GEMV path this CPU takes.
const char* gemv_isa();

}  // namespace oscar::backend::cpu
