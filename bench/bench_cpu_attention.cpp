// CPU decode attention over the INT2 (OSCAR) paged cache vs an all-BF16
// paged cache, same kernel entry point, same threads, same run.
//
// Decode attention is memory-bound (DESIGN §7): every row reports bytes read
// per call, achieved GB/s, percent of this machine's copy bandwidth measured
// in the same run, and the speedup of INT2 over BF16. To measure DRAM and
// not the (large) last-level cache, each configuration rotates through
// enough independent "layers" that the working set is >= --ws-mb (default
// 640 MB), as a real decode step walks every layer's cache once.
//
// --kivi adds a kivi2 row per decode configuration: no sink, recent 128..191
// BF16, INT2 middle with values in groups of 32 and keys per channel over
// 32-token spans (paged_kv.h KeyAxis::kChannel; always the float kernels).
//
// --center S adds an int2+pc row: the same INT2 cache with page centering over S RoPE pairs
// (paged_kv.h MidCenter; the CPU kernel then runs each middle page as its own partial and
// shifts it; docs/core.md "Page centering"). 44 is Qwen2.5-1.5B's count. --center-heads K
// centres only the first K KV heads (the others' centre is 0 and they keep the plain path;
// Qwen2.5-1.5B centres 5 of its 56 KV heads). Default: every head (the worst case).
//
// Usage: bench_cpu_attention [--threads N] [--ws-mb MB] [--ctx 4096,8192,...] [--quick] [--decode-only] [--kivi]
//                            [--center S] [--center-heads K]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/half.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/cache_write.h"
#include "kernels/cpu/parallel.h"
#include "kernels/paged_kv.h"

namespace {

using Clock = std::chrono::steady_clock;
namespace kc = oscar::kernels::cpu;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Fast deterministic fill (xorshift64*), so GB-sized setup stays quick.
void fill_random(void* p, size_t bytes, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  auto* w = static_cast<uint8_t*>(p);
  size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    s ^= s >> 12;
    s ^= s << 25;
    s ^= s >> 27;
    const uint64_t r = s * 2685821657736338717ull;
    std::memcpy(w + i, &r, 8);
  }
  for (; i < bytes; ++i) w[i] = uint8_t(i * 131 + seed);
}

// Valid finite bf16 / fp16 values (random bits could be NaN/inf).
void fill_bf16(std::vector<uint16_t>& v, uint64_t seed) {
  std::mt19937 rng{static_cast<uint32_t>(seed)};
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<uint16_t> base(4096);
  for (auto& x : base) x = oscar::f32_to_bf16(n(rng));
  const size_t step = base.size() - 64;
  for (size_t i = 0; i < v.size(); i += step)
    std::memcpy(v.data() + i, base.data() + (i * 7) % 64, sizeof(uint16_t) * std::min(step, v.size() - i));
}

// STREAM-style copy bandwidth: (bytes read + bytes written) / time, best of 5.
double measure_copy_gbs(size_t bytes) {
  std::vector<uint8_t> a(bytes), b(bytes);
  fill_random(a.data(), bytes, 1);
  fill_random(b.data(), bytes, 2);
  const int parts = 64;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = Clock::now();
    kc::parallel_for(parts, [&](int64_t i) {
      const size_t lo = bytes * size_t(i) / parts, hi = bytes * size_t(i + 1) / parts;
      std::memcpy(b.data() + lo, a.data() + lo, hi - lo);
    });
    best = std::max(best, 2.0 * double(bytes) / seconds_since(t0) / 1e9);
  }
  return best;
}

struct Shape {
  const char* name;
  int hq, hkv, d, group;
};

// `layers` independent one-sequence caches of T tokens sharing two pools.
struct LayerCaches {
  std::vector<uint16_t> bk, bv, kp, vp;
  std::vector<uint8_t> kcodes, vcodes;
  std::vector<std::vector<int32_t>> idx[3];
  std::vector<int32_t> indptr[3], len[3];
  std::vector<oscar::kv::PagedKvView> views;
  std::vector<float> cu, cw, cmu, cang;  // page centering (shared by the layers: same positions)
  std::vector<uint8_t> cactive;
  double bytes_per_call = 0;
  double working_set = 0;
};

