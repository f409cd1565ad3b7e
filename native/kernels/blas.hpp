// Dense matrix products through OpenBLAS (scipy-openblas32), shared by matmul
// and attention: strided float32 operands go to cblas in place when their
// layout allows, anything else (other strides, float16/bfloat16) is packed
// into dense float32 first.
#pragma once

#include <cstdint>
#include <vector>

namespace tandem::kernels::blas {

// A logical rows x cols matrix of td_dtype `dtype`: element (i, j) at element
// offset i * rs + j * cs from p.
struct Mat {
  const void* p;
  int32_t dtype;
  int64_t rows, cols, rs, cs;

  Mat t() const { return Mat{p, dtype, cols, rows, cs, rs}; }  // the transpose, as a view
};

// True when every extent and leading dimension fits cblas' 32-bit integers.
bool fits(int64_t v);

// How cblas reads a matrix: transposed or not, its leading dimension and
// its dense-row float32 data.
struct Operand {
  bool trans;
  int64_t ld;
  const float* p;
};

// The operand for m: m itself when cblas can read its layout in place, else a
// dense float32 copy in `buf` (which must outlive the operand).
Operand operand(const Mat& m, std::vector<float>& buf);

// c = alpha * op(a) @ op(b) + beta * c for an M x K op(a) and a K x N op(b);
// c is float32 with unit column stride and row stride ldc >= N. beta == 0
// ignores c's old contents (NaN included). Extents must satisfy fits().
void gemm(int64_t m, int64_t n, int64_t k, float alpha, const Operand& a, const Operand& b, float beta, float* c,
          int64_t ldc);

// Pins this process's OpenBLAS (a library instance tandem alone loads) to run
// each call on its calling thread: the worker pool supplies the parallelism.
// Idempotent; the first call must happen before kernels run concurrently.
void use_caller_thread_only();

}  // namespace tandem::kernels::blas
