// Scalar attention over the BF16 regions of a paged view, for any even
// head_dim. The backend uses it only for shapes the kernels/cpu dispatch does
// not take (e.g. head_dim 32 of the tiny test models); same contracts as
// kernels/cpu/attention.h. A non-empty quantized middle region is an error here.
#pragma once

#include "kernels/paged_kv.h"

namespace oscar::backend::cpu {

// True when kernels/cpu handles this head_dim (64, 128, 256).
bool kernel_supports_head_dim(int head_dim);

void decode_attention_generic(const kv::PagedKvView& kv, const float* q, int num_q_heads,
                              float sm_scale, float* o);
void prefill_attention_generic(const kv::PagedKvView& kv, int b, int cached_len, const float* q,
                               const float* k_new, const float* v_new, int n, int num_q_heads,
                               float sm_scale, float* o);

}  // namespace oscar::backend::cpu
