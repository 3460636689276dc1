// The one translation unit that calls into torch for the kernel: oneDNN's brgemm micro-kernels as
// PyTorch exports them (ATen/native/CPUBlas.h), behind plain declarations in problem.h so that the
// ISA translation units stay free of torch's inline code (see problem.h). oneDNN JIT-compiles each
// kernel for the running CPU (AMX, AVX512-BF16/FP16, AVX-512, AVX2) and caches it per thread and shape.
#include <ATen/native/CPUBlas.h>

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

}  // namespace treeattn_native
