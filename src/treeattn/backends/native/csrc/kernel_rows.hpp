// Work items of few query rows: a decoding token's GQA group (1-8 rows), the commonest item of a
// serving engine's step. Written once against `V`, included by kernel.hpp before run_item.
//
// run_item puts query rows in the vector lanes; with 3 rows in 16 lanes most of every vector idles.
// Here rows stay outside the vectors and keys, then head dims, fill the lanes:
// - S[r][keys], V::W keys at a time for every row in turn (the rows share those keys' K rows while they
//   are in L1): each key's d products accumulate in a vector of its own (K is read as rows, never
//   transposed), and the V::W vectors are summed across their lanes at once (V::sum_lanes), which
//   yields the scores of those keys as one vector;
// - the online softmax runs along a row's scores, a vector of keys at a time;
// - O[r][dv] += P[r][key] * V[key][dv] for up to 4 rows at once: V's row in the lanes, loaded once for
//   them, each row's probability broadcast (independent accumulators: no wait on the FMA latency).
// Measured on Sapphire Rapids (16 decodes, h 9/3, d 64, 200 keys in 128-key pages, fp32): the shared
// K chunks and the 4-row P V took a call from 309 to 265 us, 175 to 144 us with all keys in L2.
// fp32 K / V rows are read in place when a tile's rows lie evenly spaced (in one page), their dims contiguous
// and whole vectors; otherwise they are converted into a zero-padded tile, as run_item does.

// Items of at most this many rows run here. Measured on Sapphire Rapids (d 128, 256 keys in L2, per call
// of 8 items): 1 row 5.5x / 4.9x faster than run_item (AVX-512 / AVX2), 4 rows 2.4x / 2.1x, 8 rows
// 1.45x / 1.2x. Since rows share each K chunk and V row, up to 16 rows gain too (16 items of 512 keys in
// 128-key pages, h_kv 4, d 128, fp32; AVX-512 / AVX2 / generic on the same CPU): 12 rows 1.59x / 1.34x /
// 1.11x, 16 rows 1.3x / 1.05x / 0.85x. So V::FEW_ROWS is 16 on the AVX paths, 8 on the generic one.
// With a dims-major K (vLLM's cells) the rows share each of its dim rows in place of a transposed tile
// and gain further: V::FEW_ROWS_DIMS. Measured on a Zen 5 (fp32, 576 keys per request in 128-key pages),
// AVX-512 against run_item / the brgemm kernel: 12 rows - / 1.44x, 18 rows 1.5x / 1.8x, 20 rows 1.52x /
// 1.58x, 30 rows 1.13x / 1.19x, 32 rows 1.04x / 1.11x (fp16 and bf16 against run_item: 24 rows 1.33x and
// 1.46x, 32 rows fp16 1.16x); with K as rows, 24 rows ran 0.96x / 1.07x (16 stays the bound there).
static inline bool few_rows(const Problem& p, int64_t rows) {
  return rows <= (p.k_dim != 1 ? V::FEW_ROWS_DIMS : V::FEW_ROWS);
}
static_assert(V::FEW_ROWS <= MAX_FEW_ROWS && V::FEW_ROWS_DIMS <= MAX_FEW_ROWS, "scratch: few_rows_floats");

// Where a tile's rows are: `base + i * stride` for row i, V::W-padded wide (zeros past the real width)
// and readable for i < the tile's key count rounded up to V::W.
struct RowTile {
  const float* base;
  int64_t stride;
};

static inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// The tile of keys [j0, j0 + count) of item `it` in K (rows: head dims contiguous) or V: in place where
// it can be, else packed into buf ([round_up(count, W)][round_up(width, W)]).
static RowTile row_tile(const Problem& p, const void* base, int64_t page, int64_t tok, int64_t head, int64_t width,
                        const Item& it, int64_t j0, int64_t count, float* buf) {
  const int64_t wp = round_up(width, V::W);
  const bool even = p.page_size == 0 || j0 / p.page_size == (j0 + count - 1) / p.page_size;
  if (p.dtype == F32 && width == wp && count % V::W == 0 && even)
    return {static_cast<const float*>(base) + key_offset(p, it.b, j0, page, tok, head, it.h), tok};
  for (int64_t i = 0; i < count; ++i) {
    load_row(base, p.dtype, key_offset(p, it.b, j0 + i, page, tok, head, it.h), width, buf + i * wp);
    for (int64_t c = width; c < wp; ++c) buf[i * wp + c] = 0.0f;
  }
  for (int64_t i = count * wp; i < round_up(count, V::W) * wp; ++i) buf[i] = 0.0f;
  return {buf, wp};
}

// Keys from j up to `left` of them that share j's page (all of them, ragged): evenly spaced in memory.
static inline int64_t page_run(const Problem& p, int64_t j, int64_t left) {
  return p.page_size ? imin(left, p.page_size - j % p.page_size) : left;
}

// K^T of the tile of keys [j0, j0 + count) from a dims-major K (Problem::k_dim; vLLM's CPU cache): dim c's
// keys at base + c * stride, keys in the lanes. In place for fp32 keys contiguous in memory (one page);
// else each dim's keys copied (widened from 16 bits) a run of contiguous keys at a time into buf
// ([d][KEY_TILE]), keys past count zero up to a multiple of W.
static RowTile dims_tile(const Problem& p, const Item& it, int64_t j0, int64_t count, float* buf) {
  const int64_t padded = round_up(count, V::W);
  int64_t len = 1;
  for (int64_t i = 0; i < count; i += len) {  // one key_offset per run (its division cost 12% of a decode)
    const int64_t at = key_offset(p, it.b, j0 + i, p.k_page, p.k_tok, p.k_head, it.h);
    len = p.k_tok != 1 ? 1 : page_run(p, j0 + i, count - i);
    if (p.dtype == F32 && len == count && count == padded) return {static_cast<const float*>(p.k) + at, p.k_dim};
    for (int64_t c = 0; c < p.d; ++c) load_row(p.k, p.dtype, at + c * p.k_dim, len, buf + c * KEY_TILE + i);
  }
  for (int64_t c = 0; c < p.d; ++c)
    for (int64_t i = count; i < padded; ++i) buf[c * KEY_TILE + i] = 0.0f;
  return {buf, KEY_TILE};
}

// s[i0 .. i0 + W) = q . K[i0 + i] for the W keys from i0 (q and K's rows dp wide, dp a multiple of W).
__attribute__((always_inline)) static inline void qk_keys(const float* q, RowTile k, int64_t i0, int64_t dp, float* s) {
  typename V::T acc[V::W];
  for (int i = 0; i < V::W; ++i) acc[i] = V::zero();
  const float* rows = k.base + i0 * k.stride;
  for (int64_t c = 0; c < dp; c += V::W) {
    const typename V::T qc = V::load(q + c);
    for (int i = 0; i < V::W; ++i) acc[i] = V::fma(V::load(rows + i * k.stride + c), qc, acc[i]);
  }
  V::store(s, V::sum_lanes(acc));
}

// s[r][i0 .. i0 + KB * W) = q[r] . K[i0 + i] for NR rows (q rows dp apart, s rows ss apart) from K^T (dim
// c's keys at kt.base + c * kt.stride).
template <int NR, int KB>
__attribute__((always_inline)) static inline void qk_dims(RowTile kt, int64_t d, const float* q, int64_t dp,
                                                           int64_t i0, float* s, int64_t ss) {
  typename V::T acc[NR][KB];
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < KB; ++k) acc[r][k] = V::zero();
  rank1_rows<NR, KB>(q, dp, kt.base + i0, kt.stride, d, acc);
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < KB; ++k) V::store(s + r * ss + i0 + k * V::W, acc[r][k]);
}

