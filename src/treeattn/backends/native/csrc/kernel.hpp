// The tree-attention work item, written once against a vector type `V` of V::W fp32 lanes.
//
// Included by each ISA's translation unit inside its own namespace, after it defines `V`. Every
// computation is vectorised over query rows: Q is packed transposed and pre-scaled (Q^T [d][rows]),
// so scores S^T[key][rows] = sum_k K[key][k] * Q^T[k][rows] broadcast one key element at a time,
// softmax statistics are plain per-lane vectors, and O^T[dv][rows] += V[key][dv] * P^T[key][rows]
// the same way. K and V are read from any layout (through element strides and the page table) into
// a contiguous fp32 tile once for all T x group rows of their head; no transpose is ever made.

// ------------------------------------------------------------------ scalar conversions
static inline float bits_to_float(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }

static inline float bf16_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

static inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  const uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // NaN stays NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
  const float sub = float(man) * (1.0f / 16777216.0f);  // subnormal: man * 2^-24
  return sign ? -sub : sub;
}

static inline uint16_t float_to_half(float f) {  // round to nearest even
  const uint32_t u = float_to_bits(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflows to inf (from 65520 up)
  if (a < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    const float scaled = bits_to_float(a) * 16777216.0f;  // in units of 2^-24, exact
    uint32_t m = uint32_t(scaled);
    const float rest = scaled - float(m);
    if (rest > 0.5f || (rest == 0.5f && (m & 1u))) ++m;
    return uint16_t(sign | m);
  }
  const uint32_t r = a + 0x0fffu + ((a >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15, round
  return uint16_t(sign | (r >> 13));
}

static inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// n elements of base (from element offset off) into fp32 dst.
static inline void load_row(const void* base, int32_t dtype, int64_t off, int64_t n, float* dst) {
  if (dtype == F32) {
    const float* src = static_cast<const float*>(base) + off;
    int64_t e = 0;
    for (; e + V::W <= n; e += V::W) V::store(dst + e, V::load(src + e));
    for (; e < n; ++e) dst[e] = src[e];
  } else if (dtype == BF16) {
    V::widen_bf16(static_cast<const uint16_t*>(base) + off, dst, n);
  } else {
    V::widen_f16(static_cast<const uint16_t*>(base) + off, dst, n);
  }
}

// n values `stride` elements apart from element offset off, as fp32: a key of a dims-major K (Problem::k_dim).
static inline void load_strided(const void* base, int32_t dtype, int64_t off, int64_t n, int64_t stride, float* dst) {
  if (stride == 1) return load_row(base, dtype, off, n, dst);
  const float* f = static_cast<const float*>(base) + off;
  const uint16_t* h = static_cast<const uint16_t*>(base) + off;
  for (int64_t e = 0; e < n; ++e)
    dst[e] = dtype == F32 ? f[e * stride] : dtype == BF16 ? bf16_to_float(h[e * stride]) : half_to_float(h[e * stride]);
}

// dst[c * dst_ld + r] = src[r * src_ld + c] for r < rows, c < cols: defined by each translation unit (x86.hpp
// in 8 x 8 blocks of vector registers, kernel_generic.cpp one value at a time).
static void transpose_block(const float* src, int64_t src_ld, int64_t rows, int64_t cols, float* dst, int64_t dst_ld);

// n fp32 values into base (from element offset off), rounded to dtype.
static inline void store_row(void* base, int32_t dtype, int64_t off, int64_t n, const float* src) {
  if (dtype == F32) {
    float* dst = static_cast<float*>(base) + off;
    for (int64_t e = 0; e < n; ++e) dst[e] = src[e];
  } else if (dtype == BF16) {
    uint16_t* dst = static_cast<uint16_t*>(base) + off;
    for (int64_t e = 0; e < n; ++e) dst[e] = float_to_bf16(src[e]);
  } else {
    uint16_t* dst = static_cast<uint16_t*>(base) + off;
    for (int64_t e = 0; e < n; ++e) dst[e] = float_to_half(src[e]);
  }
}

// True when every value of the row is finite (0 * x is NaN exactly for inf and NaN).
static inline bool all_finite(const float* row, int64_t n) {
  typename V::T acc = V::zero();
  int64_t e = 0;
  for (; e + V::W <= n; e += V::W) acc = V::add(acc, V::mul(V::load(row + e), V::zero()));
  float lanes[V::W], sum = 0.0f;
  V::store(lanes, acc);
  for (int i = 0; i < V::W; ++i) sum += lanes[i];
  for (; e < n; ++e) sum += row[e] * 0.0f;
  return sum == 0.0f;
}

// Whether a stored row of n values of dtype holds an inf or NaN (all exponent bits set). No early exit:
// the loops vectorise (value by value, the test took a fifth of a 16-bit prefill's time outside the GEMMs).
static bool nonfinite_row(const char* row, int32_t dtype, int64_t n) {
  if (dtype == F32) {
    uint32_t bad = 0;
    for (int64_t e = 0; e < n; ++e) {
      uint32_t u;
      __builtin_memcpy(&u, row + 4 * e, 4);
      bad |= (u & 0x7f800000u) == 0x7f800000u;
    }
    return bad;
  }
  const uint16_t exp = dtype == BF16 ? 0x7f80u : 0x7c00u;
  uint16_t bad = 0;
  for (int64_t e = 0; e < n; ++e) {
    uint16_t u;
    __builtin_memcpy(&u, row + 2 * e, 2);
    bad |= (u & exp) == exp;
  }
  return bad;
}

// tanh(x) as Eigen's rational approximation (odd degree 13 over even degree 6 on [-7.9988, 7.9988], where
// float tanh reaches +-1 to a few ulp): within 3.5e-7 of tanh everywhere (checked against float64), a
// dozen FMAs and one division per 8 scores, against 2 x d FMAs per score for Q.K and P.V. NaN stays NaN
// (the clamps return their second operand for a NaN); +-inf gives +-1.
static inline typename V::T tanh_approx(typename V::T x) {
  x = V::max(V::set1(-7.99881172180175781f), V::min(V::set1(7.99881172180175781f), x));
  const typename V::T x2 = V::mul(x, x);
  typename V::T num = V::fma(x2, V::set1(-2.76076847742355e-16f), V::set1(2.00018790482477e-13f));
  num = V::fma(x2, num, V::set1(-8.60467152213735e-11f));
  num = V::fma(x2, num, V::set1(5.12229709037114e-08f));
  num = V::fma(x2, num, V::set1(1.48572235717979e-05f));
  num = V::fma(x2, num, V::set1(6.37261928875436e-04f));
  num = V::fma(x2, num, V::set1(4.89352455891786e-03f));
  typename V::T den = V::fma(x2, V::set1(1.19825839466702e-06f), V::set1(1.18534705686654e-04f));
  den = V::fma(x2, den, V::set1(2.26843463243900e-03f));
  den = V::fma(x2, den, V::set1(4.89352518554385e-03f));
  return V::div(V::mul(x, num), den);
}

// ------------------------------------------------------------------ micro-kernels
// Row-indexed buffers (Q^T, S^T/P^T, masks, O^T) are stored as panels of W = RV x V::W rows: panel
// [X][W] for X = d, keys or dv, so a micro-kernel's rows are contiguous and stay in L1 (a plain
// [X][rows] layout puts consecutive X a multiple of 1 KiB apart, and they evict each other).

// acc[r][k] += sum_c a[r * as + c] * b[c * bs + k * W], c < n: NR rows of `a` against rows of `b`, a
// vector each, one row of b loaded once for every row of a; the NR * KB accumulators are independent
// chains (one row's would wait on the FMA latency). The scores of a dims-major K (a = Q, b = K^T: keys in
// the lanes) and the P V product (a = P, b = V) are both this (and the FMA kernel's S^T panels, qk_block).
template <int NR, int KB>
__attribute__((always_inline)) static inline void rank1_rows(const float* a, int64_t as, const float* b, int64_t bs,
                                                              int64_t n, typename V::T (&acc)[NR][KB]) {
  for (int64_t c = 0; c < n; ++c) {
    typename V::T bv[KB];
    for (int k = 0; k < KB; ++k) bv[k] = V::load(b + c * bs + k * V::W);
    for (int r = 0; r < NR; ++r) {
      const typename V::T ac = V::bcast(a + r * as + c);
      for (int k = 0; k < KB; ++k) acc[r][k] = V::fma(ac, bv[k], acc[r][k]);
    }
  }
}

// S^T panel rows i0 .. i0 + NB: NB keys x RV vectors of accumulators, one broadcast key element each.
template <int NB, int RV>
static inline void qk_block(const float* kt, int64_t d, const float* qt, float* s) {
  constexpr int W = RV * V::W;
  typename V::T acc[NB][RV];
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < RV; ++j) acc[i][j] = V::zero();
  rank1_rows<NB, RV>(kt, d, qt, W, d, acc);
  for (int i = 0; i < NB; ++i)
    for (int j = 0; j < RV; ++j) V::store(s + i * W + j * V::W, acc[i][j]);
}

// O^T[c0 + i] = alpha * O^T[c0 + i] + sum_n V[n][c0 + i] * P^T[n] on one panel (V rows vs apart: dv, or
// d when V is read from the K tile). MASKED (tiles holding keys some rows cannot see):
// a key a row cannot see is dropped with a bit mask, so a NaN/inf in it cannot reach the row
// (0 * NaN would).
template <int DB, int RV, bool MASKED>
static inline void pv_block(const float* vt, int64_t vs, int64_t c0, const float* p, const float* mask,
                            int64_t count, const float* alpha, float* ot) {
  constexpr int W = RV * V::W;
  typename V::T acc[DB][RV];
  for (int j = 0; j < RV; ++j) {
    const typename V::T a = V::load(alpha + j * V::W);
    for (int i = 0; i < DB; ++i) acc[i][j] = V::mul(V::load(ot + (c0 + i) * W + j * V::W), a);
  }
  for (int64_t n = 0; n < count; ++n) {
    typename V::T pr[RV];
    for (int j = 0; j < RV; ++j) pr[j] = V::load(p + n * W + j * V::W);
    for (int i = 0; i < DB; ++i) {
      const typename V::T b = V::bcast(vt + n * vs + c0 + i);
      for (int j = 0; j < RV; ++j) {
        if (MASKED) acc[i][j] = V::add(acc[i][j], V::band(V::mul(b, pr[j]), V::load(mask + n * W + j * V::W)));
        else acc[i][j] = V::fma(b, pr[j], acc[i][j]);
      }
    }
  }
  // Stored in the order qk_block stores (i, then j). With j outer, GCC 12 also stored every accumulator
  // of a block it left out of line to a stack copy on each key, read only by these stores (the masked
  // 2-vector block; an unmasked one ran 3x slower in a harness): see
  // test_micro_kernels_keep_their_accumulators_in_registers.
  for (int i = 0; i < DB; ++i)
    for (int j = 0; j < RV; ++j) V::store(ot + (c0 + i) * W + j * V::W, acc[i][j]);
}

template <int RV>
static void qk_panel(const float* kt, int64_t d, int64_t keys, const float* qt, float* s) {
  for (int64_t i = 0; i < keys; i += KEY_PAD) qk_block<KEY_PAD, RV>(kt + i * d, d, qt, s + i * RV * V::W);
}

template <int RV, bool MASKED>
static void pv_panel(const float* vt, int64_t vs, int64_t dv, const float* p, const float* mask, int64_t count,
                     const float* alpha, float* ot) {
  int64_t c = 0;
  for (; c + 4 <= dv; c += 4) pv_block<4, RV, MASKED>(vt, vs, c, p, mask, count, alpha, ot);
  switch (dv - c) {
    case 3: pv_block<3, RV, MASKED>(vt, vs, c, p, mask, count, alpha, ot); break;
    case 2: pv_block<2, RV, MASKED>(vt, vs, c, p, mask, count, alpha, ot); break;
    case 1: pv_block<1, RV, MASKED>(vt, vs, c, p, mask, count, alpha, ot); break;
    default: break;
  }
}

// Panel widths in vectors: 3 at a time (12 accumulators with 4 keys / dims), the rest as pairs; a
// single vector only when there is just one.
static inline int64_t panel_vectors(int64_t left) { return left == 1 ? 1 : (left == 2 || left == 4) ? 2 : 3; }

// ------------------------------------------------------------------ the work item
// Copy `count` key (or value) rows into a contiguous fp32 tile. Even fp32 rows are copied: in the
// engines' token-major layouts consecutive keys of one head lie h_kv * d apart (4 KiB for 8 heads of
// 128), so reading them in place makes every tile row alias the same L1 sets; the copy is d
// elements per key against 2 x rows x d FMAs.
// Also prefetches the same rows of the next tile (up to `end`) into L2: in token-major layouts a head's
// consecutive keys are h_kv * d apart, a stride the hardware prefetchers do not follow far enough (into
// L1 instead, fp32 T 8-128 after 4096 keys ran 1.03-1.13x slower on a Zen 4).
// Keys [j0, j0 + count) of a K stored dims-major in pages (a page's keys contiguous per dim: the K of
// vLLM's CPU cache) as fp32 rows ld apart in dst, one page's run of keys at a time: fp32 transposed in
// place; 16-bit widened 16 keys at a time into a small tile of 64 dims, then transposed. Value by value,
// a tree step on vLLM's cells (16 requests of 8 tokens, h 9/3, d 64, 1 thread, Zen 5: items of 24 rows,
// which on AVX-512 now take the few-rows loop) ran 1.72x as long in fp16 on AVX-512 (1.58x on AVX2),
// 1.10x in bf16 (1.04x on AVX2).
static void pack_dims_major(const Problem& p, const Item& it, int64_t j0, int64_t count, float* dst, int64_t ld) {
  constexpr int64_t DIMS = 64, KEYS = MAX_LANES;
  for (int64_t j = j0; j < j0 + count;) {
    const int64_t stop = imin(j0 + count, (j / p.page_size + 1) * p.page_size);
    const int64_t at = key_offset(p, it.b, j, p.k_page, p.k_tok, p.k_head, it.h);
    if (p.dtype == F32) {
      transpose_block(static_cast<const float*>(p.k) + at, p.k_dim, p.d, stop - j, dst + (j - j0) * ld, ld);
    } else {
      float block[DIMS * KEYS];
      for (int64_t k0 = j; k0 < stop; k0 += KEYS) {
        const int64_t keys = imin(KEYS, stop - k0);
        for (int64_t c0 = 0; c0 < p.d; c0 += DIMS) {
          const int64_t dims = imin(DIMS, p.d - c0);
          for (int64_t c = 0; c < dims; ++c) load_row(p.k, p.dtype, at + (k0 - j) + (c0 + c) * p.k_dim, keys, block + c * KEYS);
          transpose_block(block, KEYS, dims, keys, dst + (k0 - j0) * ld + c0, ld);
        }
      }
    }
    j = stop;
  }
}

// Whether K's tile rows are packed by pack_dims_major: dims-major, each page's keys contiguous per dim.
static inline bool dims_major_paged(const Problem& p) { return p.k_dim != 1 && p.k_tok == 1 && p.page_size > 0; }

static void pack_tile(const Problem& p, const void* base, int64_t page, int64_t tok, int64_t head, int64_t dim,
                      int64_t width, const Item& it, int64_t j0, int64_t count, int64_t end, float* tile) {
  if (dim != 1 && dims_major_paged(p)) return pack_dims_major(p, it, j0, count, tile, width);
  const int64_t bytes = width * (p.dtype == F32 ? 4 : 2);
  for (int64_t i = 0; i < count; ++i) {
    if (dim == 1 && j0 + KEY_TILE + i < end) {
      const char* next = static_cast<const char*>(base) +
                         key_offset(p, it.b, j0 + KEY_TILE + i, page, tok, head, it.h) * (bytes / width);
      for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(next + c, 0, 2);
    }
    load_strided(base, p.dtype, key_offset(p, it.b, j0 + i, page, tok, head, it.h), width, dim, tile + i * width);
  }
}

// Tiles from the PV product on, for one panel of rows: the P x V update, plain or bit-masked.
template <int RV>
static void pv_any(bool guard, const float* vt, int64_t vs, int64_t dv, const float* p, const float* mask,
                   int64_t count, const float* alpha, float* ot) {
  if (guard) pv_panel<RV, true>(vt, vs, dv, p, mask, count, alpha, ot);
  else pv_panel<RV, false>(vt, vs, dv, p, mask, count, alpha, ot);
}

#include "kernel_rows.hpp"

static void run_item(const Problem& p, const Item& it, float* scratch) {
  const int64_t d = p.d, dv = p.dv, group = p.group, b = it.b;
  const int64_t rows = (it.t1 - it.t0) * group, rp = (rows + V::W - 1) / V::W * V::W, keys = KEY_TILE + KEY_PAD;
  if (few_rows(p, rows)) return run_rows(p, it, scratch);
  const int64_t qo = p.qo_lens[b], kv = p.kv_lens[b], n = p.tree_sizes[b], tree_lo = kv - n;
  float* qt = scratch;
  float* s = qt + d * rp;
  float* mask = s + keys * rp;
  float* ot = mask + keys * rp;
  float* m = ot + dv * rp;
  float* l = m + rp;
  float* alpha = l + rp;
  int32_t* enter = reinterpret_cast<int32_t*>(alpha + rp);
  int32_t* row_lo = enter + rp;  // each row's first visible key position (sliding window)
  float* kbuf = alpha + 3 * rp;
  float* vbuf = kbuf + keys * d;
  // V rows: their own tile, or K's (MLA: V is K's first dv dims, packed once).
  const float* vt = p.v_in_k ? kbuf : vbuf;
  const int64_t vs = p.v_in_k ? d : dv;
  // Panel j holds rows [first, first + width); in a buffer of X rows per query row it starts at X * first.
  int64_t first[ROW_BLOCK / V::W + 2], width[ROW_BLOCK / V::W + 2], panels = 0;
  for (int64_t r = 0; r < rp; ++panels) {
    first[panels] = r;
    width[panels] = panel_vectors((rp - r) / V::W) * V::W;
    r += width[panels];
  }

  // Q^T, pre-scaled; padding rows are zero, see no tree key (enter -1) and every key of the window.
  // The window's ragged edge: prefix keys below `edge` are outside some row's window.
  int64_t edge = 0;
  for (int64_t j = 0; j < panels; ++j)
    for (int64_t o = 0; o < width[j]; ++o) {
      const int64_t r = first[j] + o, t = it.t0 + r / group, g = r % group;
      float* dst = qt + d * first[j] + o;
      row_lo[r] = 0;
      if (r < rows) {
        load_row(p.q, p.dtype, (p.q_starts[b] + t) * p.q_row + (it.h * group + g) * p.q_head, d, kbuf);
        for (int64_t k = 0; k < d; ++k) dst[k * width[j]] = kbuf[k] * p.q_scale;
        enter[r] = n ? p.tree_order[2 * (p.tree_starts[b] + t + n - qo)] : -1;
        if (p.window) {
          const int64_t lo = p.row_pos[p.q_starts[b] + t] - p.window + 1;
          row_lo[r] = int32_t(lo < 0 ? 0 : imin(lo, kv));
          edge = edge > row_lo[r] ? edge : imin(row_lo[r], tree_lo);
        }
      } else {
        for (int64_t k = 0; k < d; ++k) dst[k * width[j]] = 0.0f;
        enter[r] = -1;
      }
    }
  // The online softmax starts from the sink (a key of value 0 and logit sinks2[head]) in an item that
  // writes the final result; a split item's partial result leaves it to the merge (counted once).
  const bool sink = p.sinks2 && !it.part_o;
  for (int64_t r = 0; r < rp; ++r) {
    m[r] = sink && r < rows ? p.sinks2[it.h * group + r % group] : -__builtin_inff();
    l[r] = sink && r < rows ? 1.0f : 0.0f;
  }
  for (int64_t i = 0; i < dv * rp; i += V::W) V::store(ot + i, V::zero());

  const int32_t* order = p.tree_order + 2 * p.tree_starts[b];
  const int64_t* depth = p.node_depth ? p.node_depth + p.tree_starts[b] : nullptr;
  const typename V::T cap = V::set1(p.cap2);
  for (int64_t j0 = it.c0; j0 < it.c1; j0 += KEY_TILE) {
    const int64_t count = imin(KEY_TILE, it.c1 - j0), padded = (count + KEY_PAD - 1) / KEY_PAD * KEY_PAD;
    pack_tile(p, p.k, p.k_page, p.k_tok, p.k_head, p.k_dim, d, it, j0, count, it.c1, kbuf);
    if (!p.v_in_k) pack_tile(p, p.v, p.v_page, p.v_tok, p.v_head, 1, dv, it, j0, count, it.c1, vbuf);
    for (int64_t i = count * d; i < padded * d; ++i) kbuf[i] = 0.0f;  // padding keys: finite scores, never used
    // Visibility, only on tiles holding keys some row cannot see: tree keys (key of node a is visible to
    // row of node u iff enter[a] <= enter[u] < exit[a]) and, with a window, the window's edge (key at
    // position kp is visible to a row iff row_lo <= kp; tree node a is at tree_lo + depth[a]).
    // Invisible scores are replaced (not offset) by -inf, so they get probability 0; only a non-finite
    // V row of such a key needs the (slower) bit-masked P x V.
    const bool edged = p.window && j0 < edge;
    const bool in_tree = n > 0 && j0 + count > tree_lo;
    const bool masked = in_tree || edged;
    bool guard = false;
    for (int64_t i = edged ? 0 : tree_lo > j0 ? tree_lo - j0 : 0; masked && i < count && !guard; ++i)
      guard = !all_finite(vt + i * vs, dv);
    for (int64_t j = 0; j < panels; ++j) {
      const int64_t w = width[j];
      float* sp = s + keys * first[j];
      float* mp = mask + keys * first[j];
      float* op = ot + dv * first[j];
      const float* qp = qt + d * first[j];
      if (w == 3 * V::W) qk_panel<3>(kbuf, d, padded, qp, sp);
      else if (w == 2 * V::W) qk_panel<2>(kbuf, d, padded, qp, sp);
      else qk_panel<1>(kbuf, d, padded, qp, sp);
      for (int64_t o = 0; o < w; o += V::W) {  // online softmax of this panel's rows, a vector at a time
        const int64_t r = first[j] + o;
        typename V::T top = V::set1(-__builtin_inff());
        for (int64_t i = 0; i < count; ++i) {
          typename V::T x = V::load(sp + i * w + o);
          if (p.cap2 != 0.0f) x = V::mul(tanh_approx(x), cap);
          if (masked) {
            const int64_t node = j0 + i - tree_lo;
            typename V::T vis = node < 0 ? V::all_ones()
                                         : V::visible(enter + r, order[2 * node], order[2 * node + 1]);
            if (p.window && (node >= 0 || edged)) {
              const int64_t kp = node < 0 ? j0 + i : tree_lo + depth[node];
              vis = V::band(vis, V::visible(row_lo + r, -1, int32_t(kp + 1)));
            }
            x = V::select(vis, x, V::set1(-__builtin_inff()));
            V::store(mp + i * w + o, vis);
          }
          V::store(sp + i * w + o, x);
          top = V::max(top, x);
        }
        const typename V::T old = V::load(m + r), fresh = V::max(old, top);
        // A row that has seen no visible key yet keeps max -inf: subtract 0 instead (exp2(-inf) = 0).
        const typename V::T shift = V::select(V::eq(fresh, V::set1(-__builtin_inff())), V::zero(), fresh);
        const typename V::T a = V::exp2(V::sub(old, shift));
        typename V::T sum = V::zero();
        for (int64_t i = 0; i < count; ++i) {
          const typename V::T e = V::exp2(V::sub(V::load(sp + i * w + o), shift));
          V::store(sp + i * w + o, e);
          sum = V::add(sum, e);
        }
        V::store(l + r, V::fma(V::load(l + r), a, sum));
        V::store(m + r, fresh);
        V::store(alpha + r, a);
      }
      const float* ap = alpha + first[j];
      if (w == 3 * V::W) pv_any<3>(guard, vt, vs, dv, sp, mp, count, ap, op);
      else if (w == 2 * V::W) pv_any<2>(guard, vt, vs, dv, sp, mp, count, ap, op);
      else pv_any<1>(guard, vt, vs, dv, sp, mp, count, ap, op);
    }
  }

  // Normalise and write (transposing back to rows): the final output, or this chunk's partial result.
  for (int64_t j = 0; j < panels; ++j)
    for (int64_t o = 0; o < width[j] && first[j] + o < rows; ++o) {
      const int64_t r = first[j] + o;
      const float* src = ot + dv * first[j] + o;
      const float sum = l[r];
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      const float lse = sum > 0.0f ? __builtin_log2f(sum) + m[r] : EMPTY_LSE;
      float* row = it.part_o ? it.part_o + r * dv : vbuf;
      for (int64_t c = 0; c < dv; ++c) row[c] = src[c * width[j]] * inv;
      if (it.part_o) {
        it.part_lse[r] = lse;
      } else {
        const int64_t t = p.q_starts[b] + it.t0 + r / group, head = it.h * group + r % group;
        store_row(p.out, p.dtype, t * p.o_row + head * p.o_head, dv, row);
        p.lse[t * p.l_row + head * p.l_head] = lse;
      }
    }
}
