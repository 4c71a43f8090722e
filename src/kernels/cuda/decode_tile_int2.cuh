// INT2 (middle) tiles through fp16 tensor cores: the tile's fragments, the
// query in virtual-channel order, logits and P.V with the scale and min
// folded afterwards (decode_common.cuh's header comment has the algebra).
// Used by loop variants 0 and 1 of the split kernel, and (the tile, its
// loads) by the int8 loops.
#pragma once

#include "kernels/cuda/decode_common.cuh"

namespace oscar::kernels::cuda {

namespace {

// Bytes of one INT2 tile image: K and V codes [16][D/4], K and V params [16][D/G][2] fp16.
__host__ __device__ constexpr int quant_tile_bytes(int D, int G) { return 8 * D + 128 * (D / G); }

template <int D, int G>
struct QuantTile {
  static constexpr int NG = D / G;
  static constexpr int KW = G >= 64 ? G / 64 : 1;  // K code words per token and group
  uint32_t kw[2][NG][KW];  // K codes, tokens g and g+8
  uint32_t vw[4][NG];      // V codes, tokens 2r, 2r+1, 2r+8, 2r+9 (1, 2 or 4 bytes used)
  uint32_t kp[2][NG];      // K (scale, min) fp16 pairs, tokens g, g+8
  uint32_t vp[2][NG];      // V (scale, min), tokens g, g+8
  int valid;
};

// The lane's fragments of one tile from its four arrays (global memory or a
// shared-memory copy of the same bytes): K/V codes [16 tokens][D/4] bytes and
// K/V params [16 tokens][D/G] (scale, min) words. In the shared-memory copy
// the V code rows are swizzled (ring_v_row): the lanes of one V load read
// rows 2r + dt, r = 0..3, which with 32-byte rows would put r = 0 and r = 2
// (and 1 and 3) on the same 8 banks; swapping rows 4k+4 <-> 4k+5 and 4k+6 <->
// 4k+7 spreads them over all 32 (ncu on v13: 26% of shared wavefronts were
// bank conflicts).
__host__ __device__ constexpr int ring_v_row(int row) { return row ^ ((row >> 2) & 1); }
template <bool kShared, typename T>
__device__ __forceinline__ T ld(const T* p) {
  if constexpr (kShared)
    return *p;
  else
    return __ldg(p);
}

template <bool kShared, int D, int G>
__device__ __forceinline__ void load_quant_fragments(QuantTile<D, G>& T, const uint8_t* kc0,
                                                     const uint8_t* vc0, const uint32_t* kp0,
                                                     const uint32_t* vp0, int g, int r) {
  constexpr int NG = D / G, RB = D / 4;
  constexpr int KB = G == 128 ? 8 : G == 64 ? 4 : 2;  // K code bytes per lane and group
  constexpr int VB = G / 32;                          // V code bytes per lane and group
  const uint8_t* kc = kc0 + (g * RB + KB * r);
  // Rows of tokens 2r + dt, dt = 0, 1 (+8): in shared memory row 2r + (dt ^ (r >> 1)).
  // (Global memory: one base, so that every offset below is an immediate.)
  const int sw = r >> 1;
  const uint8_t* vc_even = vc0 + ((2 * r + (kShared ? sw : 0)) * RB + VB * g);
  const uint8_t* vc_odd = kShared ? vc0 + ((2 * r + 1 - sw) * RB + VB * g) : vc_even + RB;
  const uint32_t* kp = kp0 + g * NG;
  const uint32_t* vp = vp0 + g * NG;
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
#pragma unroll
    for (int gm = 0; gm < NG; ++gm) {
      const uint8_t* p = kc + (8 * tt * RB + gm * (G / 4));
      if constexpr (G == 128) {
        const uint2 w = ld<kShared>(reinterpret_cast<const uint2*>(p));
        T.kw[tt][gm][0] = w.x;
        T.kw[tt][gm][1] = w.y;
      } else if constexpr (G == 64) {
        T.kw[tt][gm][0] = ld<kShared>(reinterpret_cast<const uint32_t*>(p));
      } else {
        const uint32_t v = ld<kShared>(reinterpret_cast<const unsigned short*>(p));
        T.kw[tt][gm][0] = prmt(v, 0u, 0x4140u);  // [b0, 0, b1, 0]
      }
      T.kp[tt][gm] = ld<kShared>(kp + (8 * tt * NG + gm));
      T.vp[tt][gm] = ld<kShared>(vp + (8 * tt * NG + gm));
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    // tokens 2r, 2r+1, 2r+8, 2r+9
#pragma unroll
    for (int gm = 0; gm < NG; ++gm) {
      const uint8_t* p = ((k & 1) ? vc_odd : vc_even) + (8 * (k >> 1) * RB + gm * (G / 4));
      if constexpr (G == 128)
        T.vw[k][gm] = ld<kShared>(reinterpret_cast<const uint32_t*>(p));
      else if constexpr (G == 64)
        T.vw[k][gm] = ld<kShared>(reinterpret_cast<const unsigned short*>(p));
      else
        T.vw[k][gm] = ld<kShared>(p);
    }
  }
}

// v48: the lane's byte offsets into a shared-memory tile image (the ring),
// computed once per kernel: load_quant_fragments<true> recomputed them from
// the lane index at every step (the loop is short of registers, and the
// compiler rematerialized the whole chain there instead of keeping them).
struct RingFrag {
  uint32_t k, ve, vo, p;  // K codes, V codes of even and odd rows, K params (V params: +64 D/G)
};
template <int D, int G>
__device__ __forceinline__ RingFrag ring_frag(int g, int r) {
  constexpr int NG = D / G, RB = D / 4;
  constexpr int KB = G == 128 ? 8 : G == 64 ? 4 : 2;
  constexpr int VB = G / 32;
  const int sw = r >> 1;
  RingFrag F{static_cast<uint32_t>(g * RB + KB * r), static_cast<uint32_t>(16 * RB + (2 * r + sw) * RB + VB * g),
             static_cast<uint32_t>(16 * RB + (2 * r + 1 - sw) * RB + VB * g),
             static_cast<uint32_t>(32 * RB + 4 * g * NG)};
  // Opaque to the compiler, so that it keeps them instead of recomputing.
  asm("" : "+r"(F.k), "+r"(F.ve), "+r"(F.vo), "+r"(F.p));
  return F;
}
// load_quant_fragments<true> on the tile image at ti, from the lane's offsets.
template <int D, int G>
__device__ __forceinline__ void load_ring_fragments(QuantTile<D, G>& T, const uint8_t* ti, const RingFrag& F) {
  static_assert(D == 128 && G == 128, "the int8 rings: head_dim 128, group 128");
  constexpr int RB = D / 4;
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const uint2 w = *reinterpret_cast<const uint2*>(ti + F.k + 8 * tt * RB);
    T.kw[tt][0][0] = w.x;
    T.kw[tt][0][1] = w.y;
    T.kp[tt][0] = *reinterpret_cast<const uint32_t*>(ti + F.p + 32 * tt);
    T.vp[tt][0] = *reinterpret_cast<const uint32_t*>(ti + F.p + 64 + 32 * tt);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k)
    T.vw[k][0] = *reinterpret_cast<const uint32_t*>(ti + ((k & 1) ? F.vo : F.ve) + 8 * (k >> 1) * RB);
}

template <int D, int G>
__device__ __forceinline__ void load_quant_tile(QuantTile<D, G>& T, const kv::PagedKvView& kv,
                                                int32_t page, const FastDiv& tpp, int len, int h,
                                                int t, int g, int r) {
  constexpr int NG = D / G, RB = D / 4;  // RB: code bytes per row
  const TileLoc loc = tile_loc(page, tpp, len, kv.page_size, kv.num_kv_heads, h, t);
  T.valid = loc.valid;
  // One 64-bit address per array and tile; the per-token offsets below are
  // immediates (the lane's own offsets are folded into the base).
  const uint64_t row0 = loc.row0;
  load_quant_fragments<false>(T, kv.quant.k_codes + row0 * RB, kv.quant.v_codes + row0 * RB,
                       reinterpret_cast<const uint32_t*>(kv.quant.k_params) + row0 * NG,
                       reinterpret_cast<const uint32_t*>(kv.quant.v_params) + row0 * NG, g, r);
}

// Per-block query operands for the INT2 path.
template <int D, int G>
struct QuantQuery {
  static constexpr int NG = D / G;
  uint32_t qf[D / 16][2];  // B fragments (fp16x2) of q' = F q, virtual channel order
  float qsum[NG][2];       // sum over each group of the fp16 query, head columns 2r, 2r+1
  float qsump[NG][2];      // the same for q'
  float f[2];              // logit factor (amax * sm_scale * log2 e), head columns 2r, 2r+1
};

// Code factor F of k-tile jl of a group at fragment half `half` (kpos / 8):
// G >= 64 unpacks half 0 from lo bytes and half 1 from hi bytes at s = jl % 4;
// G = 32 unpacks both halves from lo bytes at s = 2 jl + half.
template <int G>
__host__ __device__ constexpr float k_code_factor(int jl, int half) {
  return G >= 64 ? (half ? hi_factor(jl % 4) : lo_factor(jl % 4)) : lo_factor(2 * jl + half);
}

template <int D, int G>
__device__ __forceinline__ void load_quant_query(QuantQuery<D, G>& Q, const float* qrow,
                                                 bool head_ok, float sm_scale_log2, int g, int r) {
  constexpr int NG = D / G, KTG = G / 16;
  float v[D / 16][4];
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j)
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int kpos = 2 * r + (k & 1) + 8 * (k >> 1);
      v[j][k] = head_ok ? __ldg(qrow + kq_channel(G, j / KTG, j % KTG, kpos)) : 0.0f;
      amax = fmax_nan(amax, fabsf(v[j][k]));  // a NaN query gives NaN logits
    }
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  // Normalizing by max|q| keeps fp16 far from overflow (|q'| <= 16); the
  // factor returns in f. (A zero query gives zero logits either way.)
  const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
  float part[NG], partp[NG];
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) part[gm] = partp[gm] = 0.0f;
#pragma unroll
  for (int j = 0; j < D / 16; ++j) {
    const float f0 = k_code_factor<G>(j % KTG, 0), f1 = k_code_factor<G>(j % KTG, 1);
    Q.qf[j][0] = pack_half2(v[j][0] * inv * f0, v[j][1] * inv * f0);
    Q.qf[j][1] = pack_half2(v[j][2] * inv * f1, v[j][3] * inv * f1);
    // The sums use the rounded values so that the folded offset cancels exactly
    // (scaling by a power of two commutes with the rounding).
    const float s0 = half_lo(Q.qf[j][0]) + half_hi(Q.qf[j][0]);
    const float s1 = half_lo(Q.qf[j][1]) + half_hi(Q.qf[j][1]);
    partp[j / KTG] += s0 + s1;
    part[j / KTG] += s0 / f0 + s1 / f1;
  }
  const float fh = amax * sm_scale_log2;
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) {
#pragma unroll
    for (int o = 1; o <= 2; o <<= 1) {
      part[gm] += __shfl_xor_sync(0xffffffffu, part[gm], o);
      partp[gm] += __shfl_xor_sync(0xffffffffu, partp[gm], o);
    }
    // Lane (g, r) now holds head g's sums; lane needs heads 2r and 2r+1.
    Q.qsum[gm][0] = __shfl_sync(0xffffffffu, part[gm], (2 * r) * 4);
    Q.qsum[gm][1] = __shfl_sync(0xffffffffu, part[gm], (2 * r + 1) * 4);
    Q.qsump[gm][0] = __shfl_sync(0xffffffffu, partp[gm], (2 * r) * 4);
    Q.qsump[gm][1] = __shfl_sync(0xffffffffu, partp[gm], (2 * r + 1) * 4);
  }
  Q.f[0] = __shfl_sync(0xffffffffu, fh, (2 * r) * 4);
  Q.f[1] = __shfl_sync(0xffffffffu, fh, (2 * r + 1) * 4);
}