// f(r, Rows<NR>()) for blocks of NR rows from r: fours, then the 3, 2 or 1 left (NR a compile-time
// constant, so that each block size gets its own unrolled code; a tag of this namespace, not the standard
// library's: see problem.h).
template <int N>
struct Rows {
  static constexpr int value = N;
};
template <typename F>
static inline void by_four_rows(int64_t rows, F f) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) f(r, Rows<4>());
  switch (rows - r) {
    case 3: f(r, Rows<3>()); break;
    case 2: f(r, Rows<2>()); break;
    case 1: f(r, Rows<1>()); break;
    default: break;
  }
}

// Every row's scores over the tile's `padded` keys from K^T, four rows and two vectors of keys at a time.
static void qk_dims_all(RowTile kt, int64_t d, const float* q, int64_t dp, int64_t padded, float* s, int64_t ss,
                        int64_t rows) {
  int64_t i0 = 0;
  for (; i0 + 2 * V::W <= padded; i0 += 2 * V::W)
    by_four_rows(rows, [&](int64_t r, auto nr) { qk_dims<decltype(nr)::value, 2>(kt, d, q + r * dp, dp, i0, s + r * ss, ss); });
  for (; i0 < padded; i0 += V::W)
    by_four_rows(rows, [&](int64_t r, auto nr) { qk_dims<decltype(nr)::value, 1>(kt, d, q + r * dp, dp, i0, s + r * ss, ss); });
}

// o[c0 .. c0 + CB * W) = alpha * o + sum_i p[i] * V[i][c0 ..], over the tile's `count` keys; with `keep`
// (a key some row cannot see may hold inf / NaN), keys whose keep[i] is zero are skipped: 0 * NaN is NaN.
template <int CB>
static inline void pv_dims(RowTile v, int64_t c0, const float* p, const float* keep, int64_t count, float alpha,
                           float* o) {
  typename V::T acc[CB];
  const typename V::T a = V::set1(alpha);
  for (int j = 0; j < CB; ++j) acc[j] = V::mul(V::load(o + c0 + j * V::W), a);
  for (int64_t i = 0; i < count; ++i) {
    if (keep && float_to_bits(keep[i]) == 0) continue;
    const typename V::T pi = V::bcast(p + i);
    const float* row = v.base + i * v.stride + c0;
    for (int j = 0; j < CB; ++j) acc[j] = V::fma(pi, V::load(row + j * V::W), acc[j]);
  }
  for (int j = 0; j < CB; ++j) V::store(o + c0 + j * V::W, acc[j]);
}

static void pv_row(RowTile v, int64_t dvp, const float* p, const float* keep, int64_t count, float alpha, float* o) {
  int64_t c = 0;
  for (; c + 4 * V::W <= dvp; c += 4 * V::W) pv_dims<4>(v, c, p, keep, count, alpha, o);
  for (; c < dvp; c += V::W) pv_dims<1>(v, c, p, keep, count, alpha, o);
}

// PV for NR rows at once: o[r][c0 .. c0 + CB * W) = alpha[r] * o[r] + sum_i p[r][i] * V[i][c0 ..] over the
// tile's `count` keys (p rows `ps` apart, o rows `os` apart), through rank1_rows.
template <int NR, int CB>
static inline void pv_rows_dims(RowTile v, int64_t c0, const float* p, int64_t ps, int64_t count, const float* alpha,
                                float* o, int64_t os) {
  typename V::T acc[NR][CB];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < CB; ++j) acc[r][j] = V::mul(V::load(o + r * os + c0 + j * V::W), V::set1(alpha[r]));
  rank1_rows<NR, CB>(p, ps, v.base + c0, v.stride, count, acc);
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < CB; ++j) V::store(o + r * os + c0 + j * V::W, acc[r][j]);
}

