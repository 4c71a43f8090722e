// The row kernel of CPU attention, written once over an ISA "traits" type T
// (lanes W, vector types, loads, fma, table dequantization, exp2) and
// instantiated per ISA by attention_avx512.cpp, attention_avx2.cpp and the
// scalar fallback in attention.cpp. Internal header: the including file
// defines OSCAR_TGT (a target attribute or nothing) and includes this inside
// its own namespace, so each ISA gets its own copy.
//
// Per block of up to kBlock rows (never crossing a page):
//   1. logits s[g][t] = q_g . k_t for all nq queries; each K row is loaded or
//      dequantized once per W-channel chunk and used by every query of the set;
//   2. online softmax in base 2 (queries are pre-scaled by sm_scale*log2 e);
//   3. acc[g] += p[g][t] * v_t, chunk-outer so the nq accumulators of a chunk
//      stay in registers across the block's rows.
// Quantized rows: the chunk of W consecutive channels starting at c0 is W
// code bytes of one group (quant_format.h: byte i%(G/L) holds element i at
// shift B*(i/(G/L))), shifted per lane and mapped through a per-(row, group)
// table — for AVX-512 a 16-entry permute table of m + code*s, so one
// shift + one permute dequantizes 16 channels. When a group's lane run is
// shorter than W (INT2, G = 32: 8 bytes per lane), the 8 bytes are loaded
// twice and the upper 8 lanes use the next shift: still W consecutive channels.
//
// NOTE: no include guard on purpose (included once per ISA namespace).

// Decoding plan of a quantized row for chunk width W.
template <int W>
struct QuantPlan {
  int nch = 0;                    // d / W chunks
  bool dup = false;               // W > bytes per lane run (INT2, G=32, W=16)
  int byte[256];                  // chunk -> first code byte within the row
  int group[256];                 // chunk -> group index
  alignas(64) int32_t shift[256]; // [nch][W] per-lane right shift

  void init(int d, int group_size, int bits) {
    const int lanes = 8 / bits;
    const int per_lane = group_size / lanes;  // bytes per group
    nch = d / W;
    dup = W > per_lane;
    for (int ch = 0; ch < nch; ++ch) {
      const int c0 = ch * W;
      const int g = c0 / group_size, i = c0 % group_size;
      group[ch] = g;
      byte[ch] = g * per_lane + i % per_lane;
      for (int w = 0; w < W; ++w) shift[ch * W + w] = bits * ((i + w) / per_lane);
    }
  }
};

// Contiguous BF16 rows of one page (one KV head): row t at k + t*d.
struct Bf16Run {
  const uint16_t* k;
  const uint16_t* v;
};

// Contiguous f32 rows with a stride (prefill's own chunk).
struct F32Run {
  const float* k;
  const float* v;
  int64_t stride;
};

// Contiguous quantized rows of one page (one KV head).
struct QuantRun {
  const uint8_t* kc;
  const uint8_t* vc;
  const uint16_t* kp;  // [rows][ngroups][2] fp16 (scale, min)
  const uint16_t* vp;
  int code_bytes;
  int ngroups;
};

template <class T, int NQ>
struct RowKernel {
  using F = typename T::F;
  static constexpr int W = T::W;

  // Logits of rows [0, nt) of a block into s[g][t] (t < nt).
  template <class LoadK>
  OSCAR_TGT static inline void logits(const LoadK& load_k, int nt, int d, const float* q,
                                      float (*s)[kBlock]) {
    const int nch = d / W;
    for (int t = 0; t < nt; ++t) {
      F a[NQ];
      for (int g = 0; g < NQ; ++g) a[g] = T::zero();
      for (int ch = 0; ch < nch; ++ch) {
        const F k = load_k(t, ch);
        for (int g = 0; g < NQ; ++g) a[g] = T::fma(T::load(q + g * d + ch * W), k, a[g]);
      }
      for (int g = 0; g < NQ; ++g) s[g][t] = T::reduce_add(a[g]);
    }
  }

