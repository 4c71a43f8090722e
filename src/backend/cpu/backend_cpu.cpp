#include "backend/cpu/backend_cpu.h"

#include <cblas.h>
#include <fmt/format.h>

#include <immintrin.h>

// GCC 12's avx512fintrin.h trips -Wmaybe-uninitialized inside its own
// _mm512_undefined_* helpers (GCC bug 105593); the warning is about the header.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <new>

#include "backend/cpu/ops_attention.h"
#include "backend/cpu/ops_amx.h"
#include "backend/cpu/ops_gemv.h"
#include "backend/cpu/ops_gemv_q8.h"
#include "backend/cpu/ops_threads.h"
#include "core/error.h"
#include "core/half.h"
#include "core/simd_exp.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/rope.h"

namespace oscar::backend {
namespace cpu {
namespace {

// 64-byte aligned host memory.
class HostBuffer : public Buffer {
 public:
  explicit HostBuffer(size_t n) {
    size_ = n;
    data_ = static_cast<float*>(::operator new[](std::max<size_t>(n, 1) * sizeof(float),
                                                 std::align_val_t(64)));
  }
  ~HostBuffer() override { ::operator delete[](data_, std::align_val_t(64)); }
};

struct CpuWeight : PreparedWeight {
  std::vector<float> f32;      // [rows][cols] when kept in f32 (and all vectors)
  std::vector<uint16_t> bf16;  // [rows][cols] when kept in bf16
  std::vector<int8_t> q8;      // [rows][cols] when kept in q8
  std::vector<float> q8_scale; // [rows][cols / 32]
  std::vector<float> bias;     // [rows] or empty
};

const CpuWeight& cw(const PreparedWeight& w) { return static_cast<const CpuWeight&>(w); }

#define OSCAR_AVX512_FN __attribute__((target("avx512f,avx512dq,avx512vl,fma")))
const bool g_avx512 = [] {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl");
}();

// e^x for 16 lanes: 2^(x log2 e) with the exponent clamped to [-126, 127]
// (so e^x saturates at 1.2e-38 / 1.7e38: no denormals, no overflow),
// 2^f on [-0.5, 0.5] by its degree-6 Taylor polynomial (relative error < 3e-8,
// plus the rounding of x log2 e: ~1e-7 relative for |x| < 16).
OSCAR_AVX512_FN inline __m512 exp16(__m512 x) {
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-126.0f)), _mm512_set1_ps(127.0f));
  return simd::exp2_clamped_avx512(t);
}

// out[t][j] = silu(gu[t][j]) * gu[t][inter + j] for rows [t0, t1).
OSCAR_AVX512_FN void silu_mul_avx512(const float* gu, int64_t t0, int64_t t1, int inter,
                                     float* out) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t t = t0; t < t1; ++t) {
    const float* g = gu + t * 2 * inter;
    const float* u = g + inter;
    float* o = out + t * inter;
    for (int j = 0; j < inter; j += 16) {
      const __mmask16 m = inter - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (inter - j)) - 1);
      const __m512 gv = _mm512_maskz_loadu_ps(m, g + j);
      const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
      _mm512_mask_storeu_ps(o + j, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, u + j)));
    }
  }
}