// Accumulators per block of rows: NR * CB of the vector registers (16 with AVX-512, 8 on the 16-register paths).
template <int NR>
static inline void pv_rows(RowTile v, int64_t dvp, const float* p, int64_t ps, int64_t count, const float* alpha,
                           float* o, int64_t os) {
  constexpr int CB = V::W >= 16 ? 4 : 2;
  int64_t c = 0;
  for (; c + CB * V::W <= dvp; c += CB * V::W) pv_rows_dims<NR, CB>(v, c, p, ps, count, alpha, o, os);
  for (; c < dvp; c += V::W) pv_rows_dims<NR, 1>(v, c, p, ps, count, alpha, o, os);
}

// Every row's PV of a tile, four rows at a time.
static void pv_all(RowTile v, int64_t dvp, const float* p, int64_t ps, int64_t count, const float* alpha, float* o,
                   int64_t os, int64_t rows) {
  by_four_rows(rows, [&](int64_t r, auto nr) {
    pv_rows<decltype(nr)::value>(v, dvp, p + r * ps, ps, count, alpha + r, o + r * os, os);
  });
}

// The loop's two products in fp32 (K and V widened where stored in 16 bits), or where a translation unit
// has them (kernel_rows_bf16.hpp's Pairs16), in bf16 pairs: Pairs::on.
struct NoPairs {
  static constexpr bool on = false;
  static bool usable(const Problem&) { return false; }
};

