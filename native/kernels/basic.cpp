// noop, spin, copy, fill, cast, transpose, embedding: the data-movement
// kernels. All take any strides; copy and fill take every dtype.
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>

#include "builtin.hpp"
#include "rowops.hpp"
#include "util.hpp"

namespace tandem::kernels {

TANDEM_KERNEL(noop) { return 0; }

// Busy work for `ns` nanoseconds (scalar 0), for overhead and overlap benchmarks.
TANDEM_KERNEL(spin) {
  if (args->n_scalars < 1) return fail(err, err_len, "spin: missing scalar 'ns'");
  const int64_t ns = scalar_i(args, 0, 0);
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

// Copies n elements of N bytes between strided runs.
template <size_t N>
void copy_run(const char* src, int64_t ss, char* dst, int64_t ds, int64_t n) {
  if (ss == 1 && ds == 1) {
    if (src != dst) std::memmove(dst, src, static_cast<size_t>(n) * N);
    return;
  }
  const auto* s = reinterpret_cast<const Bytes<N>*>(src);
  auto* d = reinterpret_cast<Bytes<N>*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i * ds] = s[i * ss];
}

void copy_elems(size_t size, const char* src, int64_t ss, char* dst, int64_t ds, int64_t n) {
  switch (size) {
    case 1: copy_run<1>(src, ss, dst, ds, n); break;
    case 2: copy_run<2>(src, ss, dst, ds, n); break;
    case 4: copy_run<4>(src, ss, dst, ds, n); break;
    default: copy_run<8>(src, ss, dst, ds, n); break;
  }
}

// Walks x and out (same shape) with the innermost axis as a run.
template <class F>
void walk_pairs(const td_tensor& x, const td_tensor& out, F&& f) {
  Walker w(out.ndim, out.shape);
  w.add(x.strides);
  w.add(out.strides);
  w.simplify();
  const int64_t n = w.inner_len(), sx = w.inner_stride(0), so = w.inner_stride(1);
  w.drop_inner();
  w.for_each([&](const int64_t* off) { f(off[0], sx, off[1], so, n); });
}

}  // namespace

// out <- x: same shape and dtype, any strides.
TANDEM_KERNEL(copy) {
  if (args->n_tensors != 2) return fail(err, err_len, "copy: expected 2 tensors (x, out)");
  const td_tensor& x = args->tensors[0];
  const td_tensor& out = args->tensors[1];
  if (x.dtype != out.dtype || !same_shape(x, out)) return fail(err, err_len, "copy: x and out differ in shape or dtype");
  const size_t size = td_dtype_size(out.dtype);
  if (size == 0) return fail(err, err_len, "copy: unsupported dtype %d", out.dtype);
  walk_pairs(x, out, [&](int64_t xo, int64_t sx, int64_t oo, int64_t so, int64_t n) {
    copy_elems(size, elem_ptr(x, xo), sx, elem_ptr(out, oo), so, n);
  });
  return 0;
}

namespace {
template <class T>
void fill_all(const td_tensor& out, T v) {
  Walker w(out.ndim, out.shape);
  w.add(out.strides);
  w.simplify();
  const int64_t n = w.inner_len(), s = w.inner_stride(0);
  w.drop_inner();
  w.for_each([&](const int64_t* off) {
    T* p = static_cast<T*>(out.data) + off[0];
    for (int64_t i = 0; i < n; ++i) p[i * s] = v;
  });
}
}  // namespace

// out[...] = value (scalar 0; an int scalar fills integer tensors exactly).
TANDEM_KERNEL(fill) {
  if (args->n_tensors != 1 || args->n_scalars < 1) return fail(err, err_len, "fill: expected (out, value)");
  const td_tensor& out = args->tensors[0];
  const td_scalar& s = args->scalars[0];
  const double v = s.kind == TD_SCALAR_INT ? static_cast<double>(s.value.i) : s.value.f;
  const int64_t iv = s.kind == TD_SCALAR_INT ? s.value.i : static_cast<int64_t>(v);
  switch (out.dtype) {
    case TD_FLOAT32: fill_all<float>(out, static_cast<float>(v)); break;
    case TD_FLOAT16: fill_all<uint16_t>(out, float_to_half(static_cast<float>(v))); break;
    case TD_BFLOAT16: fill_all<uint16_t>(out, float_to_bf16(static_cast<float>(v))); break;
    case TD_INT32: fill_all<int32_t>(out, static_cast<int32_t>(iv)); break;
    case TD_INT64: fill_all<int64_t>(out, iv); break;
    case TD_UINT8: fill_all<uint8_t>(out, static_cast<uint8_t>(iv)); break;
    default: return fail(err, err_len, "fill: unsupported dtype %d", out.dtype);
  }
  return 0;
}

