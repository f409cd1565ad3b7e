// Reductions over the last axis (sum, mean, max, argmax) and mean_pool, the
// masked mean over the sequence axis that sentence-embedding models use.
#include <algorithm>
#include <vector>

#include "builtin.hpp"
#include "rowops.hpp"
#include "util.hpp"

namespace tandem::kernels {

namespace {

enum class Red { sum, mean, max, argmax };

// out holds one value per row of x: shape x.shape[:-1], optionally with a
// trailing axis of 1 (keepdims).
bool reduced_shape(const td_tensor& x, const td_tensor& out) {
  const int lead = x.ndim - 1;
  if (out.ndim != lead && !(out.ndim == lead + 1 && out.shape[lead] == 1)) return false;
  for (int d = 0; d < lead; ++d)
    if (out.shape[d] != x.shape[d]) return false;
  return true;
}

void store_index(const td_tensor& out, int64_t off, int64_t v) {
  if (out.dtype == TD_INT32) {
    static_cast<int32_t*>(out.data)[off] = static_cast<int32_t>(v);
  } else {
    static_cast<int64_t*>(out.data)[off] = v;
  }
}

int reduce(const char* name, Red op, const td_args* args, char* err, size_t err_len) {
  if (args->n_tensors != 2) return fail(err, err_len, "%s: expected tensors (x, out), got %d", name, args->n_tensors);
  const td_tensor& x = args->tensors[0];
  const td_tensor& out = args->tensors[1];
  if (!is_float_dtype(x.dtype)) return fail(err, err_len, "%s: x must be a float tensor, got %s", name, dtype_name(x.dtype));
  if (op == Red::argmax ? (out.dtype != TD_INT32 && out.dtype != TD_INT64) : out.dtype != x.dtype)
    return fail(err, err_len, "%s: unsupported out dtype %s", name, dtype_name(out.dtype));
  if (x.ndim < 1 || !reduced_shape(x, out)) return fail(err, err_len, "%s: out must have shape x.shape[:-1]", name);
  const int64_t n = x.shape[x.ndim - 1];
  if (n == 0 && (op == Red::max || op == Red::argmax))
    return fail(err, err_len, "%s: cannot reduce an empty axis", name);
  const int64_t sx = x.strides[x.ndim - 1];
  Walker w(x.ndim - 1, x.shape);
  w.add(x.strides);
  w.add(out.strides);
  w.simplify();
  // Staging only for rows that are not dense float32.
  std::vector<float> buf = ops::direct(x.dtype, sx, n) ? std::vector<float>() : std::vector<float>(static_cast<size_t>(n));
  w.for_each([&](const int64_t* off) {
    const float* xr = ops::view(elem_ptr(x, off[0]), x.dtype, sx, n, buf.data());
    float v = 0.0f;
    switch (op) {
      case Red::sum: v = static_cast<float>(ops::sum(xr, n)); break;
      case Red::mean: v = static_cast<float>(ops::sum(xr, n) / static_cast<double>(n)); break;
      case Red::max: v = ops::max(xr, n); break;
      case Red::argmax: store_index(out, off[1], ops::argmax(xr, n)); return;
    }
    ops::store(&v, elem_ptr(out, off[1]), out.dtype, 1, 1);
  });
  return 0;
}

}  // namespace

TANDEM_KERNEL(sum) { return reduce("sum", Red::sum, args, err, err_len); }
TANDEM_KERNEL(mean) { return reduce("mean", Red::mean, args, err, err_len); }
TANDEM_KERNEL(max) { return reduce("max", Red::max, args, err, err_len); }
TANDEM_KERNEL(argmax) { return reduce("argmax", Red::argmax, args, err, err_len); }

// mean_pool(x, mask, out): x [..., S, D], mask [..., S] (float or integer,
// a weight per position), out [..., D] = sum_s mask*x / max(sum_s mask, 1e-9).
TANDEM_KERNEL(mean_pool) {
  if (args->n_tensors != 3) return fail(err, err_len, "mean_pool: expected tensors (x, mask, out)");
  const td_tensor& x = args->tensors[0];
  const td_tensor& mask = args->tensors[1];
  const td_tensor& out = args->tensors[2];
  if (!is_float_dtype(x.dtype) || out.dtype != x.dtype)
    return fail(err, err_len, "mean_pool: x and out must share one float dtype");
  if (td_dtype_size(mask.dtype) == 0) return fail(err, err_len, "mean_pool: unsupported mask dtype");
  const int nd = x.ndim;
  if (nd < 2 || mask.ndim != nd - 1 || out.ndim != nd - 1)
    return fail(err, err_len, "mean_pool: expected x [..., S, D], mask [..., S], out [..., D]");
  for (int d = 0; d < nd - 2; ++d)
    if (mask.shape[d] != x.shape[d] || out.shape[d] != x.shape[d])
      return fail(err, err_len, "mean_pool: leading axes of x, mask and out differ");
  const int64_t s_len = x.shape[nd - 2], dim = x.shape[nd - 1];
  if (mask.shape[nd - 2] != s_len || out.shape[nd - 2] != dim)
    return fail(err, err_len, "mean_pool: mask must be [..., S] and out [..., D]");
  const int64_t xs_s = x.strides[nd - 2], xs_d = x.strides[nd - 1];
  const int64_t ms = mask.strides[nd - 2], os = out.strides[nd - 2];
  Walker w(nd - 2, x.shape);
  w.add(x.strides);
  w.add(mask.strides);
  w.add(out.strides);
  w.simplify();
  std::vector<float> acc(static_cast<size_t>(dim));
  std::vector<float> xbuf = ops::direct(x.dtype, xs_d, dim) ? std::vector<float>() : std::vector<float>(static_cast<size_t>(dim));
  const int64_t esz = static_cast<int64_t>(td_dtype_size(x.dtype));
  w.for_each([&](const int64_t* off) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    double total = 0.0;
    const char* xb = elem_ptr(x, off[0]);
    const char* mb = elem_ptr(mask, off[1]);
    const int64_t msz = static_cast<int64_t>(td_dtype_size(mask.dtype));
    for (int64_t s = 0; s < s_len; ++s) {
      float weight;
      ops::load(mb + s * ms * msz, mask.dtype, 1, 1, &weight);
      if (weight == 0.0f) continue;  // padding: skip the row entirely
      ops::axpy(weight, ops::view(xb + s * xs_s * esz, x.dtype, xs_d, dim, xbuf.data()), acc.data(), dim);
      total += weight;
    }
    const float inv = static_cast<float>(1.0 / (total > 1e-9 ? total : 1e-9));
    ops::mul_s(acc.data(), inv, acc.data(), dim);
    ops::store(acc.data(), elem_ptr(out, off[2]), out.dtype, os, dim);
  });
  return 0;
}

}  // namespace tandem::kernels
