// One tree-attention call as plain data, shared by the binding (native.cpp) and the per-ISA kernels.
//
// Kept free of torch and standard-library templates on purpose: the kernel translation units are
// compiled for different ISAs, and an inline function or template instantiated in two of them would
// be merged by the linker into one copy that may use instructions the running CPU lacks.
#pragma once
#include <stdint.h>

namespace treeattn_native {

enum DType : int32_t { F32 = 0, F16 = 1, BF16 = 2 };

// Keys per tile, and query rows (packed as row t * group + g) per work item: whole query tokens, so a
// GQA group may not exceed ROW_BLOCK.
constexpr int64_t KEY_TILE = 64;
constexpr int64_t ROW_BLOCK = 256;
// The widest vector of any kernel path (16 fp32 lanes: AVX-512); each path pads its rows to its own
// width (V::W in kernel.hpp), scratch is sized for this one. Key padding of a tile for the QK micro-kernel.
constexpr int64_t MAX_LANES = 16;
constexpr int64_t KEY_PAD = 4;

// exp2's polynomials in f = x - round(x), on [-0.5, 0.5], highest degree first: Cephes' exp2f (2e-7
// relative: fp32 probabilities) and a degree-4 fit (3e-6: probabilities rounded to 16 bits).
constexpr float EXP2_POLY[] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                               5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};
constexpr float EXP2_POLY_16[] = {9.57009568810463e-3f, 5.591785907745361e-2f, 2.40247443318367e-1f,
                                  6.931217908859253e-1f, 9.999992847442627e-1f};
// Degree 3, to 7.5e-5 relative: probabilities rounded to bf16 (2^-9) need no more (exp_row_bf16).
constexpr float EXP2_POLY_BF16[] = {5.517144873738289e-2f, 2.426111102104187e-1f, 6.932610273361206e-1f,
                                    9.999280571937561e-1f};
// The polynomial of a degree: 6 (fp32 probabilities), 4 (fp16) or 3 (bf16).
template <int DEGREE>
constexpr const float* exp2_poly() {
  static_assert(DEGREE == 3 || DEGREE == 4 || DEGREE == 6, "exp2 polynomials: degree 3, 4 or 6");
  return DEGREE == 3 ? EXP2_POLY_BF16 : DEGREE == 4 ? EXP2_POLY_16 : EXP2_POLY;
}

struct Problem {
  int32_t dtype;
  const void* q;  // [total_q, h_q, d], element strides below
  int64_t q_row, q_head;
  const void* k;  // key j of a request: see key_offset
  int64_t k_page, k_tok, k_head;
  int64_t k_dim;  // element stride between a key's head dims: 1, or a page's keys apart in vLLM's CPU cache
  const void* v;
  int64_t v_page, v_tok, v_head;
  void* out;  // [total_q, h_q, dv] in dtype
  int64_t o_row, o_head;
  float* lse;  // [total_q, h_q] fp32, base 2
  int64_t l_row, l_head;
  int64_t h_kv, group, d, dv;
  bool v_in_k;  // V is K's first dv dims (MLA's absorbed form): the packed K tile serves as V's
  bool b_pairs;  // brgemm paths: oneDNN wants a 16-bit B in VNNI pairs here (brgemm_b_pairs), else plain
  bool pairs;  // bf16 items of few rows on bf16 pairs where the CPU has them (kernel_rows_bf16.hpp): the caller's choice
  float q_scale;  // Q's factor: sm_scale * log2(e) (scores in the base-2 domain), sm_scale / cap with a soft-cap
  float cap2;     // logit soft-cap: scores are cap2 * tanh(q_scale * q.k), cap2 = cap * log2(e); 0: none
  const float* sinks2;  // [h_q] sink logits in base 2, or null
  int64_t window;       // sliding window (0: none): a row at position p sees keys at positions > p - window
  const int64_t* row_pos;     // [total_q] each query row's position (window only)
  const int64_t* node_depth;  // [nodes] each tree node's depth, in tree_order's rows (window only)
  int64_t page_size;  // 0: ragged keys (token kv_starts[b] + j)
  const int32_t* page_indices;
  const int32_t* tree_order;  // [nodes, 2] (enter, exit)
  // Per request (length batch):
  const int64_t* q_starts;
  const int64_t* qo_lens;
  const int64_t* kv_starts;
  const int64_t* kv_lens;
  const int64_t* tree_starts;
  const int64_t* tree_sizes;
  const int64_t* page_starts;
};

