// matmul(a, b, out; transpose_b, alpha, beta): out = alpha * a @ op(b) + beta * out
// a [..., M, K], b [..., K, N] ([..., N, K] with transpose_b), out [..., M, N];
// batch axes broadcast numpy-style. float32 goes through sgemm on the views
// themselves when their strides allow; float16/bfloat16 are widened to
// float32 and the result rounded back.
#include <algorithm>
#include <vector>

#include "blas.hpp"
#include "builtin.hpp"
#include "rowops.hpp"
#include "util.hpp"

namespace tandem::kernels {

namespace {

struct Problem {
  const td_tensor* a;
  const td_tensor* b;
  const td_tensor* out;
  bool transpose_b;
  float alpha, beta;
  int64_t m, n, k;
};

// One product: a_off / b_off / o_off locate the batch; rows overrides M when
// batches are folded into rows (with a_rs / o_rs as the folded row strides).
void product(const Problem& p, int64_t a_off, int64_t b_off, int64_t o_off, int64_t rows, int64_t a_rs, int64_t o_rs,
             std::vector<float>& pa, std::vector<float>& pb, std::vector<float>& pc, bool reuse_b,
             blas::Operand& ob) {
  const td_tensor& a = *p.a;
  const td_tensor& b = *p.b;
  const td_tensor& out = *p.out;
  const int an = a.ndim, bn = b.ndim, on = out.ndim;
  const blas::Mat am{elem_ptr(a, a_off), a.dtype, rows, p.k, a_rs, a.strides[an - 1]};
  const int64_t b_r = b.strides[bn - 2], b_c = b.strides[bn - 1];
  const blas::Mat bm{elem_ptr(b, b_off), b.dtype, p.k, p.n, p.transpose_b ? b_c : b_r, p.transpose_b ? b_r : b_c};
  const int64_t ocs = out.strides[on - 1];
  char* op = elem_ptr(out, o_off);

  if (out.dtype == TD_FLOAT32 && (p.n <= 1 || ocs == 1) && (rows <= 1 || o_rs >= std::max<int64_t>(p.n, 1)) &&
      blas::fits(o_rs)) {
    const int64_t ldc = rows <= 1 ? std::max<int64_t>(p.n, 1) : o_rs;
    if (!reuse_b) ob = blas::operand(bm, pb);
    blas::gemm(rows, p.n, p.k, p.alpha, blas::operand(am, pa), ob, p.beta, reinterpret_cast<float*>(op), ldc);
    return;
  }
  if (out.dtype == TD_FLOAT32 && (rows <= 1 || o_rs == 1) && (p.n <= 1 || ocs >= std::max<int64_t>(rows, 1)) &&
      blas::fits(ocs)) {
    // Column-major out: compute out^T = op(b)^T @ a^T in place.
    const int64_t ldc = p.n <= 1 ? std::max<int64_t>(rows, 1) : ocs;
    std::vector<float> pt;
    const blas::Operand bt = blas::operand(bm.t(), pt);
    blas::gemm(p.n, rows, p.k, p.alpha, bt, blas::operand(am.t(), pa), p.beta, reinterpret_cast<float*>(op), ldc);
    return;
  }
  // Any other out (strided or half): a dense float32 staging buffer.
  if (!reuse_b) ob = blas::operand(bm, pb);
  pc.resize(static_cast<size_t>(rows * p.n));
  const int64_t esz = static_cast<int64_t>(td_dtype_size(out.dtype));
  if (p.beta != 0.0f)
    for (int64_t i = 0; i < rows; ++i) ops::load(op + i * o_rs * esz, out.dtype, ocs, p.n, pc.data() + i * p.n);
  blas::gemm(rows, p.n, p.k, p.alpha, blas::operand(am, pa), ob, p.beta, pc.data(), std::max<int64_t>(p.n, 1));
  for (int64_t i = 0; i < rows; ++i) ops::store(pc.data() + i * p.n, op + i * o_rs * esz, out.dtype, ocs, p.n);
}

}  // namespace

TANDEM_KERNEL(matmul) {
  if (args->n_tensors != 3) return fail(err, err_len, "matmul: expected tensors (a, b, out), got %d", args->n_tensors);
  const td_tensor& a = args->tensors[0];
  const td_tensor& b = args->tensors[1];
  const td_tensor& out = args->tensors[2];
  Problem p{&a, &b, &out, scalar_i(args, 0, 0) != 0, static_cast<float>(scalar_f(args, 1, 1.0)),
            static_cast<float>(scalar_f(args, 2, 0.0)), 0, 0, 0};
  if (!is_float_dtype(a.dtype) || b.dtype != a.dtype || out.dtype != a.dtype)
    return fail(err, err_len, "matmul: a, b and out must share one float dtype (got %s, %s, %s)", dtype_name(a.dtype),
                dtype_name(b.dtype), dtype_name(out.dtype));
  if (a.ndim < 2 || b.ndim < 2 || out.ndim < 2) return fail(err, err_len, "matmul: a, b and out must be at least 2-d");
  const int an = a.ndim, bn = b.ndim, on = out.ndim;
  p.m = a.shape[an - 2];
  p.k = a.shape[an - 1];
  p.n = p.transpose_b ? b.shape[bn - 2] : b.shape[bn - 1];
  const int64_t bk = p.transpose_b ? b.shape[bn - 1] : b.shape[bn - 2];
  if (bk != p.k || out.shape[on - 2] != p.m || out.shape[on - 1] != p.n)
    return fail(err, err_len, "matmul: shapes do not chain (M=%lld K=%lld, b has K=%lld, out %lld x %lld)",
                static_cast<long long>(p.m), static_cast<long long>(p.k), static_cast<long long>(bk),
                static_cast<long long>(out.shape[on - 2]), static_cast<long long>(out.shape[on - 1]));
  if (!blas::fits(p.m) || !blas::fits(p.n) || !blas::fits(p.k))
    return fail(err, err_len, "matmul: a dimension exceeds the 32-bit BLAS limit");
  const int nb = on - 2;
  int64_t as[TD_MAX_DIMS], bs[TD_MAX_DIMS];
  if (!broadcast_strides(a, an - 2, nb, out.shape, as) || !broadcast_strides(b, bn - 2, nb, out.shape, bs))
    return fail(err, err_len, "matmul: batch axes of a and b do not broadcast to out");
  if (numel(out) == 0) return 0;

  std::vector<float> pa, pb, pc;
  blas::Operand ob{};
  const int64_t a_rs = a.strides[an - 2], o_rs = out.strides[on - 2];

  // A shared b (weights) and batch axes that are just more rows of a and out:
  // one product with M = batch * M, the shape BLAS is fastest at.
  bool b_shared = true;
  for (int d = 0; d < nb; ++d) b_shared = b_shared && bs[d] == 0;
  int64_t fa = 0, fo = 0;
  if (b_shared && an == on && std::equal(a.shape, a.shape + nb, out.shape) && collapse(a, 0, an - 2, &fa) &&
      collapse(out, 0, on - 2, &fo)) {
    int64_t rows = 1;
    for (int d = 0; d <= nb; ++d) rows *= out.shape[d];
    if (blas::fits(rows)) {
      product(p, 0, 0, 0, rows, fa, fo, pa, pb, pc, false, ob);
      return 0;
    }
  }

  Walker w(nb, out.shape);
  w.add(as);
  w.add(bs);
  w.add(out.strides);
  w.simplify();
  int64_t last_b = -1;
  w.for_each([&](const int64_t* off) {
    // A broadcast b repeats its offset: keep the packed copy from the previous batch.
    const bool reuse = off[1] == last_b;
    product(p, off[0], off[1], off[2], p.m, a_rs, o_rs, pa, pb, pc, reuse, ob);
    last_b = off[1];
  });
  return 0;
}

}  // namespace tandem::kernels
