// noop, spin, copy, fill: the kernels the core itself needs (benchmarks,
// overhead tests, staging helpers).
#include <chrono>
#include <cstring>

#include "builtin.hpp"
#include "util.hpp"

namespace tandem::kernels {

TANDEM_KERNEL(noop) { return 0; }

// Busy work for `ns` nanoseconds (scalar 0), for overhead and overlap benchmarks.
TANDEM_KERNEL(spin) {
  if (args->n_scalars < 1) return fail(err, err_len, "spin: missing scalar 'ns'");
  const int64_t ns = args->scalars[0].kind == TD_SCALAR_INT ? args->scalars[0].value.i
                                                             : static_cast<int64_t>(args->scalars[0].value.f);
  if (ns < 0) return fail(err, err_len, "spin: ns must be >= 0, got %lld", static_cast<long long>(ns));
  const auto until = std::chrono::steady_clock::now() + std::chrono::nanoseconds(ns);
  while (std::chrono::steady_clock::now() < until) {
  }
  return 0;
}

namespace {
template <size_t N>
struct Bytes {
  unsigned char b[N];
};

template <typename T>
void copy_rows(const td_tensor& x, const td_tensor& out) {
  const int64_t rows = row_count(out);
  const int64_t n = row_length(out);
  const int64_t xs = row_stride(x), os = row_stride(out);
  const auto* xb = static_cast<const T*>(x.data);
  auto* ob = static_cast<T*>(out.data);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xp = xb + row_offset(x, r);
    T* op = ob + row_offset(out, r);
    if (xs == 1 && os == 1) {
      std::memmove(op, xp, static_cast<size_t>(n) * sizeof(T));
    } else {
      for (int64_t i = 0; i < n; ++i) op[i * os] = xp[i * xs];
    }
  }
}
}  // namespace

// out <- x: same shape and dtype, any strides.
TANDEM_KERNEL(copy) {
  if (args->n_tensors != 2) return fail(err, err_len, "copy: expected 2 tensors (x, out)");
  const td_tensor& x = args->tensors[0];
  const td_tensor& out = args->tensors[1];
  if (x.dtype != out.dtype || numel(x) != numel(out) || x.ndim != out.ndim)
    return fail(err, err_len, "copy: x and out differ in shape or dtype");
  switch (td_dtype_size(out.dtype)) {
    case 1: copy_rows<Bytes<1>>(x, out); break;
    case 2: copy_rows<Bytes<2>>(x, out); break;
    case 4: copy_rows<Bytes<4>>(x, out); break;
    case 8: copy_rows<Bytes<8>>(x, out); break;
    default: return fail(err, err_len, "copy: unsupported dtype %d", out.dtype);
  }
  return 0;
}

namespace {
template <typename T>
void fill_rows(const td_tensor& out, T v) {
  const int64_t rows = row_count(out);
  const int64_t n = row_length(out);
  const int64_t os = row_stride(out);
  auto* ob = static_cast<T*>(out.data);
  for (int64_t r = 0; r < rows; ++r) {
    T* op = ob + row_offset(out, r);
    for (int64_t i = 0; i < n; ++i) op[i * os] = v;
  }
}
}  // namespace

// out[...] = value (scalar 0).
TANDEM_KERNEL(fill) {
  if (args->n_tensors != 1 || args->n_scalars < 1) return fail(err, err_len, "fill: expected (out, value)");
  const td_tensor& out = args->tensors[0];
  const td_scalar& s = args->scalars[0];
  const double v = s.kind == TD_SCALAR_INT ? static_cast<double>(s.value.i) : s.value.f;
  switch (out.dtype) {
    case TD_FLOAT32: fill_rows<float>(out, static_cast<float>(v)); break;
    case TD_FLOAT16: fill_rows<uint16_t>(out, float_to_half(static_cast<float>(v))); break;
    case TD_BFLOAT16: fill_rows<uint16_t>(out, float_to_bf16(static_cast<float>(v))); break;
    case TD_INT32: fill_rows<int32_t>(out, s.kind == TD_SCALAR_INT ? static_cast<int32_t>(s.value.i) : static_cast<int32_t>(v)); break;
    case TD_INT64: fill_rows<int64_t>(out, s.kind == TD_SCALAR_INT ? s.value.i : static_cast<int64_t>(v)); break;
    case TD_UINT8: fill_rows<uint8_t>(out, static_cast<uint8_t>(v)); break;
    default: return fail(err, err_len, "fill: unsupported dtype %d", out.dtype);
  }
  return 0;
}

}  // namespace tandem::kernels
