// Helpers for the GPU tests: RAII device buffers, a random paged three-region
// cache built on the host (the CPU references read it there) and mirrored on
// the device, and error norms. Plain C++ (CUDA runtime API only).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "core/half.h"
#include "cuda_context_guard.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/paged_kv.h"

namespace oscar::test {

inline bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : count(n) {
    if (n) OSCAR_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& h) : DeviceBuffer(h.size()) { upload(h); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), count(o.count) { o.ptr = nullptr; o.count = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(count, o.count);
    return *this;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  void upload(const std::vector<T>& h) {
    if (h.size()) OSCAR_CUDA_CHECK(cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> h(count);
    if (count) OSCAR_CUDA_CHECK(cudaMemcpy(h.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  // 0xFF bytes: NaN for floats, so an unwritten output can never pass.
  void poison() {
    if (count) OSCAR_CUDA_CHECK(cudaMemset(ptr, 0xFF, count * sizeof(T)));
  }
};

struct SeqLens {
  int sink, mid, recent;
};

// A random paged cache: region pages are drawn from shuffled pool ids so
// page order never matches memory order. Padding slots of partial pages hold
// NaN bits (BF16 rows and quantized params) to prove kernels mask them.
struct HostCache {
  int batch = 0, hkv = 0, d = 0, page = 0, group = 0;
  std::vector<uint16_t> bf16_k, bf16_v;
  std::vector<uint8_t> k_codes, v_codes;
  std::vector<uint16_t> k_params, v_params;
  std::vector<int32_t> indptr[3], indices[3], len[3];  // sink, mid, recent
  kv::PagedKvView host_view;                             // pointers into the vectors above

  // Device mirror.
  DeviceBuffer<uint16_t> d_bf16_k, d_bf16_v, d_k_params, d_v_params;
  DeviceBuffer<uint8_t> d_k_codes, d_v_codes;
  DeviceBuffer<int32_t> d_indptr[3], d_indices[3], d_len[3];
  kv::PagedKvView dev_view;

  HostCache(const std::vector<SeqLens>& seqs, int hkv_, int d_, int page_, int group_, uint32_t seed,
            float k_scale = 1.0f) {
    batch = static_cast<int>(seqs.size());
    hkv = hkv_;
    d = d_;
    page = page_;
    group = group_;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_real_distribution<float> ud(0.0f, 1.0f);
    auto pages_for = [&](int n) { return (n + page - 1) / page; };
    int n_bf16 = 0, n_quant = 0;
    for (const auto& s : seqs) {
      n_bf16 += pages_for(s.sink) + pages_for(s.recent);
      n_quant += pages_for(s.mid);
    }
    n_bf16 += 3;  // unused pages in the pools too
    n_quant += 3;
    std::vector<int32_t> bf16_ids(n_bf16), quant_ids(n_quant);
    std::iota(bf16_ids.begin(), bf16_ids.end(), 0);
    std::iota(quant_ids.begin(), quant_ids.end(), 0);
    std::shuffle(bf16_ids.begin(), bf16_ids.end(), rng);
    std::shuffle(quant_ids.begin(), quant_ids.end(), rng);

    const size_t bf16_elems = size_t(n_bf16) * hkv * page * d;
    const size_t qrows = size_t(n_quant) * hkv * page;
    const int ng = d / group;
    bf16_k.assign(bf16_elems, 0x7fc0);  // NaN everywhere a region does not write
    bf16_v.assign(bf16_elems, 0x7fc0);
    k_codes.resize(qrows * d / 4);
    v_codes.resize(qrows * d / 4);
    for (auto& c : k_codes) c = static_cast<uint8_t>(rng());
    for (auto& c : v_codes) c = static_cast<uint8_t>(rng());
    k_params.assign(qrows * ng * 2, 0x7e00);  // fp16 NaN
    v_params.assign(qrows * ng * 2, 0x7e00);

    int next_bf16 = 0, next_quant = 0;
    for (int reg = 0; reg < 3; ++reg) indptr[reg].push_back(0);
    for (int b = 0; b < batch; ++b) {
      const int lens[3] = {seqs[b].sink, seqs[b].mid, seqs[b].recent};
      for (int reg = 0; reg < 3; ++reg) {
        const int n = lens[reg];
        len[reg].push_back(n);
        for (int p = 0; p < pages_for(n); ++p) {
          const int32_t id = reg == 1 ? quant_ids[next_quant++] : bf16_ids[next_bf16++];
          indices[reg].push_back(id);
          const int slots = std::min(page, n - p * page);
          for (int h = 0; h < hkv; ++h)
            for (int s = 0; s < slots; ++s) {
              const size_t row = (size_t(id) * hkv + h) * page + s;
              if (reg != 1) {
                for (int c = 0; c < d; ++c) {
                  bf16_k[row * d + c] = f32_to_bf16(k_scale * nd(rng));
                  bf16_v[row * d + c] = f32_to_bf16(nd(rng));
                }
              } else {
                for (int gm = 0; gm < ng; ++gm) {
                  // Realistic (scale, min): a range of ~[-2, 2] split in 3 steps.
                  const float ks = k_scale * (0.5f + 1.0f * ud(rng)), km = -1.5f * ks + 0.3f * nd(rng);
                  const float vs = 0.5f + 1.0f * ud(rng), vm = -1.5f * vs + 0.3f * nd(rng);
                  k_params[(row * ng + gm) * 2] = f32_to_f16(ks);
                  k_params[(row * ng + gm) * 2 + 1] = f32_to_f16(km);
                  v_params[(row * ng + gm) * 2] = f32_to_f16(vs);
                  v_params[(row * ng + gm) * 2 + 1] = f32_to_f16(vm);
                }
              }
            }
        }
        indptr[reg].push_back(static_cast<int32_t>(indices[reg].size()));
      }
    }
    for (int reg = 0; reg < 3; ++reg)
      if (indices[reg].empty()) indices[reg].push_back(0);  // keep pointers non-null

    host_view = make_view(bf16_k.data(), bf16_v.data(), k_codes.data(), v_codes.data(),
                          k_params.data(), v_params.data(), indptr, indices, len);
    d_bf16_k = DeviceBuffer<uint16_t>(bf16_k);
    d_bf16_v = DeviceBuffer<uint16_t>(bf16_v);
    d_k_codes = DeviceBuffer<uint8_t>(k_codes);
    d_v_codes = DeviceBuffer<uint8_t>(v_codes);
    d_k_params = DeviceBuffer<uint16_t>(k_params);
    d_v_params = DeviceBuffer<uint16_t>(v_params);
    for (int reg = 0; reg < 3; ++reg) {
      d_indptr[reg] = DeviceBuffer<int32_t>(indptr[reg]);
      d_indices[reg] = DeviceBuffer<int32_t>(indices[reg]);
      d_len[reg] = DeviceBuffer<int32_t>(len[reg]);
    }
    dev_view = host_view;
    dev_view.bf16 = {d_bf16_k.ptr, d_bf16_v.ptr};
    dev_view.quant = {d_k_codes.ptr, d_v_codes.ptr, d_k_params.ptr, d_v_params.ptr};
    kv::RegionTable* dr[3] = {&dev_view.sink, &dev_view.mid, &dev_view.recent};
    for (int reg = 0; reg < 3; ++reg) *dr[reg] = {d_indptr[reg].ptr, d_indices[reg].ptr, d_len[reg].ptr};
  }

  // Page centering (kernels/paged_kv.h MidCenter) on both views: S random pairs, centre
  // vectors of scale `mag`, the angle table of every middle page. start_rows: the rows through
  // MidCenter::angle_start, the sequences in reverse order with two NaN rows before each (else a
  // row per page-table slot).
  std::vector<float> cu, cw, cmu, cfreq, cangles;
  std::vector<int32_t> cstart;
  DeviceBuffer<float> d_cu, d_cw, d_cmu, d_cangles;
  DeviceBuffer<int32_t> d_cstart;
  void add_center(int S, uint32_t seed, float mag = 1.0f, bool start_rows = false) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, mag);
    std::uniform_real_distribution<float> fr(0.0f, 0.05f);
    cu.resize(size_t(hkv) * S * d);
    cw.resize(cu.size());
    cmu.resize(size_t(hkv) * d);
    for (auto* v : {&cu, &cw, &cmu})
      for (float& x : *v) x = nd(rng);
    cfreq.resize(S);
    for (float& f : cfreq) f = fr(rng);
    std::vector<int32_t> first(static_cast<size_t>(batch));
    int32_t rows = indptr[1][batch];
    if (start_rows) {
      rows = 0;
      for (int b = batch - 1; b >= 0; --b) {
        first[size_t(b)] = rows + 2;
        rows += 2 + indptr[1][b + 1] - indptr[1][b];
      }
    } else {
      for (int b = 0; b < batch; ++b) first[size_t(b)] = indptr[1][b];
    }
    cangles.assign(std::max<size_t>(1, size_t(rows) * 2 * S), start_rows ? NAN : 0.0f);
    for (int b = 0; b < batch; ++b)
      for (int i = 0; i < indptr[1][b + 1] - indptr[1][b]; ++i)
        kv::center_angles(cfreq.data(), S, kv::mid_page_center(len[0][b], i, page),
                          cangles.data() + size_t(first[size_t(b)] + i) * 2 * S);
    d_cu = DeviceBuffer<float>(cu);
    d_cw = DeviceBuffer<float>(cw);
    d_cmu = DeviceBuffer<float>(cmu);
    d_cangles = DeviceBuffer<float>(cangles);
    host_view.center = {S, cu.data(), cw.data(), cmu.data(), cangles.data()};
    dev_view.center = {S, d_cu.ptr, d_cw.ptr, d_cmu.ptr, d_cangles.ptr};
    if (start_rows) {
      cstart = first;
      d_cstart = DeviceBuffer<int32_t>(cstart);
      host_view.center.angle_start = cstart.data();
      dev_view.center.angle_start = d_cstart.ptr;
    }
  }

  kv::PagedKvView make_view(uint16_t* bk, uint16_t* bv, uint8_t* kc, uint8_t* vc, uint16_t* kp,
                            uint16_t* vp, std::vector<int32_t>* ip, std::vector<int32_t>* ix,
                            std::vector<int32_t>* ln) {
    kv::PagedKvView v;
    v.batch = batch;
    v.num_kv_heads = hkv;
    v.head_dim = d;
    v.page_size = page;
    v.bits = 2;
    v.group_size = group;
    v.bf16 = {bk, bv};
    v.quant = {kc, vc, kp, vp};
    v.sink = {ip[0].data(), ix[0].data(), ln[0].data()};
    v.mid = {ip[1].data(), ix[1].data(), ln[1].data()};
    v.recent = {ip[2].data(), ix[2].data(), ln[2].data()};
    return v;
  }
};

// ||a - b|| / ||b||, or +inf if any element of a is not finite.
inline double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace oscar::test
