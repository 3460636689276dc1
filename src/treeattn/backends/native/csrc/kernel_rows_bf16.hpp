// bf16 items of few query rows on AVX512-BF16: kernel_rows.hpp's loop (run_rows<Pairs16>) with its two
// products in bf16 pairs (vdpbf16ps: fp32 lane i += a[2i] b[2i] + a[2i + 1] b[2i + 1], the products exact),
// for the brgemm path's bf16 items of few rows (kernel_brgemm.hpp: up to 24 with K dims-major as in vLLM's
// cells, 4 with K as rows): decoding tokens' GQA groups and small trees'. The brgemm kernel packs every key tile
// (K^T and V into VNNI pairs) whatever the rows, and at 3 rows the packing costs more than the GEMMs; the
// fp32 loop widens every K and V value into a tile first. Here bf16 values are read where they are stored:
// - S = Q K^T with Q as stored (unscaled: a scaled Q would be rounded twice; the scores are scaled in
//   fp32). K dims-major (vLLM's cells): dims c and c + 1 of 32 keys interleave into pairs with one unpack
//   each (vpunpck[lh]wd, within 128-bit blocks) against q's (c, c + 1) broadcast, up to 4 rows sharing
//   each unpacked vector; the scores come out in the unpacks' order of keys and two permutes per 32 keys
//   and row put them back. K as rows: a key's row is pairs of dims already; W keys' sums at once.
// - O += P V with P rounded to bf16 (as the brgemm kernel's PV GEMM reads it): the V rows of keys 2i and
//   2i + 1 unpack into pairs against (p[2i], p[2i + 1]) broadcast. O's head dims stay in the unpacks'
//   order through the item (its rescaling is lane by lane) and are put back once, at its end.
// Head dims a multiple of 32 (a vector of bf16 values): usable(). Included by kernel_avx512.cpp after
// kernel.hpp; every function that uses AVX512-BF16 is compiled for it alone and runs only where cpuid has it
// (has_avx512_bf16).

// The unpacks' order of 32 elements (keys or head dims) in two vectors: lane l of the low unpack holds
// element 8 (l / 4) + l % 4, of the high one 8 (l / 4) + 4 + l % 4. BACK0 / BACK1: elements 0-15 / 16-31
// from [low | high] (vpermt2ps indices); LOW / HIGH: the unpacks' lanes from elements [0-15 | 16-31].
alignas(64) static const int32_t BACK0[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) static const int32_t BACK1[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};
alignas(64) static const int32_t LOW[16] = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
alignas(64) static const int32_t HIGH[16] = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};

#define PAIRS16 __attribute__((target("avx512bf16")))

static inline __m512bh as_pairs(__m512i x) { return reinterpret_cast<__m512bh>(x); }
// The 32-bit word (a pair of bf16 values) at p[i], read as bytes: Q and P lie in float scratch.
static inline int32_t word_at(const uint32_t* p, int64_t i) {
  int32_t w;
  __builtin_memcpy(&w, p + i, 4);
  return w;
}
// 16 bf16 values widened to fp32 (their bits in the upper halves).
static inline __m512 widen16(const uint16_t* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}
static inline __mmask16 first16(int64_t n) {  // the first n of 16 lanes (none for n <= 0)
  return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
}

// Pointers to the `count` stored rows of keys j0 ... of item `it` in K or V (element offsets as key_offset
// gives them): one key_offset per page.
static void stored_rows(const Problem& p, const Item& it, const void* base, int64_t page, int64_t tok, int64_t head,
                        int64_t j0, int64_t count, const uint16_t** rows) {
  for (int64_t i = 0; i < count;) {
    const int64_t run = page_run(p, j0 + i, count - i);
    const uint16_t* at = static_cast<const uint16_t*>(base) + key_offset(p, it.b, j0 + i, page, tok, head, it.h);
    for (int64_t k = 0; k < run; ++k) rows[i + k] = at + k * tok;
    i += run;
  }
}

