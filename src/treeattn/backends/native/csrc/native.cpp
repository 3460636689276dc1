// Torch binding of the native CPU kernel: checks the tensors, cuts the batch into work items
// (splitting long prefixes when there are too few items for the threads), runs them in one
// parallel region, and merges split items by their LSEs inside that region.
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "problem.h"

namespace treeattn_native {

void run_item_generic(const Problem& p, const Item& it, float* scratch);
#if defined(__x86_64__)
void run_item_avx2(const Problem& p, const Item& it, float* scratch);
void run_item_avx512(const Problem& p, const Item& it, float* scratch);
void run_item_brgemm_avx2(const Problem& p, const Item& it, float* scratch);
void run_item_brgemm_avx512(const Problem& p, const Item& it, float* scratch);
double fma_loop_avx2(int64_t iters);  // each returns the FLOPs it ran
double fma_loop_avx512(int64_t iters);
bool bf16_pairs_avx512();
int64_t bf16_pairs_items_avx512();
#endif

namespace {

// Calls below this many FLOPs run on the calling thread: a parallel region ends in a barrier that needs
// every thread scheduled, which costs far more than such a call when the cores are oversubscribed.
constexpr double PARALLEL_FLOPS = 3e7;
// With fewer items than this per thread, prefixes are split (into pieces of at least MIN_CHUNK keys).
constexpr int64_t ITEMS_PER_THREAD = 4;
constexpr int64_t MIN_CHUNK = 512;

bool has_avx2() {
#if defined(__x86_64__)
  unsigned a, b, c, d;
  const bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
#else
  return false;
#endif
}

bool has_avx512() {
#if defined(__x86_64__)
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
#else
  return false;
#endif
}

// The kernel paths this CPU can run, best first for 16-bit dtypes: "brgemm-<isa>" runs the two GEMMs of
// a tile on oneDNN's micro-kernels (whether oneDNN has them for a dtype here is for the caller to check:
// a call throws where it has none) and the rest on <isa>'s vectors; "<isa>" is the FMA kernel.
// Asked once: cpuid traps to the hypervisor in a VM (a decoding step's attention call took 8% longer).
const std::vector<std::string>& isas() {
  static const std::vector<std::string> out = [] {
    std::vector<std::string> names;
    if (has_avx512()) names.push_back("brgemm-avx512");
    if (has_avx2()) names.push_back("brgemm-avx2");
    if (has_avx512()) names.push_back("avx512");
    if (has_avx2()) names.push_back("avx2");
    names.push_back("generic");
    return names;
  }();
  return out;
}

// The 16-bit dtypes PyTorch's brgemm (torch 2.13's CPUBlas) accepts on this CPU: bf16 from AVX-512
// (natively with AVX512-BF16 or AMX, emulated below), fp16 from AVX512-FP16 (AMX-FP16 CPUs have it too).
// Elsewhere it has no kernel for the dtype and throws, so its brgemm paths are not tried: an absent
// feature is not a failure to warn about. Asked once (cpuid, as isas()).
const std::vector<std::string>& brgemm_16bit() {
  static const std::vector<std::string> out = [] {
    std::vector<std::string> names;
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (has_avx512()) {
      names.push_back("bfloat16");
      if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 23))) names.push_back("float16");  // AVX512-FP16
    }
#endif
    return names;
  }();
  return out;
}

// Whether brgemm-avx512 can run bf16 items of few query rows (head dims multiples of 32) on AVX512-BF16's
// pairs here (kernel_rows_bf16.hpp; whether a call does is the caller's choice, attention's `pairs`). And how
// many items have, in this process.
bool bf16_pairs() {
#if defined(__x86_64__)
  return has_avx512() && bf16_pairs_avx512();
#else
  return false;
#endif
}
int64_t bf16_pairs_items() {
#if defined(__x86_64__)
  return has_avx512() ? bf16_pairs_items_avx512() : 0;
#else
  return 0;
#endif
}

bool is_brgemm(const std::string& isa) { return isa.rfind("brgemm-", 0) == 0; }

