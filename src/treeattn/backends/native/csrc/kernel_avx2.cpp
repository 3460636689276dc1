// AVX2 + FMA + F16C paths (x86-64-v3: Haswell, Zen and later): the FMA kernel (kernel.hpp) and the
// brgemm kernel's glue (kernel_brgemm.hpp) over 8-lane vectors. Compiled for that ISA through the
// pragma below, whatever flags the rest of the extension gets; chosen at run time only when cpuid
// reports all three features.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "problem.h"

namespace treeattn_native {
namespace avx2 {

struct V {
  static constexpr int W = 8;
  static constexpr int FEW_ROWS = 16, FEW_ROWS_DIMS = 16;  // items of at most this many rows run kernel_rows.hpp
  using T = __m256;
  static inline T zero() { return _mm256_setzero_ps(); }
  static inline T set1(float a) { return _mm256_set1_ps(a); }
  static inline T all_ones() { return _mm256_castsi256_ps(_mm256_set1_epi32(-1)); }
  static inline T load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, T a) { _mm256_storeu_ps(p, a); }
  static inline T bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static inline T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static inline T add(T a, T b) { return _mm256_add_ps(a, b); }
  static inline T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static inline T max(T a, T b) { return _mm256_max_ps(a, b); }
  static inline T min(T a, T b) { return _mm256_min_ps(a, b); }
  static inline T div(T a, T b) { return _mm256_div_ps(a, b); }
  static inline T band(T a, T b) { return _mm256_and_ps(a, b); }
  static inline T eq(T a, T b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static inline T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static inline T select(T mask, T a, T b) { return _mm256_blendv_ps(b, a, mask); }
  static inline float reduce_max(T a) {  // of the 8 lanes
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_shuffle_ps(x, x, 1)));
  }
  static inline float reduce_add(T a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
  }
  // Lane i of the result: the sum of a[i]'s lanes (a[W]): 128-bit halves folded pairwise, then sums
  // within 128-bit blocks ([a0 .. a3 | a4 .. a7]).
  static inline T sum_lanes(const T* a) {
    __m256 b[4];
    for (int i = 0; i < 4; ++i)  // [a[i] folded to 4 lanes | a[i + 4] folded]
      b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
    const __m256 d0 = _mm256_add_ps(_mm256_unpacklo_ps(b[0], b[1]), _mm256_unpackhi_ps(b[0], b[1]));
    const __m256 d1 = _mm256_add_ps(_mm256_unpacklo_ps(b[2], b[3]), _mm256_unpackhi_ps(b[2], b[3]));
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(d0), _mm256_castps_pd(d1))),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(d0), _mm256_castps_pd(d1))));
  }
  static inline T range(const int32_t* lo, const int32_t* hi, int32_t x) {  // lo <= x < hi, lane by lane
    const __m256i v = _mm256_set1_epi32(x);
    const __m256i below = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)), v);
    const __m256i under = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi)), v);
    return _mm256_castsi256_ps(_mm256_andnot_si256(below, under));
  }
  static inline T visible(const int32_t* enter, int32_t lo, int32_t hi) {  // lo <= enter < hi
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(enter));
    const __m256i ge = _mm256_cmpgt_epi32(e, _mm256_set1_epi32(lo - 1));
    const __m256i lt = _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), e);
    return _mm256_castsi256_ps(_mm256_and_si256(ge, lt));
  }
  static inline T horner(T f, const float* c, int n) {  // c[0] f^(n-1) + ... + c[n-1]
    T poly = set1(c[0]);
    for (int i = 1; i < n; ++i) poly = fma(poly, f, set1(c[i]));
    return poly;
  }
  static inline T exp2(T x) {  // Cephes' exp2f polynomial on x - round(x); exp2(-inf) = 0, NaN stays NaN
    x = _mm256_min_ps(_mm256_set1_ps(127.0f), _mm256_max_ps(_mm256_set1_ps(-127.0f), x));
    const __m256 whole = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, whole);
    const __m256 poly = horner(f, EXP2_POLY, 7);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(poly, _mm256_castsi256_ps(e));
  }
  // exp2 for x <= 8 (or -inf), to the accuracy of exp2_poly<DEGREE> (see kernel_avx512.cpp).
  template <int DEGREE>
  static inline T exp2_shifted(T x) {
    x = _mm256_max_ps(_mm256_set1_ps(-127.0f), x);
    const __m256 whole = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 poly = horner(_mm256_sub_ps(x, whole), exp2_poly<DEGREE>(), DEGREE + 1);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(poly, _mm256_castsi256_ps(e));
  }
  // The softmax's exponentials for bf16 probabilities (as kernel_avx512.cpp's, with integer rounding).
  static T exp_row_bf16(const float* s, int64_t n, T unit, T shift, uint16_t* dst, T& top);
  static void widen_bf16(const uint16_t* src, float* dst, int64_t n);
  static void widen_f16(const uint16_t* src, float* dst, int64_t n);
  static void store_f16(uint16_t* dst, T x);  // W values rounded to fp16
};

#include "kernel.hpp"
using Pairs16 = NoPairs;  // no bf16 dot product on these vectors: the brgemm path's bf16 items stay there
#include "x86.hpp"
#include "kernel_brgemm.hpp"

void V::widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

void V::widen_f16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

V::T V::exp_row_bf16(const float* s, int64_t n, T unit, T shift, uint16_t* dst, T& top) {
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += W) {
    const __m256 x = _mm256_loadu_ps(s + i), e = exp2_shifted<3>(_mm256_fmadd_ps(x, unit, shift));
    top = _mm256_max_ps(top, x);
    sum = _mm256_add_ps(sum, e);
    const __m256i u = _mm256_castps_si256(e), high = _mm256_srli_epi32(u, 16);
    const __m256i even = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
    __m256i b = _mm256_srli_epi32(_mm256_add_epi32(u, even), 16);
    b = _mm256_blendv_epi8(b, _mm256_or_si256(high, _mm256_set1_epi32(0x40)),
                           _mm256_castps_si256(_mm256_cmp_ps(e, e, _CMP_UNORD_Q)));  // NaN stays NaN
    b = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(b));
  }
  return sum;
}

inline void V::store_f16(uint16_t* dst, T x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace avx2

void run_item_avx2(const Problem& p, const Item& it, float* scratch) { avx2::run_item(p, it, scratch); }

double fma_loop_avx2(int64_t iters) { return avx2::fma_loop(iters); }
void run_item_brgemm_avx2(const Problem& p, const Item& it, float* scratch) {
  avx2::brgemm_item::run(p, it, scratch);
}

}  // namespace treeattn_native
#endif
