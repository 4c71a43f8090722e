// INT2 (middle) tiles through int8 tensor cores, head_dim 128 / group 128:
// keys as u8 x s8 (loop variant 2, v10) and keys and values as u8 x u8
// (variant 3, v13: the default where it applies). The lane-per-head state
// and online softmax of those loops.
#pragma once

#include "kernels/cuda/decode_tile_int2.cuh"

namespace oscar::kernels::cuda {

namespace {

// ---------------------------------------------------------------------------
// Int8-key loop (kernel variant 2, docs/history.md v10): head_dim 128,
// group 128, GQA <= 4. Keys go through m16n8k32 u8 x s8 tensor cores: a code
// word shifted by 2s and masked with 0x03030303 is one A register (four
// codes of consecutive virtual channels), so K needs no fp16 conversion. The
// query is rounded to a 16-bit integer qi (|qi| <= 127*256) and split into a
// high and a low signed byte (qi = 256 hi + lo); the N = 8 columns of the MMA
// are (head 0 hi, head 0 lo, head 1 hi, ..., head 3 lo), so the GQA-4 padding
// columns of the fp16 path now carry the low bytes and 4 MMAs cover the 16x128
// tile. 256 C[2r] + C[2r+1] = sum_j c_j qi_j exactly (int32), so the only
// new error is the rounding of q to 16 bits (|dq| <= amax / 65024 per channel).
// Each lane then owns ONE head (r) for tokens g and g+8: the softmax works on
// 2 values per lane instead of 4 (half of which were padding). For P.V the
// lane's (token g, token g+8) pair of head r is transposed with one movmatrix;
// after it lane (2h+e, r') holds tokens 2r'+8e, 2r'+8e+1 of head h, which is
// B column 2h+e restricted to token half e (the other half is zero): output
// columns 2h and 2h+1 are the two halves of head h, added at the end.
constexpr float kQ16 = 32512.0f;  // 127 * 256: hi in [-127, 127], lo in [-128, 127]

struct Int8Query {
  uint32_t qb[4][2];  // shift s: B fragments (4 x s8) of column g (head g/2, hi if g even else lo)
  float f;            // head r: sm_scale * log2(e) * amax / kQ16 / 64
  float qsum;         // head r: 64 sum_j qi_j (an integer, exact in fp32)
};

template <int D>
struct WarpState1 {
  float o[D / 16][4];  // O^T accumulators: rows (channels) g, g+8; cols 2r, 2r+1 = head r, token halves
  float sp[4];         // sum_t fp16(p s) (all-ones A operand), cols as o
  float pm;            // sum_t p m of head r (this lane's tokens)
  float m;             // running max of head r (log2 domain)
  float l;             // this lane's partial row sum of head r
};


template <int D>
struct WarpState2 {
  float o[D / 16][2];  // O^T of head r, MMA m: channels of rows g, g+8 (times 4^s)
  float pm;            // sum_t p m of head r (this lane's tokens)
  float m;             // running max of head r (log2 domain)
  float l;             // this lane's partial row sum of head r
};

// One head per lane (the int8 loops' states): every sum zero, the running
// max -inf.
template <class State>
__device__ __forceinline__ void state_init_lane(State& st) {
  st = State{};
  st.m = -INFINITY;
}
template <int D>
__device__ __forceinline__ void state_init(WarpState1<D>& st) { state_init_lane(st); }
template <int D>
__device__ __forceinline__ void state_init(WarpState2<D>& st) { state_init_lane(st); }

// The lane's 32 query values (channels 8r + i + 32s of the row at qhead;
// ok: that head exists, else zeros), fetched apart from their conversion so
// that the loads can go out before the middle's first copies (v50).
struct Int8QueryRaw {
  float4 x[4][2];
};
// v50: two 16-byte loads per 8 values (q is 16-byte aligned, check_decode)
// instead of 32 scalar loads with an address each: the kernel's prologue,
// which every warp of the launch runs at once, is ~100 instructions shorter.
__device__ __forceinline__ void fetch_int8_query(Int8QueryRaw& R, const float* qhead, bool ok, int r) {
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const float4* p = reinterpret_cast<const float4*>(qhead + 8 * r + 32 * s);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    R.x[s][0] = ok ? __ldg(p) : zero;
    R.x[s][1] = ok ? __ldg(p + 1) : zero;
  }
}
// qhead: the query row of head h*gqa + g/2 (ok: that head exists).
__device__ __forceinline__ void load_int8_query(Int8Query& Q, const Int8QueryRaw& R, float sm_scale_log2, int g,
                                                int r) {
  float v[4][8];
  float amax = 0.0f;
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    const float4 x0 = R.x[s][0], x1 = R.x[s][1];
    v[s][0] = x0.x, v[s][1] = x0.y, v[s][2] = x0.z, v[s][3] = x0.w;
    v[s][4] = x1.x, v[s][5] = x1.y, v[s][6] = x1.z, v[s][7] = x1.w;
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmax_nan(amax, fabsf(v[s][i]));  // a NaN query gives NaN logits
  }
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  // (v50: the approximate reciprocal, as for v48's weight bound: |v * inv|
  // stays within 32512 (1 + 1e-6), which rounds to at most 32512; amax = inf
  // gives 0 as the division did.)
  const float inv = amax > 0.0f ? kQ16 * fast_rcp(amax) : 0.0f;
  int part = 0;
#pragma unroll
  for (int s = 0; s < 4; ++s)
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int qi = __float2int_rn(v[s][4 * w + k] * inv);
        const int hi = (qi + 128) >> 8;  // floor((qi + 128) / 256)
        const int lo = qi - (hi << 8);
        word |= (static_cast<uint32_t>((g & 1) ? lo : hi) & 0xffu) << (8 * k);
        part += qi;
      }
      Q.qb[s][w] = word;
    }
  part += __shfl_xor_sync(0xffffffffu, part, 1);
  part += __shfl_xor_sync(0xffffffffu, part, 2);
  const float f = amax / kQ16 * sm_scale_log2 * (1.0f / 64.0f);  // 1/64: codes unpacked as 64 c
  // Lane (g, r) holds head g/2's values; it needs head r's: lane 4 * (2r).
  Q.qsum = 64.0f * static_cast<float>(__shfl_sync(0xffffffffu, part, 8 * r));  // x64 like the codes
  Q.f = __shfl_sync(0xffffffffu, f, 8 * r);
  // v48: the loops apply f inside the softmax's exp2 (and to the step max),
  // so masked logits (-inf) are multiplied by it: f must be > 0 there. A
  // zero query (f = 0, all its logits 0) gets the smallest normal float
  // instead; a NaN f stays NaN.
  if (Q.f == 0.0f) Q.f = FLT_MIN;
}

