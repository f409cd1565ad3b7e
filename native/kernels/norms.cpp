// Row kernels over the last axis: softmax (optional additive mask broadcast to
// x), layernorm, rmsnorm, l2_normalize. float32, float16 and bfloat16 storage
// with float32 math; any strides; `out` may be `x` itself.
#include <cmath>
#include <limits>
#include <vector>

#include "builtin.hpp"
#include "rowops.hpp"
#include "util.hpp"

namespace tandem::kernels {

namespace {

// A float32 row buffer for a run, allocated only when the run is not dense
// float32 (a dense run is read and written in place).
std::vector<float> staging(int32_t dtype, int64_t stride, int64_t n) {
  return ops::direct(dtype, stride, n) ? std::vector<float>() : std::vector<float>(static_cast<size_t>(n));
}

bool rows_match(const td_tensor& x, const td_tensor& out) { return same_shape(x, out) && x.ndim >= 1; }

// Walks the rows (all axes but the last) of x and out, plus an optional
// third tensor given by its strides over x's leading axes.
Walker row_walker(const td_tensor& x, const td_tensor& out, const int64_t* third_lead) {
  Walker w(x.ndim - 1, x.shape);
  w.add(x.strides);
  w.add(out.strides);
  if (third_lead != nullptr) w.add(third_lead);
  w.simplify();
  return w;
}

}  // namespace

// softmax(x[, mask], out; scale): out = softmax(x * scale + mask) per row. A
// row whose every entry is -inf (fully masked) comes out as zeros.
TANDEM_KERNEL(softmax) {
  if (args->n_tensors != 2 && args->n_tensors != 3)
    return fail(err, err_len, "softmax: expected tensors (x, [mask,] out), got %d", args->n_tensors);
  const td_tensor& x = args->tensors[0];
  const td_tensor* mask = args->n_tensors == 3 ? &args->tensors[1] : nullptr;
  const td_tensor& out = args->tensors[args->n_tensors - 1];
  const float scale = static_cast<float>(scalar_f(args, 0, 1.0));
  if (!is_float_dtype(x.dtype) || out.dtype != x.dtype)
    return fail(err, err_len, "softmax: x and out must share one float dtype");
  if (!rows_match(x, out)) return fail(err, err_len, "softmax: out must have the shape of x (at least 1-d)");
  const int nd = x.ndim;
  const int64_t n = x.shape[nd - 1];
  int64_t mstr[TD_MAX_DIMS] = {};
  if (mask != nullptr) {
    if (!is_float_dtype(mask->dtype)) return fail(err, err_len, "softmax: mask must be a float tensor");
    if (!broadcast_strides(*mask, mask->ndim, nd, x.shape, mstr))
      return fail(err, err_len, "softmax: mask does not broadcast to x");
  }
  Walker w = row_walker(x, out, mask != nullptr ? mstr : nullptr);
  const int64_t sx = x.strides[nd - 1], so = out.strides[nd - 1], sm = mstr[nd - 1];
  std::vector<float> xbuf = staging(x.dtype, sx, n), obuf = staging(out.dtype, so, n);
  std::vector<float> mbuf = mask != nullptr ? staging(mask->dtype, sm, n) : std::vector<float>();
  const bool od = ops::direct(out.dtype, so, n);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  w.for_each([&](const int64_t* off) {
    const float* xr = ops::view(elem_ptr(x, off[0]), x.dtype, sx, n, xbuf.data());
    const float* mr = mask != nullptr ? ops::view(elem_ptr(*mask, off[2]), mask->dtype, sm, n, mbuf.data()) : nullptr;
    float* orow = od ? reinterpret_cast<float*>(elem_ptr(out, off[1])) : obuf.data();
    // Plain softmax reads x twice (max, then exp and sum); scale or mask
    // first materialise the shifted scores in the output row.
    const bool plain = mr == nullptr && scale == 1.0f;
    const float m = plain ? ops::max(xr, n) : ops::scale_mask_max(xr, mr, scale, orow, n);
    if (m == kNegInf) {
      for (int64_t i = 0; i < n; ++i) orow[i] = 0.0f;
    } else {
      const double s = ops::exp_sub_sum(plain ? xr : orow, m, orow, n);
      ops::mul_s(orow, static_cast<float>(1.0 / s), orow, n);
    }
    if (!od) ops::store(orow, elem_ptr(out, off[1]), out.dtype, so, n);
  });
  return 0;
}

// layernorm(x, gamma, beta, out; eps): (x - mean) / sqrt(var + eps) * gamma + beta.
TANDEM_KERNEL(layernorm) {
  if (args->n_tensors != 4) return fail(err, err_len, "layernorm: expected tensors (x, gamma, beta, out)");
  const td_tensor& x = args->tensors[0];
  const td_tensor& g = args->tensors[1];
  const td_tensor& b = args->tensors[2];
  const td_tensor& out = args->tensors[3];
  const double eps = scalar_f(args, 0, 1e-5);
  if (!is_float_dtype(x.dtype) || out.dtype != x.dtype || !is_float_dtype(g.dtype) || !is_float_dtype(b.dtype))
    return fail(err, err_len, "layernorm: x, gamma, beta and out must be float tensors, x and out of one dtype");
  if (!rows_match(x, out)) return fail(err, err_len, "layernorm: out must have the shape of x (at least 1-d)");
  const int64_t n = x.shape[x.ndim - 1];
  if (g.ndim != 1 || g.shape[0] != n || b.ndim != 1 || b.shape[0] != n)
    return fail(err, err_len, "layernorm: gamma and beta must have shape (%lld,)", static_cast<long long>(n));
  std::vector<float> gbuf = staging(g.dtype, g.strides[0], n), bbuf = staging(b.dtype, b.strides[0], n);
  const float* gv = ops::view(g.data, g.dtype, g.strides[0], n, gbuf.data());
  const float* bv = ops::view(b.data, b.dtype, b.strides[0], n, bbuf.data());
  Walker w = row_walker(x, out, nullptr);
  const int64_t sx = x.strides[x.ndim - 1], so = out.strides[out.ndim - 1];
  std::vector<float> xbuf = staging(x.dtype, sx, n), obuf = staging(out.dtype, so, n);
  const bool od = ops::direct(out.dtype, so, n);
  w.for_each([&](const int64_t* off) {
    const float* xr = ops::view(elem_ptr(x, off[0]), x.dtype, sx, n, xbuf.data());
    float* orow = od ? reinterpret_cast<float*>(elem_ptr(out, off[1])) : obuf.data();
    const double mean = ops::sum(xr, n) / static_cast<double>(n);
    const double var = ops::sum_sq_dev(xr, n, static_cast<float>(mean)) / static_cast<double>(n);
    const float rstd = static_cast<float>(1.0 / std::sqrt(var + eps));
    ops::norm_affine(xr, gv, bv, static_cast<float>(mean), rstd, orow, n);
    if (!od) ops::store(orow, elem_ptr(out, off[1]), out.dtype, so, n);
  });
  return 0;
}

// rmsnorm(x, gamma, out; eps): x / sqrt(mean(x^2) + eps) * gamma.
TANDEM_KERNEL(rmsnorm) {
  if (args->n_tensors != 3) return fail(err, err_len, "rmsnorm: expected tensors (x, gamma, out)");
  const td_tensor& x = args->tensors[0];
  const td_tensor& g = args->tensors[1];
  const td_tensor& out = args->tensors[2];
  const double eps = scalar_f(args, 0, 1e-6);
  if (!is_float_dtype(x.dtype) || out.dtype != x.dtype || !is_float_dtype(g.dtype))
    return fail(err, err_len, "rmsnorm: x, gamma and out must be float tensors, x and out of one dtype");
  if (!rows_match(x, out)) return fail(err, err_len, "rmsnorm: out must have the shape of x (at least 1-d)");
  const int64_t n = x.shape[x.ndim - 1];
  if (g.ndim != 1 || g.shape[0] != n)
    return fail(err, err_len, "rmsnorm: gamma must have shape (%lld,)", static_cast<long long>(n));
  std::vector<float> gbuf = staging(g.dtype, g.strides[0], n);
  const float* gv = ops::view(g.data, g.dtype, g.strides[0], n, gbuf.data());
  Walker w = row_walker(x, out, nullptr);
  const int64_t sx = x.strides[x.ndim - 1], so = out.strides[out.ndim - 1];
  std::vector<float> xbuf = staging(x.dtype, sx, n), obuf = staging(out.dtype, so, n);
  const bool od = ops::direct(out.dtype, so, n);
  w.for_each([&](const int64_t* off) {
    const float* xr = ops::view(elem_ptr(x, off[0]), x.dtype, sx, n, xbuf.data());
    float* orow = od ? reinterpret_cast<float*>(elem_ptr(out, off[1])) : obuf.data();
    const double ms = ops::sum_sq(xr, n) / static_cast<double>(n);
    const float rstd = static_cast<float>(1.0 / std::sqrt(ms + eps));
    ops::norm_affine(xr, gv, nullptr, 0.0f, rstd, orow, n);
    if (!od) ops::store(orow, elem_ptr(out, off[1]), out.dtype, so, n);
  });
  return 0;
}

// l2_normalize(x, out; eps): x / max(||x||, eps), as torch.nn.functional.normalize.
TANDEM_KERNEL(l2_normalize) {
  if (args->n_tensors != 2) return fail(err, err_len, "l2_normalize: expected tensors (x, out)");
  const td_tensor& x = args->tensors[0];
  const td_tensor& out = args->tensors[1];
  const double eps = scalar_f(args, 0, 1e-12);
  if (!is_float_dtype(x.dtype) || out.dtype != x.dtype)
    return fail(err, err_len, "l2_normalize: x and out must share one float dtype");
  if (!rows_match(x, out)) return fail(err, err_len, "l2_normalize: out must have the shape of x (at least 1-d)");
  const int64_t n = x.shape[x.ndim - 1];
  Walker w = row_walker(x, out, nullptr);
  const int64_t sx = x.strides[x.ndim - 1], so = out.strides[out.ndim - 1];
  std::vector<float> xbuf = staging(x.dtype, sx, n), obuf = staging(out.dtype, so, n);
  const bool od = ops::direct(out.dtype, so, n);
  w.for_each([&](const int64_t* off) {
    const float* xr = ops::view(elem_ptr(x, off[0]), x.dtype, sx, n, xbuf.data());
    float* orow = od ? reinterpret_cast<float*>(elem_ptr(out, off[1])) : obuf.data();
    const double norm = std::sqrt(ops::sum_sq(xr, n));
    ops::mul_s(xr, static_cast<float>(1.0 / (norm > eps ? norm : eps)), orow, n);
    if (!od) ops::store(orow, elem_ptr(out, off[1]), out.dtype, so, n);
  });
  return 0;
}

}  // namespace tandem::kernels
