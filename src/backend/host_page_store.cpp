// The host page store: the pools in host memory, the CPU kernels on them.
#include <fmt/format.h>

#include <cstring>

#include "core/error.h"
#include "kernels/cpu/cache_write.h"
#include "backend/page_store.h"
#include "kernels/cpu/key_transform.h"

namespace oscar::backend {

namespace {

class HostPageStore final : public PageStore {
 public:
  explicit HostPageStore(const PageStoreSpec& s) : PageStore(s) {
    const size_t ps = size_t(s.page_size), d = size_t(s.head_dim), H = size_t(s.num_kv_heads);
    const size_t bf = size_t(s.bf16_pages) * H * ps * d;
    const size_t rows = size_t(s.quant_pages) * H * ps;
    const size_t code_bytes = rows * size_t(packed_row_bytes(int(d), s.bits));
    const size_t params = rows * (d / size_t(s.group_size)) * 2;
    const size_t kparams = s.key_axis == kv::KeyAxis::kChannel
                               ? size_t(s.quant_pages) * H * (ps / kv::kKeySpan) * d * 2
                               : params;
    for (int l = 0; l < s.n_layers; ++l) {
      // Left uninitialized: untouched pages cost no physical memory.
      k_.emplace_back(new uint16_t[bf]);
      v_.emplace_back(new uint16_t[bf]);
      if (s.quant_pages > 0) {
        kc_.emplace_back(new uint8_t[code_bytes]);
        vc_.emplace_back(new uint8_t[code_bytes]);
        kp_.emplace_back(new uint16_t[kparams]);
        vp_.emplace_back(new uint16_t[params]);
      }
    }
  }

  std::string device() const override { return "cpu"; }

  kv::Bf16PagePool bf16_pool(int l) const override { return {k_.at(l).get(), v_.at(l).get()}; }
  kv::QuantPagePool quant_pool(int l) const override {
    if (spec_.quant_pages <= 0) return {};
    return {kc_.at(l).get(), vc_.at(l).get(), kp_.at(l).get(), vp_.at(l).get()};
  }

  void set_quant(std::vector<LayerQuant> layers) override {
    if (int(layers.size()) != spec_.n_layers)
      throw Error(fmt::format("{} page store: {} layers of quantization for {} layers", spec_.label,
                              layers.size(), spec_.n_layers));
    for (const LayerQuant& lq : layers)
      if (int(lq.k_clip.size()) != spec_.num_kv_heads || int(lq.v_clip.size()) != spec_.num_kv_heads)
        throw Error(fmt::format("{} page store: clip ratios for {} / {} heads, cache has {}",
                                spec_.label, lq.k_clip.size(), lq.v_clip.size(), spec_.num_kv_heads));
    q_ = std::move(layers);
    clips_.assign(q_.size(), {});
    for (size_t l = 0; l < q_.size(); ++l)
      for (int h = 0; h < spec_.num_kv_heads; ++h) clips_[l].push_back({q_[l].k_clip[size_t(h)], q_[l].v_clip[size_t(h)]});
  }

  void write_bf16(int layer, const RowPlacement& rows, const float* k, const float* v) override {
    kernels::cpu::write_bf16_tokens(layer_view(layer), rows.size(), rows.pages.data(), rows.slots.data(),
                                    k, v);
  }

  void demote(int32_t src, int32_t dst, int64_t first_pos) override {
    if (q_.empty())
      throw Error(fmt::format("{} page store: demotion before set_quant", spec_.label));
    const int d = spec_.head_dim, ps = spec_.page_size, Hkv = spec_.num_kv_heads;
    std::vector<float> cs, delta;
    for (int l = 0; l < spec_.n_layers; ++l) {
      const LayerQuant& lq = q_[l];
      const kv::PagedKvView vw = layer_view(l);
      // Page centering: the keys' centre δ_h of this page, per KV head.
      const float* off = nullptr;
      if (!lq.center.empty()) {
        const int S = lq.center.pairs();
        cs.resize(size_t(S) * 2);
        delta.resize(size_t(Hkv) * d);
        kv::center_angles(lq.center.freq.data(), S, double(first_pos) + 0.5 * (ps - 1), cs.data());
        const kv::MidCenter mc = mid_center(l);
        for (int h = 0; h < Hkv; ++h) kv::center_offset(mc, d, h, cs.data(), delta.data() + size_t(h) * d);
        off = delta.data();
      }
      kernels::cpu::demote_page(vw, src, dst, clips_[size_t(l)][0], -1, off, clips_[size_t(l)].data());
    }
  }

  kv::MidCenter mid_center(int l) const override {
    kv::MidCenter c;
    if (q_.empty() || q_.at(l).center.empty()) return c;
    const PageCenter& pc = q_[l].center;
    c.pairs = pc.pairs();
    c.u = pc.u.data();
    c.w = pc.w.data();
    c.mu = pc.mu.data();
    c.active = pc.active.data();
    return c;
  }

  void copy_bf16_page(int32_t from, int32_t to) override {
    const int64_t pe = int64_t(spec_.num_kv_heads) * spec_.page_size * spec_.head_dim;
    for (int l = 0; l < spec_.n_layers; ++l) {
      std::memcpy(k_[l].get() + to * pe, k_[l].get() + from * pe, pe * sizeof(uint16_t));
      std::memcpy(v_[l].get() + to * pe, v_[l].get() + from * pe, pe * sizeof(uint16_t));
    }
  }

  void transform_keys(int layer, float* k, int n) override {
    if (q_.empty() || n == 0 || q_.at(layer).identity) return;
    kernels::cpu::transform_keys(q_[layer].xf, k, n, spec_.num_kv_heads);
  }
  void transform_queries(int layer, float* q, int n, int n_q_heads) override {
    if (q_.empty() || n == 0 || q_.at(layer).identity) return;
    kernels::cpu::transform_queries(q_[layer].xf, q, n, n_q_heads, spec_.num_kv_heads);
  }

 private:
  std::vector<std::unique_ptr<uint16_t[]>> k_, v_;   // [L][pages * Hkv * ps * d] bf16
  std::vector<std::unique_ptr<uint8_t[]>> kc_, vc_;  // [L][pages * Hkv * ps * row bytes]
  std::vector<std::unique_ptr<uint16_t[]>> kp_, vp_; // [L][pages * Hkv * (ps * groups | ps/32 * d) * 2]
  std::vector<LayerQuant> q_;
  std::vector<std::vector<kernels::cpu::ClipRatios>> clips_;  // [L][Hkv]: each head's clip ratios
};

}  // namespace

std::unique_ptr<PageStore> make_host_page_store(const PageStoreSpec& spec) {
  return std::make_unique<HostPageStore>(spec);
}

std::unique_ptr<PageStore> make_page_store(const PageStoreFactory& f, const PageStoreSpec& spec) {
  return f ? f(spec) : make_host_page_store(spec);
}

}  // namespace oscar::backend