ItemFn item_fn(const std::string& isa) {
  const auto& names = isas();
  for (const auto& name : names) {
    if (name != isa) continue;
#if defined(__x86_64__)
    if (name == "brgemm-avx512") return run_item_brgemm_avx512;
    if (name == "brgemm-avx2") return run_item_brgemm_avx2;
    if (name == "avx512") return run_item_avx512;
    if (name == "avx2") return run_item_avx2;
#endif
    return run_item_generic;
  }
  std::string list;
  for (const auto& name : names) list += (list.empty() ? "" : ", ") + name;
  TORCH_CHECK(false, "native kernel path '", isa, "' is not available on this CPU (available: ", list, ")");
}

// Ends a thread's brgemm calls (oneDNN's per-thread state, AMX's tile configuration) however it leaves.
struct Release {
  bool brgemm;
  int32_t dtype;
  ~Release() {
    if (brgemm) brgemm_release(dtype);
  }
};

int32_t dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kHalf: return F16;
    case at::kBFloat16: return BF16;
    default: TORCH_CHECK(false, "native kernel: unsupported dtype ", t.scalar_type());
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  // A zero-size tensor has no meaningful strides (numpy-made ones report 0): nothing of it is read.
  TORCH_CHECK(t.numel() == 0 || t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

template <typename T>
void store(void* base, int64_t at, int64_t n, const float* x) {
  T* out = static_cast<T*>(base) + at;
  for (int64_t e = 0; e < n; ++e) out[e] = static_cast<T>(x[e]);
}

// out[at, at + n) = x, in the output's dtype (one branch per row, not per value).
void store_values(const Problem& p, int64_t at, int64_t n, const float* x) {
  if (p.dtype == F32) store<float>(p.out, at, n, x);
  else if (p.dtype == BF16) store<at::BFloat16>(p.out, at, n, x);
  else store<at::Half>(p.out, at, n, x);
}

// One (request, KV head, row block) and its chunks of keys [lo, hi) (lo > 0: keys below every row's
// window are never read; hi < kv_len: tree keys after every node the rows can see), in `count` items.
struct Group {
  int64_t b, h, t0, t1, lo, hi, count;
  float* part_o;  // [count][rows][dv] partial outputs, then [count][rows] LSEs; null when count == 1
};

// A part with no keys (treeattn.lse.is_empty): TVM's sentinel or -inf. It gets weight 0 in a merge
// whatever its output holds, since a real LSE may lie below the sentinel.
inline bool is_empty(float lse) { return lse == EMPTY_LSE || lse == -INFINITY; }

// Softmax weights 2^(lse_c - max) of `count` parts (stride apart) into `w`, normalised; returns the
// merged LSE (EMPTY_LSE, all weights 0, when every part is empty). This is treeattn.lse.merge. A sink
// (base-2 logit `sink`; -inf: none) is one more part, of value 0: it takes weight, and gives none to `w`.
inline float merge_weights(const float* lses, int64_t stride, int64_t count, float* w, float sink = -INFINITY) {
  float top = sink;
  for (int64_t c = 0; c < count; ++c)
    if (!is_empty(lses[c * stride])) top = std::max(top, lses[c * stride]);
  float total = sink == -INFINITY ? 0.0f : std::exp2(sink - top);
  for (int64_t c = 0; c < count; ++c) {
    w[c] = is_empty(lses[c * stride]) ? 0.0f : std::exp2(lses[c * stride] - top);
    total += w[c];
  }
  if (total == 0.0f) return EMPTY_LSE;
  for (int64_t c = 0; c < count; ++c) w[c] /= total;
  return top + std::log2(total);
}

// Merge a split group's partial results into out/lse, adding the sinks (no chunk counted them).
void merge_group(const Problem& p, const Group& g, std::vector<float>& w) {
  const int64_t rows = (g.t1 - g.t0) * p.group, dv = p.dv;
  const float* lses = g.part_o + g.count * rows * dv;
  w.resize(size_t(g.count + dv));  // the parts' weights, then the merged row
  float* acc = w.data() + g.count;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = p.q_starts[g.b] + g.t0 + r / p.group, head = g.h * p.group + r % p.group;
    const float lse = merge_weights(lses + r, rows, g.count, w.data(), p.sinks2 ? p.sinks2[head] : -INFINITY);
    // Part by part over the whole row (vector loops; value by value, with the dtype's branch per value,
    // the merge took 3% of a bf16 call of 64-node trees cut in two chunks per head).
    std::fill(acc, acc + dv, 0.0f);
    for (int64_t c = 0; c < g.count; ++c) {
      if (!(w[c] > 0.0f)) continue;  // a part of weight 0 adds nothing, even a NaN
      const float wc = w[c], *part = g.part_o + (c * rows + r) * dv;
      for (int64_t e = 0; e < dv; ++e) acc[e] += wc * part[e];
    }
    store_values(p, t * p.o_row + head * p.o_head, dv, acc);
    p.lse[t * p.l_row + head * p.l_head] = lse;
  }
}