// Logits of one tile for head r, tokens g and g+8, masked -inf, and the
// value params of those tokens (zero for padding slots). kMasked = false: the
// caller knows every token of the tile is valid (no selects). v48: the logits
// are not yet multiplied by Q.f (> 0): softmax_step_lane folds it into its
// exp2 argument (one FFMA there instead of an FMUL per logit here).
template <bool kMasked>
__device__ __forceinline__ void int8k_logits(const QuantTile<128, 128>& T, const Int8Query& Q, int g,
                                             float (&s)[2], float (&vs)[2], float (&vm)[2]) {
  // Codes are taken at bits 6-7 of each byte: (w << (6 - 2 sh)) & 0xC0C0C0C0
  // is 64 c per byte, a left shift (IMAD.SHL, on the FMA pipe) and one LOP3 on
  // the integer pipe, which the V unpacking already keeps busy (ncu, v10).
  // The factor 64 is folded into Q.f. |acc| <= 64 * 3 * 128 * 128, so
  // 256 acc_hi + acc_lo < 2^30: exact in int32.
  int acc[4] = {0, 0, 0, 0};
#pragma unroll
  for (int sh = 0; sh < 4; ++sh) {
    constexpr uint32_t m = 0xC0C0C0C0u;
    const int l = 6 - 2 * sh;
    mma_u8s8(acc, (T.kw[0][0][0] << l) & m, (T.kw[1][0][0] << l) & m, (T.kw[0][0][1] << l) & m,
             (T.kw[1][0][1] << l) & m, Q.qb[sh][0], Q.qb[sh][1]);
  }
#pragma unroll
  for (int tt = 0; tt < 2; ++tt) {
    const bool ok = !kMasked || g + 8 * tt < T.valid;
    const float dot = static_cast<float>(acc[2 * tt] * 256 + acc[2 * tt + 1]);
    const float ks = half_lo(T.kp[tt][0]), km = half_hi(T.kp[tt][0]);
    s[tt] = ok ? fmaf(ks, dot, km * Q.qsum) : -INFINITY;
    vs[tt] = ok ? half_lo(T.vp[tt][0]) : 0.0f;
    vm[tt] = ok ? half_hi(T.vp[tt][0]) : 0.0f;
  }
}

