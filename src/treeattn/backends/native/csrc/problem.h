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
// Vector width of every kernel path (8 fp32 lanes), and key padding of a tile for the QK micro-kernel.
constexpr int64_t LANES = 8;
constexpr int64_t KEY_PAD = 4;

struct Problem {
  int32_t dtype;
  const void* q;  // [total_q, h_q, d], element strides below
  int64_t q_row, q_head;
  const void* k;  // key j of a request: see key_offset
  int64_t k_page, k_tok, k_head;
  const void* v;
  int64_t v_page, v_tok, v_head;
  void* out;  // [total_q, h_q, dv] in dtype
  int64_t o_row, o_head;
  float* lse;  // [total_q, h_q] fp32, base 2
  int64_t l_row, l_head;
  int64_t h_kv, group, d, dv;
  bool v_in_k;  // V is K's first dv dims (MLA's absorbed form): the packed K tile serves as V's
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

static inline int64_t padded_rows(int64_t rows) { return (rows + LANES - 1) / LANES * LANES; }

// Floats of scratch one thread needs for items of this problem with at most `rows` query rows.
static inline int64_t scratch_floats(const Problem& p, int64_t rows) {
  const int64_t rp = padded_rows(rows), keys = KEY_TILE + KEY_PAD;
  return p.d * rp           // Q^T
         + 2 * keys * rp    // scores / probabilities, and visibility masks
         + p.dv * rp        // O^T
         + 5 * rp           // m, l, alpha, enter, window start of each row
         + keys * (p.d + p.dv);  // a tile of K and V rows in fp32
}

using ItemFn = void (*)(const Problem&, const Item&, float* scratch);

}  // namespace treeattn_native