void run(const Problem& p, int64_t batch, const std::string& isa) {
  const ItemFn fn = item_fn(isa);
  const bool brg = is_brgemm(isa);
  const int64_t threads = at::get_num_threads();
  const int64_t block = std::max<int64_t>(1, (brg ? BRGEMM_ROW_BLOCK : ROW_BLOCK) / p.group);
  std::vector<Group> groups;
  double flops = 0, keys = 0;
  int64_t max_rows = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t qo = p.qo_lens[b], kv = p.kv_lens[b];
    if (qo == 0) continue;
    if (kv == 0) {  // no keys at all: out 0, lse EMPTY_LSE (the sink's, with sinks)
      const std::vector<float> zeros(size_t(p.dv), 0.0f);
      for (int64_t t = p.q_starts[b]; t < p.q_starts[b] + qo; ++t)
        for (int64_t head = 0; head < p.h_kv * p.group; ++head) {
          store_values(p, t * p.o_row + head * p.o_head, p.dv, zeros.data());
          p.lse[t * p.l_row + head * p.l_head] = p.sinks2 ? p.sinks2[head] : EMPTY_LSE;
        }
      continue;
    }
    const int64_t n = p.tree_sizes[b];
    const int32_t* order = p.tree_order + 2 * p.tree_starts[b];
    for (int64_t t0 = 0; t0 < qo; t0 += block) {
      const int64_t t1 = std::min(qo, t0 + block);
      // With a window, reading starts at the lowest window start of these rows, w: no prefix key below
      // it is in any row's window. Tree node a sits at position tree_lo + depth(a) and index tree_lo + a;
      // numbered parents first, depth(a) <= a, and no tree key below w either. Any other numbering (a
      // valid tree_order need not be one) may put a node of depth >= w - tree_lo at a lower index:
      // reading starts at the first such node then (the per-key window test masks the rest).
      int64_t lo = p.window ? kv : 0;
      for (int64_t t = t0; p.window && t < t1; ++t)
        lo = std::min(lo, std::max<int64_t>(0, p.row_pos[p.q_starts[b] + t] - p.window + 1));
      for (int64_t a = 0; p.window && n > 0 && a < lo - (kv - n); ++a)
        if (p.node_depth[p.tree_starts[b] + a] >= lo - (kv - n)) {
          lo = kv - n + a;
          break;
        }
      // Reading ends after the last tree node that enters the DFS no later than these rows' nodes do: a
      // row sees only its ancestors, which enter before it. A chain (a prefill) cut into row blocks
      // reads no key after each block's last row: about half the keys of a long one.
      int64_t hi = kv;
      if (n > 0) {
        int32_t top = -1;  // the rows' latest enter (row t is node t + n - qo)
        for (int64_t t = t0; t < t1; ++t) top = std::max(top, order[2 * (t + n - qo)]);
        int64_t last = n - 1;
        while (order[2 * last] > top) --last;  // stops at the rows' own nodes at the latest
        hi = kv - n + last + 1;
      }
      for (int64_t h = 0; h < p.h_kv; ++h) {
        groups.push_back({b, h, t0, t1, lo, hi, 1, nullptr});
        max_rows = std::max(max_rows, (t1 - t0) * p.group);
        flops += 2.0 * double((t1 - t0) * p.group * (hi - lo) * (p.d + p.dv));
        keys += double(hi - lo);
      }
    }
  }
  const bool parallel = threads > 1 && flops >= PARALLEL_FLOPS;
  int64_t chunk = 0;  // keys per item (0: a group's keys in one item)
  if (parallel && int64_t(groups.size()) < ITEMS_PER_THREAD * threads) {
    const int64_t even = int64_t(std::ceil(keys / double(ITEMS_PER_THREAD * threads)));
    chunk = (std::max(MIN_CHUNK, even) + KEY_TILE - 1) / KEY_TILE * KEY_TILE;
  }
  // Items, and the partial results of groups cut into several chunks.
  std::vector<Item> items;
  std::vector<int64_t> owner;
  std::vector<int64_t> part_at(groups.size(), -1);
  int64_t part_floats = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    const int64_t count = chunk ? std::max<int64_t>(1, (g.hi - g.lo + chunk - 1) / chunk) : 1;
    g.count = count;
    if (count > 1) {
      part_at[gi] = part_floats;
      part_floats += count * (g.t1 - g.t0) * p.group * (p.dv + 1);
    }
  }
  std::vector<float> parts(static_cast<size_t>(part_floats));
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    const int64_t rows = (g.t1 - g.t0) * p.group;
    if (g.count == 1) {
      items.push_back({g.b, g.h, g.t0, g.t1, g.lo, g.hi, nullptr, nullptr});
      owner.push_back(int64_t(gi));
      continue;
    }
    g.part_o = parts.data() + part_at[gi];
    const int64_t size = (g.hi - g.lo + g.count - 1) / g.count;
    for (int64_t c = 0; c < g.count; ++c)
      items.push_back({g.b, g.h, g.t0, g.t1, g.lo + c * size, std::min(g.hi, g.lo + (c + 1) * size), g.part_o + c * rows * p.dv,
                       g.part_o + g.count * rows * p.dv + c * rows});
    for (int64_t c = 0; c < g.count; ++c) owner.push_back(int64_t(gi));
  }

  // The thread that finishes a split group's last chunk merges it: no second parallel region.
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[groups.size()]);
  for (size_t gi = 0; gi < groups.size(); ++gi) left[gi] = groups[gi].count;
  const int64_t n_items = int64_t(items.size());
  const int64_t floats = std::max(brg ? brgemm_scratch_floats(p, max_rows) : scratch_floats(p, max_rows),
                                  few_rows_floats(p, std::min<int64_t>(max_rows, MAX_FEW_ROWS))) + MAX_LANES;
  auto work = [&](float* scratch, std::vector<float>& weights, int64_t i) {
    fn(p, items[i], scratch);
    const Group& g = groups[owner[i]];
    if (g.count > 1 && left[owner[i]].fetch_sub(1) == 1) merge_group(p, g, weights);
  };
  if (!parallel) {
    std::unique_ptr<float[]> scratch(new float[size_t(floats)]);  // not zero-filled: every item sets what it reads
    std::vector<float> weights;
    Release release{brg, p.dtype};
    for (int64_t i = 0; i < n_items; ++i) work(scratch.get(), weights, i);
    return;
  }
  std::atomic<int64_t> next{0};  // items are taken dynamically: uneven requests still balance
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::unique_ptr<float[]> scratch(new float[size_t(floats)]);
    std::vector<float> weights;
    Release release{brg, p.dtype};
    // The next item is claimed before this one runs, and its first keys prefetched meanwhile.
    for (int64_t i = next++; i < n_items;) {
      const int64_t following = next++;
      if (following < n_items) prefetch_tile(p, items[following], items[following].c0);
      work(scratch.get(), weights, i);
      i = following;
    }
  });
}

