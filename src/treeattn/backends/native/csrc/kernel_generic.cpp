// Portable path: the kernel over plain 8-float structs (the compiler vectorises what it can). Runs
// on any CPU; also the baseline the ISA paths are tested against.
#include "problem.h"

namespace treeattn_native {
namespace generic {

// exp2 as the vector paths compute it (Cephes' exp2f polynomial on x - round(x)), lane by lane.
static inline float exp2_one(float x) {
  if (x != x) return x;
  x = x < -127.0f ? -127.0f : (x > 127.0f ? 127.0f : x);
  const float whole = __builtin_rintf(x), f = x - whole;
  float poly = EXP2_POLY[0];
  for (int i = 1; i < 7; ++i) poly = poly * f + EXP2_POLY[i];
  const uint32_t bits = uint32_t(int32_t(whole) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, 4);
  return poly * scale;
}

struct V {
  static constexpr int W = 8;
  static constexpr int FEW_ROWS = 8, FEW_ROWS_DIMS = 8;  // items of at most this many rows run kernel_rows.hpp
  struct T { float x[W]; };
  static inline uint32_t bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
  static inline float from(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }
  static inline T zero() { return set1(0.0f); }
  static inline T set1(float a) { T r; for (int i = 0; i < W; ++i) r.x[i] = a; return r; }
  static inline T all_ones() { return set1(from(0xffffffffu)); }
  static inline T load(const float* p) { T r; for (int i = 0; i < W; ++i) r.x[i] = p[i]; return r; }
  static inline void store(float* p, T a) { for (int i = 0; i < W; ++i) p[i] = a.x[i]; }
  static inline T bcast(const float* p) { return set1(*p); }
#define TREEATTN_LANEWISE(name, expr) \
  static inline T name(T a, T b) { T r; for (int i = 0; i < W; ++i) r.x[i] = (expr); return r; }
  TREEATTN_LANEWISE(mul, a.x[i] * b.x[i])
  TREEATTN_LANEWISE(add, a.x[i] + b.x[i])
  TREEATTN_LANEWISE(sub, a.x[i] - b.x[i])
  TREEATTN_LANEWISE(max, a.x[i] > b.x[i] ? a.x[i] : b.x[i])  // b when either is NaN, like maxps
  TREEATTN_LANEWISE(min, a.x[i] < b.x[i] ? a.x[i] : b.x[i])  // b when either is NaN, like minps
  TREEATTN_LANEWISE(div, a.x[i] / b.x[i])
  TREEATTN_LANEWISE(band, from(bits(a.x[i]) & bits(b.x[i])))
  TREEATTN_LANEWISE(eq, from(a.x[i] == b.x[i] ? 0xffffffffu : 0u))
#undef TREEATTN_LANEWISE
  static inline T fma(T a, T b, T c) { T r; for (int i = 0; i < W; ++i) r.x[i] = a.x[i] * b.x[i] + c.x[i]; return r; }  // libm's fmaf is a call
  static inline T select(T mask, T a, T b) {
    T r;
    for (int i = 0; i < W; ++i) r.x[i] = (bits(mask.x[i]) >> 31) ? a.x[i] : b.x[i];
    return r;
  }
  static inline T visible(const int32_t* enter, int32_t lo, int32_t hi) {
    T r;
    for (int i = 0; i < W; ++i) r.x[i] = from(enter[i] >= lo && enter[i] < hi ? 0xffffffffu : 0u);
    return r;
  }
  static inline T range(const int32_t* lo, const int32_t* hi, int32_t x) {  // lo <= x < hi, lane by lane
    T r;
    for (int i = 0; i < W; ++i) r.x[i] = from(lo[i] <= x && x < hi[i] ? 0xffffffffu : 0u);
    return r;
  }
  static inline T sum_lanes(const T* a) {  // lane i: the sum of a[i]'s lanes
    T r;
    for (int i = 0; i < W; ++i) {
      r.x[i] = 0.0f;
      for (int j = 0; j < W; ++j) r.x[i] += a[i].x[j];
    }
    return r;
  }
  static inline float reduce_max(T a) {
    float r = a.x[0];
    for (int i = 1; i < W; ++i) r = a.x[i] > r ? a.x[i] : r;
    return r;
  }
  static inline float reduce_add(T a) {
    float r = 0.0f;
    for (int i = 0; i < W; ++i) r += a.x[i];
    return r;
  }
  static inline T exp2(T a) { T r; for (int i = 0; i < W; ++i) r.x[i] = exp2_one(a.x[i]); return r; }
  static void widen_bf16(const uint16_t* src, float* dst, int64_t n);
  static void widen_f16(const uint16_t* src, float* dst, int64_t n);
};

#include "kernel.hpp"

static void transpose_block(const float* src, int64_t src_ld, int64_t rows, int64_t cols, float* dst, int64_t dst_ld) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_ld + r] = src[r * src_ld + c];
}

void V::widen_bf16(const uint16_t* src, float* dst, int64_t n) { for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]); }
void V::widen_f16(const uint16_t* src, float* dst, int64_t n) { for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]); }

}  // namespace generic

void run_item_generic(const Problem& p, const Item& it, float* scratch) { generic::run_item(p, it, scratch); }

}  // namespace treeattn_native
