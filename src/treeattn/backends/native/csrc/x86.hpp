// Shared by the x86 paths (AVX2 and AVX-512 translation units): the brgemm paths' data movement and the
// FMA peak's loop, included inside each one's namespace after its target pragma and kernel.hpp: every
// function here is static (internal linkage), so each translation unit keeps its own copy, compiled for
// its own ISA (see problem.h).

// An 8 x 8 block of 32-bit words, rows[r] + off (bytes) for r < 8, transposed into dst[c * ld + r].
static inline void transpose8x8(const char* const* rows, int64_t off, uint32_t* dst, int64_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(rows[i] + off));
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);  // row i, i+1 interleaved: words 0, 1 | 4, 5
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // words 2, 3 | 6, 7
  }
  for (int i = 0; i < 8; i += 4) {  // four rows' word c | c + 4, for c = 0 .. 3
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(reinterpret_cast<float*>(dst + c * ld), _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(reinterpret_cast<float*>(dst + (c + 4) * ld), _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}

static void transpose_block(const float* src, int64_t src_ld, int64_t rows, int64_t cols, float* dst, int64_t dst_ld) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) {
    const char* at[8];
    for (int k = 0; k < 8; ++k) at[k] = reinterpret_cast<const char*>(src + (r + k) * src_ld);
    int64_t c = 0;
    for (; c + 8 <= cols; c += 8) transpose8x8(at, 4 * c, reinterpret_cast<uint32_t*>(dst + c * dst_ld + r), dst_ld);
    for (; c < cols; ++c)
      for (int k = 0; k < 8; ++k) dst[c * dst_ld + r + k] = src[(r + k) * src_ld + c];
  }
  for (; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * dst_ld + r] = src[r * src_ld + c];
}

// A 16 x 16 block of 32-bit words, rows[r] + off (bytes) for r < 16, transposed into dst[c * ld + r]: 64
// shuffles (a quarter per word, against 3/8 for 8 x 8 blocks on 256-bit vectors). Templated so that the
// AVX2 translation unit, which never calls it, does not compile its 512-bit instructions.
template <int W = V::W>
static inline void transpose16x16(const char* const* rows, int64_t off, uint32_t* dst, int64_t ld) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(reinterpret_cast<const float*>(rows[i] + off));
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + j], 128-bit lane L: rows i .. i + 3 of word 4L + j
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int j = 0; j < 4; ++j) {  // word 4L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
    const __m512 even0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), odd0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    const __m512 even1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    const __m512 odd1 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    _mm512_storeu_ps(reinterpret_cast<float*>(dst + j * ld), _mm512_shuffle_f32x4(even0, even1, 0x88));
    _mm512_storeu_ps(reinterpret_cast<float*>(dst + (4 + j) * ld), _mm512_shuffle_f32x4(odd0, odd1, 0x88));
    _mm512_storeu_ps(reinterpret_cast<float*>(dst + (8 + j) * ld), _mm512_shuffle_f32x4(even0, even1, 0xdd));
    _mm512_storeu_ps(reinterpret_cast<float*>(dst + (12 + j) * ld), _mm512_shuffle_f32x4(odd0, odd1, 0xdd));
  }
}

// dst[2i] = a[i], dst[2i + 1] = b[i] for i < n 16-bit values (b null: zeros): one VNNI row pair.
template <int W = V::W>
static inline void interleave16(const char* a, const char* b, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (W == 16) {  // unpack within 128-bit lanes, then whole lanes into order: 4 shuffles per 32 pairs
    const __m512i first = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    for (; i + 32 <= n; i += 32) {
      const __m512i va = _mm512_loadu_si512(a + 2 * i);
      const __m512i vb = b ? _mm512_loadu_si512(b + 2 * i) : _mm512_setzero_si512();
      const __m512i lo = _mm512_unpacklo_epi16(va, vb), hi = _mm512_unpackhi_epi16(va, vb);
      _mm512_storeu_si512(dst + 2 * i, _mm512_permutex2var_epi64(lo, first, hi));
      _mm512_storeu_si512(dst + 2 * i + 32, _mm512_permutex2var_epi64(lo, second, hi));
    }
  }
  for (; i + 16 <= n; i += 16) {  // unpack works within 128-bit lanes: lo holds pairs 0-3 | 8-11, hi 4-7 | 12-15
    const __m256i va = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 2 * i));
    const __m256i vb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2 * i)) : _mm256_setzero_si256();
    const __m256i lo = _mm256_unpacklo_epi16(va, vb), hi = _mm256_unpackhi_epi16(va, vb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 2 * i + 16), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
  for (; i + 8 <= n; i += 8) {
    const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 2 * i));
    const __m128i vb = b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * i)) : _mm_setzero_si128();
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), _mm_unpacklo_epi16(va, vb));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 8), _mm_unpackhi_epi16(va, vb));
  }
  for (; i < n; ++i) {
    uint16_t x = 0, y = 0;
    __builtin_memcpy(&x, a + 2 * i, 2);
    if (b) __builtin_memcpy(&y, b + 2 * i, 2);
    dst[2 * i] = x;
    dst[2 * i + 1] = y;
  }
}

// The FMA peak's inner loop (native.cpp's peak): independent accumulators, enough to keep every FMA
// pipe busy through its latency (2 pipes x 4 cycles on the CPUs here), and few enough to stay in registers
// with the two operands: 16 on AVX2's 16 ymm registers spilled 3 of them to the stack, whose store-to-load
// chain held a Zen 3 at half its FMA rate. Returns the FLOPs it ran; their sum goes to a volatile, so the
// loop is not optimised away.
static double fma_loop(int64_t iters) {
  constexpr int ACC = V::W == 8 ? 12 : 16;  // registers: AVX2 16, AVX-512 32
  typename V::T acc[ACC];
  const typename V::T a = V::set1(0.999999f), b = V::set1(1e-7f);
  for (int i = 0; i < ACC; ++i) acc[i] = V::set1(float(i));
  for (int64_t n = 0; n < iters; ++n)
    for (int i = 0; i < ACC; ++i) acc[i] = V::fma(acc[i], a, b);
  for (int i = 1; i < ACC; ++i) acc[0] = V::add(acc[0], acc[i]);
  volatile float sink = V::reduce_add(acc[0]);
  (void)sink;
  return 2.0 * ACC * V::W * double(iters);
}