Problem problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& meta,
                const at::Tensor& order, const at::Tensor& pages, int64_t page_size, double sm_scale,
                const at::Tensor& out, const at::Tensor& lse) {
  check_rows(q, "q");
  // K's head dims may be strided (vLLM's CPU cache keeps each page's K dims-major); every other row is contiguous.
  TORCH_CHECK(k.device().is_cpu() && (k.numel() == 0 || k.stride(-1) >= 1), "k must be on the CPU with positive strides");
  check_rows(v, "v");
  check_rows(out, "out");
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && lse.dim() == 2, "q/out must be [rows, heads, d], lse [rows, heads]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(), "q, k, v and out must share one dtype");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.device().is_cpu(), "lse must be float32 on the CPU");
  TORCH_CHECK(meta.scalar_type() == at::kLong && meta.is_contiguous() && meta.dim() == 2 && meta.size(0) == 7,
              "meta must be a contiguous int64 [7, batch] tensor");
  TORCH_CHECK(order.scalar_type() == at::kInt && order.is_contiguous(), "tree_order must be contiguous int32");
  TORCH_CHECK(pages.scalar_type() == at::kInt && pages.is_contiguous(), "page_indices must be contiguous int32");
  const bool paged = page_size > 0;
  TORCH_CHECK(k.dim() == (paged ? 4 : 3) && v.dim() == k.dim(), "k/v must be ", paged ? "[pages, page_size, h_kv, d]" : "[tokens, h_kv, d]");
  Problem p{};
  p.dtype = dtype_code(q);
  p.q = q.data_ptr();
  p.q_row = q.stride(0);
  p.q_head = q.stride(1);
  const int64_t o = paged ? 1 : 0;  // ragged k/v have no page dimension
  p.k = k.data_ptr();
  p.k_page = paged ? k.stride(0) : 0;
  p.k_tok = k.stride(o);
  p.k_head = k.stride(o + 1);
  p.k_dim = k.numel() ? k.stride(-1) : 1;
  p.v = v.data_ptr();
  p.v_page = paged ? v.stride(0) : 0;
  p.v_tok = v.stride(o);
  p.v_head = v.stride(o + 1);
  p.out = out.data_ptr();
  p.o_row = out.stride(0);
  p.o_head = out.stride(1);
  p.lse = lse.data_ptr<float>();
  p.l_row = lse.stride(0);
  p.l_head = lse.stride(1);
  p.h_kv = k.size(o + 1);
  TORCH_CHECK(p.h_kv > 0 && q.size(1) % p.h_kv == 0, "query heads must be a multiple of KV heads");
  p.group = q.size(1) / p.h_kv;
  TORCH_CHECK(p.group <= ROW_BLOCK, "native kernel: at most ", ROW_BLOCK, " query heads per KV head, got ", p.group);
  p.d = q.size(2);
  p.dv = v.size(o + 2);
  TORCH_CHECK(k.size(o + 2) == p.d && out.size(2) == p.dv && out.size(1) == q.size(1), "head dims disagree");
  // MLA's absorbed form: V is K's first dv dims (same storage and strides), read from the K tile.
  p.v_in_k = p.dv <= p.d && p.k_dim == 1 && v.data_ptr() == k.data_ptr() && p.v_page == p.k_page && p.v_tok == p.k_tok &&
             p.v_head == p.k_head;
  p.q_scale = float(sm_scale / std::log(2.0));
  p.page_size = page_size;
  p.page_indices = pages.data_ptr<int32_t>();
  p.tree_order = order.data_ptr<int32_t>();
  const int64_t* m = meta.data_ptr<int64_t>();
  const int64_t batch = meta.size(1);
  p.q_starts = m;
  p.qo_lens = m + batch;
  p.kv_starts = m + 2 * batch;
  p.kv_lens = m + 3 * batch;
  p.tree_starts = m + 4 * batch;
  p.tree_sizes = m + 5 * batch;
  p.page_starts = m + 6 * batch;
  return p;
}

