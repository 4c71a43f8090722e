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
// Per-channel keys (KIVI, paged_kv.h KeyAxis::kChannel): the middle is walked
// span by span (kKeySpan slots); per span the query is transformed once,
// q'_c = q_c * scale_c, bias = sum_c q_c * min_c, and the same quantized-key
// loop runs on q' with the unit table (code -> code); the bias is added to the
// logits. Values stay per-token rows. See RowKernel::run_kchan_impl.
//
// NOTE: no include guard on purpose (included once per ISA namespace).

// Decoding plan of a quantized row for chunk width W. A "window" is W code
// bytes (or 8 bytes twice when dup) loaded and widened once; each of its
// chunks is one shift of it = W consecutive channels starting at c0.
template <int W>
struct QuantPlan {
  int nch = 0;                     // d / W chunks, listed window by window
  int nwin = 0;
  bool dup = false;                // W > bytes per lane run (INT2, G=32, W=16)
  int wbyte[256] = {};                // window -> first code byte within the row
  int wfirst[257] = {};               // window -> its chunks [wfirst[w], wfirst[w+1])
  int byte[256] = {};                 // chunk -> its window's first byte
  int c0[256] = {};                   // chunk -> first channel
  int group[256] = {};                // chunk -> group index
  bool noshift[256] = {};             // chunk -> all shifts are 0
  alignas(64) int32_t shift[256] = {};  // [nch][W] per-lane right shift

  constexpr void init(int d, int group_size, int bits) {
    const int lanes = 8 / bits;
    const int per_lane = group_size / lanes;  // bytes per group
    dup = W > per_lane;
    nch = nwin = 0;
    auto add_chunk = [&](int first_channel, int window_byte, int shift_lo, int shift_hi) {
      c0[nch] = first_channel;
      byte[nch] = window_byte;
      group[nch] = first_channel / group_size;
      noshift[nch] = shift_lo == 0 && shift_hi == 0;
      for (int w = 0; w < W; ++w) shift[nch * W + w] = w < W / 2 || W == 1 ? shift_lo : shift_hi;
      ++nch;
    };
    for (int g = 0; g < d / group_size; ++g) {
      if (dup) {  // 8 bytes: lanes (0,1) then (2,3), 16 channels each
        wbyte[nwin] = g * per_lane;
        wfirst[nwin] = nch;
        for (int q = 0; q < lanes; q += 2)
          add_chunk(g * group_size + q * per_lane, wbyte[nwin], bits * q, bits * (q + 1));
        ++nwin;
        continue;
      }
      for (int o = 0; o < per_lane; o += W) {
        wbyte[nwin] = g * per_lane + o;
        wfirst[nwin] = nch;
        for (int q = 0; q < lanes; ++q)
          add_chunk(g * group_size + q * per_lane + o, wbyte[nwin], bits * q, bits * q);
        ++nwin;
      }
    }
    wfirst[nwin] = nch;
  }
};

template <int W>
constexpr QuantPlan<W> make_plan(int d, int group_size, int bits) {
  QuantPlan<W> p{};
  p.init(d, group_size, bits);
  return p;
}

// Contiguous BF16 rows of one page (one KV head): row t at k + t*d.
struct Bf16Run {
  const uint16_t* k;
  const uint16_t* v;
};


// Dense f32 rows whose keys are pre-transposed in blocks of kBlock rows:
// kt[block][d][kBlock] (rows past the end zero), values row-major with a stride.
struct F32TRun {
  const float* kt;
  const float* v;
  int64_t vstride;
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

  // Per-row partial sums red[g][t] (W lanes) -> logits s[g][t]; rows t >= nt
  // are zeroed first (their logits are masked to -inf by softmax anyway).
  OSCAR_TGT static inline void reduce(F (*red)[kBlock], int nt, float (*s)[kBlock]) {
    for (int g = 0; g < NQ; ++g) {
      for (int t = nt; t < kBlock; ++t) red[g][t] = T::zero();
      T::reduce_rows(red[g], s[g]);
    }
  }

