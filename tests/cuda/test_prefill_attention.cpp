// The fused prefill attention kernel (kernels/cuda/prefill_attention.h) against a
// double-precision reference on the same BF16-rounded q, K and V: causal masking at
// every offset of the chunk in the sequence, GQA, rows and keys that are not multiples
// of the 64-row tiles, and bad arguments refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "cuda_test_util.h"
#include "kernels/cuda/prefill_attention.h"

namespace oscar::kernels::cuda {
namespace {

using test::DeviceBuffer;

struct Shape {
  int n, L, hq, hkv, d;
};

// o[t][h] over keys j <= L + t, in double, from the BF16 values the kernel reads.
std::vector<float> reference(const std::vector<float>& q, const std::vector<uint16_t>& K,
                             const std::vector<uint16_t>& V, const Shape& s, int Lt, float scale) {
  std::vector<float> o(size_t(s.n) * s.hq * s.d);
  const int G = s.hq / s.hkv;
  std::vector<double> w(Lt);
  for (int t = 0; t < s.n; ++t)
    for (int h = 0; h < s.hq; ++h) {
      const float* qr = q.data() + (size_t(t) * s.hq + h) * s.d;
      const uint16_t* Kh = K.data() + size_t(h / G) * Lt * s.d;
      const uint16_t* Vh = V.data() + size_t(h / G) * Lt * s.d;
      const int nk = s.L + t + 1;
      double mx = -INFINITY;
      for (int j = 0; j < nk; ++j) {
        double dot = 0;
        for (int c = 0; c < s.d; ++c)
          dot += double(bf16_to_f32(f32_to_bf16(qr[c]))) * bf16_to_f32(Kh[size_t(j) * s.d + c]);
        w[j] = dot * scale;
        mx = std::max(mx, w[j]);
      }
      double sum = 0;
      for (int j = 0; j < nk; ++j) sum += (w[j] = std::exp(w[j] - mx));
      for (int c = 0; c < s.d; ++c) {
        double acc = 0;
        for (int j = 0; j < nk; ++j) acc += w[j] * bf16_to_f32(Vh[size_t(j) * s.d + c]);
        o[(size_t(t) * s.hq + h) * s.d + c] = float(acc / sum);
      }
    }
  return o;
}

TEST(CudaPrefill, FusedAttentionMatchesReference) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const Shape shapes[] = {{1, 0, 4, 2, 64},    {37, 0, 4, 4, 64},    {64, 0, 8, 2, 128},
                          {130, 77, 8, 2, 128}, {200, 1000, 4, 1, 128}, {5, 300, 12, 2, 128},
                          {257, 63, 2, 2, 64},  {96, 4096, 32, 8, 128}};
  for (const Shape& s : shapes) {
    SCOPED_TRACE("n " + std::to_string(s.n) + ", L " + std::to_string(s.L) + ", Hq " + std::to_string(s.hq) +
                 ", Hkv " + std::to_string(s.hkv) + ", d " + std::to_string(s.d));
    const int Lt = s.L + s.n + 3;  // rows past the chunk's last key must be ignored
    std::vector<float> q(size_t(s.n) * s.hq * s.d);
    std::vector<uint16_t> K(size_t(s.hkv) * Lt * s.d), V(K.size());
    // Large scores on a few keys so the softmax is peaked, not uniform.
    for (auto& x : q) x = nd(rng);
    for (auto& x : K) x = f32_to_bf16(nd(rng) * (std::uniform_real_distribution<float>(0, 1)(rng) < 0.02f ? 4.0f : 1.0f));
    for (auto& x : V) x = f32_to_bf16(nd(rng));
    for (int h = 0; h < s.hkv; ++h)  // NaN past the last key: must never be read into a result
      for (int j = s.L + s.n; j < Lt; ++j)
        for (int c = 0; c < s.d; ++c) K[(size_t(h) * Lt + j) * s.d + c] = V[(size_t(h) * Lt + j) * s.d + c] = 0x7fc0;
    const float scale = 1.0f / std::sqrt(float(s.d));
    const auto ref = reference(q, K, V, s, Lt, scale);
    DeviceBuffer<float> dq(q), dout(q.size());
    DeviceBuffer<uint16_t> dK(K), dV(V);
    for (int warps : {4, 8}) {
      dout.poison();
      OSCAR_CUDA_CHECK(prefill_attention_bf16(dq.ptr, dK.ptr, dV.ptr, s.n, s.L, Lt, s.hq, s.hkv, s.d, scale,
                                              dout.ptr, nullptr, warps));
      OSCAR_CUDA_CHECK(cudaDeviceSynchronize());
      const auto got = dout.download();
      // BF16 probabilities in the value product: ~2^-9 relative per term.
      const double rel = test::rel_l2(got, ref);
      double worst = 0;
      for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(double(got[i]) - ref[i]));
      std::printf("  prefill n %d L %d Hq %d Hkv %d d %d, %d warps: rel_l2 %.2e, max abs %.2e\n", s.n, s.L,
                  s.hq, s.hkv, s.d, warps, rel, worst);
      EXPECT_LE(rel, 1e-2) << warps << " warps";
      EXPECT_LE(worst, 3e-2) << warps << " warps";
      EXPECT_TRUE(std::isfinite(worst));
    }
  }
}

TEST(CudaPrefill, BadArgumentsAreRefused) {
  if (!test::have_gpu()) GTEST_SKIP() << "no GPU";
  DeviceBuffer<float> q(64 * 4 * 64), o(64 * 4 * 64);
  DeviceBuffer<uint16_t> K(2 * 128 * 64), V(2 * 128 * 64);
  EXPECT_EQ(prefill_attention_bf16(q.ptr, K.ptr, V.ptr, 64, 64, 100, 4, 2, 64, 0.125f, o.ptr, nullptr),
            cudaErrorInvalidValue);  // Lt < L + n
  EXPECT_EQ(prefill_attention_bf16(q.ptr, K.ptr, V.ptr, 8, 0, 8, 4, 3, 64, 0.125f, o.ptr, nullptr),
            cudaErrorInvalidValue);  // Hq not a multiple of Hkv
  EXPECT_EQ(prefill_attention_bf16(q.ptr, K.ptr, V.ptr, 8, 0, 8, 4, 2, 96, 0.125f, o.ptr, nullptr),
            cudaErrorInvalidValue);  // head_dim
  EXPECT_EQ(prefill_attention_bf16(q.ptr, K.ptr, V.ptr, 0, 0, 8, 4, 2, 64, 0.125f, o.ptr, nullptr), cudaSuccess);
  EXPECT_EQ(prefill_attention_bf16(q.ptr, K.ptr, V.ptr, 8, 0, 8, 4, 2, 64, 0.125f, o.ptr, nullptr, 5),
            cudaErrorInvalidValue);  // warps per CTA
  EXPECT_FALSE(prefill_attention_supported(256));
}

}  // namespace
}  // namespace oscar::kernels::cuda