// The attention variants: window (0: none) with each query row's position and each tree node's depth
// (int64, in the plan's rows), soft-cap (0: none), sinks (float32 [h_q] natural-log logits, or empty).
// `pairs`: bf16 items of few rows on the brgemm path run on AVX512-BF16's pairs where the CPU has them.
void attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& meta,
               const at::Tensor& order, const at::Tensor& pages, int64_t page_size, double sm_scale,
               const at::Tensor& out, const at::Tensor& lse, const std::string& isa, int64_t window,
               double softcap, const at::Tensor& sinks, const at::Tensor& row_pos, const at::Tensor& depths,
               bool pairs) {
  Problem p = problem(q, k, v, meta, order, pages, page_size, sm_scale, out, lse);
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0: not used)");
  if (window > 0) {
    TORCH_CHECK(row_pos.scalar_type() == at::kLong && row_pos.is_contiguous() && row_pos.numel() >= q.size(0) &&
                    depths.scalar_type() == at::kLong && depths.is_contiguous() && depths.numel() == order.size(0),
                "a window needs contiguous int64 row positions [total_q] and node depths [nodes]");
    p.window = window;
    p.row_pos = row_pos.data_ptr<int64_t>();
    p.node_depth = depths.data_ptr<int64_t>();
  }
  if (softcap > 0.0) {
    p.q_scale = float(sm_scale / softcap);
    p.cap2 = float(softcap / std::log(2.0));
  }
  std::vector<float> sinks2;
  if (sinks.numel()) {
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.device().is_cpu() && sinks.numel() == q.size(1),
                "sinks must be float32 [h_q] on the CPU");
    const at::Tensor flat = sinks.contiguous();
    sinks2.resize(size_t(flat.numel()));
    for (int64_t i = 0; i < flat.numel(); ++i) sinks2[size_t(i)] = float(flat.data_ptr<float>()[i] / std::log(2.0));
    p.sinks2 = sinks2.data();
  }
  p.pairs = pairs;
  p.b_pairs = is_brgemm(isa) && p.dtype != F32 && brgemm_b_pairs(p.dtype);
  run(p, meta.size(1), isa);
}

