// Four fp32 values to and from four BF16 values in 8 bytes (round to nearest even, as
// __float2bfloat16_rn), for the elementwise kernels that move rows 16 bytes of fp32 at a time.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace oscar::kernels::cuda {

__device__ __forceinline__ uint2 pack_bf16x4(float4 v) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}

__device__ __forceinline__ float4 unpack_bf16x4(uint2 w) {
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

}  // namespace oscar::kernels::cuda
