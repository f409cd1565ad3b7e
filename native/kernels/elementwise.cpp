// Elementwise kernels: add, sub, mul, div (second operand broadcast to the
// first's shape), scale, relu, gelu, silu, tanh, exp. float32, float16 and
// bfloat16 storage with float32 math; any strides; `out` may be the input.
#include <algorithm>

#include "builtin.hpp"
#include "rowops.hpp"
#include "util.hpp"

namespace tandem::kernels {

namespace {

// Elements converted per step when a run is not dense float32: three such
// buffers stay in L1.
constexpr int64_t kChunk = 1024;

enum class Bin { add, sub, mul, div };

void apply_bin(Bin op, const float* a, const float* b, float* o, int64_t n) {
  switch (op) {
    case Bin::add: ops::add(a, b, o, n); break;
    case Bin::sub: ops::sub(a, b, o, n); break;
    case Bin::mul: ops::mul(a, b, o, n); break;
    case Bin::div: ops::div(a, b, o, n); break;
  }
}

void apply_bin_s(Bin op, const float* a, float b, float* o, int64_t n) {
  switch (op) {
    case Bin::add: ops::add_s(a, b, o, n); break;
    case Bin::sub: ops::sub_s(a, b, o, n); break;
    case Bin::mul: ops::mul_s(a, b, o, n); break;
    case Bin::div: ops::div_s(a, b, o, n); break;
  }
}

int binary(const char* name, Bin op, const td_args* args, char* err, size_t err_len) {
  if (args->n_tensors != 3) return fail(err, err_len, "%s: expected 3 tensors (a, b, out), got %d", name, args->n_tensors);
  const td_tensor& a = args->tensors[0];
  const td_tensor& b = args->tensors[1];
  const td_tensor& out = args->tensors[2];
  if (!is_float_dtype(a.dtype) || b.dtype != a.dtype || out.dtype != a.dtype)
    return fail(err, err_len, "%s: a, b and out must share one float dtype (got %s, %s, %s)", name, dtype_name(a.dtype),
                dtype_name(b.dtype), dtype_name(out.dtype));
  if (!same_shape(a, out)) return fail(err, err_len, "%s: out must have the shape of a", name);
  const int nd = a.ndim;
  int64_t bs[TD_MAX_DIMS];
  if (!broadcast_strides(b, b.ndim, nd, a.shape, bs)) return fail(err, err_len, "%s: b does not broadcast to a", name);

  Walker w(nd, a.shape);
  w.add(a.strides);
  w.add(bs);
  w.add(out.strides);
  w.simplify();
  const int64_t n = w.inner_len();
  const int64_t sa = w.inner_stride(0), sb = w.inner_stride(1), so = w.inner_stride(2);
  w.drop_inner();

  const bool dense = ops::direct(a.dtype, sa, n) && ops::direct(out.dtype, so, n) && (sb == 0 || ops::direct(b.dtype, sb, n));
  const int64_t step = dense ? std::max<int64_t>(n, 1) : kChunk;
  float abuf[kChunk], bbuf[kChunk], obuf[kChunk];
  w.for_each([&](const int64_t* off) {
    const char* pa = elem_ptr(a, off[0]);
    const char* pb = elem_ptr(b, off[1]);
    char* po = elem_ptr(out, off[2]);
    const int64_t esz = static_cast<int64_t>(td_dtype_size(a.dtype));
    float bval = 0.0f;
    if (sb == 0) ops::load(pb, b.dtype, 1, 1, &bval);
    for (int64_t c = 0; c < n; c += step) {
      const int64_t len = std::min(step, n - c);
      const float* xa = ops::view(pa + c * sa * esz, a.dtype, sa, len, abuf);
      const bool od = ops::direct(out.dtype, so, len);
      float* xo = od ? reinterpret_cast<float*>(po + c * so * esz) : obuf;
      if (sb == 0) {
        apply_bin_s(op, xa, bval, xo, len);
      } else {
        apply_bin(op, xa, ops::view(pb + c * sb * esz, b.dtype, sb, len, bbuf), xo, len);
      }
      if (!od) ops::store(xo, po + c * so * esz, out.dtype, so, len);
    }
  });
  return 0;
}

enum class Un { scale, relu, gelu, gelu_tanh, silu, tanh, exp };

void apply_un(Un op, float alpha, const float* x, float* o, int64_t n) {
  switch (op) {
    case Un::scale: ops::mul_s(x, alpha, o, n); break;
    case Un::relu: ops::relu(x, o, n); break;
    case Un::gelu: ops::gelu(x, o, n); break;
    case Un::gelu_tanh: ops::gelu_tanh(x, o, n); break;
    case Un::silu: ops::silu(x, o, n); break;
    case Un::tanh: ops::tanh(x, o, n); break;
    case Un::exp: ops::exp(x, o, n); break;
  }
}

int unary(const char* name, Un op, float alpha, const td_args* args, char* err, size_t err_len) {
  if (args->n_tensors != 2) return fail(err, err_len, "%s: expected 2 tensors (x, out), got %d", name, args->n_tensors);
  const td_tensor& x = args->tensors[0];
  const td_tensor& out = args->tensors[1];
  if (!is_float_dtype(x.dtype) || out.dtype != x.dtype)
    return fail(err, err_len, "%s: x and out must share one float dtype (got %s, %s)", name, dtype_name(x.dtype),
                dtype_name(out.dtype));
  if (!same_shape(x, out)) return fail(err, err_len, "%s: out must have the shape of x", name);

  Walker w(x.ndim, x.shape);
  w.add(x.strides);
  w.add(out.strides);
  w.simplify();
  const int64_t n = w.inner_len();
  const int64_t sx = w.inner_stride(0), so = w.inner_stride(1);
  w.drop_inner();

  const bool dense = ops::direct(x.dtype, sx, n) && ops::direct(out.dtype, so, n);
  const int64_t step = dense ? std::max<int64_t>(n, 1) : kChunk;
  const int64_t esz = static_cast<int64_t>(td_dtype_size(x.dtype));
  float xbuf[kChunk], obuf[kChunk];
  w.for_each([&](const int64_t* off) {
    const char* px = elem_ptr(x, off[0]);
    char* po = elem_ptr(out, off[1]);
    for (int64_t c = 0; c < n; c += step) {
      const int64_t len = std::min(step, n - c);
      const float* xx = ops::view(px + c * sx * esz, x.dtype, sx, len, xbuf);
      const bool od = ops::direct(out.dtype, so, len);
      float* xo = od ? reinterpret_cast<float*>(po + c * so * esz) : obuf;
      apply_un(op, alpha, xx, xo, len);
      if (!od) ops::store(xo, po + c * so * esz, out.dtype, so, len);
    }
  });
  return 0;
}

}  // namespace

TANDEM_KERNEL(add) { return binary("add", Bin::add, args, err, err_len); }
TANDEM_KERNEL(sub) { return binary("sub", Bin::sub, args, err, err_len); }
TANDEM_KERNEL(mul) { return binary("mul", Bin::mul, args, err, err_len); }
TANDEM_KERNEL(div) { return binary("div", Bin::div, args, err, err_len); }

TANDEM_KERNEL(scale) {
  return unary("scale", Un::scale, static_cast<float>(scalar_f(args, 0, 1.0)), args, err, err_len);
}
TANDEM_KERNEL(relu) { return unary("relu", Un::relu, 0.0f, args, err, err_len); }
// Scalar 0: approximate, 0 = exact (erf), 1 = tanh.
TANDEM_KERNEL(gelu) {
  const int64_t approx = scalar_i(args, 0, 0);
  if (approx != 0 && approx != 1) return fail(err, err_len, "gelu: approximate must be 0 (none) or 1 (tanh)");
  return unary("gelu", approx == 1 ? Un::gelu_tanh : Un::gelu, 0.0f, args, err, err_len);
}
TANDEM_KERNEL(silu) { return unary("silu", Un::silu, 0.0f, args, err, err_len); }
TANDEM_KERNEL(tanh) { return unary("tanh", Un::tanh, 0.0f, args, err, err_len); }
TANDEM_KERNEL(exp) { return unary("exp", Un::exp, 0.0f, args, err, err_len); }

}  // namespace tandem::kernels
