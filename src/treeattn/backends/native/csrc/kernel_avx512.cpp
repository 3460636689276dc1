// AVX-512 paths (F, BW, VL, DQ: Skylake-SP, Zen 4 and later): the FMA kernel (kernel.hpp) and the
// brgemm kernel's glue (kernel_brgemm.hpp) over 16-lane vectors, with masks kept as all-ones float
// lanes as in the 8-lane paths. Compiled for that ISA through the pragma below; chosen at run time
// only when cpuid reports all four features.
#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include <immintrin.h>

#include "problem.h"

namespace treeattn_native {
namespace avx512 {

struct V {
  static constexpr int W = 16;
  static constexpr int FEW_ROWS = 16, FEW_ROWS_DIMS = 32;  // items of at most this many rows run kernel_rows.hpp
  using T = __m512;
  static inline T from_mask(__mmask16 k) { return _mm512_castsi512_ps(_mm512_movm_epi32(k)); }
  static inline __mmask16 to_mask(T a) { return _mm512_movepi32_mask(_mm512_castps_si512(a)); }
  static inline T zero() { return _mm512_setzero_ps(); }
  static inline T set1(float a) { return _mm512_set1_ps(a); }
  static inline T all_ones() { return _mm512_castsi512_ps(_mm512_set1_epi32(-1)); }
  static inline T load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, T a) { _mm512_storeu_ps(p, a); }
  static inline T bcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static inline T add(T a, T b) { return _mm512_add_ps(a, b); }
  static inline T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static inline T max(T a, T b) { return _mm512_max_ps(a, b); }  // b when either is NaN, like maxps
  static inline T min(T a, T b) { return _mm512_min_ps(a, b); }
  static inline T div(T a, T b) { return _mm512_div_ps(a, b); }
  static inline T band(T a, T b) { return _mm512_and_ps(a, b); }
  static inline T eq(T a, T b) { return from_mask(_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ)); }
  static inline T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static inline T select(T mask, T a, T b) { return _mm512_mask_blend_ps(to_mask(mask), b, a); }
  static inline float reduce_max(T a) { return _mm512_reduce_max_ps(a); }
  static inline float reduce_add(T a) { return _mm512_reduce_add_ps(a); }
  // Lane i of the result: the sum of a[i]'s lanes (a[W]). Halves, then quarters, are folded pairwise so
  // that every step adds whole vectors; the last step leaves the 128-bit blocks in order 0, 8, 4, 12.
  static inline T sum_lanes(const T* a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; ++i)  // [a[i] folded to 8 lanes | a[i + 8] folded]
      b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 8], 0x44), _mm512_shuffle_f32x4(a[i], a[i + 8], 0xee));
    for (int i = 0; i < 4; ++i)  // 4 lanes each of a[i], a[i + 8], a[i + 4], a[i + 12]
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88), _mm512_shuffle_f32x4(b[i], b[i + 4], 0xdd));
    const __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
    const __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
    const __m512 e = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(d0), _mm512_castps_pd(d1))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(d0), _mm512_castps_pd(d1))));
    return _mm512_shuffle_f32x4(e, e, 0xd8);
  }
  static inline T range(const int32_t* lo, const int32_t* hi, int32_t x) {  // lo <= x < hi, lane by lane
    const __m512i v = _mm512_set1_epi32(x);
    return from_mask(_mm512_cmple_epi32_mask(_mm512_loadu_si512(lo), v) & _mm512_cmplt_epi32_mask(v, _mm512_loadu_si512(hi)));
  }
  static inline T visible(const int32_t* enter, int32_t lo, int32_t hi) {  // lo <= enter < hi
    const __m512i e = _mm512_loadu_si512(enter);
    return from_mask(_mm512_cmpge_epi32_mask(e, _mm512_set1_epi32(lo)) & _mm512_cmplt_epi32_mask(e, _mm512_set1_epi32(hi)));
  }
  static inline T horner(T f, const float* c, int n) {  // c[0] f^(n-1) + ... + c[n-1]
    T poly = set1(c[0]);
    for (int i = 1; i < n; ++i) poly = fma(poly, f, set1(c[i]));
    return poly;
  }
  static inline T exp2(T x) {  // the 8-lane paths' polynomial (kernel_avx2.cpp), 16 lanes at a time
    x = _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-127.0f), x));
    const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 poly = horner(_mm512_sub_ps(x, whole), EXP2_POLY, 7);
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(whole), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(poly, _mm512_castsi512_ps(e));
  }
  // exp2 for x <= 8 (or -inf: the softmax's shifted scores), to the accuracy of exp2_poly<DEGREE>: the
  // probabilities' dtype needs no more, and the softmax spends most of its time here. At or below -125 the
  // result is exactly 0 (a masked key's -inf among them: its NaN fraction is masked off too), so that no
  // lane ever makes a denormal: each one costs a microcode assist of ~100 cycles on Intel cores (a masked
  // tile of -inf scores ran 1.5x slower scaled to 2^-160). NaN stays NaN. Four instructions fewer than exp2.
  template <int DEGREE>
  static inline T exp2_shifted(T x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_NLE_UQ);
    const __m512 whole = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 poly = horner(_mm512_sub_ps(x, whole), exp2_poly<DEGREE>(), DEGREE + 1);
    return _mm512_maskz_scalef_ps(live, poly, whole);
  }
  // The softmax's exponentials for bf16 probabilities: dst[i] = bf16(exp2_shifted<3>(s[i] * unit + shift)) rounded
  // as float_to_bf16 does, top = max(top, s[i]), for i < n (a multiple of W); returns their sum in lanes.
  // With AVX512-BF16 (every CPU whose bf16 brgemm pays) the rounding is one instruction.
  static T exp_row_bf16(const float* s, int64_t n, T unit, T shift, uint16_t* dst, T& top);
  static void widen_bf16(const uint16_t* src, float* dst, int64_t n);
  static void widen_f16(const uint16_t* src, float* dst, int64_t n);
  static void store_f16(uint16_t* dst, T x);  // W values rounded to fp16
};