// Code factor F of INT2 V m-tile i of a group at row half `half` (rp / 8).
template <int G>
__host__ __device__ constexpr float v_code_factor(int i, int half) {
  return G == 128 ? (half ? hi_factor(i % 4) : lo_factor(i % 4))
                  : G == 64 ? (half ? hi_factor(i) : lo_factor(i)) : lo_factor(2 * i + half);
}

// Logits of one INT2 tile (s[4], log2 domain, masked -inf) and the value
// params of tokens g, g+8 (zero for padding slots).
template <int D, int G>
__device__ __forceinline__ void quant_logits(const QuantTile<D, G>& T, const QuantQuery<D, G>& Q,
                                             int g, float (&s)[4], float (&vs)[2][D / G],
                                             float (&vm)[2][D / G]) {
  constexpr int NG = D / G, KTG = G / 16;
  // --- logits: S^T = K Q'^T, one accumulator per group (scales differ per group)
  float sacc[NG][4];
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) {
    sacc[gm][0] = sacc[gm][1] = sacc[gm][2] = sacc[gm][3] = 0.0f;
    if constexpr (G >= 64) {
#pragma unroll
      for (int wi = 0; wi < G / 64; ++wi) {
        const CodeWord w0(T.kw[0][gm][wi]), w1(T.kw[1][gm][wi]);
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          const int j = gm * KTG + wi * 4 + s;
          mma_f16(sacc[gm], w0.lo(s), w1.lo(s), w0.hi(s), w1.hi(s), Q.qf[j][0], Q.qf[j][1]);
        }
      }
    } else {
      const CodeWord w0(T.kw[0][gm][0]), w1(T.kw[1][gm][0]);
#pragma unroll
      for (int jl = 0; jl < 2; ++jl) {
        const int j = gm * KTG + jl;
        mma_f16(sacc[gm], w0.lo(2 * jl), w1.lo(2 * jl), w0.lo(2 * jl + 1), w1.lo(2 * jl + 1),
                Q.qf[j][0], Q.qf[j][1]);
      }
    }
  }
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const bool ok = g + 8 * tt < T.valid;
    float acc0 = 0.0f, acc1 = 0.0f;
