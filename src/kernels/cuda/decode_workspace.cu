// The decode's workspace (decode_attention.h): its device buffers, and the
// plan's tables copied into them in launch order (upload_plan).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/decode_attention.h"

namespace oscar::kernels::cuda {

using namespace decode_impl;

DecodeWorkspace alloc_decode_workspace(int capacity, int max_batch, int max_q_heads, int head_dim) {
  if (capacity <= 0 || max_batch <= 0 || max_q_heads <= 0 || head_dim <= 0)
    throw Error("alloc_decode_workspace: sizes must be positive");
  DecodeWorkspace ws;
  ws.capacity = capacity;
  ws.max_batch = max_batch;
  ws.max_q_heads = max_q_heads;
  ws.head_dim = head_dim;
  try {  // a failed allocation frees the earlier ones
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.chunks, sizeof(int32_t) * 8 * size_t(capacity)));
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.seq_chunk_ptr, sizeof(int32_t) * (size_t(max_batch) + 1)));
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.first_pages, sizeof(int32_t) * kWarps * size_t(capacity)));
    OSCAR_CUDA_CHECK(
        cudaMalloc(&ws.partial_o, sizeof(float) * size_t(capacity) * max_q_heads * head_dim));
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.partial_lse, sizeof(float) * size_t(capacity) * max_q_heads));
    OSCAR_CUDA_CHECK(
        cudaMalloc(&ws.center_coef, sizeof(float) * size_t(max_batch) * max_q_heads * (head_dim + 8)));
    // The write's flags (one per block: KV head, K/V, 32 channels); the heads
    // are bounded by the q heads.
    const size_t flags = size_t(max_batch) * max_q_heads * 2 * std::max(head_dim / 32, 1);
    OSCAR_CUDA_CHECK(cudaMalloc(&ws.step_sync, flags * sizeof(uint32_t)));
    OSCAR_CUDA_CHECK(cudaMemset(ws.step_sync, 0, flags * sizeof(uint32_t)));
    OSCAR_CUDA_CHECK(cudaDeviceSynchronize());  // zero before any launch reads it
  } catch (...) {
    free_decode_workspace(ws);
    throw;
  }
  return ws;
}

void free_decode_workspace(DecodeWorkspace& ws) {
  cudaFree(ws.chunks);
  cudaFree(ws.seq_chunk_ptr);
  cudaFree(ws.first_pages);
  cudaFree(ws.partial_o);
  cudaFree(ws.partial_lse);
  cudaFree(ws.center_coef);
  cudaFree(ws.step_sync);
  ws = DecodeWorkspace{};
}

