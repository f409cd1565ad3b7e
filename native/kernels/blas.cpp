#include "blas.hpp"

#include <cblas.h>

#include <algorithm>
#include <cstdlib>

#include "rowops.hpp"
#include "util.hpp"

namespace tandem::kernels::blas {

bool fits(int64_t v) { return v >= 0 && v <= 0x7fffffff; }

namespace {

// cblas reads a row-major matrix (unit column stride) or, flagged as
// transposed, a column-major one (unit row stride); the leading dimension
// must cover the other extent.
bool in_place(const Mat& m, Operand* op) {
  if (m.dtype != TD_FLOAT32) return false;
  const float* p = static_cast<const float*>(m.p);
  if (m.cols <= 1 || m.cs == 1) {
    const int64_t ld = m.rows <= 1 ? std::max<int64_t>(m.cols, 1) : m.rs;
    if (ld >= std::max<int64_t>(m.cols, 1) && fits(ld)) {
      *op = Operand{false, ld, p};
      return true;
    }
  }
  if (m.rows <= 1 || m.rs == 1) {
    const int64_t ld = m.cols <= 1 ? std::max<int64_t>(m.rows, 1) : m.cs;
    if (ld >= std::max<int64_t>(m.rows, 1) && fits(ld)) {
      *op = Operand{true, ld, p};
      return true;
    }
  }
  return false;
}

}  // namespace

Operand operand(const Mat& m, std::vector<float>& buf) {
  Operand op{};
  if (in_place(m, &op)) return op;
  // Pack along whichever axis is closer to contiguous: reading the source in
  // order matters more than the (free) transposed flag.
  const bool by_columns = std::llabs(m.rs) < std::llabs(m.cs);
  const Mat src = by_columns ? m.t() : m;
  buf.resize(static_cast<size_t>(src.rows * src.cols));
  const int64_t esz = static_cast<int64_t>(td_dtype_size(src.dtype));
  for (int64_t i = 0; i < src.rows; ++i)
    ops::load(static_cast<const char*>(src.p) + i * src.rs * esz, src.dtype, src.cs, src.cols,
              buf.data() + i * src.cols);
  return Operand{by_columns, std::max<int64_t>(src.cols, 1), buf.data()};
}

void gemm(int64_t m, int64_t n, int64_t k, float alpha, const Operand& a, const Operand& b, float beta, float* c,
          int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: only the beta term remains
    for (int64_t i = 0; i < m; ++i) {
      float* row = c + i * ldc;
      for (int64_t j = 0; j < n; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  if (m == 1) {  // one row (a decode step's): sgemv reads b once, where sgemm would pack it first (4-5x slower)
    if (beta == 0.0f) std::fill(c, c + n, 0.0f);  // beta == 0 ignores c's old contents, NaN included
    // c = alpha * op(b)^T a: b as stored is k x n (ld >= n), or n x k when transposed.
    const blasint rows = static_cast<blasint>(b.trans ? n : k), cols = static_cast<blasint>(b.trans ? k : n);
    const int64_t inc_a = a.trans ? a.ld : 1;  // a's k values: a row, or a column of a column-major a
    scipy_cblas_sgemv(CblasRowMajor, b.trans ? CblasNoTrans : CblasTrans, rows, cols, alpha, b.p,
                      static_cast<blasint>(b.ld), a.p, static_cast<blasint>(inc_a), beta, c, 1);
    return;
  }
  scipy_cblas_sgemm(CblasRowMajor, a.trans ? CblasTrans : CblasNoTrans, b.trans ? CblasTrans : CblasNoTrans,
                    static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a.p,
                    static_cast<blasint>(a.ld), b.p, static_cast<blasint>(b.ld), beta, c, static_cast<blasint>(ldc));
}

void use_caller_thread_only() {
  // scipy-openblas32 declares openblas_set_num_threads_local() but does not
  // export it, so the thread count of this instance is set once instead.
  // The setting is idempotent, and numpy and torch carry their own BLAS.
  if (scipy_openblas_get_num_threads() != 1) scipy_openblas_set_num_threads(1);
}

}  // namespace tandem::kernels::blas