#pragma unroll
    for (int gm = 0; gm < NG; ++gm) {
      const float ks = half_lo(T.kp[tt][gm]), km = half_hi(T.kp[tt][gm]);
      acc0 += ks * (sacc[gm][2 * tt] - Q.qsump[gm][0]) + km * Q.qsum[gm][0];
      acc1 += ks * (sacc[gm][2 * tt + 1] - Q.qsump[gm][1]) + km * Q.qsum[gm][1];
      // Padding slots of a partial page may hold anything (even NaN): zero
      // their value params so p = 0 cannot meet a NaN.
      vs[tt][gm] = ok ? half_lo(T.vp[tt][gm]) : 0.0f;
      vm[tt][gm] = ok ? half_hi(T.vp[tt][gm]) : 0.0f;
    }
    s[2 * tt] = ok ? acc0 * Q.f[0] : -INFINITY;
    s[2 * tt + 1] = ok ? acc1 * Q.f[1] : -INFINITY;
  }
}

// O^T += V^T (p s)^T per group for one tile (p in s[4]); sums of p s and p m
// for the fold.
template <int D, int G>
__device__ __forceinline__ void quant_pv(WarpState<D, D / G>& st, const QuantTile<D, G>& T,
                                         const float (&s)[4], const float (&vs)[2][D / G],
                                         const float (&vm)[2][D / G]) {
  constexpr int NG = D / G;
#pragma unroll
  for (int gm = 0; gm < NG; ++gm) {
    const uint32_t h01 = pack_half2(s[0] * vs[0][gm], s[1] * vs[0][gm]);  // token g
    const uint32_t h23 = pack_half2(s[2] * vs[1][gm], s[3] * vs[1][gm]);  // token g+8
    st.pm[gm][0] += s[0] * vm[0][gm] + s[2] * vm[1][gm];
    st.pm[gm][1] += s[1] * vm[0][gm] + s[3] * vm[1][gm];
    const uint32_t b0 = transpose8x8(h01), b1 = transpose8x8(h23);
    // sum_t fp16(p s) per head on the tensor cores: an all-ones A operand.
    constexpr uint32_t kOnes = 0x3C003C00u;
    mma_f16(st.sp[gm], kOnes, kOnes, kOnes, kOnes, b0, b1);
    if constexpr (G == 128) {
#pragma unroll
      for (int xi = 0; xi < 2; ++xi) {
        const uint32_t sel = xi ? 0x7632u : 0x5410u;
        const CodeWord x0(prmt(T.vw[0][gm], T.vw[1][gm], sel)), x1(prmt(T.vw[2][gm], T.vw[3][gm], sel));
#pragma unroll
        for (int sh = 0; sh < 4; ++sh)
          mma_f16(st.o[gm * 8 + xi * 4 + sh], x0.lo(sh), x0.hi(sh), x1.lo(sh), x1.hi(sh), b0, b1);
      }
    } else if constexpr (G == 64) {
      const CodeWord x0(prmt(T.vw[0][gm], T.vw[1][gm], 0x5410u)), x1(prmt(T.vw[2][gm], T.vw[3][gm], 0x5410u));
#pragma unroll
      for (int i = 0; i < 4; ++i)
        mma_f16(st.o[gm * 4 + i], x0.lo(i), x0.hi(i), x1.lo(i), x1.hi(i), b0, b1);
    } else {
      // 1-byte loads: the upper bytes are zero, so 0x5410 gives [t0.b0, 0, t1.b0, 0].
      const CodeWord x0(prmt(T.vw[0][gm], T.vw[1][gm], 0x5410u)), x1(prmt(T.vw[2][gm], T.vw[3][gm], 0x5410u));
#pragma unroll
      for (int i = 0; i < 2; ++i)
        mma_f16(st.o[gm * 2 + i], x0.lo(2 * i), x0.lo(2 * i + 1), x1.lo(2 * i), x1.lo(2 * i + 1), b0, b1);
    }
  }
}