  // Online-softmax update of the state from block logits; p[g][t] = weights.
  OSCAR_TGT static inline void softmax(QuerySet& qs, int nt, int key_base, int d, float (*s)[kBlock],
                                       float (*p)[kBlock]) {
    for (int g = 0; g < NQ; ++g) {
      float bm = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < kBlock; ++t) {
        if (t >= nt || (qs.limit && key_base + t > qs.limit[g]))
          s[g][t] = -std::numeric_limits<float>::infinity();
        bm = std::max(bm, s[g][t]);
      }
      if (bm == -std::numeric_limits<float>::infinity()) {
        for (int t = 0; t < kBlock; ++t) p[g][t] = 0.0f;
        continue;
      }
      const float m_new = std::max(qs.m[g], bm);
      const float alpha = std::exp2(qs.m[g] - m_new);  // 0 when m was -inf
      const float sum = T::exp2_block(s[g], m_new, p[g]);
      qs.l[g] = qs.l[g] * alpha + sum;
      qs.m[g] = m_new;
      if (alpha != 1.0f) {
        float* acc = qs.acc + g * d;
        const F av = T::set1(alpha);
        for (int c = 0; c < d; c += W) T::store(acc + c, T::mul(T::load(acc + c), av));
      }
    }
  }

  template <class LoadV>
  OSCAR_TGT static inline void accumulate(const LoadV& load_v, int nt, int d, QuerySet& qs,
                                          float (*p)[kBlock]) {
    const int nch = d / W;
    for (int ch = 0; ch < nch; ++ch) {
      F a[NQ];
      for (int g = 0; g < NQ; ++g) a[g] = T::load(qs.acc + g * d + ch * W);
      for (int t = 0; t < nt; ++t) {
        const F v = load_v(t, ch);
        for (int g = 0; g < NQ; ++g) a[g] = T::fma(T::set1(p[g][t]), v, a[g]);
      }
      for (int g = 0; g < NQ; ++g) T::store(qs.acc + g * d + ch * W, a[g]);
    }
  }

  // Chunk loaders (functors, not lambdas: a lambda would not inherit OSCAR_TGT).
  struct LoadBf16 {
    const uint16_t* base;
    int d;
    OSCAR_TGT F operator()(int t, int ch) const { return T::load_bf16(base + t * d + ch * W); }
  };
  struct LoadF32 {
    const float* base;
    int64_t stride;
    OSCAR_TGT F operator()(int t, int ch) const { return T::load(base + t * stride + ch * W); }
  };
  struct LoadQuant {
    const uint8_t* base;
    int cb, bits;
    const QuantPlan<W>* plan;
    const typename T::Table (*tab)[8];
    OSCAR_TGT F operator()(int t, int ch) const {
      return T::dequant(base + t * cb + plan->byte[ch], plan->dup, plan->shift + ch * W,
                        tab[t][plan->group[ch]], bits);
    }
  };

  OSCAR_TGT static void run(const Bf16Run& run, int n, int key_base, int d, QuerySet& qs) {
    alignas(64) float s[NQ][kBlock];
    alignas(64) float p[NQ][kBlock];
    for (int t0 = 0; t0 < n; t0 += kBlock) {
      const int nt = std::min(kBlock, n - t0);
      logits(LoadBf16{run.k + int64_t(t0) * d, d}, nt, d, qs.q, s);
      softmax(qs, nt, key_base + t0, d, s, p);
      accumulate(LoadBf16{run.v + int64_t(t0) * d, d}, nt, d, qs, p);
    }
  }

  OSCAR_TGT static void run(const F32Run& run, int n, int key_base, int d, QuerySet& qs) {
    alignas(64) float s[NQ][kBlock];
    alignas(64) float p[NQ][kBlock];
    for (int t0 = 0; t0 < n; t0 += kBlock) {
      const int nt = std::min(kBlock, n - t0);
      logits(LoadF32{run.k + t0 * run.stride, run.stride}, nt, d, qs.q, s);
      softmax(qs, nt, key_base + t0, d, s, p);
      accumulate(LoadF32{run.v + t0 * run.stride, run.stride}, nt, d, qs, p);
    }
  }

  OSCAR_TGT static void run(const QuantRun& run, const QuantPlan<W>& plan, int bits, int n,
                            int key_base, int d, QuerySet& qs) {
    alignas(64) float s[NQ][kBlock];
    alignas(64) float p[NQ][kBlock];
    using Table = typename T::Table;
    Table kt[kBlock][8], vt[kBlock][8];  // [row][group], ngroups <= 8
    alignas(64) float kpar[kBlock * 16], vpar[kBlock * 16];
    const int ng = run.ngroups, cb = run.code_bytes;
    for (int t0 = 0; t0 < n; t0 += kBlock) {
      const int nt = std::min(kBlock, n - t0);
      // fp16 (scale, min) of the block's rows -> f32 -> per-(row, group) tables.
      T::f16_to_f32(run.kp + int64_t(t0) * ng * 2, nt * ng * 2, kpar);
      T::f16_to_f32(run.vp + int64_t(t0) * ng * 2, nt * ng * 2, vpar);
      for (int t = 0; t < nt; ++t)
        for (int g = 0; g < ng; ++g) {
          kt[t][g] = T::make_table(kpar[(t * ng + g) * 2], kpar[(t * ng + g) * 2 + 1], bits);
          vt[t][g] = T::make_table(vpar[(t * ng + g) * 2], vpar[(t * ng + g) * 2 + 1], bits);
        }
      logits(LoadQuant{run.kc + int64_t(t0) * cb, cb, bits, &plan, kt}, nt, d, qs.q, s);
      softmax(qs, nt, key_base + t0, d, s, p);
      accumulate(LoadQuant{run.vc + int64_t(t0) * cb, cb, bits, &plan, vt}, nt, d, qs, p);
    }
  }
};