cudaError_t upload_plan(const DecodePlan& plan, const DecodeWorkspace& ws, cudaStream_t stream) {
  if (plan.num_chunks < 0 || plan.num_chunks > ws.capacity || plan.batch < 0 || plan.batch > ws.max_batch ||
      plan.batch >= (1 << 24))
    return cudaErrorInvalidValue;
  // A plan not made by plan_decode (or edited) is checked before it is read.
  if (plan.chunks.size() != 4 * size_t(plan.num_chunks) || plan.order.size() != size_t(plan.num_chunks) ||
      plan.seq_chunk_ptr.size() != size_t(plan.batch) + 1 || plan.regions.size() != 6 * size_t(plan.batch))
    return cudaErrorInvalidValue;
  for (int i = 0; i < plan.batch * 3; ++i)
    if (plan.regions[2 * size_t(i)] < 0 || plan.regions[2 * size_t(i) + 1] < 0) return cudaErrorInvalidValue;
  if (!plan.first_pages.empty()) {
    if (plan.first_pages.size() != kWarps * size_t(plan.num_chunks) || !ws.first_pages) return cudaErrorInvalidValue;
    for (int32_t pg : plan.first_pages)
      if (pg < -1) return cudaErrorInvalidValue;
  }
  std::vector<bool> seen(size_t(plan.num_chunks), false);
  for (int i = 0; i < plan.num_chunks; ++i) {
    const int32_t id = plan.order[i];
    // Every chunk once: a repeated one would write its partial twice and
    // leave another's unwritten (the merge would read stale rows).
    if (id < 0 || id >= plan.num_chunks || seen[size_t(id)]) return cudaErrorInvalidValue;
    seen[size_t(id)] = true;
    const int32_t* c = &plan.chunks[4 * size_t(id)];
    if (c[0] < 0 || c[0] >= plan.batch || c[1] < 0 || c[1] > 3 || c[2] < 0 || c[3] < c[2])
      return cudaErrorInvalidValue;
    // Launch positions: the middle chunks first, then the window chunks
    // (fused ones exactly when the plan fuses).
    if ((c[1] == 1) != (i < plan.num_quant_chunks)) return cudaErrorInvalidValue;
    if ((c[1] == 3) != (plan.fused_windows && i >= plan.num_quant_chunks)) return cudaErrorInvalidValue;
    if (c[1] == 3) {
      // A fused window chunk: [c[2], c[3]) are middle chunks of its sequence.
      if (c[3] > plan.num_chunks || c[3] - c[2] > kFuseMaxChunks) return cudaErrorInvalidValue;
      for (int k = c[2]; k < c[3]; ++k)
        if (plan.chunks[4 * size_t(k)] != c[0] || plan.chunks[4 * size_t(k) + 1] != 1) return cudaErrorInvalidValue;
      continue;
    }
    // Tiles within the region's length: the kernels trust t1 and the length.
    if (c[3] > ceil_div(plan.regions[6 * size_t(c[0]) + 2 * c[1] + 1], kTileTokens)) return cudaErrorInvalidValue;
    // Whole-group copies read 64 rows from a group's first tile: only where
    // every middle chunk starts at a multiple of 4 tiles.
    if (c[1] == 1 && plan.mid_groups_aligned && c[2] % kRingTiles != 0) return cudaErrorInvalidValue;
  }
  // The kernels read 32 bytes per CTA: the plan's chunks in launch order
  // (plan.order), each with its id (the row of its partial result) and its
  // region's page-table offset and length.
  std::vector<int32_t> table(8 * size_t(plan.num_chunks), 0);
  for (int i = 0; i < plan.num_chunks; ++i) {
    const int id = plan.order[i];
    const int32_t* c = &plan.chunks[4 * size_t(id)];
    int32_t* e = &table[8 * size_t(i)];
    e[0] = c[0] | (c[1] << 24);
    e[1] = c[2];
    e[2] = c[3];
    e[3] = id;
    if (c[1] == 3) {  // fused window: sink and recent (page-table offset, length)
      for (int k = 0; k < 2; ++k) {
        e[4 + 2 * k] = plan.regions[6 * size_t(c[0]) + 4 * k];
        e[5 + 2 * k] = plan.regions[6 * size_t(c[0]) + 4 * k + 1];
      }
    } else {
      e[4] = plan.regions[6 * size_t(c[0]) + 2 * c[1]];
      e[5] = plan.regions[6 * size_t(c[0]) + 2 * c[1] + 1];
    }
  }
  if (plan.num_chunks > 0)
    OSCAR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ws.chunks, table.data(), sizeof(int32_t) * table.size(),
                                               cudaMemcpyHostToDevice, stream));
  std::vector<int32_t> first_pages;
  if (!plan.first_pages.empty() && plan.num_chunks > 0) {
    first_pages.resize(kWarps * size_t(plan.num_chunks));
    for (int i = 0; i < plan.num_chunks; ++i)
      std::copy_n(&plan.first_pages[kWarps * size_t(plan.order[i])], kWarps, &first_pages[kWarps * size_t(i)]);
    OSCAR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ws.first_pages, first_pages.data(),
                                               sizeof(int32_t) * first_pages.size(), cudaMemcpyHostToDevice,
                                               stream));
  }
  OSCAR_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(ws.seq_chunk_ptr, plan.seq_chunk_ptr.data(),
                                             sizeof(int32_t) * plan.seq_chunk_ptr.size(),
                                             cudaMemcpyHostToDevice, stream));
  // No stream synchronization: an asynchronous copy from pageable host memory
  // has read its source when it returns (staged, or done synchronously), so the
  // local tables may go; a sync here stalled every decode step's first layer.
  return cudaSuccess;
}

}  // namespace oscar::kernels::cuda
