// What the decode's .cu files give each other (not a public header): the
// launchers that decode_dispatch.cu calls, each defined and instantiated in
// the file of its kernel. A launch of a shape that no file instantiates
// fails to link instead of at run time.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/paged_kv.h"

namespace oscar::kernels::cuda::decode_impl {

struct KernelArgs;  // decode_args.cuh

// decode_split_kernel.cuh; instances: decode_split_d64.cu, _d128.cu, _d256.cu.
// One split launch (middle or window chunks, or fused windows) of grid
// (KV heads, chunks), with its dynamic shared memory.
// kCenter: page centering folded into the middle loop (KernelArgs::center_coef).
template <int D, int G, bool kQuant, int kVariant, bool kFused = false, bool kGroup = false, bool kCenter = false>
cudaError_t launch_split(dim3 grid, bool pdl, cudaStream_t stream, const KernelArgs& a);

// decode_merge.cu: the chunks of each sequence merged by log-sum-exp into
// o [batch][Hq][D] and lse (or nullptr), grid (batch, Hq).
template <int D>
cudaError_t launch_merge(dim3 grid, bool pdl, cudaStream_t stream, const int32_t* seq_chunk_ptr,
                         const float* partial_o, const float* partial_lse, int num_q_heads,
                         float* o, float* lse);

// decode_center.cu: page centering's per-query coefficients (KernelArgs::center_coef,
// [batch][Hq][coef_row_floats(S)]), before the middle launch, whose kCenter instances turn them
// into their pages' shifts. pdl: a programmatic dependent (it waits for the query before
// reading it).
template <int D>
cudaError_t launch_center_coef(const kv::PagedKvView& kv, const float* q, int num_q_heads, int gqa,
                               float* center_coef, bool pdl, cudaStream_t stream);

#if defined(OSCAR_DECODE_TRACE)
// Each .cu with traced kernels is a device module with its own copy of the
// trace buffer's address: set_decode_trace sets them all.
template <int D>
cudaError_t set_split_trace(unsigned long long* buf, int capacity);  // decode_split_d<D>.cu
cudaError_t set_merge_trace(unsigned long long* buf, int capacity);  // decode_merge.cu
#endif

}  // namespace oscar::kernels::cuda::decode_impl