// RMSNorm of rows [r0, r1): Σx² in fp64 (as the scalar path), scaling in fp32.
OSCAR_AVX512_FN void rms_norm_avx512(const float* x, const float* w, int64_t r0, int64_t r1,
                                     int dim, float eps, float* y) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (int c = 0; c < dim; c += 16) {
      const __mmask16 m = dim - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (dim - c)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(m, xr + c);
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
      const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
      s0 = _mm512_fmadd_pd(lo, lo, s0);
      s1 = _mm512_fmadd_pd(hi, hi, s1);
    }
    const double ss = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    const __m512 inv = _mm512_set1_ps(static_cast<float>(1.0 / std::sqrt(ss / dim + eps)));
    for (int c = 0; c < dim; c += 16) {
      const __mmask16 m = dim - c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (dim - c)) - 1);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + c), inv);
      _mm512_mask_storeu_ps(yr + c, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + c)));
    }
  }
}

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& o) : opts_(o) {
    if (o.threads > 0) {
      set_op_threads(o.threads);
      openblas_set_num_threads(o.threads);
    }
    kernels::cpu::set_num_threads(op_threads());
  }

  std::string name() const override {
    const std::string amx = opts_.weight_dtype == WeightDtype::kBf16 && amx_available()
                                ? fmt::format(", amx from {} rows", amx_min_rows())
                                : std::string();
    return fmt::format("cpu ({} weights, gemv {}{}, attention {}, {} threads)",
                       to_string(opts_.weight_dtype), gemv_isa(), amx, kernels::cpu::attention_isa(),
                       op_threads());
  }

  BufferPtr alloc(size_t n) override { return std::make_unique<HostBuffer>(n); }
  void to_host(const float* src, float* dst, size_t n) override {
    std::memcpy(dst, src, n * sizeof(float));
  }
  void from_host(const float* src, float* dst, size_t n) override {
    std::memcpy(dst, src, n * sizeof(float));
  }
  double copy_bandwidth() override {
    // 256 MiB each way (beyond the L3 of the machines here), split over the op threads.
    const size_t n = size_t(1) << 28;
    std::vector<char> a(n, 1), b(n, 2);
    double best = 0;
    for (int r = 0; r < 5; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      parallel_for(int64_t(n), 1 << 20, [&](int64_t s, int64_t e) {
        std::memcpy(b.data() + s, a.data() + s, size_t(e - s));
      });
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * double(n) / sec);
    }
    if (b[n / 2] != 1) throw Error("cpu backend: the bandwidth copy did not copy");
    return best;
  }

  WeightPtr prepare_linear(std::initializer_list<const Tensor*> ws,
                           std::initializer_list<const Tensor*> biases) override {
    auto w = std::make_unique<CpuWeight>();
    int64_t cols = -1, rows = 0;
    for (const Tensor* t : ws) {
      if (t->shape.size() != 2)
        throw Error(fmt::format("cpu backend: linear weight of rank {} (want 2)", t->shape.size()));
      if (cols >= 0 && t->shape[1] != cols)
        throw Error(fmt::format("cpu backend: stacked weights with {} and {} input columns", cols,
                                t->shape[1]));
      cols = t->shape[1];
      rows += t->shape[0];
    }
    w->rows = rows;
    w->cols = cols;
    bool any_bias = false;
    for (const Tensor* b : biases) any_bias |= (b && !b->empty());
    // q8 needs the AVX-512 kernels and whole 32-channel blocks; else bf16.
    const bool q8 = opts_.weight_dtype == WeightDtype::kQ8 && q8_supported() && cols % kQ8Block == 0;
    if (q8) {
      w->q8.resize(size_t(rows * cols));
      w->q8_scale.resize(size_t(rows * cols / kQ8Block));
      int64_t r0 = 0;
      for (const Tensor* t : ws) {
        quantize_q8(t->data.data(), t->shape[0], cols, w->q8.data() + r0 * cols,
                    w->q8_scale.data() + r0 * (cols / kQ8Block));
        r0 += t->shape[0];
      }
      w->bytes = rows * cols + rows * (cols / kQ8Block) * 4;
    } else if (opts_.weight_dtype == WeightDtype::kF32) {
      w->f32.reserve(size_t(rows * cols));
      for (const Tensor* t : ws) w->f32.insert(w->f32.end(), t->data.begin(), t->data.end());
      w->bytes = rows * cols * 4;
    } else {
      w->bf16.reserve(size_t(rows * cols));
      for (const Tensor* t : ws)
        for (float x : t->data) w->bf16.push_back(f32_to_bf16(x));
      w->bytes = rows * cols * 2;
    }
    if (any_bias) {
      auto wi = ws.begin();
      for (const Tensor* b : biases) {
        const int64_t r = (*wi++)->shape[0];
        if (b && !b->empty()) {
          if (b->numel() != r)
            throw Error(fmt::format("cpu backend: bias of {} for {} rows", b->numel(), r));
          w->bias.insert(w->bias.end(), b->data.begin(), b->data.end());
        } else {
          w->bias.insert(w->bias.end(), size_t(r), 0.f);
        }
      }
      w->bytes += rows * 4;
    }
    return w;
  }

  WeightPtr prepare_vector(const Tensor& v) override {
    auto w = std::make_unique<CpuWeight>();
    w->f32 = v.data;
    w->rows = 1;
    w->cols = v.numel();
    w->bytes = v.numel() * 4;
    return w;
  }

  WeightPtr prepare_embedding(const Tensor& e) override {
    // Rows are gathered, never streamed whole: keep f32 (exact).
    auto w = std::make_unique<CpuWeight>();
    if (e.shape.size() != 2) throw Error("cpu backend: embedding is not a matrix");
    w->f32 = e.data;
    w->rows = e.shape[0];
    w->cols = e.shape[1];
    w->bytes = e.numel() * 4;
    return w;
  }

  void embed(const PreparedWeight& emb, const int32_t* tokens, int n, float* x) override {
    const CpuWeight& e = cw(emb);
    for (int i = 0; i < n; ++i) {
      if (tokens[i] < 0 || tokens[i] >= e.rows)
        throw Error(fmt::format("embedding: token id {} outside vocabulary [0, {})", tokens[i],
                                e.rows));
      std::memcpy(x + int64_t(i) * e.cols, e.f32.data() + int64_t(tokens[i]) * e.cols,
                  size_t(e.cols) * sizeof(float));
    }
  }

  void linear(const PreparedWeight& pw, const float* x, int n, float* y) override {
    const CpuWeight& w = cw(pw);
    const float* b = w.bias.empty() ? nullptr : w.bias.data();
    if (!w.q8.empty())
      linear_q8(w.q8.data(), w.q8_scale.data(), w.rows, w.cols, b, x, n, y);
    else if (!w.bf16.empty())
      linear_bf16(w.bf16.data(), w.rows, w.cols, b, x, n, y);
    else
      linear_f32(w.f32.data(), w.rows, w.cols, b, x, n, y);
  }

  void rms_norm(const float* x, const PreparedWeight& pw, int rows, int dim, float eps,
                float* y) override {
    const float* w = cw(pw).f32.data();
    if (cw(pw).cols != dim)
      throw Error(fmt::format("rms_norm: weight of {} for rows of {}", cw(pw).cols, dim));
    if (g_avx512 && int64_t(rows) * dim >= 16384) {
      parallel_for(rows, 16, [&](int64_t r0, int64_t r1) {
        rms_norm_avx512(x, w, r0, r1, dim, eps, y);
      });
      return;
    }
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + int64_t(r) * dim;
      float* yr = y + int64_t(r) * dim;
      double ss = 0;
      for (int c = 0; c < dim; ++c) ss += double(xr[c]) * xr[c];
      const float inv = static_cast<float>(1.0 / std::sqrt(ss / dim + eps));
      for (int c = 0; c < dim; ++c) yr[c] = xr[c] * inv * w[c];
    }
  }

  void rope(float* x, int n, int heads, int head_dim, const float* cos,
            const float* sin) override {
    kernels::cpu::rope_apply(x, n, heads, head_dim, cos, sin);
  }

  void silu_mul(const float* gu, int n, int inter, float* out) override {
    if (g_avx512) {
      parallel_for(n, 1, [&](int64_t t0, int64_t t1) { silu_mul_avx512(gu, t0, t1, inter, out); });
      return;
    }
    parallel_for(int64_t(n) * inter, 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t t = i / inter, j = i % inter;
        const float g = gu[t * 2 * inter + j], u = gu[t * 2 * inter + inter + j];
        out[i] = g / (1.0f + std::exp(-g)) * u;
      }
    });
  }

  void add(float* x, const float* y, size_t n) override {
    parallel_for(int64_t(n), 1 << 15, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) x[i] += y[i];
    });
  }

  void copy_cols(const float* src, int n, int src_cols, int col0, int width,
                 float* dst) override {
    parallel_for(n, std::max<int64_t>(1, (1 << 15) / std::max(width, 1)), [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t)
        std::memcpy(dst + t * width, src + t * src_cols + col0, size_t(width) * sizeof(float));
    });
  }

  void decode_attention(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                        float sm_scale, float* o) override {
    if (!kernel_supports_head_dim(kv.head_dim))
      return decode_attention_generic(kv, q, num_q_heads, sm_scale, o);
    kernels::cpu::decode_attention(kv, q, num_q_heads, sm_scale, o, nullptr);
  }

  void prefill_attention(const kv::PagedKvView& kv, int b, int cached_len, const float* q,
                         const float* k_new, const float* v_new, int n, int num_q_heads,
                         float sm_scale, float* o) override {
    // Reduced-precision weights: the chunk's own rows are read as the cache stores them (BF16), as
    // every earlier chunk's are and as the CUDA backend's BF16 prefill reads them, so a prompt's
    // logits do not depend on how it was split into chunks. f32 weights (the exact mode): fp32.
    if (opts_.weight_dtype != WeightDtype::kF32) {
      const size_t rows = size_t(n) * size_t(kv.num_kv_heads) * size_t(kv.head_dim);
      thread_local std::vector<float> own_rows;  // (a backend may serve several threads)
      own_rows.resize(2 * rows);
      for (size_t i = 0; i < rows; ++i) {
        own_rows[i] = bf16_to_f32(f32_to_bf16(k_new[i]));
        own_rows[rows + i] = bf16_to_f32(f32_to_bf16(v_new[i]));
      }
      k_new = own_rows.data();
      v_new = own_rows.data() + rows;
    }
    if (!kernel_supports_head_dim(kv.head_dim))
      return prefill_attention_generic(kv, b, cached_len, q, k_new, v_new, n, num_q_heads,
                                       sm_scale, o);
    kernels::cpu::prefill_attention(kv, b, cached_len, q, k_new, v_new, n, num_q_heads, sm_scale,
                                    o);
  }

 private:
  CpuBackendOptions opts_;
};

}  // namespace
}  // namespace cpu

std::unique_ptr<Backend> make_cpu_backend(const CpuBackendOptions& opts) {
  return std::make_unique<cpu::CpuBackend>(opts);
}

}  // namespace oscar::backend