// AVX512-BF16 (vdpbf16ps, vcvtne2ps2bf16). Asked once: cpuid traps to the hypervisor in a VM.
static bool has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

#include "kernel.hpp"
#include "kernel_rows_bf16.hpp"
#include "x86.hpp"
#include "kernel_brgemm.hpp"

void V::widen_bf16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) _mm512_storeu_ps(dst + i, widen16(src + i));
  for (; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}

void V::widen_f16(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// Two vectors at a time: one instruction rounds both to bf16 (1-3% faster at T 26-128 on Sapphire Rapids).
__attribute__((target("avx512bf16"))) static __m512 exp_row_bf16_native(const float* s, int64_t n, __m512 unit,
                                                                         __m512 shift, uint16_t* dst, __m512& top) {
  __m512 sum = _mm512_setzero_ps(), max = top;
  int64_t i = 0;
  for (; i + 2 * V::W <= n; i += 2 * V::W) {
    const __m512 x0 = _mm512_loadu_ps(s + i), x1 = _mm512_loadu_ps(s + i + V::W);
    const __m512 e0 = V::exp2_shifted<3>(_mm512_fmadd_ps(x0, unit, shift));
    const __m512 e1 = V::exp2_shifted<3>(_mm512_fmadd_ps(x1, unit, shift));
    max = _mm512_max_ps(max, _mm512_max_ps(x0, x1));
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    _mm512_storeu_si512(dst + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));  // e0 in the low half
  }
  for (; i < n; i += V::W) {
    const __m512 x = _mm512_loadu_ps(s + i), e = V::exp2_shifted<3>(_mm512_fmadd_ps(x, unit, shift));
    max = _mm512_max_ps(max, x);
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  top = max;
  return sum;
}

V::T V::exp_row_bf16(const float* s, int64_t n, T unit, T shift, uint16_t* dst, T& top) {
  if (has_avx512_bf16()) return exp_row_bf16_native(s, n, unit, shift, dst, top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += W) {
    const __m512 x = _mm512_loadu_ps(s + i), e = exp2_shifted<3>(_mm512_fmadd_ps(x, unit, shift));
    top = _mm512_max_ps(top, x);
    sum = _mm512_add_ps(sum, e);
    const __m512i u = _mm512_castps_si512(e), high = _mm512_srli_epi32(u, 16);
    const __m512i even = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    const __m512i b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q),
                                              _mm512_srli_epi32(_mm512_add_epi32(u, even), 16),
                                              _mm512_or_si512(high, _mm512_set1_epi32(0x40)));  // NaN stays NaN
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(b));
  }
  return sum;
}

inline void V::store_f16(uint16_t* dst, T x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

}  // namespace avx512

void run_item_avx512(const Problem& p, const Item& it, float* scratch) { avx512::run_item(p, it, scratch); }

double fma_loop_avx512(int64_t iters) { return avx512::fma_loop(iters); }
bool bf16_pairs_avx512() { return avx512::Pairs16::cpu(); }
int64_t bf16_pairs_items_avx512() { return __atomic_load_n(&avx512::Pairs16::items, __ATOMIC_RELAXED); }
void run_item_brgemm_avx512(const Problem& p, const Item& it, float* scratch) {
  avx512::brgemm_item::run(p, it, scratch);
}

}  // namespace treeattn_native
#endif
