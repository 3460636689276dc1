// The one translation unit that calls into torch for the kernel: oneDNN's brgemm micro-kernels as
// PyTorch exports them (ATen/native/CPUBlas.h), behind plain declarations in problem.h so that the
// ISA translation units stay free of torch's inline code (see problem.h). oneDNN JIT-compiles each
// kernel for the running CPU (AMX, AVX512-BF16/FP16, AVX-512, AVX2) and caches it per thread and shape.
#include <ATen/native/CPUBlas.h>

#include <exception>
#include <vector>

#include "problem.h"

namespace treeattn_native {

void brgemm(int32_t dtype, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add,
            const void* a, const void* b, float* c) {
  namespace blas = at::native::cpublas;
  if (dtype == F32)
    blas::brgemm(m, n, k, lda, ldb, ldc, add, static_cast<const float*>(a), static_cast<const float*>(b), c, false);
  else if (dtype == BF16)
    blas::brgemm(m, n, k, lda, ldb, ldc, add, static_cast<const at::BFloat16*>(a),
                 static_cast<const at::BFloat16*>(b), c, true);
  else
    blas::brgemm(m, n, k, lda, ldb, ldc, add, static_cast<const at::Half*>(a), static_cast<const at::Half*>(b), c,
                 true);
}

void brgemm_release(int32_t dtype) { at::native::cpublas::brgemm_release(dtype != F32); }

namespace {

// Row 0 of A picks B's row k = 0, stored as b[i] = i % 128 + 1 (exact in every 16-bit type): read plain,
// C[0][1] = b[1] = 2; read in pairs, C[0][1] = b[2] = 3. The shape is one the kernel uses (M 4, N 64).
template <typename T>
bool probe_pairs() {
  constexpr int64_t M = 4, N = 64, K = 32;
  std::vector<T> a(M * K, T(0.0f)), b(K * N);
  a[0] = T(1.0f);
  for (int64_t i = 0; i < K * N; ++i) b[i] = T(float(i % 128 + 1));
  std::vector<float> c(M * N, 0.0f);
  try {
    at::native::cpublas::brgemm(M, N, K, K, N, N, false, a.data(), b.data(), c.data(), true);
    at::native::cpublas::brgemm_release(true);
  } catch (const std::exception&) {
    return true;  // no kernel for this dtype here: the self-check reports the call's own error
  }
  return c[1] != 2.0f;
}

}  // namespace

bool brgemm_b_pairs(int32_t dtype) {
  static const bool half = probe_pairs<at::Half>(), bf16 = probe_pairs<at::BFloat16>();
  return dtype == F16 ? half : dtype == BF16 ? bf16 : false;
}

}  // namespace treeattn_native
