// The blocked GEMM (backend/cpu/ops_gemm.h), the base-2 softmax row and the dense
// causal attention of the calibration forward against plain references on
// fresh random inputs. Tolerances are relative to the natural scale of each
// output (Σ|a·b| for a dot product), so a NaN or a wrong element fails.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/cpu/backend_cpu.h"
#include "backend/cpu/ops_gemm.h"
#include "backend/cpu/ops_threads.h"
#include "core/half.h"
#include "model/calib_forward.h"

namespace oscar::backend::cpu {
namespace {

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = nd(rng);
  return v;
}

// fp64 reference and Σ|terms| for the tolerance.
struct Ref {
  std::vector<double> y, mag;
};
Ref gemm_ref64(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, bool b_nk, const float* C0, int64_t ldc, float alpha,
               const float* bias, bool accumulate) {
  Ref r{std::vector<double>(size_t(M * N)), std::vector<double>(size_t(M * N))};
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, a = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = double(A[m * lda + k]) * (b_nk ? B[n * ldb + k] : B[k * ldb + n]);
        s += p;
        a += std::abs(p);
      }
      double y = alpha * s + (bias ? bias[n] : 0.0);
      double mag = std::abs(alpha) * a + (bias ? std::abs(bias[n]) : 0.0);
      if (accumulate) y += C0[m * ldc + n], mag += std::abs(C0[m * ldc + n]);
      r.y[size_t(m * N + n)] = y;
      r.mag[size_t(m * N + n)] = mag;
    }
  return r;
}

// fp32 products summed in fp32: relative error of order K·2^-24 at worst;
// 4e-6·(Σ|terms|) + 1e-30 holds for these K (<= 600) with margin in practice.
void expect_close(const std::vector<float>& C, int64_t ldc, const Ref& r, int64_t M, int64_t N,
                  const std::string& what) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      const double y = C[size_t(m * ldc + n)], want = r.y[size_t(m * N + n)];
      const double tol = 4e-6 * r.mag[size_t(m * N + n)] + 1e-30;
      ASSERT_TRUE(std::abs(y - want) <= tol)
          << what << " at (" << m << ", " << n << "): " << y << " vs " << want << " tol " << tol;
    }
}

TEST(Gemm, MatchesReferenceOnOddShapes) {
  std::mt19937 rng(11);
  struct Shape {
    int64_t M, N, K;
  };
  // Row tiles are 14, column panels 32, passes up to 256 deep, M blocks 224.
  const Shape shapes[] = {{1, 1, 1},     {13, 31, 7},   {14, 32, 16},   {15, 33, 64},
                          {29, 64, 255}, {100, 17, 257}, {225, 70, 300}, {230, 96, 600},
                          {57, 200, 40}};
  // portable: OpenBLAS / plain-loop paths of CPUs without AVX-512.
  for (int threads : {1, 2, -1}) {
    const bool portable = threads < 0;
    gemm_force_portable(portable);
    set_op_threads(portable ? 2 : threads);
    for (const Shape& s : shapes)
      for (bool b_nk : {true, false})
        for (int variant = 0; variant < 3; ++variant) {
          // Leading dimensions larger than the shape (sub-matrices), and one
          // row stride of exactly 1024 floats (the packed-A path).
          const int64_t lda = variant == 2 ? 1024 : s.K + 3;
          const int64_t ldb = (b_nk ? s.K : s.N) + 5, ldc = s.N + 2;
          const auto A = randn(size_t(s.M * lda), rng);
          const auto B = randn(size_t((b_nk ? s.N : s.K) * ldb), rng);
          const auto bias = randn(size_t(s.N), rng);
          const auto C0 = randn(size_t(s.M * ldc), rng);
          const float alpha = variant == 1 ? -0.37f : 1.0f;
          const bool acc = variant == 1;
          const float* bp = variant == 0 ? nullptr : bias.data();
          std::vector<float> C = C0;
          gemm_f32(s.M, s.N, s.K, A.data(), lda, B.data(), ldb, b_nk, C.data(), ldc, alpha, bp,
                   acc);
          const Ref r = gemm_ref64(s.M, s.N, s.K, A.data(), lda, B.data(), ldb, b_nk, C0.data(),
                                   ldc, alpha, bp, acc);
          const std::string what = "gemm " + std::to_string(s.M) + "x" + std::to_string(s.N) +
                                   "x" + std::to_string(s.K) + (b_nk ? " nk" : " kn") +
                                   " variant " + std::to_string(variant) + " threads " +
                                   std::to_string(threads) + (portable ? " portable" : "");
          expect_close(C, ldc, r, s.M, s.N, what);
          // Columns past N of C are untouched.
          for (int64_t m = 0; m < s.M; ++m)
            for (int64_t n = s.N; n < ldc; ++n)
              ASSERT_EQ(C[size_t(m * ldc + n)], C0[size_t(m * ldc + n)]) << what;
          // The scalar reference of the library agrees too.
          std::vector<float> R = C0;
          gemm_f32_ref(s.M, s.N, s.K, A.data(), lda, B.data(), ldb, b_nk, R.data(), ldc, alpha,
                       bp, acc);
          expect_close(R, ldc, r, s.M, s.N, what + " (gemm_f32_ref)");
        }
  }
  gemm_force_portable(false);
  set_op_threads(0);
}