// The item, in scratch of few_rows_floats(p, rows) floats (problem.h).
template <class Pairs = NoPairs>
static void run_rows(const Problem& p, const Item& it, float* scratch) {
  constexpr bool pairs = Pairs::on;
  if constexpr (pairs) Pairs::count_item();
  const int64_t d = p.d, dv = p.dv, group = p.group, b = it.b, rows = (it.t1 - it.t0) * group;
  const int64_t dp = round_up(d, V::W), dvp = round_up(dv, V::W), kt = KEY_TILE;
  const int64_t qo = p.qo_lens[b], kv = p.kv_lens[b], n = p.tree_sizes[b], tree_lo = kv - n;
  float* q = scratch;           // [rows][dp], pre-scaled (pairs: the stored bf16 rows, 2 dp values apart)
  float* s = q + rows * dp;     // [rows][kt] scores, then probabilities
  float* keep = s + rows * kt;  // [rows][kt] visibility (all-ones / zero bits), on masked tiles (pairs: P in bf16)
  float* o = keep + rows * kt;  // [rows][dvp]
  float* m = o + rows * dvp;
  float* l = m + rows;
  float* alpha = l + rows;  // each row's rescale of its output on this tile
  int32_t* enter = reinterpret_cast<int32_t*>(alpha + rows);  // each row's tree entry (-1: sees no tree key)
  int32_t* row_lo = enter + rows;                          // each row's first visible key position (window)
  int32_t* key_lo = row_lo + rows;  // [kt] per key of a masked tile: rows with lo <= enter < hi see it
  int32_t* key_hi = key_lo + kt;
  int32_t* key_pos = key_hi + kt;    // [kt] per key: its position + 1 (window: seen by rows with row_lo < it)
  int32_t* no_lo = key_pos + kt;     // [kt] INT32_MIN: the window test's lower bound
  float* kbuf = reinterpret_cast<float*>(no_lo + kt);  // [kt][dp] (pairs: K^T in bf16, [d][kt])
  float* vbuf = kbuf + kt * dp;                         // [kt][dvp]

  int64_t edge = 0;  // prefix keys below it are outside some row's window
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.t0 + r / group, g = r % group, at = (p.q_starts[b] + t) * p.q_row + (it.h * group + g) * p.q_head;
    if constexpr (pairs) {
      __builtin_memcpy(reinterpret_cast<uint16_t*>(q + r * dp), static_cast<const uint16_t*>(p.q) + at, uint64_t(2 * d));
    } else {
      load_row(p.q, p.dtype, at, d, q + r * dp);
      for (int64_t c = 0; c < d; ++c) q[r * dp + c] *= p.q_scale;
      for (int64_t c = d; c < dp; ++c) q[r * dp + c] = 0.0f;
    }
    enter[r] = n ? p.tree_order[2 * (p.tree_starts[b] + t + n - qo)] : -1;
    row_lo[r] = 0;
    if (p.window) {
      const int64_t lo = p.row_pos[p.q_starts[b] + t] - p.window + 1;
      row_lo[r] = int32_t(lo < 0 ? 0 : imin(lo, kv));
      edge = edge > row_lo[r] ? edge : imin(row_lo[r], tree_lo);
    }
    // The online softmax starts from the sink (a key of value 0 and logit sinks2[head]) in an item that
    // writes the final result; a split item's partial result leaves it to the merge (counted once).
    const bool sink = p.sinks2 && !it.part_o;
    m[r] = sink ? p.sinks2[it.h * group + g] : -__builtin_inff();
    l[r] = sink ? 1.0f : 0.0f;
    for (int64_t c = 0; c < dvp; ++c) o[r * dvp + c] = 0.0f;
  }
  for (int64_t i = 0; i < kt; ++i) no_lo[i] = INT32_MIN;

  const int32_t* order = p.tree_order + 2 * p.tree_starts[b];
  const int64_t* depth = p.node_depth ? p.node_depth + p.tree_starts[b] : nullptr;
  const typename V::T cap = V::set1(p.cap2), minus_inf = V::set1(-__builtin_inff());
  for (int64_t j0 = it.c0; j0 < it.c1; j0 += kt) {
    const int64_t count = imin(kt, it.c1 - j0), padded = round_up(count, V::W);
    // K as rows (head dims in the lanes), or dims-major as K^T (keys in the lanes); V as rows. Pairs: V's
    // rows where they are stored (K: Pairs::scores).
    const bool dims = p.k_dim != 1;
    RowTile kt_rows{}, vt_rows{};
    const uint16_t* v16[KEY_TILE];
    if constexpr (pairs) {
      Pairs::value_rows(p, it, j0, count, v16);
    } else {
      kt_rows = dims ? dims_tile(p, it, j0, count, kbuf)
                     : row_tile(p, p.k, p.k_page, p.k_tok, p.k_head, d, it, j0, count, kbuf);
      vt_rows = p.v_in_k ? kt_rows : row_tile(p, p.v, p.v_page, p.v_tok, p.v_head, dv, it, j0, count, vbuf);
    }
    // Visibility (see run_item): tree keys by DFS interval, window edges by position; the padding keys
    // of a last tile are seen by no row.
    const bool edged = p.window && j0 < edge, in_tree = n > 0 && j0 + count > tree_lo;
    const bool masked = in_tree || edged || count < padded;
    bool guard = false;
    if (masked) {
      for (int64_t i = 0; i < padded; ++i) {
        const int64_t node = j0 + i - tree_lo;
        key_lo[i] = i >= count ? INT32_MAX : node < 0 ? INT32_MIN : order[2 * node];
        key_hi[i] = i >= count ? INT32_MIN : node < 0 ? INT32_MAX : order[2 * node + 1];
        key_pos[i] = !p.window || i >= count || (node < 0 && !edged) ? INT32_MAX
                     : int32_t((node < 0 ? j0 + i : tree_lo + depth[node]) + 1);
      }
      auto finite = [&](int64_t i) {
        if constexpr (pairs) return !nonfinite_row(reinterpret_cast<const char*>(v16[i]), BF16, dv);
        else return all_finite(vt_rows.base + i * vt_rows.stride, dv);
      };
      for (int64_t i = edged ? 0 : tree_lo > j0 ? tree_lo - j0 : 0; i < count && !guard; ++i) guard = !finite(i);
    }
    // Scores of every row, a vector of keys at a time: the rows share each K chunk while it is in L1.
    for (int64_t i0 = 0; i0 < padded; i0 += V::W) {
      prefetch_keys(p, it, j0 + kt + i0, j0 + kt + i0 + V::W);  // the next tile's, spread over this one
      for (int64_t r = 0; !pairs && !dims && r < rows; ++r) qk_keys(q + r * dp, kt_rows, i0, dp, s + r * kt + i0);
    }
    if constexpr (pairs)
      Pairs::scores(p, it, j0, count, reinterpret_cast<const uint16_t*>(q), 2 * dp, rows, reinterpret_cast<uint16_t*>(kbuf), s, kt);
    else if (dims)
      qk_dims_all(kt_rows, d, q, dp, padded, s, kt, rows);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * kt;
      typename V::T top = minus_inf;
      for (int64_t i0 = 0; i0 < padded; i0 += V::W) {
        typename V::T x = V::load(sr + i0);
        if (p.cap2 != 0.0f) x = V::mul(tanh_approx(x), cap);
        if (masked) {
          typename V::T vis = V::range(key_lo + i0, key_hi + i0, enter[r]);
          if (p.window) vis = V::band(vis, V::range(no_lo + i0, key_pos + i0, row_lo[r]));
          x = V::select(vis, x, minus_inf);
          V::store(keep + r * kt + i0, vis);
        }
        V::store(sr + i0, x);
        top = V::max(top, x);
      }
      const float old = m[r], top_max = V::reduce_max(top), fresh = old > top_max ? old : top_max;
      // A row that has seen no visible key yet keeps max -inf: subtract 0 instead (exp2(-inf) = 0).
      const float shift = fresh == -__builtin_inff() ? 0.0f : fresh;
      typename V::T sum = V::zero();
      for (int64_t i0 = 0; i0 < padded; i0 += V::W) {
        const typename V::T e = V::exp2(V::sub(V::load(sr + i0), V::set1(shift)));
        V::store(sr + i0, e);
        sum = V::add(sum, e);
      }
      float alpha_lanes[V::W];
      V::store(alpha_lanes, V::exp2(V::set1(old - shift)));
      alpha[r] = alpha_lanes[0];
      l[r] = l[r] * alpha[r] + V::reduce_add(sum);
      m[r] = fresh;
    }
    // Every row's P V, each V row read once for all rows; a tile holding a key that is not finite takes
    // the row-by-row path that skips the keys a row cannot see (0 * NaN is NaN): pairs, on V widened in
    // the order in which they keep O.
    if constexpr (pairs) {
      if (guard) {
        Pairs::widen_v(v16, count, dv, vbuf, dvp);
        for (int64_t r = 0; r < rows; ++r)
          pv_row(RowTile{vbuf, dvp}, dvp, s + r * kt, keep + r * kt, count, alpha[r], o + r * dvp);
      } else {
        Pairs::pv(v16, count, s, kt, reinterpret_cast<uint16_t*>(keep), alpha, dv, rows, o, dvp);
      }
    } else if (guard)
      for (int64_t r = 0; r < rows; ++r) pv_row(vt_rows, dvp, s + r * kt, keep + r * kt, count, alpha[r], o + r * dvp);
    else
      pv_all(vt_rows, dvp, s, kt, count, alpha, o, dvp, rows);
  }

  // Normalise and write: the final output, or this chunk's partial result.
  for (int64_t r = 0; r < rows; ++r) {
    float* src = o + r * dvp;
    if constexpr (pairs) Pairs::unpermute(src, dv);
    const float sum = l[r], inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const float lse = sum > 0.0f ? __builtin_log2f(sum) + m[r] : EMPTY_LSE;
    for (int64_t c = 0; c < dv; ++c) src[c] *= inv;
    if (it.part_o) {
      for (int64_t c = 0; c < dv; ++c) it.part_o[r * dv + c] = src[c];
      it.part_lse[r] = lse;
    } else {
      const int64_t t = p.q_starts[b] + it.t0 + r / group, head = it.h * group + r % group;
      store_row(p.out, p.dtype, t * p.o_row + head * p.o_head, dv, src);
      p.lse[t * p.l_row + head * p.l_head] = lse;
    }
  }
}
