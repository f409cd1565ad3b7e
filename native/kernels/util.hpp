// Small helpers shared by the built-in kernels: error reporting, scalar
// access, element conversion for half types, and iteration over strided
// tensors (Walker).
#pragma once

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "tandem/kernel_abi.h"

namespace tandem::kernels {

// Writes a printf-style message into err and returns 1 (a kernel's error code).
inline int fail(char* err, size_t err_len, const char* fmt, ...) __attribute__((format(printf, 3, 4)));
inline int fail(char* err, size_t err_len, const char* fmt, ...) {
  if (err != nullptr && err_len > 0) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
  }
  return 1;
}

inline const char* dtype_name(int32_t d) {
  switch (d) {
    case TD_FLOAT32: return "float32";
    case TD_FLOAT16: return "float16";
    case TD_BFLOAT16: return "bfloat16";
    case TD_INT32: return "int32";
    case TD_INT64: return "int64";
    case TD_UINT8: return "uint8";
    default: return "unknown";
  }
}

inline bool is_float_dtype(int32_t d) { return d == TD_FLOAT32 || d == TD_FLOAT16 || d == TD_BFLOAT16; }
inline bool is_int_dtype(int32_t d) { return d == TD_INT32 || d == TD_INT64 || d == TD_UINT8; }

// Scalar `i` as a number, or `dflt` when the call passed fewer scalars.
inline double scalar_f(const td_args* a, int i, double dflt) {
  if (i >= a->n_scalars) return dflt;
  const td_scalar& s = a->scalars[i];
  return s.kind == TD_SCALAR_INT ? static_cast<double>(s.value.i) : s.value.f;
}
inline int64_t scalar_i(const td_args* a, int i, int64_t dflt) {
  if (i >= a->n_scalars) return dflt;
  const td_scalar& s = a->scalars[i];
  return s.kind == TD_SCALAR_INT ? s.value.i : static_cast<int64_t>(s.value.f);
}

inline int64_t numel(const td_tensor& t) {
  int64_t n = 1;
  for (int i = 0; i < t.ndim; ++i) n *= t.shape[i];
  return n;
}

// Number of rows when the last axis is the row (1 for a 0-d or 1-d tensor).
inline int64_t row_count(const td_tensor& t) {
  int64_t n = 1;
  for (int i = 0; i + 1 < t.ndim; ++i) n *= t.shape[i];
  return n;
}

inline int64_t row_length(const td_tensor& t) { return t.ndim == 0 ? 1 : t.shape[t.ndim - 1]; }
inline int64_t row_stride(const td_tensor& t) { return t.ndim == 0 ? 1 : t.strides[t.ndim - 1]; }

// Element offset of row `r` (row-major order over the leading axes).
inline int64_t row_offset(const td_tensor& t, int64_t r) {
  int64_t off = 0;
  for (int i = t.ndim - 2; i >= 0; --i) {
    const int64_t n = t.shape[i];
    off += (r % n) * t.strides[i];
    r /= n;
  }
  return off;
}

// True when the tensor's elements are laid out densely in row-major order.
inline bool is_contiguous(const td_tensor& t) {
  int64_t expect = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    if (t.shape[i] != 1 && t.strides[i] != expect) return false;
    expect *= t.shape[i];
  }
  return true;
}

inline bool same_shape(const td_tensor& a, const td_tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  return true;
}

// Whether axes [first, last] of t collapse into one axis, and its stride.
inline bool collapse(const td_tensor& t, int first, int last, int64_t* stride) {
  int64_t expect = -1;  // stride the next outer non-trivial axis must have
  *stride = t.strides[last];
  bool seen = false;
  for (int d = last; d >= first; --d) {
    if (t.shape[d] == 1) continue;
    if (seen && t.strides[d] != expect) return false;
    if (!seen) *stride = t.strides[d];
    seen = true;
    expect = t.strides[d] * t.shape[d];
  }
  return true;
}

// Address of the element at element offset `off`.
inline char* elem_ptr(const td_tensor& t, int64_t off) {
  return static_cast<char*>(t.data) + off * static_cast<int64_t>(td_dtype_size(t.dtype));
}