// int2 == false: all T tokens in BF16 (one "sink" region). int2 == true:
// sink 64 + INT2 middle + recent 256..319 BF16, the OSCAR layout; kivi:
// no sink, recent 128..191, group 32, per-channel keys.
void build(LayerCaches& c, const Shape& s0, int T, bool int2, int layers, int page, bool kivi = false,
           int center_pairs = 0, int center_heads = -1) {
  Shape s = s0;
  if (kivi) s.group = 32;
  const int sink = kivi ? 0 : int2 ? std::min(T, 64) : T;
  const int recent = int2 ? std::min(T - sink, (kivi ? 128 : 256) + (T % page)) : 0;
  const int mid = T - sink - recent;
  auto pages = [&](int n) { return (n + page - 1) / page; };
  const int bpl = pages(sink) + pages(recent), qpl = pages(mid);  // pages per layer
  const size_t bf16_page = size_t(s.hkv) * page * s.d;
  const int cb = s.d * 2 / 8, ng = s.d / s.group;
  c.bk.resize(bf16_page * bpl * layers);
  c.bv.resize(c.bk.size());
  fill_bf16(c.bk, 3);
  fill_bf16(c.bv, 4);
  c.kcodes.resize(size_t(qpl) * layers * s.hkv * page * cb);
  c.vcodes.resize(c.kcodes.size());
  fill_random(c.kcodes.data(), c.kcodes.size(), 5);
  fill_random(c.vcodes.data(), c.vcodes.size(), 6);
  c.kp.resize(size_t(qpl) * layers * s.hkv * page * ng * 2);
  for (size_t i = 0; i < c.kp.size(); ++i) c.kp[i] = oscar::f32_to_f16(i % 2 ? -1.0f - 0.001f * (i % 97) : 0.5f + 0.001f * (i % 89));
  c.vp = c.kp;
  if (kivi) c.kp.resize(size_t(qpl) * layers * s.hkv * (page / oscar::kv::kKeySpan) * s.d * 2);  // same fill
  for (int r = 0; r < 3; ++r) {
    c.idx[r].assign(layers, {});
    c.indptr[r] = {0, 0};
  }
  const int lens[3] = {sink, mid, recent};
  for (int r = 0; r < 3; ++r) {
    c.len[r] = {lens[r]};
    c.indptr[r][1] = pages(lens[r]);
  }
  std::mt19937 rng(9);
  c.views.resize(layers);
  for (int l = 0; l < layers; ++l) {
    std::vector<int32_t> bp(bpl), qp(qpl);
    std::iota(bp.begin(), bp.end(), l * bpl);
    std::iota(qp.begin(), qp.end(), l * qpl);
    std::shuffle(bp.begin(), bp.end(), rng);  // scattered pages, as a pool allocator leaves them
    std::shuffle(qp.begin(), qp.end(), rng);
    c.idx[0][l].assign(bp.begin(), bp.begin() + pages(sink));
    c.idx[2][l].assign(bp.begin() + pages(sink), bp.end());
    c.idx[1][l] = qp;
    oscar::kv::PagedKvView& v = c.views[l];
    v.batch = 1;
    v.num_kv_heads = s.hkv;
    v.head_dim = s.d;
    v.page_size = page;
    v.bits = 2;
    v.group_size = s.group;
    v.key_axis = kivi ? oscar::kv::KeyAxis::kChannel : oscar::kv::KeyAxis::kToken;
    v.bf16 = {c.bk.data(), c.bv.data()};
    v.quant = {c.kcodes.data(), c.vcodes.data(), c.kp.data(), c.vp.data()};
    v.sink = {c.indptr[0].data(), c.idx[0][l].data(), c.len[0].data()};
    v.mid = {c.indptr[1].data(), c.idx[1][l].data(), c.len[1].data()};
    v.recent = {c.indptr[2].data(), c.idx[2][l].data(), c.len[2].data()};
  }
  if (center_pairs > 0 && int2 && !kivi) {
    const int S = std::min(center_pairs, s.d / 2);
    c.cu.resize(size_t(s.hkv) * S * s.d);
    c.cw.resize(c.cu.size());
    c.cmu.resize(size_t(s.hkv) * s.d);
    std::normal_distribution<float> nd(0.0f, 0.1f);
    for (auto* vec : {&c.cu, &c.cw, &c.cmu})
      for (float& x : *vec) x = nd(rng);
    c.cactive.assign(size_t(s.hkv), 1);
    for (int h = std::max(0, center_heads); h < s.hkv && center_heads >= 0; ++h) {  // uncentred heads: 0
      c.cactive[size_t(h)] = 0;
      std::fill(c.cu.begin() + size_t(h) * S * s.d, c.cu.begin() + size_t(h + 1) * S * s.d, 0.0f);
      std::fill(c.cw.begin() + size_t(h) * S * s.d, c.cw.begin() + size_t(h + 1) * S * s.d, 0.0f);
      std::fill(c.cmu.begin() + size_t(h) * s.d, c.cmu.begin() + size_t(h + 1) * s.d, 0.0f);
    }
    std::vector<float> freq(S);
    for (int i = 0; i < S; ++i) freq[i] = 1e-3f / float(i + 1);
    c.cang.resize(size_t(std::max(1, qpl)) * 2 * S);
    for (int i = 0; i < qpl; ++i)
      oscar::kv::center_angles(freq.data(), S, oscar::kv::mid_page_center(sink, i, page), c.cang.data() + size_t(i) * 2 * S);
    for (auto& v : c.views) v.center = {S, c.cu.data(), c.cw.data(), c.cmu.data(), c.cang.data(), c.cactive.data()};
  }
  const double bf16_rows = double(sink + recent) * s.hkv, q_rows = double(mid) * s.hkv;
  c.bytes_per_call = 2 * (bf16_rows * s.d * 2 + q_rows * (cb + ng * 2 * 2));  // K and V
  if (kivi)  // K params: d (scale, min) pairs per 32 rows instead of ng per row
    c.bytes_per_call += q_rows * (double(s.d) * 4 / oscar::kv::kKeySpan - ng * 4);
  c.working_set = c.bytes_per_call * layers;
}

