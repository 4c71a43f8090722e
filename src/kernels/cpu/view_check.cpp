#include "kernels/cpu/view_check.h"

#include <string>

#include "core/error.h"

namespace oscar::kernels::cpu::detail {

namespace {

[[noreturn]] void fail(const char* who, const std::string& what) {
  throw Error(std::string(who) + ": " + what);
}

void check_region(const kv::PagedKvView& kv, const kv::RegionTable& r, const char* name,
                  bool pool_present, const char* who) {
  if (kv.batch == 0) return;
  if (!r.indptr || !r.len) fail(who, std::string(name) + " region: null indptr/len");
  for (int b = 0; b < kv.batch; ++b) {
    const int len = r.len[b];
    const int64_t npages = int64_t(r.indptr[b + 1]) - r.indptr[b];
    if (len < 0) fail(who, std::string(name) + " region: negative length for sequence " + std::to_string(b));
    const int64_t want = (int64_t(len) + kv.page_size - 1) / kv.page_size;
    if (npages != want)
      fail(who, std::string(name) + " region of sequence " + std::to_string(b) + ": " +
                    std::to_string(npages) + " pages for " + std::to_string(len) + " tokens (want " +
                    std::to_string(want) + ")");
    if (len > 0 && (!r.indices || !pool_present))
      fail(who, std::string(name) + " region of sequence " + std::to_string(b) +
                    " is non-empty but its page indices or pool are null");
    for (int64_t i = r.indptr[b]; i < r.indptr[b + 1]; ++i)
      if (r.indices[i] < 0)
        fail(who, std::string(name) + " region: negative page id " + std::to_string(r.indices[i]));
  }
}

}  // namespace

void check_format(const kv::PagedKvView& kv, const char* who) {
  if (kv.head_dim != 64 && kv.head_dim != 128 && kv.head_dim != 256)
    fail(who, "unsupported head_dim " + std::to_string(kv.head_dim) + " (64, 128 or 256)");
  if (kv.num_kv_heads <= 0) fail(who, "num_kv_heads must be positive");
  if (kv.page_size <= 0 || kv.page_size % 16 != 0)
    fail(who, "page_size " + std::to_string(kv.page_size) + " is not a positive multiple of 16");
  if (kv.bits != 2 && kv.bits != 4) fail(who, "unsupported bits " + std::to_string(kv.bits) + " (2 or 4)");
  if ((kv.group_size != 32 && kv.group_size != 64 && kv.group_size != 128) ||
      kv.group_size > kv.head_dim)
    fail(who, "unsupported group_size " + std::to_string(kv.group_size) + " for head_dim " +
                  std::to_string(kv.head_dim));
  if (kv.key_axis != kv::KeyAxis::kToken && kv.key_axis != kv::KeyAxis::kChannel)
    fail(who, "unknown key_axis " + std::to_string(int(kv.key_axis)));
  if (kv.key_axis == kv::KeyAxis::kChannel && kv.page_size % kv::kKeySpan != 0)
    fail(who, "per-channel keys need a page_size that is a multiple of " +
                  std::to_string(kv::kKeySpan) + " (got " + std::to_string(kv.page_size) + ")");
  if (kv.center.pairs < 0 || kv.center.pairs > kv.head_dim / 2)
    fail(who, "page centering with " + std::to_string(kv.center.pairs) + " pairs for head_dim " +
                  std::to_string(kv.head_dim));
  if (kv.center.pairs > 0 && (!kv.center.u || !kv.center.w))
    fail(who, "page centering without its u / w vectors");
  if (kv.center.pairs > 0 && kv.key_axis == kv::KeyAxis::kChannel)
    fail(who, "page centering needs per-token keys");
}

void check_slots(const kv::PagedKvView& kv, int n, const int32_t* pages, const int32_t* slots,
                 const char* who) {
  if (n < 0) fail(who, "negative token count");
  if (n > 0 && (!pages || !slots)) fail(who, "null page/slot arrays");
  for (int i = 0; i < n; ++i) {
    if (pages[i] < 0) fail(who, "negative page id " + std::to_string(pages[i]));
    if (slots[i] < 0 || slots[i] >= kv.page_size)
      fail(who, "slot " + std::to_string(slots[i]) + " outside page of " + std::to_string(kv.page_size));
  }
}

void check_quant_pool(const kv::PagedKvView& kv, const char* who) {
  if (!kv.quant.k_codes || !kv.quant.v_codes || !kv.quant.k_params || !kv.quant.v_params)
    fail(who, "quantized pool pointers are null");
}

void check_bf16_pool(const kv::PagedKvView& kv, const char* who) {
  if (!kv.bf16.k || !kv.bf16.v) fail(who, "BF16 pool pointers are null");
}

int check_demote(const kv::PagedKvView& kv, int32_t bf16_page, int32_t quant_page, float clip_k,
                 int num_tokens, const char* who) {
  check_format(kv, who);
  if (num_tokens < 0) num_tokens = kv.page_size;
  if (num_tokens > kv.page_size || bf16_page < 0 || quant_page < 0)
    fail(who, "bad page ids or token count " + std::to_string(num_tokens));
  check_bf16_pool(kv, who);
  check_quant_pool(kv, who);
  if (kv.key_axis == kv::KeyAxis::kChannel) {
    if (num_tokens % kv::kKeySpan != 0)
      fail(who, "per-channel keys need whole spans of " + std::to_string(kv::kKeySpan) + " tokens, got " +
                    std::to_string(num_tokens));
    if (clip_k < 1.0f)
      fail(who, "per-channel keys are not clipped (key clip ratio " + std::to_string(clip_k) + " must be >= 1)");
  }
  return num_tokens;
}

void check_view(const kv::PagedKvView& kv, int num_q_heads, const char* who) {
  if (kv.batch < 0) fail(who, "negative batch");
  check_format(kv, who);
  if (num_q_heads <= 0 || num_q_heads % kv.num_kv_heads != 0)
    fail(who, "num_q_heads " + std::to_string(num_q_heads) + " is not a multiple of num_kv_heads " +
                  std::to_string(kv.num_kv_heads));
  const bool bf16_ok = kv.bf16.k && kv.bf16.v;
  const bool quant_ok = kv.quant.k_codes && kv.quant.v_codes && kv.quant.k_params && kv.quant.v_params;
  check_region(kv, kv.sink, "sink", bf16_ok, who);
  check_region(kv, kv.mid, "middle", quant_ok, who);
  check_region(kv, kv.recent, "recent", bf16_ok, who);
  if (kv.center.pairs > 0 && kv.batch > 0 && kv.mid.indptr[kv.batch] > 0 && !kv.center.angles)
    fail(who, "page centering without the middle pages' angle table");
}

}  // namespace oscar::kernels::cpu::detail