// Online-softmax rescale of the lane-per-head states' accumulators.
template <int D>
__device__ __forceinline__ void scale_accumulators(WarpState1<D>& st, float sc) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    st.o[i][0] *= sc;
    st.o[i][1] *= sc;
    st.o[i][2] *= sc;
    st.o[i][3] *= sc;
  }
  st.sp[0] *= sc;
  st.sp[1] *= sc;
  st.sp[2] *= sc;
  st.sp[3] *= sc;
}
template <int D>
__device__ __forceinline__ void scale_accumulators(WarpState2<D>& st, float sc) {
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    st.o[i][0] *= sc;
    st.o[i][1] *= sc;
  }
}

// Online softmax step for a lane that owns one head (int8 loops, WarpState1
// or WarpState2): f * s[u] = logits (log2 domain) of tokens g, g+8 of tile u
// (f > 0, so the maximum of s gives the logits'), p in place.
// Returns 2^(step max - base), the largest p of the step (0 if the step has
// no finite logit); the v13 loop scales its weights by it.
template <class State, int N>
__device__ __forceinline__ float softmax_step_lane(State& st, float (&s)[N][2], float f) {
  float mx = fmaxf(s[0][0], s[0][1]);
#pragma unroll
  for (int u = 1; u < N; ++u) mx = fmaxf(mx, fmaxf(s[u][0], s[u][1]));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
  mx *= f;
  const float mn = fmaxf(st.m, mx);
  if (__any_sync(0xffffffffu, mn > st.m)) {
    const float sc = mn > st.m ? fast_exp2(st.m - mn) : 1.0f;
    scale_accumulators(st, sc);
    st.pm *= sc;
    st.l *= sc;
    st.m = mn;
  }
  const float b = st.m == -INFINITY ? 0.0f : st.m;
#pragma unroll
  for (int u = 0; u < N; ++u) {
    s[u][0] = fast_exp2(fmaf(s[u][0], f, -b));
    s[u][1] = fast_exp2(fmaf(s[u][1], f, -b));
    st.l += s[u][0] + s[u][1];
  }
  return fast_exp2(mx - b);
}

__device__ __forceinline__ void int8k_pv(WarpState1<128>& st, const QuantTile<128, 128>& T,
                                         const float (&p)[2], const float (&vs)[2], const float (&vm)[2],
                                         int g) {
  st.pm += p[0] * vm[0] + p[1] * vm[1];
  const uint32_t y = transpose8x8(pack_half2(p[0] * vs[0], p[1] * vs[1]));
  const bool e = g & 1;
  const uint32_t b0 = e ? 0u : y, b1 = e ? y : 0u;
  constexpr uint32_t kOnes = 0x3C003C00u;
  mma_f16(st.sp, kOnes, kOnes, kOnes, kOnes, b0, b1);
#pragma unroll
  for (int xi = 0; xi < 2; ++xi) {
    const uint32_t sel = xi ? 0x7632u : 0x5410u;
    const CodeWord x0(prmt(T.vw[0][0], T.vw[1][0], sel)), x1(prmt(T.vw[2][0], T.vw[3][0], sel));
#pragma unroll
    for (int sh = 0; sh < 4; ++sh)
      mma_f16(st.o[xi * 4 + sh], x0.lo(sh), x0.hi(sh), x1.lo(sh), x1.hi(sh), b0, b1);
  }
}

#ifndef OSCAR_INT8K_FASTPATH
#define OSCAR_INT8K_FASTPATH 1  // unmasked code for steps of full tiles (build-time A/B knob)
#endif
template <int N, bool kMasked>
__device__ __forceinline__ void compute_int8k_tiles(WarpState1<128>& st, const QuantTile<128, 128> (&T)[N],
                                                    const Int8Query& Q, int g) {
  float s[N][2], vs[N][2], vm[N][2];
#pragma unroll
  for (int u = 0; u < N; ++u) int8k_logits<kMasked>(T[u], Q, g, s[u], vs[u], vm[u]);
  softmax_step_lane(st, s, Q.f);
#pragma unroll
  for (int u = 0; u < N; ++u) int8k_pv(st, T[u], s[u], vs[u], vm[u], g);
}