// `rows` runs of n <= 64 16-bit values, src / dst rows `ss` / `ds` values apart, in whole and masked vectors:
// a page's short runs (16 keys a dim) cost a library memcpy call each otherwise.
static_assert(KEY_TILE <= 64, "copy_runs: a tile's runs fit two vectors");
static inline void copy_runs(const uint16_t* src, int64_t ss, int64_t rows, int64_t n, uint16_t* dst, int64_t ds) {
  const __mmask32 first = n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1;
  const __mmask32 second = n >= 64 ? ~__mmask32(0) : n <= 32 ? __mmask32(0) : (__mmask32(1) << (n - 32)) - 1;
  for (int64_t c = 0; c < rows; ++c) {
    _mm512_mask_storeu_epi16(dst + c * ds, first, _mm512_maskz_loadu_epi16(first, src + c * ss));
    if (second) _mm512_mask_storeu_epi16(dst + c * ds + 32, second, _mm512_maskz_loadu_epi16(second, src + c * ss + 32));
  }
}

// s[r][0 .. 32 KB) = scale * q[r] . K[key] for NR rows from K^T (dim c's keys at kt + c * stride); q rows
// of pairs of dims, `qs` words apart. Whole vectors only: with masked loads in the loop, GCC 12 kept the
// accumulators in memory (a store each per step).
template <int NR, int KB>
PAIRS16 static void qk_dims_block(const uint16_t* kt, int64_t stride, const uint32_t* q, int64_t qs, int64_t words,
                                  float scale, float* s, int64_t ss) {
  __m512 lo[NR][KB], hi[NR][KB];
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < KB; ++k) lo[r][k] = hi[r][k] = _mm512_setzero_ps();
  for (int64_t w = 0; w < words; ++w) {
    const uint16_t* even = kt + 2 * w * stride;
    __m512i pl[KB], ph[KB];
    for (int k = 0; k < KB; ++k) {
      const __m512i a = _mm512_loadu_si512(even + 32 * k), b = _mm512_loadu_si512(even + stride + 32 * k);
      pl[k] = _mm512_unpacklo_epi16(a, b);
      ph[k] = _mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512bh qw = as_pairs(_mm512_set1_epi32(word_at(q, r * qs + w)));
      for (int k = 0; k < KB; ++k) {
        lo[r][k] = _mm512_dpbf16_ps(lo[r][k], as_pairs(pl[k]), qw);
        hi[r][k] = _mm512_dpbf16_ps(hi[r][k], as_pairs(ph[k]), qw);
      }
    }
  }
  const __m512i back0 = _mm512_load_si512(BACK0), back1 = _mm512_load_si512(BACK1);
  const __m512 f = _mm512_set1_ps(scale);
  for (int r = 0; r < NR; ++r)
    for (int k = 0; k < KB; ++k) {
      _mm512_storeu_ps(s + r * ss + 32 * k, _mm512_mul_ps(_mm512_permutex2var_ps(lo[r][k], back0, hi[r][k]), f));
      _mm512_storeu_ps(s + r * ss + 32 * k + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo[r][k], back1, hi[r][k]), f));
    }
}

// s[r][0 .. 16) = scale * q . K[key] for one row and 16 keys stored as rows (d a multiple of 32).
PAIRS16 static void qk_rows16(const uint16_t* const* keys, const uint16_t* q, int64_t d, float scale, float* s) {
  __m512 acc[16];
  for (int k = 0; k < 16; ++k) acc[k] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    const __m512bh qc = as_pairs(_mm512_loadu_si512(q + c));
    for (int k = 0; k < 16; ++k) acc[k] = _mm512_dpbf16_ps(acc[k], as_pairs(_mm512_loadu_si512(keys[k] + c)), qc);
  }
  _mm512_storeu_ps(s, _mm512_mul_ps(V::sum_lanes(acc), _mm512_set1_ps(scale)));
}

