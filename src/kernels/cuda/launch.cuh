// Kernel launch with optional programmatic stream serialization (PDL, sm_90):
// with `programmatic` the kernel may begin while the previous launch on the
// stream is still running (from that launch's griddepcontrol.launch_dependents
// on) and calls pdl_wait() (mma.cuh) before it needs that launch's results;
// without it the launch is an ordinary stream-ordered one. smem: dynamic
// shared memory bytes (above 48 KB the caller raises the kernel's limit).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace oscar::kernels::cuda::detail {

template <typename... KArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, bool programmatic,
                       cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace oscar::kernels::cuda::detail