namespace {

constexpr int64_t kChunk = 1024;

int64_t read_int(const char* p, int32_t dt) {
  switch (dt) {
    case TD_INT32: return *reinterpret_cast<const int32_t*>(p);
    case TD_INT64: return *reinterpret_cast<const int64_t*>(p);
    default: return *reinterpret_cast<const uint8_t*>(p);
  }
}

// Integer stores wrap like numpy's astype.
void write_int(char* p, int32_t dt, int64_t v) {
  switch (dt) {
    case TD_INT32: *reinterpret_cast<int32_t*>(p) = static_cast<int32_t>(static_cast<uint32_t>(v)); break;
    case TD_INT64: *reinterpret_cast<int64_t*>(p) = v; break;
    default: *reinterpret_cast<uint8_t*>(p) = static_cast<uint8_t>(v); break;
  }
}

// float -> integer truncates toward zero; NaN becomes 0 and values beyond
// int64 saturate (C++ leaves them undefined).
int64_t float_to_int(float f) {
  if (f != f) return 0;
  if (f >= 9.2233720368547758e18f) return std::numeric_limits<int64_t>::max();
  if (f <= -9.2233720368547758e18f) return std::numeric_limits<int64_t>::min();
  return static_cast<int64_t>(f);
}

}  // namespace

// out <- x converted to out's dtype: any pair of dtypes, same shape.
TANDEM_KERNEL(cast) {
  if (args->n_tensors != 2) return fail(err, err_len, "cast: expected 2 tensors (x, out)");
  const td_tensor& x = args->tensors[0];
  const td_tensor& out = args->tensors[1];
  if (!same_shape(x, out)) return fail(err, err_len, "cast: x and out differ in shape");
  if (td_dtype_size(x.dtype) == 0 || td_dtype_size(out.dtype) == 0) return fail(err, err_len, "cast: unsupported dtype");
  const int64_t xsz = static_cast<int64_t>(td_dtype_size(x.dtype));
  const int64_t osz = static_cast<int64_t>(td_dtype_size(out.dtype));
  float buf[kChunk];
  walk_pairs(x, out, [&](int64_t xo, int64_t sx, int64_t oo, int64_t so, int64_t n) {
    const char* xp = elem_ptr(x, xo);
    char* op = elem_ptr(out, oo);
    if (x.dtype == out.dtype) {
      copy_elems(static_cast<size_t>(xsz), xp, sx, op, so, n);
    } else if (is_int_dtype(x.dtype) && is_int_dtype(out.dtype)) {
      for (int64_t i = 0; i < n; ++i) write_int(op + i * so * osz, out.dtype, read_int(xp + i * sx * xsz, x.dtype));
    } else if (is_int_dtype(x.dtype) && out.dtype == TD_FLOAT32) {
      float* o = reinterpret_cast<float*>(op);
      for (int64_t i = 0; i < n; ++i) o[i * so] = static_cast<float>(read_int(xp + i * sx * xsz, x.dtype));
    } else {
      // Through float32 chunks: exact for every float source, and the one
      // rounding step for integers into half types.
      for (int64_t c = 0; c < n; c += kChunk) {
        const int64_t len = n - c < kChunk ? n - c : kChunk;
        ops::load(xp + c * sx * xsz, x.dtype, sx, len, buf);
        if (is_float_dtype(out.dtype)) {
          ops::store(buf, op + c * so * osz, out.dtype, so, len);
        } else {
          for (int64_t i = 0; i < len; ++i) write_int(op + (c + i) * so * osz, out.dtype, float_to_int(buf[i]));
        }
      }
    }
  });
  return 0;
}

namespace {
// out[j, i] = x[i, j] for one m x n matrix, in tiles that keep both sides in cache.
template <size_t N>
void transpose_matrix(const char* src, int64_t srs, int64_t scs, char* dst, int64_t drs, int64_t dcs, int64_t m,
                      int64_t n) {
  constexpr int64_t kTile = 32;
  const auto* s = reinterpret_cast<const Bytes<N>*>(src);
  auto* d = reinterpret_cast<Bytes<N>*>(dst);
  for (int64_t i0 = 0; i0 < m; i0 += kTile) {
    const int64_t i1 = i0 + kTile < m ? i0 + kTile : m;
    for (int64_t j0 = 0; j0 < n; j0 += kTile) {
      const int64_t j1 = j0 + kTile < n ? j0 + kTile : n;
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t i = i0; i < i1; ++i) d[j * drs + i * dcs] = s[i * srs + j * scs];
    }
  }
}
}  // namespace