// o[r][c0 .. c0 + 32 CB) (the unpacks' order) = alpha[r] o[r] + sum_i p[r][i] V[i][c0 ..] for NR rows over
// `count` keys; p rows of bf16 pairs of keys, `ps` words apart.
template <int NR, int CB>
PAIRS16 static void pv_block(const uint16_t* const* v, int64_t count, const uint32_t* p, int64_t ps, const float* alpha,
                             int64_t c0, float* o, int64_t os) {
  __m512 acc[NR][2 * CB];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 2 * CB; ++j)
      acc[r][j] = _mm512_mul_ps(_mm512_loadu_ps(o + r * os + c0 + 16 * j), _mm512_set1_ps(alpha[r]));
  auto step = [&](int64_t i, const uint16_t* odd) {  // keys i and i + 1 (odd: its row, or null past the last)
    __m512i pl[CB], ph[CB];
    for (int k = 0; k < CB; ++k) {
      const __m512i a = _mm512_loadu_si512(v[i] + c0 + 32 * k);
      const __m512i b = odd ? _mm512_loadu_si512(odd + c0 + 32 * k) : _mm512_setzero_si512();
      pl[k] = _mm512_unpacklo_epi16(a, b);
      ph[k] = _mm512_unpackhi_epi16(a, b);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512bh pw = as_pairs(_mm512_set1_epi32(word_at(p, r * ps + i / 2)));
      for (int k = 0; k < CB; ++k) {
        acc[r][2 * k] = _mm512_dpbf16_ps(acc[r][2 * k], as_pairs(pl[k]), pw);
        acc[r][2 * k + 1] = _mm512_dpbf16_ps(acc[r][2 * k + 1], as_pairs(ph[k]), pw);
      }
    }
  };
  int64_t i = 0;
  for (; i + 1 < count; i += 2) step(i, v[i + 1]);
  if (i < count) step(i, nullptr);
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 2 * CB; ++j) _mm512_storeu_ps(o + r * os + c0 + 16 * j, acc[r][j]);
}

// Rows of fp32 probabilities (`count` of each, zero up to an even count) rounded to bf16, read as pairs:
// dst[rows][ds].
PAIRS16 static void round_probs(const float* prob, int64_t pstride, int64_t count, int64_t rows, uint16_t* dst,
                                int64_t ds) {
  const int64_t n = (count + 1) / 2 * 2;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; i += 32) {
      const __m512 a = _mm512_maskz_loadu_ps(first16(n - i), prob + r * pstride + i);
      const __m512 b = _mm512_maskz_loadu_ps(first16(n - i - 16), prob + r * pstride + i + 16);
      _mm512_storeu_si512(dst + r * ds + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));  // a: low half
    }
}

struct Pairs16 {
  static constexpr bool on = true;

  // bf16 where the caller asks for it (Problem::pairs: NativeBackend.pairs, which times this loop against
  // brgemm's GEMMs on the running CPU) and the CPU has AVX512-BF16, head dims of whole vectors, V stored
  // apart from K.
  static bool cpu() { return has_avx512_bf16(); }
  static bool usable(const Problem& p) {
    return p.pairs && p.dtype == BF16 && p.d % 32 == 0 && p.dv % 32 == 0 && !p.v_in_k && cpu();
  }
  // Items run here in this process (bf16_pairs_items: how a test knows they were).
  static inline int64_t items = 0;
  static void count_item() { __atomic_fetch_add(&items, 1, __ATOMIC_RELAXED); }

  static void value_rows(const Problem& p, const Item& it, int64_t j0, int64_t count, const uint16_t** rows) {
    stored_rows(p, it, p.v, p.v_page, p.v_tok, p.v_head, j0, count, rows);
  }