// ---------------------------------------------------------------------------
// Int8 K and V loop (kernel variant 3, docs/history.md v13): keys as in the
// int8-key loop above; values through m16n8k32 u8 x u8 tensor cores too:
//   O^T[channel][head hi|lo] += V^T[channel][32 tokens] . P'^T[32 tokens][head hi|lo]
// A (codes): the lane already holds the 4-byte words (16 codes each) of tokens
// 2r, 2r+1, 2r+8, 2r+9 at row byte 4g. Byte gathers (8 PRMT per tile) make
// word k = byte k of the four tokens, and word_k & (3 << 2s per byte) is one A
// register: those four tokens' codes of channel 4g + k + 32s (G = 128 packing),
// times 4^s, undone at the end. One MMA's K dimension is a PAIR of tiles: slots
// 4r..4r+3 are tokens 2r, 2r+1, 2r+8, 2r+9 of the first, slots 16+4r.. of the
// second.
// B (weights): P' = p s (s: the token's value scale) rounded to 16 bits
// against the step's bound S = (largest p of the step) * (largest s), as a
// high and a low byte in the N columns (head 0 hi, head 0 lo, ..., head 3 lo).
// The lane's (token g, token g+8) pair of head r goes through one movmatrix
// (lane (2h+e, r) then holds tokens 2r+8e, 2r+8e+1 of head h), one shuffle
// with the lane holding the other token half, and one PRMT that takes the hi
// (e = 0) or lo (e = 1) bytes in slot order.
// The int32 accumulators start each step at 2^23's float bit pattern: a sum
// 0 <= x < 2^23 (here <= 255 * 192 * 64 = 3.1e6) read back as a float is
// exactly 2^23 + x, so a step folds into the fp32 output with two FADD and two
// FFMA per value: o += S / 65280 * (256 hi + lo). The integer sums are exact;
// the only new error is rounding p s to 16 bits of the step's bound, and the
// min term sum p m stays in fp32 (no all-ones MMA: codes carry no offset).
constexpr float kPQ = 65280.0f;       // 255 * 256: hi and lo bytes both <= 255
constexpr int kAccBias = 0x4B000000;  // 2^23 as float bits
constexpr float kAccBiasF = 8388608.0f;

// x[k] = byte k of w[0..3] (tokens 2r, 2r+1, 2r+8, 2r+9), in token order.
__device__ __forceinline__ void gather_token_bytes(const QuantTile<128, 128>& T, uint32_t (&x)[4]) {
  const uint32_t a = prmt(T.vw[0][0], T.vw[1][0], 0x5140u), b = prmt(T.vw[2][0], T.vw[3][0], 0x5140u);
  const uint32_t c = prmt(T.vw[0][0], T.vw[1][0], 0x7362u), d = prmt(T.vw[2][0], T.vw[3][0], 0x7362u);
  x[0] = prmt(a, b, 0x5410u);
  x[1] = prmt(a, b, 0x7632u);
  x[2] = prmt(c, d, 0x5410u);
  x[3] = prmt(c, d, 0x7632u);
}

// Channel of output o[m][i] in lane row g (G = 128 packing: byte j, shift s
// holds channel j + 32 s), and its code factor 4^s.
__host__ __device__ constexpr int v8_shift(int m, int i) { return 2 * (m & 1) + i; }
__host__ __device__ constexpr int v8_channel(int g, int m, int i) { return 4 * g + (m >> 1) + 32 * v8_shift(m, i); }

