// The tree-attention work item on oneDNN's brgemm micro-kernels (brgemm.cpp): the two GEMMs of every
// key tile run there, the rest (packing, online softmax, masks, variants) here, against the vector type
// V of the including translation unit (after kernel.hpp and x86.hpp, whose helpers it shares).
//
// Row-major, as the GEMMs want it: S[rows][keys] = Q K^T, with K^T packed per tile (for 16-bit, B's
// VNNI layout [d/2][keys][2] is the transpose of K's rows read as 32-bit words, so one transpose serves
// every dtype); the online softmax runs over a row's keys, the ancestor and window tests with them (each
// key's bounds are vectors, each row's position a scalar); then O[rows][dv] += P V, with P rounded to the
// dtype (fp32 accumulation) and V packed in VNNI pairs of keys (or plain rows, where oneDNN's kernel
// for the dtype reads B plain: brgemm_b_pairs). Q is multiplied unscaled (a scaled 16-bit
// Q would be rounded twice): the scores are scaled in fp32. Tiles are large (BRGEMM_TILE keys: the
// per-row work of a tile, reductions and O's rescaling, is spread over more keys) and a short one is
// padded to a multiple of KEY_TILE; M (rows) is padded to a few sizes (brgemm_rows), leading dimensions
// are fixed: oneDNN's per-shape kernel cache stays small. Pads are zero.

namespace brgemm_item {

constexpr int64_t BT = BRGEMM_TILE;

constexpr int32_t NEVER = -2147483647 - 1, ALWAYS = 2147483647;
// How far (log2) a score may exceed a row's shift before the shift moves (see the online softmax).
constexpr float SLACK = 8.0f;

static inline float* aligned(float* at) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(at) + 4 * ALIGN - 1) & ~uintptr_t(4 * ALIGN - 1));
}

// K^T of a tile: `words` 32-bit words of each of `count` key rows into dst[word][BT] (keys past
// count, up to `padded`, zero). `half`: the rows' last word holds one 16-bit value only (odd d): its upper half is zero.
template <int W = V::W>
static void pack_kt(const char* const* rows, int64_t count, int64_t padded, int64_t words, bool half, uint32_t* dst) {
  const int64_t full = half ? words - 1 : words;
  // Blocks of 8 keys (and of 16, whose first 16-word blocks go in one transpose, on 16 lanes); the words
  // that no 8 x 8 block covers, and the last keys, one at a time.
  auto block8 = [&](int64_t i, int64_t w) {
    for (; w + 8 <= full; w += 8) transpose8x8(rows + i, 4 * w, dst + w * BT + i, BT);
    for (; w < full; ++w)
      for (int64_t r = 0; r < 8; ++r) __builtin_memcpy(dst + w * BT + i + r, rows[i + r] + 4 * w, 4);
  };
  int64_t i = 0;
  if constexpr (W == 16)
    for (; i + 16 <= count; i += 16) {
      int64_t w = 0;
      for (; w + 16 <= full; w += 16) transpose16x16(rows + i, 4 * w, dst + w * BT + i, BT);
      block8(i, w);
      block8(i + 8, w);
    }
  for (; i + 8 <= count; i += 8) block8(i, 0);
  for (; i < count; ++i)
    for (int64_t w = 0; w < full; ++w) __builtin_memcpy(dst + w * BT + i, rows[i] + 4 * w, 4);
  for (int64_t w = 0; w < full; ++w)
    for (int64_t r = count; r < padded; ++r) dst[w * BT + r] = 0;
  if (half)
    for (int64_t r = 0; r < padded; ++r) {
      uint16_t x = 0;
      if (r < count) __builtin_memcpy(&x, rows[r] + 4 * full, 2);
      dst[full * BT + r] = x;
    }
}