// out <- x with its last two axes swapped: x [..., M, N], out [..., N, M].
TANDEM_KERNEL(transpose) {
  if (args->n_tensors != 2) return fail(err, err_len, "transpose: expected 2 tensors (x, out)");
  const td_tensor& x = args->tensors[0];
  const td_tensor& out = args->tensors[1];
  const int nd = x.ndim;
  if (x.dtype != out.dtype || nd < 2 || out.ndim != nd) return fail(err, err_len, "transpose: x and out must be [..., M, N] and [..., N, M] of one dtype");
  for (int d = 0; d < nd - 2; ++d)
    if (out.shape[d] != x.shape[d]) return fail(err, err_len, "transpose: leading axes of x and out differ");
  const int64_t m = x.shape[nd - 2], n = x.shape[nd - 1];
  if (out.shape[nd - 2] != n || out.shape[nd - 1] != m) return fail(err, err_len, "transpose: out must be [..., N, M]");
  const size_t size = td_dtype_size(x.dtype);
  if (size == 0) return fail(err, err_len, "transpose: unsupported dtype %d", x.dtype);
  Walker w(nd - 2, x.shape);
  w.add(x.strides);
  w.add(out.strides);
  w.simplify();
  const int64_t srs = x.strides[nd - 2], scs = x.strides[nd - 1], drs = out.strides[nd - 2], dcs = out.strides[nd - 1];
  w.for_each([&](const int64_t* off) {
    const char* s = elem_ptr(x, off[0]);
    char* d = elem_ptr(out, off[1]);
    switch (size) {
      case 1: transpose_matrix<1>(s, srs, scs, d, drs, dcs, m, n); break;
      case 2: transpose_matrix<2>(s, srs, scs, d, drs, dcs, m, n); break;
      case 4: transpose_matrix<4>(s, srs, scs, d, drs, dcs, m, n); break;
      default: transpose_matrix<8>(s, srs, scs, d, drs, dcs, m, n); break;
    }
  });
  return 0;
}

// embedding(ids, table, out): out[..., :] = table[ids[...], :]. Every id is
// checked before anything is written, so a bad id leaves out untouched.
TANDEM_KERNEL(embedding) {
  if (args->n_tensors != 3) return fail(err, err_len, "embedding: expected tensors (ids, table, out)");
  const td_tensor& ids = args->tensors[0];
  const td_tensor& table = args->tensors[1];
  const td_tensor& out = args->tensors[2];
  if (ids.dtype != TD_INT32 && ids.dtype != TD_INT64)
    return fail(err, err_len, "embedding: ids must be int32 or int64, got %s", dtype_name(ids.dtype));
  if (table.ndim != 2 || out.dtype != table.dtype || td_dtype_size(table.dtype) == 0)
    return fail(err, err_len, "embedding: table must be 2-d and out of its dtype");
  const int64_t vocab = table.shape[0], dim = table.shape[1];
  if (out.ndim != ids.ndim + 1 || out.shape[ids.ndim] != dim)
    return fail(err, err_len, "embedding: out must have shape ids.shape + (%lld,)", static_cast<long long>(dim));
  for (int d = 0; d < ids.ndim; ++d)
    if (out.shape[d] != ids.shape[d]) return fail(err, err_len, "embedding: out must have shape ids.shape + (D,)");
  Walker w(ids.ndim, ids.shape);
  w.add(ids.strides);
  w.add(out.strides);
  w.simplify();
  const int64_t isz = static_cast<int64_t>(td_dtype_size(ids.dtype));
  const auto id_at = [&](int64_t off) { return read_int(static_cast<const char*>(ids.data) + off * isz, ids.dtype); };
  int64_t pos = 0, bad_pos = -1, bad_id = 0;
  w.for_each([&](const int64_t* off) {
    const int64_t id = id_at(off[0]);
    if (bad_pos < 0 && (id < 0 || id >= vocab)) {
      bad_pos = pos;
      bad_id = id;
    }
    ++pos;
  });
  if (bad_pos >= 0)
    return fail(err, err_len, "embedding: id %lld at position %lld is out of range for a table of %lld rows",
                static_cast<long long>(bad_id), static_cast<long long>(bad_pos), static_cast<long long>(vocab));
  const size_t size = td_dtype_size(table.dtype);
  const int64_t trs = table.strides[0], tcs = table.strides[1], ocs = out.strides[ids.ndim];
  w.for_each([&](const int64_t* off) {
    copy_elems(size, elem_ptr(table, id_at(off[0]) * trs), tcs, elem_ptr(out, off[1]), ocs, dim);
  });
  return 0;
}

}  // namespace tandem::kernels