TEST(Gemm, Bf16WeightsAndPackedPrefix) {
  for (bool portable : {false, true}) {
    gemm_force_portable(portable);
    std::mt19937 rng(12);
    const int64_t M = 47, N = 77, K = 130;
    const auto A = randn(size_t(M * K), rng), W = randn(size_t(N * K), rng), bias = randn(N, rng);
    std::vector<uint16_t> Wb(W.size());
    std::vector<float> Wr(W.size());
    for (size_t i = 0; i < W.size(); ++i) Wr[i] = bf16_to_f32(Wb[i] = f32_to_bf16(W[i]));
    std::vector<float> C(size_t(M * N));
    gemm_bf16w(M, N, K, A.data(), K, Wb.data(), K, C.data(), N, bias.data());
    expect_close(C, N, gemm_ref64(M, N, K, A.data(), K, Wr.data(), K, true, nullptr, N, 1.0f,
                                  bias.data(), false),
                 M, N, "bf16 weights");
    // Deep K: packed B goes in column chunks of ~8 MiB (here 256 columns).
    {
      const int64_t m = 15, n = 300, k = 8192;
      const auto a = randn(size_t(m * k), rng), b = randn(size_t(n * k), rng), bi = randn(n, rng);
      std::vector<float> c(size_t(m * n));
      gemm_f32(m, n, k, a.data(), k, b.data(), k, true, c.data(), n, 1.0f, bi.data());
      expect_close(c, n, gemm_ref64(m, n, k, a.data(), k, b.data(), k, true, nullptr, n, 1.0f,
                                    bi.data(), false),
                   m, n, "deep K, column chunks");
    }
    // Pack once, use leading column / depth ranges (how attention uses it).
    for (bool b_nk : {true, false}) {
      const auto B = randn(size_t(N * K), rng);
      const int64_t ldb = b_nk ? K : N;
      PackedB pb;
      pb.pack(B.data(), ldb, b_nk, N, K);
      for (auto [n, k] : {std::pair<int64_t, int64_t>{N, K}, {33, K}, {N, 50}, {5, 1}}) {
        std::vector<float> Cp(size_t(M * n));
        gemm_packed(M, n, k, A.data(), K, pb, Cp.data(), n, 0.5f);
        expect_close(Cp, n, gemm_ref64(M, n, k, A.data(), K, B.data(), ldb, b_nk, nullptr, n, 0.5f,
                                       nullptr, false),
                     M, n, "packed prefix " + std::to_string(n) + "x" + std::to_string(k));
      }
      std::vector<float> Cp(size_t(M * N));
      EXPECT_THROW(gemm_packed(M, N + 1, K, A.data(), K, pb, Cp.data(), N + 1), std::exception);
    }
  }
  gemm_force_portable(false);
}