// K^T of a tile from a dims-major K (Problem::k_dim: dim c of key i at rows[i] + c * k_dim elements), as
// vLLM's CPU cache stores it: within a page each dim's keys are contiguous, so K^T's rows are copied a run
// of contiguous keys at a time (a run per page; keys anywhere else are runs of one). Into dst's rows of
// BT: fp32 values, 16-bit values read plain (value rows [dp][BT]), or 16-bit VNNI pairs of dims (word
// rows [dp / 2][BT], as pack_kt writes them). Keys past count, up to `padded`, and an odd d's pad dim are zero.
static void pack_kt_dims(const char* const* rows, int64_t count, int64_t padded, int64_t d, int64_t k_dim,
                         int32_t dtype, bool pairs, uint32_t* dst) {
  const int64_t esize = dtype == F32 ? 4 : 2, stride = k_dim * esize, dp = dtype == F32 ? d : (d + 1) / 2 * 2;
  const bool paired = dtype != F32 && pairs;
  char* out = reinterpret_cast<char*>(dst);
  int64_t len = 1;
  for (int64_t i = 0; i < count; i += len) {
    for (len = 1; i + len < count && rows[i + len] == rows[i] + len * esize; ++len) {
    }
    const char* at = rows[i];
    if (paired)
      for (int64_t w = 0; w < dp / 2; ++w)
        interleave16(at + 2 * w * stride, 2 * w + 1 < d ? at + (2 * w + 1) * stride : nullptr,
                     reinterpret_cast<uint16_t*>(dst + w * BT + i), len);
    else
      for (int64_t c = 0; c < d; ++c) __builtin_memcpy(out + (c * BT + i) * esize, at + c * stride, size_t(len * esize));
  }
  if (paired) {
    for (int64_t w = 0; w < dp / 2; ++w)
      for (int64_t r = count; r < padded; ++r) dst[w * BT + r] = 0;
    return;
  }
  for (int64_t c = 0; c < dp; ++c)
    __builtin_memset(out + (c * BT + (c < d ? count : 0)) * esize, 0, size_t((c < d ? padded - count : padded) * esize));
}

// A 16-bit K^T tile from VNNI pairs to plain rows, in place: word row w (BT pairs) becomes value rows 2w
// and 2w + 1 (BT values each), which occupy the same bytes.
static void unpair_kt(int64_t words, int64_t padded, uint32_t* kt) {
  uint32_t row[BT];
  for (int64_t w = 0; w < words; ++w) {
    __builtin_memcpy(row, kt + w * BT, size_t(4 * padded));
    uint16_t* lo = reinterpret_cast<uint16_t*>(kt + w * BT);
    uint16_t* hi = lo + BT;
    for (int64_t i = 0; i < padded; ++i) {
      lo[i] = uint16_t(row[i]);
      hi[i] = uint16_t(row[i] >> 16);
    }
  }
}

// V of a tile: rows as they are into dst[key][dv] (fp32, or 16-bit where oneDNN reads B plain); else
// 16-bit rows in VNNI pairs of keys, dst[key / 2][dv][2]. Keys past count, up to `padded`, are zero.
static void pack_v(const char* const* rows, int64_t count, int64_t padded, int64_t dv, int32_t dtype, bool pairs,
                   void* dst) {
  if (dtype == F32 || !pairs) {
    const int64_t bytes = (dtype == F32 ? 4 : 2) * dv;
    char* out = static_cast<char*>(dst);
    for (int64_t i = 0; i < padded; ++i) {
      if (i < count) __builtin_memcpy(out + i * bytes, rows[i], size_t(bytes));
      else __builtin_memset(out + i * bytes, 0, size_t(bytes));
    }
    return;
  }
  uint16_t* out = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < padded; i += 2) {
    if (i < count) interleave16(rows[i], i + 1 < count ? rows[i + 1] : nullptr, out + i * dv, dv);
    else for (int64_t c = 0; c < 2 * dv; ++c) out[i * dv + c] = 0;
  }
}

// Zero key i's values in a packed V tile (its contribution is then added row by row, see run).
static void clear_v(void* vt, int32_t dtype, bool pairs, int64_t dv, int64_t i) {
  if (dtype == F32 || !pairs) {
    const int64_t bytes = (dtype == F32 ? 4 : 2) * dv;
    __builtin_memset(static_cast<char*>(vt) + i * bytes, 0, size_t(bytes));
    return;
  }
  uint16_t* pair = static_cast<uint16_t*>(vt) + (i / 2) * 2 * dv + (i % 2);
  for (int64_t c = 0; c < dv; ++c) pair[2 * c] = 0;
}