// Query rows [t0, t1) of request b (all group heads of KV head h) against its keys [c0, c1).
struct Item {
  int64_t b, h, t0, t1, c0, c1;
  float* part_o;    // null: write the final out/lse; else a partial result [rows][dv], normalised
  float* part_lse;  // [rows], base 2 (EMPTY_LSE where no key of [c0, c1) is visible); sinks left out
};

constexpr float EMPTY_LSE = -5e4f;

// Element offset of key j (of request b, KV head h) in K or V.
static inline int64_t key_offset(const Problem& p, int64_t b, int64_t j, int64_t page, int64_t tok, int64_t head,
                                 int64_t h) {
  if (p.page_size == 0) return (p.kv_starts[b] + j) * tok + h * head;
  const int64_t id = p.page_indices[p.page_starts[b] + j / p.page_size];
  return id * page + (j % p.page_size) * tok + h * head;
}

// Prefetches the K and V rows of keys [j0, j1) of item `it` (up to it.c1): the hardware
// prefetchers stop at every 4 KiB page and lose token-major layouts' strides, so that the misses of a
// tile would otherwise come one row at a time as the kernel reaches them. Into L2 (prefetcht1): into
// L1, the few-rows loop ran 1.3-1.9x slower on a Zen 4 (4 requests of 2-node trees after 4096 keys,
// fp32 and fp16). They are for keys in memory, as when serving: a step goes round every layer's cache. On
// a Zen 5 (vLLM's cells, 16 decodes, h 9/3, d 64, 576 keys), with the calls going round 30 layers' caches,
// the few-rows loop ran 0.92x (fp32) and 0.87x (bf16) as fast without them; with one layer's cache called
// again and again (in L3), 1.17x and 1.39x: bench/vllm_kernels.py times both. Always inlined: GCC takes
// a function whose only effects are prefetches for one without effects and deletes the calls it does not
// inline (until 2026-12-06 every call of these two was gone; see test_native_prefetches_compiled_in).
__attribute__((always_inline)) static inline void prefetch_keys(const Problem& p, const Item& it, int64_t j0, int64_t j1) {
  const int64_t bytes = p.dtype == F32 ? 4 : 2, end = j1 < it.c1 ? j1 : it.c1;
  for (int64_t j = j0; j < end;) {  // one page at a time: its rows are evenly spaced
    const int64_t stop = p.page_size == 0 || (j / p.page_size + 1) * p.page_size > end ? end
                                                                                       : (j / p.page_size + 1) * p.page_size;
    const char* k = static_cast<const char*>(p.k) + key_offset(p, it.b, j, p.k_page, p.k_tok, p.k_head, it.h) * bytes;
    const char* v = static_cast<const char*>(p.v) + key_offset(p, it.b, j, p.v_page, p.v_tok, p.v_head, it.h) * bytes;
    if (p.k_dim != 1)  // dims-major K: each dim's keys of this page run are contiguous
      for (int64_t c = 0; c < p.d; ++c)
        for (int64_t e = 0; e < (stop - j) * bytes; e += 64) __builtin_prefetch(k + c * p.k_dim * bytes + e, 0, 2);
    for (; j < stop; ++j, k += p.k_tok * bytes, v += p.v_tok * bytes) {
      for (int64_t c = 0; p.k_dim == 1 && c < p.d * bytes; c += 64) __builtin_prefetch(k + c, 0, 2);
      for (int64_t c = 0; !p.v_in_k && c < p.dv * bytes; c += 64) __builtin_prefetch(v + c, 0, 2);
    }
  }
}
__attribute__((always_inline)) static inline void prefetch_tile(const Problem& p, const Item& it, int64_t j0) {
  prefetch_keys(p, it, j0, j0 + KEY_TILE);
}