TEST(Gemm, SoftmaxExp2Row) {
  for (bool portable : {false, true}) {
    gemm_force_portable(portable);
    std::mt19937 rng(13);
    for (int len : {1, 2, 15, 16, 17, 100, 1000}) {
      const int width = len + 37;
      auto s = randn(size_t(width), rng, 8.0f);
      s[0] = -300.0f;  // underflows to 0 after the shift
      if (len > 3) s[3] = 250.0f;  // dominant
      if (len > 5) s[5] = 250.0f - 130.0f;  // 2^-130: a denormal, may flush to 0
      const std::vector<float> x = s;
      softmax_exp2_row(s.data(), len, width);
      double mx = -INFINITY;
      for (int j = 0; j < len; ++j) mx = std::max(mx, double(x[j]));
      double sum = 0;
      for (int j = 0; j < len; ++j) sum += std::exp2(double(x[j]) - mx);
      for (int j = 0; j < len; ++j) {
        const double want = std::exp2(double(x[j]) - mx) / sum;
        ASSERT_TRUE(std::abs(s[j] - want) <= 2e-6 * want + 1e-37)
            << "len " << len << " j " << j << ": " << s[j] << " vs " << want;
      }
      for (int j = len; j < width; ++j) ASSERT_EQ(s[j], 0.0f) << "len " << len << " j " << j;
      // The unnormalized form: 2^(x - max) and its sum.
      std::vector<float> e = x;
      const double got = exp2_row(e.data(), len, width);
      ASSERT_TRUE(std::abs(got - sum) <= 1e-6 * sum) << "len " << len << ": sum " << got << " vs " << sum;
      for (int j = 0; j < len; ++j) {
        const double want = std::exp2(double(x[j]) - mx);
        ASSERT_TRUE(std::abs(e[j] - want) <= 2e-7 * want + 1e-37) << "len " << len << " j " << j;
      }
    }
  }
  gemm_force_portable(false);
}

// softmax(q_t K[0..t]ᵀ / sqrt(d)) V in fp64.
std::vector<double> attention_ref(const std::vector<float>& q, const std::vector<float>& k,
                                  const std::vector<float>& v, int T, int Hq, int Hkv, int d) {
  std::vector<double> o(size_t(T) * Hq * d);
  const int group = Hq / Hkv;
  std::vector<double> p(static_cast<size_t>(T));
  for (int g = 0; g < Hq; ++g)
    for (int t = 0; t < T; ++t) {
      const int h = g / group;
      double mx = -INFINITY;
      for (int j = 0; j <= t; ++j) {
        double s = 0;
        for (int c = 0; c < d; ++c)
          s += double(q[(size_t(t) * Hq + g) * d + c]) * k[(size_t(j) * Hkv + h) * d + c];
        p[j] = s / std::sqrt(double(d));
        mx = std::max(mx, p[j]);
      }
      double sum = 0;
      for (int j = 0; j <= t; ++j) sum += (p[j] = std::exp(p[j] - mx));
      for (int c = 0; c < d; ++c) {
        double acc = 0;
        for (int j = 0; j <= t; ++j) acc += p[j] * v[(size_t(j) * Hkv + h) * d + c];
        o[(size_t(t) * Hq + g) * d + c] = acc / sum;
      }
    }
  return o;
}

TEST(DenseAttention, MatchesFp64Reference) {
  for (bool portable : {false, true}) {
    gemm_force_portable(portable);
    std::mt19937 rng(14);
    struct Case {
      int T, Hq, Hkv, d;
    };
    // Query blocks are 112 rows; key panels 32; head dims with and without tails.
    for (const Case& c : {Case{1, 2, 1, 64}, Case{5, 4, 2, 32}, Case{113, 6, 2, 64},
                          Case{250, 3, 3, 40}, Case{300, 9, 3, 64}}) {
      // Scaled so that the softmax is peaked (scores ~ ±10), as in real models.
      auto q = randn(size_t(c.T) * c.Hq * c.d, rng, 2.0f);
      auto k = randn(size_t(c.T) * c.Hkv * c.d, rng, 0.6f);
      auto v = randn(size_t(c.T) * c.Hkv * c.d, rng);
      std::vector<float> o(q.size(), NAN);
      model::dense_causal_attention(q.data(), k.data(), v.data(), c.T, c.Hq, c.Hkv, c.d, o.data());
      const std::vector<double> r = attention_ref(q, k, v, c.T, c.Hq, c.Hkv, c.d);
      // o is a convex combination of v rows (|v| ~ 1): absolute tolerance.
      for (size_t i = 0; i < o.size(); ++i)
        ASSERT_TRUE(std::abs(o[i] - r[i]) <= 2e-5)
            << "T " << c.T << " d " << c.d << " at " << i << ": " << o[i] << " vs " << r[i];
    }
  }
  gemm_force_portable(false);
}

}  // namespace
}  // namespace oscar::backend::cpu