// Base-2 LSE merge of two partial results, elementwise over rows x heads; out/lse may alias a.
template <typename T>
void merge_typed(const at::Tensor& a, const at::Tensor& la, const at::Tensor& b, const at::Tensor& lb,
                 const at::Tensor& out, const at::Tensor& lse) {
  const int64_t rows = la.numel(), d = a.size(-1);
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  T* po = out.data_ptr<T>();
  const float* sa = la.data_ptr<float>();
  const float* sb = lb.data_ptr<float>();
  float* so = lse.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, d)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float parts[2] = {sa[r], sb[r]};
      float w[2];
      const float merged = merge_weights(parts, 1, 2, w);
      for (int64_t e = 0; e < d; ++e) {
        float acc = 0.0f;  // a part of weight 0 adds nothing, even a NaN
        if (w[0] > 0.0f) acc += w[0] * static_cast<float>(pa[r * d + e]);
        if (w[1] > 0.0f) acc += w[1] * static_cast<float>(pb[r * d + e]);
        po[r * d + e] = static_cast<T>(acc);
      }
      so[r] = merged;
    }
  });
}

void merge_state(const at::Tensor& a, const at::Tensor& la, const at::Tensor& b, const at::Tensor& lb,
                 const at::Tensor& out, const at::Tensor& lse) {
  for (const auto* t : {&a, &b, &out}) TORCH_CHECK(t->is_contiguous() && t->device().is_cpu() &&
                                                   t->scalar_type() == a.scalar_type() && t->sizes() == a.sizes(),
                                                   "merge_state: outputs must be contiguous CPU tensors of one shape and dtype");
  for (const auto* t : {&la, &lb, &lse}) TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat &&
                                                     t->numel() * a.size(-1) == a.numel(),
                                                     "merge_state: LSEs must be contiguous float32, one per output row");
  switch (dtype_code(a)) {
    case F32: merge_typed<float>(a, la, b, lb, out, lse); break;
    case BF16: merge_typed<at::BFloat16>(a, la, b, lb, out, lse); break;
    default: merge_typed<at::Half>(a, la, b, lb, out, lse); break;
  }
}