// N INT2 tiles with one softmax step. kShift (page centering): pb[u] are tile u's logit
// shifts (log2 domain) of the lane's head columns 2r, 2r+1, added before the softmax.
template <bool kShift, int D, int G, int N>
__device__ __forceinline__ void compute_quant_tiles_impl(WarpState<D, D / G>& st, const QuantTile<D, G> (&T)[N],
                                                         const QuantQuery<D, G>& Q, int g, const float (&pb)[N][2]) {
  float s[N][4], vs[N][2][D / G], vm[N][2][D / G];
#pragma unroll
  for (int u = 0; u < N; ++u) quant_logits(T[u], Q, g, s[u], vs[u], vm[u]);
  if constexpr (kShift) {
#pragma unroll
    for (int u = 0; u < N; ++u) {
      s[u][0] += pb[u][0];
      s[u][1] += pb[u][1];
      s[u][2] += pb[u][0];
      s[u][3] += pb[u][1];
    }
  }
  softmax_step(st, s);
#pragma unroll
  for (int u = 0; u < N; ++u) quant_pv(st, T[u], s[u], vs[u], vm[u]);
}
template <int D, int G, int N>
__device__ __forceinline__ void compute_quant_tiles(WarpState<D, D / G>& st, const QuantTile<D, G> (&T)[N],
                                                    const QuantQuery<D, G>& Q, int g) {
  const float none[N][2] = {};
  compute_quant_tiles_impl<false>(st, T, Q, g, none);
}
template <int D, int G, int N>
__device__ __forceinline__ void compute_quant_tiles(WarpState<D, D / G>& st, const QuantTile<D, G> (&T)[N],
                                                    const QuantQuery<D, G>& Q, int g, const float (&pb)[N][2]) {
  compute_quant_tiles_impl<true>(st, T, Q, g, pb);
}

}  // namespace

}  // namespace oscar::kernels::cuda