// fp32 items of at most this many rows (decoding tokens' GQA groups, tiny trees) run the FMA kernel's
// few-rows loop (kernel_rows.hpp): oneDNN's fp32 GEMM on so few (padded) rows ran 0.68-0.92x as fast on
// Sapphire Rapids at 3-8 rows (0.99-1.11x at 12-16); with a dims-major K on AVX-512, all the few-rows
// loop takes (V::FEW_ROWS_DIMS: up to 32 rows, 1.1-1.8x on a Zen 5; on AVX2 it ran 0.77x at 12 rows). 16-bit items
// stay (bf16 on AMX ran 1.25-1.5x at 3-4), except bf16 where the pairs run (below).
constexpr int64_t FEW_F32_ROWS = 8;

// bf16 items of at most this many rows run the few-rows loop on bf16 pairs where the CPU has them and the
// caller asks for it (kernel_rows_bf16.hpp; NativeBackend.pairs times it against this kernel on the running
// CPU): with K dims-major (vLLM's cells) FEW_BF16_ROWS_DIMS, with K as rows (whose scores
// are summed across lanes key by key, row by row) FEW_BF16_ROWS. Measured on a Zen 5 (AVX512-BF16) against
// this kernel. vLLM's cells (K dims-major in 128-key pages, 576 keys per request; 1 thread for h 9/3, d 64,
// 2 for h 32/8, d 128): 16 decodes of h 9/3 (3 rows) 1.7x; 6 / 9 / 12 / 15 / 18 / 24 / 30 rows 1.45x / 1.3x /
// 1.14x / 1.11x / 1.34x / 1.15x / 0.96x; h 32/8: 4 / 8 / 12 / 16 / 20 / 32 rows 1.5x / 1.3x / 1.14x / 1.08x /
// 1.41x / 0.98x. K as rows (ragged, 4096 keys, h 32/8, d 128, 2 threads): 4 / 8 / 12 / 16 rows 1.09x / 0.9x
// / 0.84x / 0.77x.
constexpr int64_t FEW_BF16_ROWS = 4, FEW_BF16_ROWS_DIMS = 24;
static_assert(FEW_BF16_ROWS_DIMS <= MAX_FEW_ROWS, "scratch holds few-rows items of at most MAX_FEW_ROWS rows (native.cpp)");

// A tile's rows go through its GEMMs and softmax in chunks of this many (see run): each chunk reads only
// the keys its rows may see, and M takes few values (oneDNN compiles a kernel per shape).
constexpr int64_t ROW_STEP = 64;