// This CPU's peak in GFLOP/s on `threads` threads (0: at::get_num_threads()), measured now: "fma-avx512" /
// "fma-avx2" (independent FMAs on 16 / 8 lanes), or "brgemm-fp32" / "brgemm-bf16" / "brgemm-fp16" (oneDNN's
// micro-kernel on the brgemm path's QK^T shape at T 64, group 4, d 128: 256 x 256 x 128, operands in cache,
// its fastest of the kernel's shapes measured on a Sapphire Rapids).
// Each thread runs `iters` rounds; throws where the kind is not available.
double peak(const std::string& kind, int64_t iters, int64_t threads) {
  if (threads <= 0) threads = at::get_num_threads();
  constexpr int64_t M = 256, N = 256, K = 128;
  const bool fma = kind == "fma-avx512" || kind == "fma-avx2";
  TORCH_CHECK(fma || kind == "brgemm-fp32" || kind == "brgemm-bf16" || kind == "brgemm-fp16", "unknown peak kind ", kind);
  TORCH_CHECK(!fma || (kind == "fma-avx512" ? has_avx512() : has_avx2()), kind, " is not available on this CPU");
  const int32_t dtype = kind == "brgemm-bf16" ? BF16 : kind == "brgemm-fp16" ? F16 : F32;
  std::vector<double> ran(threads, 0.0);  // each thread's FLOPs (brgemm is a call into libtorch: never elided)
  auto body = [&](int64_t t) {
#if defined(__x86_64__)
    if (fma) {
      ran[t] = kind == "fma-avx512" ? fma_loop_avx512(iters) : fma_loop_avx2(iters);
      return;
    }
#endif
    // Operands: zeros in fp32, 0x3f00 in 16 bits (0.5 in bf16, 1.75 in fp16): finite sums either way.
    const size_t halves = dtype == F32 ? 2 : 1;
    std::vector<uint16_t> a(M * K * halves, dtype == F32 ? 0 : 0x3f00), b(K * N * halves, dtype == F32 ? 0 : 0x3f00);
    std::vector<float> c(M * N, 0.0f);
    Release release{true, dtype};
    // C overwritten, not accumulated: with add_C the 256 KB of C moving through L2 held AMX to 0.6x its rate
    for (int64_t i = 0; i < iters; ++i) brgemm(dtype, M, N, K, K, N, N, false, a.data(), b.data(), c.data());
    ran[t] = 2.0 * M * N * K * double(iters);
  };
  auto all = [&]() {
    at::parallel_for(0, threads, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) body(t);
    });
  };
  all();  // warm-up: each thread's kernel JIT compile, and the clock's ramp
  const auto start = std::chrono::steady_clock::now();
  all();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return std::accumulate(ran.begin(), ran.end(), 0.0) / seconds / 1e9;
}

}  // namespace
}  // namespace treeattn_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isas", &treeattn_native::isas, "kernel paths this CPU can run, best first for 16-bit dtypes");
  m.def("brgemm_16bit", &treeattn_native::brgemm_16bit, "16-bit dtypes PyTorch's brgemm accepts on this CPU");
  m.def("bf16_pairs", &treeattn_native::bf16_pairs,
        "whether brgemm-avx512 can run bf16 items of few rows (head dims multiples of 32) on AVX512-BF16's bf16 pairs here");
  m.def("bf16_pairs_items", &treeattn_native::bf16_pairs_items, "bf16 items run on those pairs in this process");
  // The GIL is released while the kernels run: other Python threads (other layers, other requests) go on.
  m.def("attention", &treeattn_native::attention, "ragged or paged tree attention for a whole batch",
        py::call_guard<py::gil_scoped_release>());
  m.def("peak", &treeattn_native::peak, "this CPU's measured FMA or brgemm peak in GFLOP/s (kind, rounds per thread, threads)",
        py::call_guard<py::gil_scoped_release>());
  m.def("merge_state", &treeattn_native::merge_state, "base-2 LSE merge of two partial results",
        py::call_guard<py::gil_scoped_release>());
}