// Region rows: walk the pages of [i0, i1) and run each page's contiguous rows.
template <class T, int NQ>
OSCAR_TGT void region_rows_nq(const RegionRows& rr, QuerySet& qs) {
  const kv::PagedKvView& kv = *rr.kv;
  const int d = kv.head_dim, ps = kv.page_size;
  QuantPlan<T::W> plan;
  if (rr.quantized) plan.init(d, kv.group_size, kv.bits);
  for (int i = rr.i0; i < rr.i1;) {
    const int32_t page = rr.r->indices[rr.r->indptr[rr.b] + i / ps];
    const int slot = i % ps;
    const int n = std::min(ps - slot, rr.i1 - i);
    const int key_base = rr.key_base + (i - rr.i0);
    if (rr.quantized) {
      const int64_t row = kv.quant_row_index(page, rr.h, slot);
      const int cb = kv.row_code_bytes(), ng = kv.row_groups();
      const QuantRun run{kv.quant.k_codes + row * cb, kv.quant.v_codes + row * cb,
                         kv.quant.k_params + row * ng * 2, kv.quant.v_params + row * ng * 2, cb, ng};
      RowKernel<T, NQ>::run(run, plan, kv.bits, n, key_base, d, qs);
    } else {
      const int64_t off = kv.bf16_row_offset(page, rr.h, slot);
      RowKernel<T, NQ>::run(Bf16Run{kv.bf16.k + off, kv.bf16.v + off}, n, key_base, d, qs);
    }
    i += n;
  }
}

template <class T, int NQ>
OSCAR_TGT void dense_rows_nq(const DenseRows& dr, int d, QuerySet& qs) {
  RowKernel<T, NQ>::run(F32Run{dr.k, dr.v, dr.stride}, dr.n, dr.key_base, d, qs);
}

template <class T>
OSCAR_TGT void region_rows(const RegionRows& rr, QuerySet& qs) {
  switch (qs.nq) {
    case 1: return region_rows_nq<T, 1>(rr, qs);
    case 2: return region_rows_nq<T, 2>(rr, qs);
    case 3: return region_rows_nq<T, 3>(rr, qs);
    case 4: return region_rows_nq<T, 4>(rr, qs);
    case 5: return region_rows_nq<T, 5>(rr, qs);
    case 6: return region_rows_nq<T, 6>(rr, qs);
    case 7: return region_rows_nq<T, 7>(rr, qs);
    case 8: return region_rows_nq<T, 8>(rr, qs);
    default: throw Error("attention: query set of " + std::to_string(qs.nq) + " (1..8)");
  }
}

template <class T>
OSCAR_TGT void dense_rows(const DenseRows& dr, int d, QuerySet& qs) {
  switch (qs.nq) {
    case 1: return dense_rows_nq<T, 1>(dr, d, qs);
    case 2: return dense_rows_nq<T, 2>(dr, d, qs);
    case 3: return dense_rows_nq<T, 3>(dr, d, qs);
    case 4: return dense_rows_nq<T, 4>(dr, d, qs);
    case 5: return dense_rows_nq<T, 5>(dr, d, qs);
    case 6: return dense_rows_nq<T, 6>(dr, d, qs);
    case 7: return dense_rows_nq<T, 7>(dr, d, qs);
    case 8: return dense_rows_nq<T, 8>(dr, d, qs);
    default: throw Error("attention: query set of " + std::to_string(qs.nq) + " (1..8)");
  }
}