// Strides of `t`'s first `t_dims` axes over an index space of `nd` axes, aligned
// to the right (numpy broadcasting): missing and size-1 axes get stride 0.
// Returns false when an axis of `t` neither matches nor broadcasts.
inline bool broadcast_strides(const td_tensor& t, int t_dims, int nd, const int64_t* shape, int64_t* out) {
  if (t_dims > nd) return false;
  const int lead = nd - t_dims;
  for (int d = 0; d < nd; ++d) {
    if (d < lead) {
      out[d] = 0;
      continue;
    }
    const int64_t n = t.shape[d - lead];
    if (n == shape[d]) {
      out[d] = n == 1 ? 0 : t.strides[d - lead];
    } else if (n == 1) {
      out[d] = 0;
    } else {
      return false;
    }
  }
  return true;
}

// Walks an index space shared by up to kMax tensors in row-major order and
// hands each visit the tensors' element offsets. Size-1 axes drop out and
// axes that are contiguous for every tensor merge, so a dense [B, S, N] costs
// one counter. Kernels usually peel the innermost axis off (inner_*) and
// process it as a run of `inner_len()` elements.
class Walker {
 public:
  static constexpr int kMax = 6;

  Walker(int nd, const int64_t* shape) : nd_(nd) {
    for (int d = 0; d < nd; ++d) shape_[d] = shape[d];
  }

  // Adds a tensor by its strides over the shape (0 on broadcast axes); returns its index.
  int add(const int64_t* strides) {
    for (int d = 0; d < nd_; ++d) strides_[nt_][d] = strides[d];
    return nt_++;
  }

  // Merges and drops axes; call after the last add().
  void simplify() {
    int w = 0;
    for (int d = 0; d < nd_; ++d) {
      if (shape_[d] == 1) continue;
      bool merge = w > 0;
      for (int t = 0; merge && t < nt_; ++t) merge = strides_[t][w - 1] == strides_[t][d] * shape_[d];
      if (merge) {
        shape_[w - 1] *= shape_[d];
        for (int t = 0; t < nt_; ++t) strides_[t][w - 1] = strides_[t][d];
      } else {
        shape_[w] = shape_[d];
        for (int t = 0; t < nt_; ++t) strides_[t][w] = strides_[t][d];
        ++w;
      }
    }
    nd_ = w;
  }

  int64_t size() const {
    int64_t n = 1;
    for (int d = 0; d < nd_; ++d) n *= shape_[d];
    return n;
  }
  int ndim() const { return nd_; }

  // The innermost axis as a run: its length and each tensor's stride along it.
  int64_t inner_len() const { return nd_ == 0 ? 1 : shape_[nd_ - 1]; }
  int64_t inner_stride(int t) const { return nd_ == 0 ? 1 : strides_[t][nd_ - 1]; }
  // Removes the innermost axis from the walk (after reading inner_*).
  void drop_inner() {
    if (nd_ > 0) --nd_;
  }

  // Calls f(off) for every position; off[t] is tensor t's element offset.
  template <class F>
  void for_each(F&& f) const {
    int64_t off[kMax] = {};
    if (size() == 0) return;
    if (nd_ == 0) {
      f(static_cast<const int64_t*>(off));
      return;
    }
    int64_t idx[TD_MAX_DIMS] = {};
    const int last = nd_ - 1;
    for (;;) {
      for (int64_t i = 0; i < shape_[last]; ++i) {
        f(static_cast<const int64_t*>(off));
        for (int t = 0; t < nt_; ++t) off[t] += strides_[t][last];
      }
      for (int t = 0; t < nt_; ++t) off[t] -= strides_[t][last] * shape_[last];
      int d = last - 1;
      for (; d >= 0; --d) {
        for (int t = 0; t < nt_; ++t) off[t] += strides_[t][d];
        if (++idx[d] < shape_[d]) break;
        for (int t = 0; t < nt_; ++t) off[t] -= strides_[t][d] * shape_[d];
        idx[d] = 0;
      }
      if (d < 0) return;
    }
  }

 private:
  int nd_ = 0;
  int nt_ = 0;
  int64_t shape_[TD_MAX_DIMS] = {};
  int64_t strides_[kMax][TD_MAX_DIMS] = {};
};

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (absx < 0x38800000u) {                                                 // subnormal or zero
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = absx >> 23;
    const uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14 + (112 - e) ... aligns to 2^-24 units
    uint32_t half_m = m >> (shift);
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1u))) ++half_m;
    return static_cast<uint16_t>(sign | half_m);
  }
  // normal: round to nearest even
  uint32_t h = ((absx - 0x38000000u) >> 13);
  const uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet nan
  const uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;  // round to nearest even
  return static_cast<uint16_t>(x >> 16);
}

}  // namespace tandem::kernels
