// BF16 tiles (sink and recent windows, and the BF16-only baseline): loads,
// the query, and one tile's logits, softmax step and P.V on bf16 tensor cores.
#pragma once

#include "kernels/cuda/decode_common.cuh"

namespace oscar::kernels::cuda {

namespace {

template <int D>
struct Bf16Tile {
  uint4 k[2][D / 32];  // tokens g, g+8: channels 32k + 8r .. +7
  uint4 v[4][D / 64];  // tokens 2r, 2r+1, 2r+8, 2r+9: channels 64k + 8g .. +7
  int valid;
};

// A staged BF16 row's 16-byte chunk c (8 channels) lives at chunk
// window_chunk(row, c): the low three bits XOR-ed with a function of the row
// such that the K fragment loads (rows g, g+8 x chunks 4k + r) and the V
// fragment loads (rows 2r + j' x chunks 8k + g) of one 8-lane phase touch 8
// different 16-byte bank groups.
__device__ __forceinline__ int window_chunk(int row, int c) {
  return c ^ ((((row >> 1) & 3) << 1) ^ ((row & 1) << 2));
}

// Loads through L2 (ld.global.cg), not the read-only path (v40d): the tile
// holding a step write's new row was written by a launch running at the
// same time (v40b), and the read-only path is for data that does not change
// while the kernel runs; a branch that kept the read-only path for the
// other tiles measured 0.3 us slower at 8 x 4K (v40c), every tile through
// L2 the same as before.
template <int D>
__device__ __forceinline__ void load_bf16_tile(Bf16Tile<D>& T, const kv::PagedKvView& kv,
                                               const int32_t* pages, const FastDiv& tpp, int len,
                                               int h, int t, int g, int r) {
  auto load = [](const uint16_t* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); };
  const TileLoc loc =
      tile_loc(page_of(pages, tpp, t), tpp, len, kv.page_size, kv.num_kv_heads, h, t);
  T.valid = loc.valid;
  const uint16_t* kb = kv.bf16.k + size_t(loc.row0) * D;
  const uint16_t* vb = kv.bf16.v + size_t(loc.row0) * D;
#pragma unroll
  for (int tt = 0; tt < 2; ++tt)
#pragma unroll
    for (int k = 0; k < D / 32; ++k)
      T.k[tt][k] = load(kb + (g + 8 * tt) * D + 32 * k + 8 * r);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = 2 * r + (j & 1) + 8 * (j >> 1);
#pragma unroll
    for (int k = 0; k < D / 64; ++k) {
      const uint4 w = load(vb + tok * D + 64 * k + 8 * g);
      // Padding slots may hold NaN bits; p = 0 times NaN would poison O.
      T.v[j][k] = tok < loc.valid ? w : make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

template <int D>
struct Bf16Query {
  uint32_t qf[D / 16][2];  // bf16x2 B fragments
  float f[2];
};

template <int D>
__device__ __forceinline__ void load_bf16_query(Bf16Query<D>& Q, const float* qrow, bool head_ok,
                                                float sm_scale_log2, int g, int r) {
  float v[D / 16][4];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int kpos = 2 * r + (k & 1) + 8 * (k >> 1);
      v[j][k] = head_ok ? __ldg(qrow + kb_channel(j, kpos)) : 0.0f;
      amax = fmax_nan(amax, fabsf(v[j][k]));  // a NaN query gives NaN logits
    }
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    Q.qf[j][0] = pack_bf162(v[j][0] * inv, v[j][1] * inv);
    Q.qf[j][1] = pack_bf162(v[j][2] * inv, v[j][3] * inv);
  }
  const float fh = amax * sm_scale_log2;
  Q.f[0] = __shfl_sync(0xffffffffu, fh, (2 * r) * 4);
  Q.f[1] = __shfl_sync(0xffffffffu, fh, (2 * r + 1) * 4);
}

template <int D, int NG>
__device__ __forceinline__ void compute_bf16_tile(WarpState<D, NG>& st, const Bf16Tile<D>& T,
                                                  const Bf16Query<D>& Q, int g) {
  float sacc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const int k = j / 2, mm = j % 2;
    const uint32_t* k0 = reinterpret_cast<const uint32_t*>(&T.k[0][k]);
    const uint32_t* k1 = reinterpret_cast<const uint32_t*>(&T.k[1][k]);
    mma_bf16(sacc, k0[2 * mm], k1[2 * mm], k0[2 * mm + 1], k1[2 * mm + 1], Q.qf[j][0], Q.qf[j][1]);
  }
  float s[1][4];
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const bool ok = g + 8 * tt < T.valid;
    s[0][2 * tt] = ok ? sacc[2 * tt] * Q.f[0] : -INFINITY;
    s[0][2 * tt + 1] = ok ? sacc[2 * tt + 1] * Q.f[1] : -INFINITY;
  }
  softmax_step(st, s);
  const uint32_t b0 = transpose8x8(pack_bf162(s[0][0], s[0][1]));
  const uint32_t b1 = transpose8x8(pack_bf162(s[0][2], s[0][3]));
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const int k = i / 4, w = i % 4;
    const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&T.v[0][k]);
    const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&T.v[1][k]);
    const uint32_t* v2 = reinterpret_cast<const uint32_t*>(&T.v[2][k]);
    const uint32_t* v3 = reinterpret_cast<const uint32_t*>(&T.v[3][k]);
    mma_bf16(st.o[i], prmt(v0[w], v1[w], 0x5410u), prmt(v0[w], v1[w], 0x7632u),
             prmt(v2[w], v3[w], 0x5410u), prmt(v2[w], v3[w], 0x7632u), b0, b1);
  }
}

}  // namespace

}  // namespace oscar::kernels::cuda