struct Result {
  double us_per_call, gbs;
};

Result time_decode(const LayerCaches& c, const Shape& s, double min_seconds) {
  std::vector<float> q(size_t(s.hq) * s.d), o(q.size()), lse(s.hq);
  std::mt19937 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (auto& x : q) x = n(rng);
  const float sm = 1.0f / std::sqrt(float(s.d));
  for (const auto& v : c.views) kc::decode_attention(v, q.data(), s.hq, sm, o.data(), lse.data());  // warm-up
  size_t calls = 0;
  const auto t0 = Clock::now();
  double el = 0;
  do {
    for (const auto& v : c.views) kc::decode_attention(v, q.data(), s.hq, sm, o.data(), lse.data());
    calls += c.views.size();
    el = seconds_since(t0);
  } while (el < min_seconds);
  if (!std::isfinite(o[0])) std::printf("warning: non-finite output\n");
  const double per = el / double(calls);
  return Result{per * 1e6, c.bytes_per_call / per / 1e9};
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 0;
  double ws_mb = 640;
  double min_seconds = 1.0;
  std::vector<int> ctxs = {4096, 8192, 16384, 32768};
  bool decode_only = false, with_kivi = false;
  int center_pairs = 0, center_heads = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--ws-mb" && i + 1 < argc) ws_mb = std::atof(argv[++i]);
    else if (a == "--quick") min_seconds = 0.3;
    else if (a == "--decode-only") decode_only = true;
    else if (a == "--kivi") with_kivi = true;
    else if (a == "--center" && i + 1 < argc) center_pairs = std::atoi(argv[++i]);
    else if (a == "--center-heads" && i + 1 < argc) center_heads = std::atoi(argv[++i]);
    else if (a == "--ctx" && i + 1 < argc) {
      ctxs.clear();
      std::string list = argv[++i];
      for (size_t p = 0; p < list.size();) {
        const size_t q = list.find(',', p);
        ctxs.push_back(std::atoi(list.substr(p, q - p).c_str()));
        p = q == std::string::npos ? list.size() : q + 1;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--threads N] [--ws-mb MB] [--ctx 4096,8192] [--quick] [--decode-only] [--kivi] [--center S] [--center-heads K]\n", argv[0]);
      return 2;
    }
  }
  if (threads > 0) kc::set_num_threads(threads);
  const double copy_gbs = measure_copy_gbs(size_t(512) << 20);
  std::printf("CPU decode attention, ISA %s, %d threads; copy bandwidth %.1f GB/s (read+write, 512 MiB memcpy, best of 5)\n",
              kc::attention_isa(), kc::num_threads(), copy_gbs);
  std::printf("INT2: G = min(128, d), fp16 scale/min, sink 64 + recent 256..319 BF16; page 64; batch 1; working set >= %.0f MB\n\n",
              ws_mb);
  std::printf("%-14s %6s %-7s %6s %9s %10s %11s %11s %8s %7s %8s\n", "shape", "ctx", "cache", "layers", "ws MB",
              "MB/call", "floor us", "us/call", "GB/s", "%copy", "speedup");
  const Shape shapes[] = {{"Qwen3-8B", 32, 8, 128, 128}, {"SmolLM2-135M", 9, 3, 64, 64}};
  const int page = 64;
  for (const Shape& s : shapes)
    for (int T : ctxs) {
      double bf16_us = 0;
      for (int kind = 0; kind < 4; ++kind) {
        if ((kind == 2 && !with_kivi) || (kind == 3 && center_pairs <= 0)) continue;
        const bool int2 = kind > 0, kivi = kind == 2, pc = kind == 3;
        // Layers: enough for the working set, at least 2, at most 4096.
        LayerCaches probe;
        build(probe, s, T, int2, 1, page, kivi);
        const int layers = int(std::clamp(std::ceil(ws_mb * 1e6 / probe.bytes_per_call), 2.0, 4096.0));
        probe = LayerCaches{};
        LayerCaches c;
        build(c, s, T, int2, layers, page, kivi, pc ? center_pairs : 0, center_heads);
        const Result r = time_decode(c, s, min_seconds);
        if (!int2) bf16_us = r.us_per_call;
        char speed[32] = "1.00x";
        if (int2) std::snprintf(speed, sizeof speed, "%.2fx", bf16_us / r.us_per_call);
        // floor: the call's bytes moved at the measured copy bandwidth.
        std::printf("%-14s %6d %-7s %6d %9.0f %10.3f %11.1f %11.1f %8.1f %6.1f%% %8s\n", s.name, T,
                    kivi ? "kivi2" : pc ? "int2+pc" : int2 ? "int2" : "bf16", layers, c.working_set / 1e6, c.bytes_per_call / 1e6,
                    c.bytes_per_call / (copy_gbs * 1e9) * 1e6, r.us_per_call, r.gbs, 100.0 * r.gbs / copy_gbs, speed);
        std::fflush(stdout);
      }
    }

  if (decode_only) return 0;

  // Prefill: one chunk of n new tokens after `cached` tokens held in the INT2
  // layout; work = 4 * n * (cached + (n+1)/2) * d * Hq flops (QK and PV).
  std::printf("\nPrefill attention (one layer, one sequence; INT2 cache for the cached part)\n");
  std::printf("%-14s %7s %7s %10s %10s %9s\n", "shape", "cached", "n", "ms", "tok/s", "GFLOP/s");
  const int pre[][2] = {{0, 2048}, {8192, 512}, {30720, 2048}};
  for (const Shape& s : shapes)
    for (const auto& pc : pre) {
      const int cached = pc[0], n = pc[1];
      LayerCaches c;
      build(c, s, std::max(cached, 1), true, 1, page);
      std::mt19937 rng(3);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      std::vector<float> q(size_t(n) * s.hq * s.d), kn(size_t(n) * s.hkv * s.d), vn(kn.size()), o(q.size());
      for (auto& x : q) x = nd(rng);
      for (auto& x : kn) x = nd(rng);
      for (auto& x : vn) x = nd(rng);
      const float sm = 1.0f / std::sqrt(float(s.d));
      double best = 1e30;
      const auto t_all = Clock::now();
      do {
        const auto t0 = Clock::now();
        kc::prefill_attention(c.views[0], 0, cached, q.data(), kn.data(), vn.data(), n, s.hq, sm, o.data());
        best = std::min(best, seconds_since(t0));
      } while (seconds_since(t_all) < min_seconds);
      const double flops = 4.0 * n * (cached + (n + 1) / 2.0) * s.d * s.hq;
      std::printf("%-14s %7d %7d %10.2f %10.0f %9.1f\n", s.name, cached, n, best * 1e3, n / best, flops / best / 1e9);
      std::fflush(stdout);
    }

  // Cache writes (single-threaded kernels): one decode token into the INT2
  // middle (all KV heads, K and V: clip -> quantize -> pack), one token into a
  // BF16 window, one rotation of a token's keys, and one page demotion.
  std::printf("\nCache writes (one call, all KV heads, K and V; us)\n");
  std::printf("%-14s %12s %12s %12s %14s\n", "shape", "rotate K", "write bf16", "write int2", "demote page");
  for (const Shape& s : shapes) {
    LayerCaches c;
    build(c, s, 4096, true, 1, page);
    const oscar::kv::PagedKvView& v = c.views[0];
    std::vector<float> k(size_t(s.hkv) * s.d), val(k.size()), R(size_t(s.d) * s.d);
    std::mt19937 rng(4);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : k) x = nd(rng);
    for (auto& x : val) x = nd(rng);
    for (auto& x : R) x = nd(rng) / std::sqrt(float(s.d));
    const int32_t bpage = v.sink.indices[0], qpage = v.mid.indices[0], slot = 3;
    auto best_us = [&](auto&& fn) {
      double best = 1e30;
      const auto t_all = Clock::now();
      do {
        const auto t0 = Clock::now();
        for (int i = 0; i < 10; ++i) fn();
        best = std::min(best, seconds_since(t0) / 10);
      } while (seconds_since(t_all) < 0.2);
      return best * 1e6;
    };
    const double rot = best_us([&] { kc::rotate_heads(k.data(), 1, s.hkv, s.d, R.data(), 1, k.data()); });
    const double wb = best_us([&] { kc::write_bf16_tokens(v, 1, &bpage, &slot, k.data(), val.data()); });
    const double wq = best_us([&] { kc::write_quant_tokens(v, 1, &qpage, &slot, k.data(), val.data(), {0.96f, 0.92f}); });
    const double dm = best_us([&] { kc::demote_page(v, bpage, qpage, {0.96f, 0.92f}); });
    std::printf("%-14s %12.2f %12.2f %12.2f %14.1f\n", s.name, rot, wb, wq, dm);
  }
  return 0;
}