  // Logits of rows [0, nt) of a block into s[g][t] (t < nt).
  template <class LoadK>
  OSCAR_TGT static inline void logits(const LoadK& load_k, int nt, int d, const float* q,
                                      float (*s)[kBlock]) {
    const int nch = d / W;
    F red[NQ][kBlock];
    for (int t = 0; t < nt; ++t) {
      F a[NQ];
      for (int g = 0; g < NQ; ++g) a[g] = T::zero();
      for (int ch = 0; ch < nch; ++ch) {
        const F k = load_k(t, ch);
        for (int g = 0; g < NQ; ++g) a[g] = T::fma(T::load(q + g * d + ch * W), k, a[g]);
      }
      for (int g = 0; g < NQ; ++g) red[g][t] = a[g];
    }
    reduce(red, nt, s);
  }

  // Quantized keys: each window of code bytes is widened once and shifted per
  // lane into its chunks (DESIGN §3.5: codes dequantized in registers, shared
  // by the nq queries).
  OSCAR_TGT static inline void logits_quant(const uint8_t* base, int cb, const QuantPlan<W>& plan,
                                            const typename T::Table (*tab)[8], int bits, int nt, int d,
                                            const float* q, float (*s)[kBlock]) {
    F red[NQ][kBlock];
    for (int t = 0; t < nt; ++t) {
      F a[NQ];
      for (int g = 0; g < NQ; ++g) a[g] = T::zero();
      const uint8_t* row = base + t * cb;
#pragma GCC unroll 16
      for (int w = 0; w < plan.nwin; ++w) {
        const auto x = T::load_window(row + plan.wbyte[w], plan.dup);
#pragma GCC unroll 4
        for (int ch = plan.wfirst[w]; ch < plan.wfirst[w + 1]; ++ch) {
          const F k = T::dequant_x(x, plan.shift + ch * W, plan.noshift[ch], tab[t][plan.group[ch]], bits);
          const float* qc = q + plan.c0[ch];
          for (int g = 0; g < NQ; ++g) a[g] = T::fma(T::load(qc + g * d), k, a[g]);
        }
      }
      for (int g = 0; g < NQ; ++g) red[g][t] = a[g];
    }
    reduce(red, nt, s);
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
      // The running max rarely moves after the first blocks: skip the exp2.
      const float alpha = m_new == qs.m[g] ? 1.0f : std::exp2(qs.m[g] - m_new);  // 0 when m was -inf
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
      const int c0 = load_v.channel(ch);
      F a[NQ];
      for (int g = 0; g < NQ; ++g) a[g] = T::load(qs.acc + g * d + c0);
      for (int t = 0; t < nt; ++t) {
        const F v = load_v(t, ch);
        for (int g = 0; g < NQ; ++g) a[g] = T::fma(T::set1(p[g][t]), v, a[g]);
      }
      for (int g = 0; g < NQ; ++g) T::store(qs.acc + g * d + c0, a[g]);
    }
  }

  // Quantized values: chunk-outer so the nq accumulators stay in registers
  // across the block's rows.
  OSCAR_TGT static inline void accumulate_quant(const uint8_t* base, int cb, const QuantPlan<W>& plan,
                                                const typename T::Table (*tab)[8], int bits, int nt, int d,
                                                QuerySet& qs, float (*p)[kBlock]) {
    if constexpr (NQ <= 4 && W > 1) {
      // Window-outer: widen each window of code bytes once for all its chunks
      // (up to 4 chunks x NQ accumulators = 16 registers).
#pragma GCC unroll 16
      for (int w = 0; w < plan.nwin; ++w) {
        const int ch0 = plan.wfirst[w], nc = plan.wfirst[w + 1] - ch0;
        if (nc > 4) break;  // not expected (<= 8/bits chunks per window)
        F a[4][NQ];
        for (int c = 0; c < 4; ++c)
          for (int g = 0; g < NQ; ++g) a[c][g] = T::zero();
#pragma GCC unroll 4
        for (int c = 0; c < nc; ++c)
          for (int g = 0; g < NQ; ++g) a[c][g] = T::load(qs.acc + g * d + plan.c0[ch0 + c]);
        const uint8_t* src = base + plan.wbyte[w];
        for (int t = 0; t < nt; ++t) {
          const auto x = T::load_window(src + t * cb, plan.dup);
#pragma GCC unroll 4
          for (int c = 0; c < nc; ++c) {
            const int ch = ch0 + c;
            const F v = T::dequant_x(x, plan.shift + ch * W, plan.noshift[ch], tab[t][plan.group[ch]], bits);
            for (int g = 0; g < NQ; ++g) a[c][g] = T::fma(T::set1(p[g][t]), v, a[c][g]);
          }
        }
#pragma GCC unroll 4
        for (int c = 0; c < nc; ++c)
          for (int g = 0; g < NQ; ++g) T::store(qs.acc + g * d + plan.c0[ch0 + c], a[c][g]);
      }
      return;
    }
#pragma GCC unroll 16
    for (int ch = 0; ch < plan.nch; ++ch) {
      const int c0 = plan.c0[ch];
      F a[NQ];
      for (int g = 0; g < NQ; ++g) a[g] = T::load(qs.acc + g * d + c0);
      const uint8_t* src = base + plan.byte[ch];
      for (int t = 0; t < nt; ++t) {
        const F v = T::dequant_x(T::load_window(src + t * cb, plan.dup), plan.shift + ch * W, plan.noshift[ch],
                                 tab[t][plan.group[ch]], bits);
        for (int g = 0; g < NQ; ++g) a[g] = T::fma(T::set1(p[g][t]), v, a[g]);
      }
      for (int g = 0; g < NQ; ++g) T::store(qs.acc + g * d + c0, a[g]);
    }
  }

  // Chunk loaders (functors, not lambdas: a lambda would not inherit OSCAR_TGT).
  struct LoadBf16 {
    const uint16_t* base;
    int d;
    OSCAR_TGT F operator()(int t, int ch) const { return T::load_bf16(base + t * d + ch * W); }
    int channel(int ch) const { return ch * W; }
  };
  struct LoadF32 {
    const float* base;
    int64_t stride;
    OSCAR_TGT F operator()(int t, int ch) const { return T::load(base + t * stride + ch * W); }
    int channel(int ch) const { return ch * W; }
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

  // Transposed keys: logits of kBlock rows at once with rows in lanes, one
  // broadcast query element per FMA and no horizontal reductions (prefill).
  OSCAR_TGT static void run(const F32TRun& run, int n, int key_base, int d, QuerySet& qs) {
    alignas(64) float s[NQ][kBlock];
    alignas(64) float p[NQ][kBlock];
    for (int t0 = 0; t0 < n; t0 += kBlock) {
      const int nt = std::min(kBlock, n - t0);
      const float* kb = run.kt + int64_t(t0 / kBlock) * d * kBlock;
      for (int h0 = 0; h0 < kBlock; h0 += W) {
        F a[NQ];
        for (int g = 0; g < NQ; ++g) a[g] = T::zero();
        for (int c = 0; c < d; ++c) {
          const F k = T::load(kb + c * kBlock + h0);
          for (int g = 0; g < NQ; ++g) a[g] = T::fma(T::set1(qs.q[g * d + c]), k, a[g]);
        }
        for (int g = 0; g < NQ; ++g) T::store(s[g] + h0, a[g]);
      }
      softmax(qs, nt, key_base + t0, d, s, p);
      accumulate(LoadF32{run.v + t0 * run.vstride, run.vstride}, nt, d, qs, p);
    }
  }


  // Quantized rows; with a compile-time plan (run_fixed) the window/chunk
  // loops unroll and every index folds to a constant.
  // shift (page centering, optional): [NQ] added to every logit of query g.
  __attribute__((always_inline)) OSCAR_TGT static inline void run_quant(const QuantRun& run,
                                                                         const QuantPlan<W>& plan, int bits,
                                                                         int n, int key_base, int d, QuerySet& qs,
                                                                         const float* shift) {
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
      logits_quant(run.kc + int64_t(t0) * cb, cb, plan, kt, bits, nt, d, qs.q, s);
      if (shift)
        for (int g = 0; g < NQ; ++g)
          for (int t = 0; t < nt; ++t) s[g][t] += shift[g];
      softmax(qs, nt, key_base + t0, d, s, p);
      accumulate_quant(run.vc + int64_t(t0) * cb, cb, plan, vt, bits, nt, d, qs, p);
    }
  }

  OSCAR_TGT static void run(const QuantRun& run, const QuantPlan<W>& plan, int bits, int n, int key_base,
                            int d, QuerySet& qs, const float* shift = nullptr) {
    run_quant(run, plan, bits, n, key_base, d, qs, shift);
  }

  template <int D, int G, int BITS>
  OSCAR_TGT static void run_fixed(const QuantRun& run, int n, int key_base, QuerySet& qs,
                                  const float* shift = nullptr) {
    static constexpr QuantPlan<W> plan = make_plan<W>(D, G, BITS);
    QuantRun r = run;
    r.code_bytes = D * BITS / 8;
    r.ngroups = D / G;
    run_quant(r, plan, BITS, n, key_base, D, qs, shift);
  }

  // Per-channel keys (paged_kv.h, KeyAxis::kChannel): rows [0, n) of ONE span
  // of kKeySpan slots, whose keys share the per-channel (scale, min) pairs
  // kspan [d][2] fp16. With q'_c = q_c * scale_c and b = sum_c q_c * min_c,
  // the logit of row t is q' . code_t + b: the quantized-key loop above runs
  // on q' (computed once per span) with the unit table code -> code, and b is
  // added to every logit of the query. Values are per-token rows as usual.
  // (run.kp is not read.)
  __attribute__((always_inline)) OSCAR_TGT static inline void run_kchan_impl(const QuantRun& run,
                                                                              const uint16_t* kspan,
                                                                              const QuantPlan<W>& plan, int bits,
                                                                              int n, int key_base, int d,
                                                                              QuerySet& qs) {
    alignas(64) float s[NQ][kBlock];
    alignas(64) float p[NQ][kBlock];
    alignas(64) float par[512], sc[256], mn[256];  // d <= 256
    alignas(64) float qk[NQ * 256];
    float bias[NQ];
    T::f16_to_f32(kspan, 2 * d, par);
    for (int c = 0; c < d; ++c) {
      sc[c] = par[2 * c];
      mn[c] = par[2 * c + 1];
    }
    for (int g = 0; g < NQ; ++g) {
      F b = T::zero();
      for (int c = 0; c < d; c += W) {
        const F qv = T::load(qs.q + g * d + c);
        T::store(qk + g * d + c, T::mul(qv, T::load(sc + c)));
        b = T::fma(qv, T::load(mn + c), b);
      }
      bias[g] = T::reduce_add(b);
    }
    using Table = typename T::Table;
    Table kt[kBlock][8], vt[kBlock][8];  // [row][group], ngroups <= 8
    const Table unit = T::make_table(1.0f, 0.0f, bits);
    for (int t = 0; t < kBlock; ++t)
      for (int g = 0; g < 8; ++g) kt[t][g] = unit;
    alignas(64) float vpar[kBlock * 16];
    const int ng = run.ngroups, cb = run.code_bytes;
    for (int t0 = 0; t0 < n; t0 += kBlock) {
      const int nt = std::min(kBlock, n - t0);
      T::f16_to_f32(run.vp + int64_t(t0) * ng * 2, nt * ng * 2, vpar);
      for (int t = 0; t < nt; ++t)
        for (int g = 0; g < ng; ++g) vt[t][g] = T::make_table(vpar[(t * ng + g) * 2], vpar[(t * ng + g) * 2 + 1], bits);
      logits_quant(run.kc + int64_t(t0) * cb, cb, plan, kt, bits, nt, d, qk, s);
      for (int g = 0; g < NQ; ++g)
        for (int t = 0; t < nt; ++t) s[g][t] += bias[g];
      softmax(qs, nt, key_base + t0, d, s, p);
      accumulate_quant(run.vc + int64_t(t0) * cb, cb, plan, vt, bits, nt, d, qs, p);
    }
  }

  OSCAR_TGT static void run_kchan(const QuantRun& run, const uint16_t* kspan, const QuantPlan<W>& plan, int bits,
                                  int n, int key_base, int d, QuerySet& qs) {
    run_kchan_impl(run, kspan, plan, bits, n, key_base, d, qs);
  }

  template <int D, int G, int BITS>
  OSCAR_TGT static void run_kchan_fixed(const QuantRun& run, const uint16_t* kspan, int n, int key_base,
                                        QuerySet& qs) {
    static constexpr QuantPlan<W> plan = make_plan<W>(D, G, BITS);
    QuantRun r = run;
    r.code_bytes = D * BITS / 8;
    r.ngroups = D / G;
    run_kchan_impl(r, kspan, plan, BITS, n, key_base, D, qs);
  }
};