  // s[r][0 .. count), rounded up to 16 keys (zero past count), for every row: q rows of stored bf16, qs
  // elements apart; buf: d * KEY_TILE values.
  PAIRS16 static void scores(const Problem& p, const Item& it, int64_t j0, int64_t count, const uint16_t* q,
                             int64_t qs, int64_t rows, uint16_t* buf, float* s, int64_t ss) {
    const int64_t d = p.d;
    if (p.k_dim == 1) {  // rows: the keys past count read a zero row
      const uint16_t* keys[KEY_TILE];
      stored_rows(p, it, p.k, p.k_page, p.k_tok, p.k_head, j0, count, keys);
      __builtin_memset(buf, 0, size_t(2 * d));
      for (int64_t i = count; i < (count + 15) / 16 * 16; ++i) keys[i] = buf;
      for (int64_t i0 = 0; i0 < count; i0 += 16)
        for (int64_t r = 0; r < rows; ++r) qk_rows16(keys + i0, q + r * qs, d, p.q_scale, s + r * ss + i0);
      return;
    }
    // Dims-major: in place where the tile's keys are one run of whole vectors (one page: dim c's keys
    // contiguous), else copied a run at a time into buf [d][KEY_TILE], zero up to a whole vector.
    const int64_t whole = (count + 31) / 32 * 32;
    const uint16_t* kt = buf;
    int64_t stride = KEY_TILE;
    for (int64_t i = 0; i < count;) {
      const int64_t run = p.k_tok != 1 ? 1 : page_run(p, j0 + i, count - i);
      const uint16_t* at = static_cast<const uint16_t*>(p.k) + key_offset(p, it.b, j0 + i, p.k_page, p.k_tok, p.k_head, it.h);
      if (run == count && count == whole) {
        kt = at;
        stride = p.k_dim;
        break;
      }
      copy_runs(at, p.k_dim, d, run, buf + i, KEY_TILE);
      i += run;
    }
    if (kt == buf)
      for (int64_t c = 0; c < d; ++c) __builtin_memset(buf + c * KEY_TILE + count, 0, size_t(2 * (whole - count)));
    const uint32_t* qw = reinterpret_cast<const uint32_t*>(q);
    by_four_rows(rows, [&](int64_t r, auto nr) {
      constexpr int NR = decltype(nr)::value;
      if (whole > 32) qk_dims_block<NR, 2>(kt, stride, qw + r * qs / 2, qs / 2, d / 2, p.q_scale, s + r * ss, ss);
      else qk_dims_block<NR, 1>(kt, stride, qw + r * qs / 2, qs / 2, d / 2, p.q_scale, s + r * ss, ss);
    });
  }

  // o[r] = alpha[r] o[r] + P[r] V for every row (o in the unpacks' order, rows os apart): P from prob's
  // fp32 rows (ps apart), rounded to bf16 into p16 ([rows][KEY_TILE]).
  PAIRS16 static void pv(const uint16_t* const* v, int64_t count, const float* prob, int64_t ps, uint16_t* p16,
                         const float* alpha, int64_t dv, int64_t rows, float* o, int64_t os) {
    round_probs(prob, ps, count, rows, p16, KEY_TILE);
    const uint32_t* pw = reinterpret_cast<const uint32_t*>(p16);
    by_four_rows(rows, [&](int64_t r, auto nr) {
      constexpr int NR = decltype(nr)::value;
      int64_t c = 0;
      for (; c + 64 <= dv; c += 64) pv_block<NR, 2>(v, count, pw + r * KEY_TILE / 2, KEY_TILE / 2, alpha + r, c, o + r * os, os);
      for (; c < dv; c += 32) pv_block<NR, 1>(v, count, pw + r * KEY_TILE / 2, KEY_TILE / 2, alpha + r, c, o + r * os, os);
    });
  }

  // V's rows widened to fp32 with their head dims in the unpacks' order (O's): dst[i][...], ds apart. For
  // a tile with a non-finite V row, whose P V takes kernel_rows.hpp's fp32 row-by-row path (with P unrounded:
  // such a tile is rare, and its result within bf16's tolerance either way).
  static void widen_v(const uint16_t* const* v, int64_t count, int64_t dv, float* dst, int64_t ds) {
    const __m512i low = _mm512_load_si512(LOW), high = _mm512_load_si512(HIGH);
    for (int64_t i = 0; i < count; ++i)
      for (int64_t c = 0; c < dv; c += 32) {
        const __m512 a = widen16(v[i] + c), b = widen16(v[i] + c + 16);
        _mm512_storeu_ps(dst + i * ds + c, _mm512_permutex2var_ps(a, low, b));
        _mm512_storeu_ps(dst + i * ds + c + 16, _mm512_permutex2var_ps(a, high, b));
      }
  }

  // A row of O from the unpacks' order of its head dims back to theirs.
  static void unpermute(float* o, int64_t dv) {
    const __m512i back0 = _mm512_load_si512(BACK0), back1 = _mm512_load_si512(BACK1);
    for (int64_t c = 0; c < dv; c += 32) {
      const __m512 lo = _mm512_loadu_ps(o + c), hi = _mm512_loadu_ps(o + c + 16);
      _mm512_storeu_ps(o + c, _mm512_permutex2var_ps(lo, back0, hi));
      _mm512_storeu_ps(o + c + 16, _mm512_permutex2var_ps(lo, back1, hi));
    }
  }
};

#undef PAIRS16
