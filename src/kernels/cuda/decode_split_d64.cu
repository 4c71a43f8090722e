// The split kernels of head_dim 64 (decode_split_kernel.cuh), one instance
// per shape that decode_dispatch.cu launches; none with
// OSCAR_CUDA_INSTANCES=min (head_dim 128 only).
#include "kernels/cuda/decode_split_kernel.cuh"

#if !defined(OSCAR_CUDA_MIN_INSTANCES)
namespace oscar::kernels::cuda::decode_impl {

// Windows (BF16 chunks; the group argument is unused) and fused windows.
OSCAR_DECODE_SPLIT_INSTANCE(64, 128, false, 0, false, false)
OSCAR_DECODE_SPLIT_INSTANCE(64, 128, false, 0, true, false)
// Middle: the register-prefetch loop for every group.
OSCAR_DECODE_SPLIT_INSTANCE(64, 64, true, 1, false, false)
OSCAR_DECODE_SPLIT_INSTANCE(64, 32, true, 1, false, false)
// Middle with page centering folded into the loop (launch_quant_centered).
OSCAR_DECODE_SPLIT_INSTANCE(64, 64, true, 1, false, false, true)
OSCAR_DECODE_SPLIT_INSTANCE(64, 32, true, 1, false, false, true)

#if defined(OSCAR_DECODE_TRACE)
template <>
cudaError_t set_split_trace<64>(unsigned long long* buf, int capacity) {
  return set_trace_symbols(buf, capacity);
}
#endif

}  // namespace oscar::kernels::cuda::decode_impl
#endif
