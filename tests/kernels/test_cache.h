// Test fixture: a random paged three-region KV cache (one layer) with its
// dense dequantized copy, for checking attention kernels.
//
// Pages are allocated in shuffled order, every pool has spare pages, and all
// bytes no region owns (spare pages, the tail of a partial last page) are
// filled with NaN (bf16 / fp16 params), so a kernel that reads outside its
// rows produces NaN and fails.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "core/half.h"
#include "core/quantizer.h"
#include "kernels/paged_kv.h"

namespace oscar::test {

struct CacheSpec {
  int hkv = 2, d = 128, page = 16, bits = 2, group = 128;
  // Keys of the middle per channel over spans of 32 slots (paged_kv.h,
  // KeyAxis::kChannel; page must be a multiple of 32). The rows of a span
  // past the region's end are filled too (their params cover them); spans
  // wholly past it keep NaN params.
  bool key_channel = false;
  // Page centering (paged_kv.h MidCenter): `center_pairs` random pairs with large random
  // u / w / mu, so a kernel that ignores the centre is far off. 0 = none. With an even count and
  // more than one KV head, head 1's centre is 0 and marked inactive (a head without ν: the
// kernels' plain path).
  int center_pairs = 0;
  // Page centering with MidCenter::angle_start: the sequences' angle rows in reverse order, two
  // unused NaN rows apart (a kernel that indexes by page-table slot reads the wrong rows or NaN).
  bool center_start = false;
  std::vector<int> sink, mid, recent;  // per sequence (sizes define the batch)
};

inline constexpr uint16_t kBf16NaN = 0x7fc0;
inline constexpr uint16_t kF16NaN = 0x7e00;

struct TestCache {
  CacheSpec spec;
  std::vector<uint16_t> bk, bv;                  // BF16 pool
  std::vector<uint8_t> kc, vc;                   // quantized codes
  std::vector<uint16_t> kp, vp;                  // quantized params
  std::vector<int32_t> indptr[3], idx[3], len[3];  // sink, mid, recent
  std::vector<float> cu, cw, cmu, cfreq, cangles;  // page centering (spec.center_pairs > 0)
  std::vector<uint8_t> cactive;
  std::vector<int32_t> cstart;  // spec.center_start: the angle_start rows
  kv::PagedKvView view;
  // Dense copy as the kernels must see it: [b] -> [T_b][hkv][d].
  std::vector<std::vector<float>> K, V;

  int batch() const { return int(spec.sink.size()); }
  int total(int b) const { return spec.sink[b] + spec.mid[b] + spec.recent[b]; }
};

// Row generator: N(0,1) with a few large channels (the outliers rotations
// and clipping exist for), so quantization error is not trivial.
inline void random_row(std::mt19937& rng, int d, float* x) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (int c = 0; c < d; ++c) x[c] = n(rng) * ((c % 17 == 3) ? 4.0f : 1.0f);
}