static void run(const Problem& p, const Item& it, float* scratch) {
  const bool wide = p.dtype == F32;  // 32-bit elements
  const int64_t d = p.d, dv = p.dv, group = p.group, b = it.b, esize = wide ? 4 : 2;
  const int64_t rows = (it.t1 - it.t0) * group, mp = brgemm_rows(rows);
  if (wide && (rows <= FEW_F32_ROWS || (V::W >= 16 && p.k_dim != 1 && rows <= V::FEW_ROWS_DIMS))) return run_rows(p, it, scratch);
  if (rows <= (p.k_dim != 1 ? FEW_BF16_ROWS_DIMS : FEW_BF16_ROWS) && Pairs16::usable(p))
    return run_rows<Pairs16>(p, it, scratch);
  const int64_t dp = wide ? d : (d + 1) / 2 * 2;  // the QK GEMM's K: 16-bit pairs need an even count
  const int64_t words = wide ? d : dp / 2;       // 32-bit words of a K row
  const int64_t qo = p.qo_lens[b], kv = p.kv_lens[b], n = p.tree_sizes[b], tree_lo = kv - n;
  float* cursor = aligned(scratch);
  auto take = [&](int64_t floats) {
    float* at = cursor;
    cursor += (floats + ALIGN - 1) / ALIGN * ALIGN;
    return at;
  };
  char* qa = reinterpret_cast<char*>(take(mp * dp));  // Q [mp][dp] in its dtype (halves used for 16-bit)
  uint32_t* kt = reinterpret_cast<uint32_t*>(take(dp * BT));
  void* vt = take(BT * dv);
  float* s = take(mp * BT);
  float* pf = take(wide ? mp * BT : mp * BT / 2);  // P [mp][BT] in the dtype the PV GEMM reads
  uint16_t* pa = reinterpret_cast<uint16_t*>(pf);  // (16-bit)
  float* o = take(mp * dv);
  float* m = take(mp);
  float* l = take(mp);
  int32_t* enter = reinterpret_cast<int32_t*>(take(mp));
  int32_t* row_lo = reinterpret_cast<int32_t*>(take(mp));
  int32_t* klo = reinterpret_cast<int32_t*>(take(BT));  // key i visible to row r iff
  int32_t* khi = reinterpret_cast<int32_t*>(take(BT));  //   klo[i] <= enter[r] < khi[i]
  int32_t* wlo = reinterpret_cast<int32_t*>(take(BT));  //   and wlo[i] <= row_lo[r] < whi[i]
  int32_t* whi = reinterpret_cast<int32_t*>(take(BT));
  float* orow = take(dv);
  const char* kr[BT];  // K and V rows of the tile
  const char* vr[BT];
  int64_t bad[BT];  // keys of a masked tile whose V row is not finite

  // Q rows as stored (padding: zero rows and columns); each row's tree entry and window start.
  int64_t edge = 0;  // prefix keys below it are outside some row's window
  for (int64_t r = 0; r < mp; ++r) {
    char* dst = qa + r * dp * esize;
    int64_t filled = 0;
    row_lo[r] = 0;
    enter[r] = -1;
    if (r < rows) {
      const int64_t t = it.t0 + r / group, g = r % group;
      const char* src = static_cast<const char*>(p.q) + ((p.q_starts[b] + t) * p.q_row + (it.h * group + g) * p.q_head) * esize;
      __builtin_memcpy(dst, src, size_t(d * esize));
      filled = d;
      enter[r] = n ? p.tree_order[2 * (p.tree_starts[b] + t + n - qo)] : -1;
      if (p.window) {
        const int64_t lo = p.row_pos[p.q_starts[b] + t] - p.window + 1;
        row_lo[r] = int32_t(lo < 0 ? 0 : imin(lo, kv));
        edge = edge > row_lo[r] ? edge : imin(row_lo[r], tree_lo);
      }
    }
    for (int64_t e = filled * esize; e < dp * esize; ++e) dst[e] = 0;
  }
  const bool sink = p.sinks2 && !it.part_o;  // as in kernel.hpp: the merge adds a split item's sinks
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = sink ? p.sinks2[it.h * group + r % group] : -__builtin_inff();
    l[r] = sink ? 1.0f : 0.0f;
  }
  for (int64_t i = 0; i < mp * dv; ++i) o[i] = 0.0f;
  for (int64_t i = rows * BT; i < mp * BT; ++i)  // padding rows' P: never written
    if (wide) pf[i] = 0.0f;
    else pa[i] = 0;

  const int32_t* order = p.tree_order + 2 * p.tree_starts[b];
  const int64_t* depth = p.node_depth ? p.node_depth + p.tree_starts[b] : nullptr;
  const typename V::T cap = V::set1(p.cap2), scale = V::set1(p.q_scale), minus_inf = V::set1(-__builtin_inff());
  for (int64_t j0 = it.c0; j0 < it.c1; j0 += BT) {
    const int64_t count = imin(BT, it.c1 - j0), padded = (count + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
    // Keys a row may see: its ancestors, which enter the DFS before it. Rows [r0, r1) see no key of this
    // tile past the last one that enters no later than the latest of them (prefix keys: every row): the
    // GEMMs and the softmax of a chunk of ROW_STEP rows stop there, rounded up to KEY_TILE keys (few GEMM
    // shapes), so a chain's diagonal tile is cut in steps (a prefill's upper triangle), and a tile no row
    // sees is skipped whole. 0: none.
    auto seen = [&](int64_t r0, int64_t r1) {
      if (n == 0 || j0 + count <= tree_lo) return padded;
      int32_t top = -1;
      for (int64_t r = r0; r < r1; ++r) top = enter[r] > top ? enter[r] : top;
      int64_t i = count - 1;
      while (i >= 0 && j0 + i >= tree_lo && order[2 * (j0 + i - tree_lo)] > top) --i;
      return i < 0 ? int64_t(0) : imin(padded, (i + KEY_TILE) / KEY_TILE * KEY_TILE);
    };
    if (seen(0, rows) == 0) continue;
    for (int64_t i = 0; i < count; ++i) {
      kr[i] = static_cast<const char*>(p.k) + key_offset(p, b, j0 + i, p.k_page, p.k_tok, p.k_head, it.h) * esize;
      vr[i] = static_cast<const char*>(p.v) + key_offset(p, b, j0 + i, p.v_page, p.v_tok, p.v_head, it.h) * esize;
    }
    if (p.k_dim != 1) {
      pack_kt_dims(kr, count, padded, d, p.k_dim, p.dtype, p.b_pairs, kt);
    } else {
      pack_kt(kr, count, padded, words, !wide && (d % 2), kt);
      if (!wide && !p.b_pairs) unpair_kt(words, padded, kt);
    }
    pack_v(vr, count, padded, dv, p.dtype, p.b_pairs, vt);
    // The next tile's rows into L2, all at once once this tile is packed (token-major rows that no
    // hardware prefetcher follows): they arrive during this tile's GEMMs. On a Zen 4, bf16 T 64 after
    // 4096 keys ran 1.03x as fast as without (T 26: 1.01x); spread over the softmax instead, the
    // prefetches stalled it about as long as they saved; issued before this tile's packing, they slowed
    // it on a Sapphire Rapids.
    prefetch_keys(p, it, j0 + BT, j0 + 2 * BT);

    // Visibility (as in kernel.hpp), on tiles holding keys some row cannot see: tree keys, the window's
    // ragged edge, and the padding keys of a short tile. An invisible score becomes -inf (probability 0);
    // a non-finite V row of such a key would still reach every row through 0 * inf in the GEMM, so it is
    // cleared there and added to the rows that see it one by one.
    const bool edged = p.window && j0 < edge;
    const bool masked = (n > 0 && j0 + count > tree_lo) || edged || count < padded;
    int64_t nbad = 0;
    if (masked) {
      for (int64_t i = 0; i < padded; ++i) {
        const int64_t node = j0 + i - tree_lo;
        klo[i] = i >= count ? ALWAYS : node < 0 ? NEVER : order[2 * node];
        khi[i] = i >= count ? NEVER : node < 0 ? ALWAYS : order[2 * node + 1];
        wlo[i] = NEVER;
        whi[i] = p.window && i < count ? int32_t((node < 0 ? j0 + i : tree_lo + depth[node]) + 1) : ALWAYS;
      }
      for (int64_t i = edged ? 0 : tree_lo > j0 ? tree_lo - j0 : 0; i < count; ++i)
        if (nonfinite_row(vr[i], p.dtype, dv)) {
          bad[nbad++] = i;
          clear_v(vt, p.dtype, p.b_pairs, dv, i);
        }
    }
    // Online softmax with a lazy shift: a row's exponentials are taken against m[r], which only moves
    // when a (log2-scaled) score exceeds it by more than SLACK (probabilities up to 2^SLACK are exact in
    // fp32 and every 16-bit dtype): after a row's first tiles the shift stays, so O is seldom rescaled and a tile
    // whose scores are used as computed (no mask, no soft-cap) is read once, its max taken alongside the
    // exponentials (the rare row whose max rose past the slack is taken again). Other tiles store their
    // final scores in a first pass that also takes the max. Scores stay in s; probabilities go to P in
    // the dtype the PV GEMM reads. The sums of a block of V::W rows are folded at once. The mask is
    // applied per chunk of rows, from its first key that some row of the chunk does not see (`clear`, below):
    // a chunk that sees all its keys (a prefill's rows past a tile, a tree's rows below a tile of their
    // common ancestors) runs as an unmasked tile does.
    int64_t clear = 0;
    bool raw = false;
    float unit = 1.0f;
    typename V::T vunit = V::set1(unit);
    // Row r's exponentials of its first `width` keys against shift into P, its scores' max into top;
    // returns their sum in lanes.
    auto exp_pass = [&](int64_t r, int64_t width, float shift, typename V::T& top) {
      const float* sr = s + r * BT;
      const typename V::T vshift = V::set1(-shift);
      typename V::T sum = V::zero();
      auto loop = [&](auto exp, auto store) {  // one loop per dtype: no branch per vector
        for (int64_t i = 0; i < width; i += V::W) {
          const typename V::T x = V::load(sr + i), e = exp(V::fma(x, vunit, vshift));
          top = V::max(top, x);
          sum = V::add(sum, e);
          store(i, e);
        }
      };
      // [&], though nothing is captured: a captureless lambda gets a static invoker returning a vector, and
      // GCC warns of its ABI (-Wpsabi) on every build.
      if (wide) loop([&](typename V::T x) { return V::template exp2_shifted<6>(x); }, [&](int64_t i, typename V::T e) { V::store(pf + r * BT + i, e); });
      else if (p.dtype == F16)
        loop([&](typename V::T x) { return V::template exp2_shifted<4>(x); }, [&](int64_t i, typename V::T e) { V::store_f16(pa + r * BT + i, e); });
      else sum = V::exp_row_bf16(sr, width, vunit, vshift, pa + r * BT, top);
      return sum;
    };
    // Row r's probabilities (of its first `width` keys), their sum in lanes; m[r] updated (it changes only
    // when the shift moves).
    auto row_pass = [&](int64_t r, int64_t width) {
      float* sr = s + r * BT;
      const float was = m[r];
      typename V::T top = minus_inf;
      if (raw && was != -__builtin_inff()) {
        const typename V::T sum = exp_pass(r, width, was, top);
        const float row_top = V::reduce_max(top) * unit;
        if (!(row_top > was + SLACK)) return sum;
        m[r] = row_top;
        return exp_pass(r, width, row_top, top);
      }
      if (raw) {
        for (int64_t i = 0; i < width; i += V::W) top = V::max(top, V::load(sr + i));
      } else {
        auto score = [&](int64_t i) {
          const typename V::T x = V::mul(V::load(sr + i), scale);
          return p.cap2 != 0.0f ? V::mul(tanh_approx(x), cap) : x;
        };
        int64_t i = 0;
        for (; i < clear; i += V::W) {
          const typename V::T x = score(i);
          V::store(sr + i, x);
          top = V::max(top, x);
        }
        for (; i < width; i += V::W) {
          const typename V::T x = V::select(
              V::band(V::range(klo + i, khi + i, enter[r]), V::range(wlo + i, whi + i, row_lo[r])), score(i), minus_inf);
          V::store(sr + i, x);
          top = V::max(top, x);
        }
      }
      const float row_top = V::reduce_max(top) * unit;
      if (row_top > was + SLACK) m[r] = row_top;
      // A row that has seen no visible key yet keeps max -inf: subtract 0 instead (exp2(-inf) = 0).
      return exp_pass(r, width, m[r] == -__builtin_inff() ? 0.0f : m[r], top);
    };
    // Chunk by chunk of rows: S = Q K^T up to the keys the chunk may see, the softmax, O += P V. A tile of
    // prefix keys only, which every row sees, runs all rows at once (in chunks, a 512-row item ran 0.97x).
    const int64_t step = n > 0 && j0 + count > tree_lo ? ROW_STEP : mp;
    for (int64_t c0 = 0; c0 < rows; c0 += step) {
      const int64_t c1 = imin(c0 + step, rows), m_rows = imin(c0 + step, mp) - c0, width = seen(c0, c1);
      if (width == 0) continue;
      // The chunk's leading keys that each of its rows sees (whole vectors of them); all, if the tile is unmasked.
      clear = width;
      if (masked) {
        int32_t elo = ALWAYS, ehi = NEVER, wlo_min = ALWAYS, wlo_max = NEVER;
        for (int64_t r = c0; r < c1; ++r) {
          elo = enter[r] < elo ? enter[r] : elo;
          ehi = enter[r] > ehi ? enter[r] : ehi;
          wlo_min = row_lo[r] < wlo_min ? row_lo[r] : wlo_min;
          wlo_max = row_lo[r] > wlo_max ? row_lo[r] : wlo_max;
        }
        int64_t i = 0;
        while (i < imin(width, count) && klo[i] <= elo && ehi < khi[i] && wlo[i] <= wlo_min && wlo_max < whi[i]) ++i;
        clear = i / V::W * V::W;
      }
      raw = clear == width && p.cap2 == 0.0f;
      unit = raw ? p.q_scale : 1.0f;
      vunit = V::set1(unit);
      brgemm(p.dtype, m_rows, width, dp, dp, BT, BT, false, qa + c0 * dp * esize, kt, s + c0 * BT);
      for (int64_t r0 = c0; r0 < c1; r0 += V::W) {
        const int64_t nr = imin(V::W, c1 - r0);
        alignas(64) float totals[V::W];
        float was[V::W];
        typename V::T sums[V::W];
        for (int64_t k = 0; k < V::W; ++k) sums[k] = V::zero();
        for (int64_t k = 0; k < nr; ++k) {
          was[k] = m[r0 + k];
          sums[k] = row_pass(r0 + k, width);
        }
        V::store(totals, V::sum_lanes(sums));
        for (int64_t k = 0; k < nr; ++k) {
          const int64_t r = r0 + k;
          if (m[r] != was[k]) {  // the shift moved: l and O were summed against the old one
            float lanes[V::W];
            V::store(lanes, V::exp2(V::set1(was[k] - m[r])));
            const float a = was[k] == -__builtin_inff() ? 0.0f : lanes[0];
            float* orr = o + r * dv;
            int64_t c = 0;
            for (; c + V::W <= dv; c += V::W) V::store(orr + c, V::mul(V::load(orr + c), V::set1(a)));
            for (; c < dv; ++c) orr[c] *= a;
            l[r] *= a;
          }
          l[r] += totals[k];
        }
      }
      brgemm(p.dtype, m_rows, dv, width, BT, dv, dv, true,
             wide ? static_cast<const void*>(pf + c0 * BT) : pa + c0 * BT, vt, o + c0 * dv);
    }
    for (int64_t k = 0; k < nbad; ++k) {
      const int64_t i = bad[k];
      load_row(vr[i], p.dtype, 0, dv, orow);
      for (int64_t r = 0; r < rows; ++r) {
        if (!(klo[i] <= enter[r] && enter[r] < khi[i] && wlo[i] <= row_lo[r] && row_lo[r] < whi[i])) continue;
        const float pr = wide ? pf[r * BT + i]
                              : p.dtype == BF16 ? bf16_to_float(pa[r * BT + i]) : half_to_float(pa[r * BT + i]);
        for (int64_t c = 0; c < dv; ++c) o[r * dv + c] += pr * orow[c];
      }
    }
  }

  // Normalise and write: the final output, or this chunk's partial result.
  for (int64_t r = 0; r < rows; ++r) {
    const float sum = l[r];
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    const float lse = sum > 0.0f ? __builtin_log2f(sum) + m[r] : EMPTY_LSE;
    float* row = it.part_o ? it.part_o + r * dv : orow;
    for (int64_t c = 0; c < dv; ++c) row[c] = o[r * dv + c] * inv;
    if (it.part_o) {
      it.part_lse[r] = lse;
    } else {
      const int64_t t = p.q_starts[b] + it.t0 + r / group, head = it.h * group + r % group;
      store_row(p.out, p.dtype, t * p.o_row + head * p.o_head, dv, row);
      p.lse[t * p.l_row + head * p.l_head] = lse;
    }
  }
}

}  // namespace brgemm_item