// Floats of scratch one thread needs for items of this problem with at most `rows` query rows: the
// FMA kernel's (kernel.hpp).
static inline int64_t scratch_floats(const Problem& p, int64_t rows) {
  const int64_t rp = (rows + MAX_LANES - 1) / MAX_LANES * MAX_LANES, keys = KEY_TILE + KEY_PAD;
  return p.d * rp           // Q^T
         + 2 * keys * rp    // scores / probabilities, and visibility masks
         + p.dv * rp        // O^T
         + 5 * rp           // m, l, alpha, enter, window start of each row
         + keys * (p.d + p.dv);  // a tile of K and V rows in fp32
}

// Items of few rows run kernel_rows.hpp's run_rows (few_rows there: at most MAX_FEW_ROWS), in this much.
constexpr int64_t MAX_FEW_ROWS = 32;
static inline int64_t few_rows_floats(const Problem& p, int64_t rows) {
  const int64_t dp = (p.d + MAX_LANES - 1) / MAX_LANES * MAX_LANES, dvp = (p.dv + MAX_LANES - 1) / MAX_LANES * MAX_LANES;
  return rows * (dp + 2 * KEY_TILE + dvp + 5)  // Q, scores, visibility, O, and m, l, alpha, enter, window start
         + 4 * KEY_TILE                          // each key's visibility bounds
         + KEY_TILE * (dp + dvp);                // a tile of K and V rows in fp32
}

// The brgemm kernel's (kernel_brgemm.hpp): key tiles of up to BRGEMM_TILE keys, padded to a multiple
// of KEY_TILE; rows padded to brgemm_rows, head dim to an even count,
// every buffer aligned to 64 bytes (ALIGN floats of slack for each of its 15 buffers and the start).
constexpr int64_t ALIGN = 16;
// 384 keys: measured on Sapphire Rapids (AMX, bf16, h 32/8, d 128) against 128-512, 1.06-1.13x faster
// than 256 at T 64 and 128 with P 4096 and 1.1x at P 512; at T 8, P 4096 0.9-1.0x (within run-to-run noise).
constexpr int64_t BRGEMM_TILE = 384;
// Query rows per brgemm work item: more than the FMA kernel's, since each item packs its key tiles once
// for all its rows (T 128 x group 4 in one item); S (rows x tile, fp32) stays within L2.
constexpr int64_t BRGEMM_ROW_BLOCK = 512;
static inline int64_t brgemm_rows(int64_t rows) { return rows <= 16 ? (rows + 3) / 4 * 4 : (rows + 15) / 16 * 16; }
static inline int64_t brgemm_scratch_floats(const Problem& p, int64_t rows) {
  const int64_t mp = brgemm_rows(rows), dp = (p.d + 1) / 2 * 2;
  return mp * dp              // Q in its dtype
         + dp * BRGEMM_TILE      // K^T tile (VNNI for 16-bit)
         + BRGEMM_TILE * p.dv    // V tile (VNNI for 16-bit)
         + 2 * mp * BRGEMM_TILE  // scores and probabilities
         + mp * p.dv             // O
         + 5 * mp                // m, l, alpha, enter, window start of each row
         + 4 * BRGEMM_TILE       // each key's visibility bounds
         + p.dv               // one output row
         + 16 * ALIGN;
}

using ItemFn = void (*)(const Problem&, const Item&, float* scratch);

// oneDNN's brgemm micro-kernels through PyTorch (brgemm.cpp, the only translation unit that sees torch):
// C[M x N] (+)= A[M x K] B[K x N], row-major, fp32 C; a 16-bit B is in the layout brgemm_b_pairs says.
// Throws (c10::Error) where oneDNN has no kernel for dtype on this CPU. brgemm_release: once per thread
// after its last call.
void brgemm(int32_t dtype, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add,
            const void* a, const void* b, float* c);
void brgemm_release(int32_t dtype);
// Whether oneDNN's kernel for a 16-bit dtype reads B in VNNI pairs [K/2][N][2] (AMX; bf16 on AVX512-BF16)
// or plain [K][N] (fp16 on AVX512-FP16 without AMX-FP16: PyTorch passes "VNNI" through, oneDNN reads it
// plain). Probed once per process and dtype on a known product; true where the probe cannot tell (the
// path's self-check then judges it).
bool brgemm_b_pairs(int32_t dtype);

}  // namespace treeattn_native