namespace oscar::backend::cpu {
namespace {

// The CPU backend's vectorized elementwise ops (SwiGLU, RMSNorm, add, column
// copy) against their formulas in fp64, on shapes with and without 16-lane tails.
TEST(CpuBackendOps, ElementwiseMatchFormulas) {
  std::mt19937 rng(15);
  auto be = make_cpu_backend({backend::WeightDtype::kF32, 2});
  for (int dim : {576, 100}) {
    const int rows = 200;
    auto x = randn(size_t(rows) * dim, rng, 3.0f);
    Tensor wt;
    wt.shape = {dim};
    wt.data = randn(size_t(dim), rng);
    auto w = be->prepare_vector(wt);
    std::vector<float> y(x.size());
    be->rms_norm(x.data(), *w, rows, dim, 1e-6f, y.data());
    for (int r = 0; r < rows; ++r) {
      double ss = 0;
      for (int c = 0; c < dim; ++c) ss += double(x[size_t(r) * dim + c]) * x[size_t(r) * dim + c];
      const double inv = 1.0 / std::sqrt(ss / dim + 1e-6);
      for (int c = 0; c < dim; ++c) {
        const double want = x[size_t(r) * dim + c] * inv * wt.data[size_t(c)];
        ASSERT_TRUE(std::abs(y[size_t(r) * dim + c] - want) <= 1e-6 * std::abs(want) + 1e-12)
            << "rms_norm dim " << dim << " (" << r << ", " << c << ")";
      }
    }
  }
  for (int inter : {1536, 100}) {
    const int n = 7;
    auto gu = randn(size_t(n) * 2 * inter, rng, 8.0f);
    gu[0] = -30.0f, gu[1] = 30.0f, gu[2] = -200.0f, gu[3] = 200.0f;  // saturation
    std::vector<float> out(size_t(n) * inter);
    be->silu_mul(gu.data(), n, inter, out.data());
    for (int t = 0; t < n; ++t)
      for (int j = 0; j < inter; ++j) {
        const double g = gu[size_t(t) * 2 * inter + j], u = gu[size_t(t) * 2 * inter + inter + j];
        const double want = g / (1.0 + std::exp(-g)) * u;
        // exp via 2^(x log2 e): the fp32 product x·log2 e costs ~6e-8·|x| relative.
        const double tol = 1e-7 * (2.0 + std::abs(g)) * std::abs(want) + 1e-30;
        ASSERT_TRUE(std::abs(out[size_t(t) * inter + j] - want) <= tol)
            << "silu inter " << inter << " (" << t << ", " << j << "): " << out[size_t(t) * inter + j]
            << " vs " << want;
      }
  }
  {
    auto a = randn(100003, rng), b = randn(100003, rng);
    std::vector<float> want(a.size());
    for (size_t i = 0; i < a.size(); ++i) want[i] = a[i] + b[i];
    be->add(a.data(), b.data(), a.size());
    ASSERT_EQ(a, want);
    std::vector<float> dst(size_t(300) * 17);
    be->copy_cols(b.data(), 300, 300, 5, 17, dst.data());
    for (int t = 0; t < 300; ++t)
      for (int c = 0; c < 17; ++c) ASSERT_EQ(dst[size_t(t) * 17 + c], b[size_t(t) * 300 + 5 + c]);
  }
  set_op_threads(0);
}

}  // namespace
}  // namespace oscar::backend::cpu
