// Can software prefetches hide the K/V rows' memory time behind compute on this CPU? The FMA kernel's
// question in isolation (docs/architecture.md, "One call, from the API to a kernel", the FMA kernel on AVX2):
//
//     cc -O2 -mavx2 -mfma bench/prefetch_probe.c -o /tmp/prefetch_probe && /tmp/prefetch_probe [--huge]
//
// One head's rows of a 128 MiB fp32 K (32768 keys x 8 heads x 128 dims, beyond the L3; token-major: a
// key's 8 heads in one 4 KiB row; or head-major: each head's keys contiguous) are copied into a 64-key
// tile, as the kernel packs them; after each copy comes FMA work on registers, standing in for the tile's
// GEMMs. Ways to fetch the next tile: none (the hardware prefetchers alone), prefetches issued during the
// copy (the kernel's way), or prefetches (hint T1 or T0) or real loads spread over the compute in 8 or 64
// slices, beside the same slicing with no fetch (what slicing alone costs). Prints the TSC ticks per tile
// of the copy, the compute and both, median of 7 interleaved rounds. --huge asks for transparent huge
// pages (madvise), so that a token-major row is not a page of its own.
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <x86intrin.h>

enum { KEYS = 32768, HEADS = 8, DIMS = 128, TILE = 64, ROUNDS = 7, FMA_REPS = 2048 };
enum Fetch { NONE, IN_COPY, SLICED8, SPREAD8_T1, SLICED64, SPREAD64_T1, SPREAD64_T0, LOADS64, FETCHES };
static const char* NAMES[FETCHES] = {"none",           "during the copy", "sliced x8, none", "spread x8, T1",
                                     "sliced x64, none", "spread x64, T1",  "spread x64, T0", "loads, spread x64"};

static float* k;
static float tile[TILE * DIMS];
static volatile float sink;

static unsigned long long ticks(void) {  // fenced: the copy's loads are done before it reads the clock
  _mm_lfence();
  const unsigned long long t = __rdtsc();
  _mm_lfence();
  return t;
}

static const float* row(int head_major, int head, int key) {
  return head_major ? k + ((size_t)head * KEYS + key) * DIMS : k + ((size_t)key * HEADS + head) * DIMS;
}

static void fetch(enum Fetch how, const float* r) {
  for (int c = 0; c < DIMS; c += 16) {
    if (how == SPREAD64_T0) _mm_prefetch((const char*)(r + c), _MM_HINT_T0);
    else if (how == LOADS64) sink = r[c];
    else _mm_prefetch((const char*)(r + c), _MM_HINT_T1);
  }
}

// reps rounds of 12 independent FMA chains on registers (the caller's a[], inlined into its loop).
static inline __attribute__((always_inline)) void compute(__m256 a[12], int reps) {
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
  for (int r = 0; r < reps; ++r)
#pragma GCC unroll 12  // unrolled, a[] stays in registers (rolled, GCC kept it in memory)
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
}

// Ticks per tile (copy, compute) over every head's pass through the keys.
static void run(enum Fetch how, int head_major, double* copy, double* work) {
  const int slices = how == NONE || how == IN_COPY ? 1 : how == SLICED8 || how == SPREAD8_T1 ? 8 : 64;
  const int rows = TILE / slices, reps = FMA_REPS / slices;
  const int fetches = how != NONE && how != IN_COPY && how != SLICED8 && how != SLICED64;
  __m256 a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps((float)i);
  unsigned long long c = 0, w = 0;
  for (int h = 0; h < HEADS; ++h)
    for (int j0 = 0; j0 < KEYS; j0 += TILE) {
      const unsigned long long t0 = ticks();
      for (int i = 0; i < TILE; ++i) {
        if (how == IN_COPY && j0 + TILE + i < KEYS) fetch(how, row(head_major, h, j0 + TILE + i));
        const float* src = row(head_major, h, j0 + i);
        for (int e = 0; e < DIMS; e += 8) _mm256_storeu_ps(tile + i * DIMS + e, _mm256_loadu_ps(src + e));
      }
      __asm__ volatile("" ::"r"(tile) : "memory");  // the tile is "read": no compiler may drop the copy
      const unsigned long long t1 = ticks();
      for (int s = 0, i = 0; s < slices; ++s) {
        for (int stop = i + rows; fetches && i < stop && j0 + TILE + i < KEYS; ++i) fetch(how, row(head_major, h, j0 + TILE + i));
        compute(a, reps);
      }
      c += t1 - t0;
      w += ticks() - t1;
    }
  for (int i = 1; i < 12; ++i) a[0] = _mm256_add_ps(a[0], a[i]);
  sink = _mm256_cvtss_f32(a[0]);
  *copy = (double)c / (HEADS * KEYS / TILE);
  *work = (double)w / (HEADS * KEYS / TILE);
}

static int by_value(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  const int huge = argc > 1 && !strcmp(argv[1], "--huge");
  const size_t bytes = (size_t)KEYS * HEADS * DIMS * sizeof(float);
  k = aligned_alloc(2 << 20, bytes);
  if (!k) return 1;
  if (huge && madvise(k, bytes, MADV_HUGEPAGE)) perror("madvise(MADV_HUGEPAGE)");
  for (size_t i = 0; i < bytes / sizeof(float); ++i) k[i] = (float)(i & 1023);
  static double copy[2][FETCHES][ROUNDS], work[2][FETCHES][ROUNDS];
  run(NONE, 0, &copy[0][0][0], &work[0][0][0]);  // warm-up: clock ramp
  for (int r = 0; r < ROUNDS; ++r)
    for (int layout = 0; layout < 2; ++layout)
      for (int f = 0; f < FETCHES; ++f) run((enum Fetch)f, layout, &copy[layout][f][r], &work[layout][f][r]);
  printf("TSC ticks per 64-key tile (32 KiB), median of %d rounds; pages: %s\n%-12s %-18s %8s %8s %8s\n", ROUNDS,
         huge ? "huge pages asked for (madvise)" : "the default", "layout", "next tile fetched", "copy", "compute", "both");
  for (int layout = 0; layout < 2; ++layout)
    for (int f = 0; f < FETCHES; ++f) {
      double both[ROUNDS];
      for (int r = 0; r < ROUNDS; ++r) both[r] = copy[layout][f][r] + work[layout][f][r];
      qsort(copy[layout][f], ROUNDS, sizeof(double), by_value);
      qsort(work[layout][f], ROUNDS, sizeof(double), by_value);
      qsort(both, ROUNDS, sizeof(double), by_value);
      printf("%-12s %-18s %8.0f %8.0f %8.0f\n", layout ? "head-major" : "token-major", NAMES[f],
             copy[layout][f][ROUNDS / 2], work[layout][f][ROUNDS / 2], both[ROUNDS / 2]);
    }
  free(k);
  return 0;
}