// Software prefetch into L2 of [p, p + bytes), one request per 64-byte line.
inline void prefetch_bytes(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

// Region rows: walk the pages of [i0, i1) and run each page's contiguous rows.
template <class T, int NQ>
OSCAR_TGT void region_rows_nq(const RegionRows& rr, QuerySet& qs) {
  const kv::PagedKvView& kv = *rr.kv;
  const int d = kv.head_dim, ps = kv.page_size;
  // Runtime plan only for formats without a compile-time one (see below).
  const bool kchan = kv.key_axis == kv::KeyAxis::kChannel;
  const bool fixed =
      kv.bits == 2 && (kchan ? (kv.group_size == 32 && (d == 128 || d == 64))
                             : ((d == 128 && kv.group_size == 128) || (d == 64 && kv.group_size == 64) ||
                                (d == 256 && kv.group_size == 128)));
  static thread_local QuantPlan<T::W> plan;
  if (rr.quantized && !fixed) plan.init(d, kv.group_size, kv.bits);
  for (int i = rr.i0; i < rr.i1;) {
    const int32_t page = rr.r->indices[rr.r->indptr[rr.b] + i / ps];
    const int slot = i % ps;
    const int n = std::min(ps - slot, rr.i1 - i);
    const int key_base = rr.key_base + (i - rr.i0);
    if (i + n < rr.i1) {
      // Pages are scattered in the pool, so the hardware prefetcher restarts
      // at every page: fetch the next page's rows (this head) while this one runs.
      const int32_t next = rr.r->indices[rr.r->indptr[rr.b] + (i + n) / ps];
      const int nn = std::min(ps, rr.i1 - i - n);
      if (rr.quantized) {
        const int64_t row = kv.quant_row_index(next, rr.h, 0);
        const int cb = kv.row_code_bytes(), pb = kv.row_groups() * 4;
        prefetch_bytes(kv.quant.k_codes + row * cb, int64_t(nn) * cb);
        prefetch_bytes(kv.quant.v_codes + row * cb, int64_t(nn) * cb);
        if (kchan)
          prefetch_bytes(reinterpret_cast<const uint8_t*>(kv.quant.k_params + kv.key_span_params_offset(next, rr.h, 0)),
                         int64_t((nn + kv::kKeySpan - 1) / kv::kKeySpan) * d * 4);
        else
          prefetch_bytes(reinterpret_cast<const uint8_t*>(kv.quant.k_params) + row * pb, int64_t(nn) * pb);
        prefetch_bytes(reinterpret_cast<const uint8_t*>(kv.quant.v_params) + row * pb, int64_t(nn) * pb);
      } else {
        const int64_t off = kv.bf16_row_offset(next, rr.h, 0);
        prefetch_bytes(reinterpret_cast<const uint8_t*>(kv.bf16.k + off), int64_t(nn) * d * 2);
        prefetch_bytes(reinterpret_cast<const uint8_t*>(kv.bf16.v + off), int64_t(nn) * d * 2);
      }
    }
    if (rr.quantized && kchan) {
      // Per-channel keys: one call per span of kKeySpan slots (its own params).
      const int cb = kv.row_code_bytes(), ng = kv.row_groups();
      for (int j = 0; j < n;) {
        const int sl = slot + j;
        const int nn = std::min(n - j, kv::kKeySpan - sl % kv::kKeySpan);
        const int64_t row = kv.quant_row_index(page, rr.h, sl);
        const QuantRun run{kv.quant.k_codes + row * cb, kv.quant.v_codes + row * cb, nullptr,
                           kv.quant.v_params + row * ng * 2, cb, ng};
        const uint16_t* ksp = kv.quant.k_params + kv.key_span_params_offset(page, rr.h, sl);
        if (kv.bits == 2 && d == 128 && kv.group_size == 32)
          RowKernel<T, NQ>::template run_kchan_fixed<128, 32, 2>(run, ksp, nn, key_base + j, qs);
        else if (kv.bits == 2 && d == 64 && kv.group_size == 32)
          RowKernel<T, NQ>::template run_kchan_fixed<64, 32, 2>(run, ksp, nn, key_base + j, qs);
        else
          RowKernel<T, NQ>::run_kchan(run, ksp, plan, kv.bits, nn, key_base + j, d, qs);
        j += nn;
      }
    } else if (rr.quantized) {
      const int64_t row = kv.quant_row_index(page, rr.h, slot);
      const int cb = kv.row_code_bytes(), ng = kv.row_groups();
      const QuantRun run{kv.quant.k_codes + row * cb, kv.quant.v_codes + row * cb,
                         kv.quant.k_params + row * ng * 2, kv.quant.v_params + row * ng * 2, cb, ng};
      // Page centering: this page's shifts (one run never crosses a page).
      const float* shift = rr.page_shift(i);
      // The default formats get compile-time plans; the rest the runtime one.
      if (kv.bits == 2 && d == 128 && kv.group_size == 128)
        RowKernel<T, NQ>::template run_fixed<128, 128, 2>(run, n, key_base, qs, shift);
      else if (kv.bits == 2 && d == 64 && kv.group_size == 64)
        RowKernel<T, NQ>::template run_fixed<64, 64, 2>(run, n, key_base, qs, shift);
      else if (kv.bits == 2 && d == 256 && kv.group_size == 128)
        RowKernel<T, NQ>::template run_fixed<256, 128, 2>(run, n, key_base, qs, shift);
      else
        RowKernel<T, NQ>::run(run, plan, kv.bits, n, key_base, d, qs, shift);
    } else {
      const int64_t off = kv.bf16_row_offset(page, rr.h, slot);
      RowKernel<T, NQ>::run(Bf16Run{kv.bf16.k + off, kv.bf16.v + off}, n, key_base, d, qs);
    }
    i += n;
  }
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

template <class T, int NQ>
OSCAR_TGT void dense_t_rows_nq(const DenseTRows& dr, int d, QuerySet& qs) {
  RowKernel<T, NQ>::run(F32TRun{dr.kt, dr.v, dr.vstride}, dr.n, dr.key_base, d, qs);
}

template <class T>
OSCAR_TGT void dense_t_rows(const DenseTRows& dr, int d, QuerySet& qs) {
  switch (qs.nq) {
    case 1: return dense_t_rows_nq<T, 1>(dr, d, qs);
    case 2: return dense_t_rows_nq<T, 2>(dr, d, qs);
    case 3: return dense_t_rows_nq<T, 3>(dr, d, qs);
    case 4: return dense_t_rows_nq<T, 4>(dr, d, qs);
    case 5: return dense_t_rows_nq<T, 5>(dr, d, qs);
    case 6: return dense_t_rows_nq<T, 6>(dr, d, qs);
    case 7: return dense_t_rows_nq<T, 7>(dr, d, qs);
    case 8: return dense_t_rows_nq<T, 8>(dr, d, qs);
    default: throw Error("attention: query set of " + std::to_string(qs.nq) + " (1..8)");
  }
}

