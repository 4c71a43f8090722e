// The split kernels of head_dim 128 (decode_split_kernel.cuh), one instance
// per shape that decode_dispatch.cu launches. One file per head_dim: they
// compile in parallel, and OSCAR_CUDA_INSTANCES=min keeps group 128 only.
#include "kernels/cuda/decode_split_kernel.cuh"

namespace oscar::kernels::cuda::decode_impl {

// Windows (BF16 chunks; the group argument is unused) and fused windows.
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, false, 0, false, false)
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, false, 0, true, false)
// Middle, group 128: the int8 K/V loop with whole-group copies (the
// default), with per-tile copies, the int8-key loop, the fp16 ring and the
// register-prefetch loop (launch_quant's `variant`).
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 3, false, true)
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 3, false, false)
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 2, false, false)
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 0, false, false)
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 1, false, false)
// Middle with page centering folded into the loop (launch_quant_centered).
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 3, false, true, true)
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 0, false, false, true)
OSCAR_DECODE_SPLIT_INSTANCE(128, 128, true, 1, false, false, true)
#if !defined(OSCAR_CUDA_MIN_INSTANCES)
// Middle, groups 64 and 32: the register-prefetch loop.
OSCAR_DECODE_SPLIT_INSTANCE(128, 64, true, 1, false, false)
OSCAR_DECODE_SPLIT_INSTANCE(128, 32, true, 1, false, false)
OSCAR_DECODE_SPLIT_INSTANCE(128, 64, true, 1, false, false, true)
OSCAR_DECODE_SPLIT_INSTANCE(128, 32, true, 1, false, false, true)
#endif

#if defined(OSCAR_DECODE_TRACE)
template <>
cudaError_t set_split_trace<128>(unsigned long long* buf, int capacity) {
  return set_trace_symbols(buf, capacity);
}
#endif

}  // namespace oscar::kernels::cuda::decode_impl