// kShift (page centering): pb[u] is tile u's logit shift of head r divided by Q.f (the logits
// here are not yet multiplied by it), added before the softmax.
template <int N, bool kMasked, bool kShift = false>
__device__ __forceinline__ void compute_int8kv_tiles(WarpState2<128>& st, const QuantTile<128, 128> (&T)[N],
                                                     const Int8Query& Q, int g, const float (&pb)[N]) {
  static_assert(N % 2 == 0, "tiles pair up in the MMA's K dimension");
  float s[N][2], vs[N][2], vm[N][2];
#pragma unroll
  for (int u = 0; u < N; ++u) int8k_logits<kMasked>(T[u], Q, g, s[u], vs[u], vm[u]);
  if constexpr (kShift) {
#pragma unroll
    for (int u = 0; u < N; ++u) {
      s[u][0] += pb[u];
      s[u][1] += pb[u];
    }
  }
  const float pmax = softmax_step_lane(st, s, Q.f);
  // The value scales are the same for every head: the bound over the step's
  // tokens is a reduction over the 8 lanes of a column quad (padding slots: 0).
  // A NaN scale (a corrupt cache row) must reach the output as the reference's
  // does, so the maximum propagates NaN (fmaxf would drop it and turn the
  // step's weights into integers of garbage): S = NaN then makes every
  // output channel NaN below.
  float vmax = 0.0f;
#pragma unroll
  for (int u = 0; u < N; ++u) vmax = fmax_nan(vmax, fmax_nan(vs[u][0], vs[u][1]));
  vmax = fmax_nan(vmax, __shfl_xor_sync(0xffffffffu, vmax, 4));
  vmax = fmax_nan(vmax, __shfl_xor_sync(0xffffffffu, vmax, 8));
  vmax = fmax_nan(vmax, __shfl_xor_sync(0xffffffffu, vmax, 16));
  const float S = pmax * vmax;
  // kPQ / S by the approximate reciprocal (v48: no IEEE division and its
  // slow path): a relative error of ~1e-7 in inv only scales the rounded
  // weights, which stay far below 2^16. S below ~2^-112 gives inv = inf, as
  // the division did; the step's weights are then < 2^-112 of the largest so
  // far, and so is their share of the output whatever they round to.
  const float inv = S > 0.0f ? kPQ * fast_rcp(S) : 0.0f;
  const uint32_t bsel = (g & 1) ? 0x2064u : 0x7531u;  // lo bytes (e = 1) / hi bytes (e = 0)
  uint32_t bf[N];
#pragma unroll
  for (int u = 0; u < N; ++u) {
    st.pm += s[u][0] * vm[u][0] + s[u][1] * vm[u][1];
    // Round to an integer by adding 2^23: the low 16 bits are the weight.
    const float f0 = fmaf(s[u][0] * vs[u][0], inv, kAccBiasF);
    const float f1 = fmaf(s[u][1] * vs[u][1], inv, kAccBiasF);
    const uint32_t y = transpose8x8(prmt(__float_as_uint(f0), __float_as_uint(f1), 0x5410u));
    bf[u] = prmt(y, __shfl_xor_sync(0xffffffffu, y, 4), bsel);
  }
  const int kBias[4] = {kAccBias, kAccBias, kAccBias, kAccBias};
  int acc[8][4];
#pragma unroll
  for (int v = 0; v < N / 2; ++v) {
    uint32_t x0[4], x1[4];
    gather_token_bytes(T[2 * v], x0);
    gather_token_bytes(T[2 * v + 1], x1);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int k = m >> 1;
      const uint32_t m0 = 0x03030303u << (2 * v8_shift(m, 0)), m1 = 0x03030303u << (2 * v8_shift(m, 1));
      if (v == 0)
        mma_u8u8(acc[m], x0[k] & m0, x0[k] & m1, x1[k] & m0, x1[k] & m1, bf[0], bf[1], kBias);
      else
        mma_u8u8(acc[m], x0[k] & m0, x0[k] & m1, x1[k] & m0, x1[k] & m1, bf[2 * v], bf[2 * v + 1], acc[m]);
    }
  }
  const float f1 = S * (1.0f / kPQ), f256 = 256.0f * f1;
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float hi = __int_as_float(acc[m][2 * i]) - kAccBiasF;
      const float lo = __int_as_float(acc[m][2 * i + 1]) - kAccBiasF;
      st.o[m][i] = fmaf(hi, f256, fmaf(lo, f1, st.o[m][i]));
    }
}

template <int N, bool kMasked>
__device__ __forceinline__ void compute_int8kv_tiles(WarpState2<128>& st, const QuantTile<128, 128> (&T)[N],
                                                     const Int8Query& Q, int g) {
  const float none[N] = {};
  compute_int8kv_tiles<N, kMasked, false>(st, T, Q, g, none);
}

}  // namespace

}  // namespace oscar::kernels::cuda