inline TestCache make_cache(const CacheSpec& spec, std::mt19937& rng) {
  TestCache tc;
  tc.spec = spec;
  const int B = int(spec.sink.size()), H = spec.hkv, d = spec.d, P = spec.page;
  const QuantSpec qs{spec.bits, spec.group, ScaleDtype::kF16};
  const int cb = d * spec.bits / 8, ng = d / spec.group;
  auto pages_for = [&](int len) { return (len + P - 1) / P; };
  int nb = 3, nq = 3;  // spare pages
  for (int b = 0; b < B; ++b) {
    nb += pages_for(spec.sink[b]) + pages_for(spec.recent[b]);
    nq += pages_for(spec.mid[b]);
  }
  tc.bk.assign(size_t(nb) * H * P * d, kBf16NaN);
  tc.bv.assign(tc.bk.size(), kBf16NaN);
  tc.kc.resize(size_t(nq) * H * P * cb);
  tc.vc.resize(tc.kc.size());
  for (auto& c : tc.kc) c = uint8_t(rng());
  for (auto& c : tc.vc) c = uint8_t(rng());
  tc.vp.assign(size_t(nq) * H * P * ng * 2, kF16NaN);
  tc.kp.assign(spec.key_channel ? size_t(nq) * H * (P / kv::kKeySpan) * d * 2 : tc.vp.size(), kF16NaN);
  std::vector<int32_t> bfree(nb), qfree(nq);
  for (int i = 0; i < nb; ++i) bfree[i] = i;
  for (int i = 0; i < nq; ++i) qfree[i] = i;
  std::shuffle(bfree.begin(), bfree.end(), rng);
  std::shuffle(qfree.begin(), qfree.end(), rng);
  size_t bnext = 0, qnext = 0;

  kv::PagedKvView& v = tc.view;
  v.batch = B;
  v.num_kv_heads = H;
  v.head_dim = d;
  v.page_size = P;
  v.bits = spec.bits;
  v.group_size = spec.group;
  v.key_axis = spec.key_channel ? kv::KeyAxis::kChannel : kv::KeyAxis::kToken;
  tc.K.resize(B);
  tc.V.resize(B);
  const std::vector<int>* lens[3] = {&spec.sink, &spec.mid, &spec.recent};
  for (int r = 0; r < 3; ++r) tc.indptr[r].push_back(0);
  std::vector<float> row(d), deq(d);
  for (int b = 0; b < B; ++b) {
    tc.K[b].resize(size_t(tc.total(b)) * H * d);
    tc.V[b].resize(tc.K[b].size());
    int pos = 0;
    for (int r = 0; r < 3; ++r) {
      const int len = (*lens[r])[b];
      tc.len[r].push_back(len);
      for (int p = 0; p < pages_for(len); ++p) tc.idx[r].push_back(r == 1 ? qfree[qnext++] : bfree[bnext++]);
      tc.indptr[r].push_back(int32_t(tc.idx[r].size()));
      for (int i = 0; i < len; ++i, ++pos) {
        const int32_t page = tc.idx[r][tc.indptr[r][b] + i / P];
        const int slot = i % P;
        for (int h = 0; h < H; ++h)
          for (int kvsel = 0; kvsel < 2; ++kvsel) {
            random_row(rng, d, row.data());
            float* dense = (kvsel ? tc.V[b] : tc.K[b]).data() + (size_t(pos) * H + h) * d;
            if (r == 1 && kvsel == 0 && spec.key_channel) {
              std::copy(row.begin(), row.end(), dense);  // quantized per span below
            } else if (r == 1) {
              const int64_t qr = (int64_t(page) * H + h) * P + slot;
              uint8_t* codes = (kvsel ? tc.vc : tc.kc).data() + qr * cb;
              uint16_t* params = (kvsel ? tc.vp : tc.kp).data() + qr * ng * 2;
              quantize_row(row.data(), d, qs, codes, params);
              dequantize_row(codes, params, d, qs, dense);
            } else {
              uint16_t* dst = (kvsel ? tc.bv : tc.bk).data() + (int64_t(page) * H * P + int64_t(h) * P + slot) * d;
              for (int c = 0; c < d; ++c) {
                dst[c] = f32_to_bf16(row[c]);
                dense[c] = bf16_to_f32(dst[c]);
              }
            }
          }
      }
      if (r == 1 && spec.key_channel && len > 0) {
        // Per-channel keys: each span of 32 slots of each page, column by
        // column through the reference quantizer (quantize_row, group 32).
        const int S = kv::kKeySpan, mid0 = pos - len;
        const QuantSpec cs{spec.bits, S, ScaleDtype::kF16};
        std::vector<float> col(S), deqc(S);
        std::vector<uint8_t> cc(size_t(S * spec.bits / 8));
        for (int s0 = 0; s0 < len; s0 += S) {
          const int32_t page = tc.idx[r][tc.indptr[r][b] + s0 / P];
          const int slot0 = s0 % P;
          for (int h = 0; h < H; ++h) {
            std::vector<float> rows(size_t(S) * d);
            for (int i = 0; i < S; ++i) {
              if (s0 + i < len)
                std::copy_n(tc.K[b].data() + (size_t(mid0 + s0 + i) * H + h) * d, d, rows.data() + size_t(i) * d);
              else
                random_row(rng, d, rows.data() + size_t(i) * d);
            }
            uint16_t* par = tc.kp.data() + ((int64_t(page) * H + h) * (P / S) + slot0 / S) * d * 2;
            uint8_t* codes0 = tc.kc.data() + ((int64_t(page) * H + h) * P + slot0) * cb;
            std::fill(codes0, codes0 + size_t(S) * cb, uint8_t(0));
            for (int c = 0; c < d; ++c) {
              for (int i = 0; i < S; ++i) col[i] = rows[size_t(i) * d + c];
              quantize_row(col.data(), S, cs, cc.data(), par + 2 * c);
              dequantize_row(cc.data(), par + 2 * c, S, cs, deqc.data());
              for (int i = 0; i < S; ++i) {
                codes0[size_t(i) * cb + code_byte(c, spec.group, spec.bits)] |=
                    uint8_t(get_code(cc.data(), i, S, spec.bits) << code_shift(c, spec.group, spec.bits));
                if (s0 + i < len) tc.K[b][(size_t(mid0 + s0 + i) * H + h) * d + c] = deqc[i];
              }
            }
          }
        }
      }
    }
  }
  v.bf16 = {tc.bk.data(), tc.bv.data()};
  v.quant = {tc.kc.data(), tc.vc.data(), tc.kp.data(), tc.vp.data()};
  kv::RegionTable* regs[3] = {&v.sink, &v.mid, &v.recent};
  for (int r = 0; r < 3; ++r) *regs[r] = {tc.indptr[r].data(), tc.idx[r].data(), tc.len[r].data()};
  if (spec.center_pairs > 0) {
    // Random centre vectors and frequencies; the dense copy's middle keys get + δ_h(t).
    const int S = spec.center_pairs;
    std::normal_distribution<float> big(0.0f, 1.0f);
    std::uniform_real_distribution<float> fr(0.0f, 0.05f);
    tc.cu.resize(size_t(H) * S * d);
    tc.cw.resize(tc.cu.size());
    tc.cmu.resize(size_t(H) * d);
    for (auto* vec : {&tc.cu, &tc.cw, &tc.cmu})
      for (float& x : *vec) x = big(rng);
    for (int i = 0; i < S; ++i) tc.cfreq.push_back(fr(rng));
    tc.cactive.assign(size_t(H), 1);
    if (S % 2 == 0 && H > 1) {
      std::fill(tc.cu.begin() + size_t(S) * d, tc.cu.begin() + size_t(2 * S) * d, 0.0f);
      std::fill(tc.cw.begin() + size_t(S) * d, tc.cw.begin() + size_t(2 * S) * d, 0.0f);
      std::fill(tc.cmu.begin() + d, tc.cmu.begin() + 2 * d, 0.0f);
      tc.cactive[1] = 0;
    }
    // Row of sequence b's middle page 0: its page-table slot, or (center_start) the sequences
    // in reverse order with two NaN rows before each.
    std::vector<int32_t> first(size_t(B) + 1, 0);
    int32_t rows = tc.indptr[1][B];
    if (spec.center_start) {
      rows = 0;
      for (int b = B - 1; b >= 0; --b) {
        first[size_t(b)] = rows + 2;
        rows += 2 + tc.indptr[1][b + 1] - tc.indptr[1][b];
      }
      tc.cstart.assign(first.begin(), first.begin() + B);
    } else {
      for (int b = 0; b < B; ++b) first[size_t(b)] = tc.indptr[1][b];
    }
    tc.cangles.assign(size_t(std::max<int32_t>(1, rows)) * S * 2, spec.center_start ? NAN : 0.0f);
    v.center.pairs = S;
    v.center.u = tc.cu.data();
    v.center.w = tc.cw.data();
    v.center.mu = tc.cmu.data();
    v.center.angles = tc.cangles.data();
    v.center.active = tc.cactive.data();
    v.center.angle_start = spec.center_start ? tc.cstart.data() : nullptr;
    std::vector<float> delta(d);
    for (int b = 0; b < B; ++b)
      for (int pi = 0; pi < tc.indptr[1][b + 1] - tc.indptr[1][b]; ++pi) {
        float* cs = tc.cangles.data() + size_t(first[size_t(b)] + pi) * S * 2;
        kv::center_angles(tc.cfreq.data(), S, kv::mid_page_center(spec.sink[b], pi, P), cs);
        for (int h = 0; h < H; ++h) {
          kv::center_offset(v.center, d, h, cs, delta.data());
          for (int i = pi * P; i < std::min(spec.mid[b], (pi + 1) * P); ++i) {
            float* row = tc.K[b].data() + (size_t(spec.sink[b] + i) * H + h) * d;
            for (int c = 0; c < d; ++c) row[c] += delta[c];
          }
        }
      }
  }
  return tc;
}

// Naive dense softmax attention of one query over rows [0, T) of K/V
// ([T][hkv][d], head h), fp64; returns lse (natural log).
inline double dense_attention(const float* q, const float* K, const float* V, int T, int hkv, int h, int d,
                              double sm_scale, double* out /*[d]*/) {
  std::vector<double> s(T);
  double m = -INFINITY;
  for (int t = 0; t < T; ++t) {
    double dot = 0;
    for (int c = 0; c < d; ++c) dot += double(q[c]) * K[(size_t(t) * hkv + h) * d + c];
    s[t] = dot * sm_scale;
    m = std::max(m, s[t]);
  }
  double l = 0;
  for (int c = 0; c < d; ++c) out[c] = 0;
  for (int t = 0; t < T; ++t) {
    const double w = std::exp(s[t] - m);
    l += w;
    for (int c = 0; c < d; ++c) out[c] += w * V[(size_t(t) * hkv + h) * d + c];
  }
  for (int c = 0; c < d; ++c) out[c] /= l;
  return m + std::log(l);
}

inline std::vector<float> random_vec(std::mt19937& rng, size_t n, float sd) {
  std::normal_distribution<float> nd(0.0f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

}  // namespace oscar::test
