#include "rowops.hpp"

#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "simd.hpp"
#include "util.hpp"

// The vector functors return 64-byte vectors; they are always inlined, so the
// ABI change GCC warns about for such returns never applies.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace tandem::kernels::ops {

namespace {

constexpr int kLanes = 32;          // independent accumulators: two AVX-512 registers
constexpr int64_t kBlock = 2048;    // elements summed in float before moving to double

inline float reduce_lanes(float* acc) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// Sum of f(x[i]) over a run. Float lane accumulators vectorise without
// reassociating anything the compiler would refuse to; each block's total
// goes into a double so long runs keep their precision.
template <class F>
TD_INLINE double blocked_sum(const float* x, int64_t n, F f) {
  double total = 0.0;
  int64_t i = 0;
  while (i < n) {
    const int64_t end = n - i > kBlock ? i + kBlock : n;
    float acc[kLanes] = {};
    for (; i + kLanes <= end; i += kLanes)
      for (int j = 0; j < kLanes; ++j) acc[j] += f(x[i + j]);
    float tail = 0.0f;
    for (; i < end; ++i) tail += f(x[i]);
    total += static_cast<double>(reduce_lanes(acc)) + static_cast<double>(tail);
  }
  return total;
}

struct Identity {
  TD_INLINE float operator()(float v) const { return v; }
};
struct Square {
  TD_INLINE float operator()(float v) const { return v * v; }
};
struct SquareDev {
  float c;
  TD_INLINE float operator()(float v) const { return (v - c) * (v - c); }
};

// Functors for simd::map / simd::zip, force-inlined into each ISA variant.
struct Add {  // lane arithmetic: any vector width (zip_narrow)
  template <class V>
  TD_INLINE V operator()(const V& a, const V& b) const { return a + b; }
};
struct Sub {  // lane arithmetic: any vector width (zip_narrow)
  template <class V>
  TD_INLINE V operator()(const V& a, const V& b) const { return a - b; }
};
struct Mul {  // lane arithmetic: any vector width (zip_narrow)
  template <class V>
  TD_INLINE V operator()(const V& a, const V& b) const { return a * b; }
};
struct Div {  // lane arithmetic: any vector width (zip_narrow)
  template <class V>
  TD_INLINE V operator()(const V& a, const V& b) const { return a / b; }
};
struct AddS {
  simd::vfloat s;
  TD_INLINE simd::vfloat operator()(const simd::vfloat& a) const { return a + s; }
};
struct SubS {
  simd::vfloat s;
  TD_INLINE simd::vfloat operator()(const simd::vfloat& a) const { return a - s; }
};
struct MulS {
  simd::vfloat s;
  TD_INLINE simd::vfloat operator()(const simd::vfloat& a) const { return a * s; }
};
struct DivS {
  simd::vfloat s;
  TD_INLINE simd::vfloat operator()(const simd::vfloat& a) const { return a / s; }
};
struct Relu {  // selecting on x < 0 lets NaN through, as torch does
  TD_INLINE simd::vfloat operator()(const simd::vfloat& a) const { return a < simd::splat(0.0f) ? simd::splat(0.0f) : a; }
};
struct Axpy {  // y + alpha * x, with (x, y) as (a, b)
  simd::vfloat alpha;
  TD_INLINE simd::vfloat operator()(const simd::vfloat& x, const simd::vfloat& y) const { return y + alpha * x; }
};

// Unary math functors.
#define TD_VEC_FUNCTOR(Name, expr)                                              \
  struct Name {                                                                 \
    TD_INLINE simd::vfloat operator()(const simd::vfloat& v) const { return expr; } \
  }
TD_VEC_FUNCTOR(Gelu, simd::gelu_erf(v));
TD_VEC_FUNCTOR(GeluTanh, simd::gelu_tanh(v));
TD_VEC_FUNCTOR(Silu, simd::silu(v));
TD_VEC_FUNCTOR(Tanh, simd::tanh(v));
TD_VEC_FUNCTOR(Exp, simd::exp(v));
#undef TD_VEC_FUNCTOR
struct ExpShift {
  simd::vfloat c;
  TD_INLINE simd::vfloat operator()(const simd::vfloat& v) const { return simd::exp(v - c); }
};
}  // namespace

TD_CLONES void add(const float* a, const float* b, float* o, int64_t n) { simd::zip_narrow(a, b, o, n, Add{}); }
TD_CLONES void sub(const float* a, const float* b, float* o, int64_t n) { simd::zip_narrow(a, b, o, n, Sub{}); }
TD_CLONES void mul(const float* a, const float* b, float* o, int64_t n) { simd::zip_narrow(a, b, o, n, Mul{}); }
TD_CLONES void div(const float* a, const float* b, float* o, int64_t n) { simd::zip_narrow(a, b, o, n, Div{}); }
TD_CLONES void add_s(const float* a, float s, float* o, int64_t n) { simd::map(a, o, n, AddS{simd::splat(s)}); }
TD_CLONES void sub_s(const float* a, float s, float* o, int64_t n) { simd::map(a, o, n, SubS{simd::splat(s)}); }
TD_CLONES void mul_s(const float* a, float s, float* o, int64_t n) { simd::map(a, o, n, MulS{simd::splat(s)}); }
TD_CLONES void div_s(const float* a, float s, float* o, int64_t n) { simd::map(a, o, n, DivS{simd::splat(s)}); }
TD_CLONES void relu(const float* x, float* o, int64_t n) { simd::map(x, o, n, Relu{}); }

TD_CLONES void gelu(const float* x, float* o, int64_t n) { simd::map(x, o, n, Gelu{}); }
TD_CLONES void gelu_tanh(const float* x, float* o, int64_t n) { simd::map(x, o, n, GeluTanh{}); }
TD_CLONES void silu(const float* x, float* o, int64_t n) { simd::map(x, o, n, Silu{}); }
TD_CLONES void tanh(const float* x, float* o, int64_t n) { simd::map(x, o, n, Tanh{}); }
TD_CLONES void exp(const float* x, float* o, int64_t n) { simd::map(x, o, n, Exp{}); }

TD_CLONES double sum(const float* x, int64_t n) { return blocked_sum(x, n, Identity{}); }
TD_CLONES double sum_sq(const float* x, int64_t n) { return blocked_sum(x, n, Square{}); }
TD_CLONES double sum_sq_dev(const float* x, int64_t n, float c) { return blocked_sum(x, n, SquareDev{c}); }

TD_CLONES float max(const float* x, int64_t n) {
  float m[kLanes];
  int32_t nan[kLanes];
  for (int j = 0; j < kLanes; ++j) {
    m[j] = -std::numeric_limits<float>::infinity();
    nan[j] = 0;
  }
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = x[i + j];
      m[j] = v > m[j] ? v : m[j];
      nan[j] |= static_cast<int32_t>(v != v);
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  int32_t any_nan = 0;
  for (int j = 0; j < kLanes; ++j) {
    best = m[j] > best ? m[j] : best;
    any_nan |= nan[j];
  }
  for (; i < n; ++i) {
    best = x[i] > best ? x[i] : best;
    any_nan |= static_cast<int32_t>(x[i] != x[i]);
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : best;
}

TD_CLONES int64_t argmax(const float* x, int64_t n) {
  if (n <= 0) return 0;
  if (n > 0x7fffffff) {  // beyond int32 lane indices: two passes
    const float m = max(x, n);
    for (int64_t i = 0; i < n; ++i)
      if (x[i] == m || (m != m && x[i] != x[i])) return i;
    return 0;
  }
  // One pass: each lane keeps its maximum and where it first saw it (strict >
  // keeps the first occurrence), plus whether it met a NaN.
  using simd::vfloat;
  using simd::vint;
  vfloat best = simd::splat(-std::numeric_limits<float>::infinity());
  vint at = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vint where = at;
  vint nan = {};
  int32_t i = 0;
  const int32_t n32 = static_cast<int32_t>(n);
  for (; i + simd::kWidth <= n32; i += simd::kWidth) {
    const vfloat v = simd::load(x + i);
    const vint better = v > best;
    best = better ? v : best;
    where = better ? at : where;
    nan |= v != v;
    at += simd::kWidth;
  }
  int64_t arg = -1;
  float m = -std::numeric_limits<float>::infinity();
  int32_t any_nan = 0;
  for (int j = 0; j < simd::kWidth; ++j) {
    any_nan |= nan[j];
    if (best[j] > m || (best[j] == m && where[j] < arg)) {
      m = best[j];
      arg = where[j];
    }
  }
  for (; i < n32; ++i) {
    any_nan |= static_cast<int32_t>(x[i] != x[i]);
    if (x[i] > m) {
      m = x[i];
      arg = i;
    }
  }
  if (any_nan) {  // numpy's rule: the first NaN wins
    for (int64_t k = 0; k < n; ++k)
      if (x[k] != x[k]) return k;
  }
  return arg < 0 ? 0 : arg;  // every element -inf: the first
}

TD_CLONES float scale_mask_max(const float* x, const float* mask, float scale, float* o, int64_t n) {
  if (mask != nullptr) {
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] * scale + mask[i];
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = x[i] * scale;
  }
  return max(o, n);
}

TD_CLONES double exp_sub_sum(const float* x, float c, float* o, int64_t n) {
  // exp and sum in one pass: 2 x 16 float lanes per block of 512 elements,
  // each block's total added in double.
  const simd::vfloat cv = simd::splat(c);
  const ExpShift f{cv};
  double total = 0.0;
  int64_t i = 0;
  while (i + 2 * simd::kWidth <= n) {
    const int64_t end = n - i > 512 ? i + 512 : n;
    simd::vfloat acc0 = {}, acc1 = {};
    for (; i + 2 * simd::kWidth <= end; i += 2 * simd::kWidth) {
      const simd::vfloat a = f(simd::load(x + i));
      const simd::vfloat b = f(simd::load(x + i + simd::kWidth));
      simd::store(o + i, a);
      simd::store(o + i + simd::kWidth, b);
      acc0 += a;
      acc1 += b;
    }
    acc0 += acc1;
    float lanes[simd::kWidth];
    simd::store(lanes, acc0);
    for (int j = 0; j < simd::kWidth; ++j) total += lanes[j];
  }
  if (i < n) {  // the rest through the padded map; its tail is summed directly
    simd::map(x + i, o + i, n - i, f);
    for (; i < n; ++i) total += o[i];
  }
  return total;
}

TD_CLONES void norm_affine(const float* x, const float* g, const float* b, float mean, float rstd, float* o,
                           int64_t n) {
  if (g != nullptr && b != nullptr) {
    for (int64_t i = 0; i < n; ++i) o[i] = (x[i] - mean) * rstd * g[i] + b[i];
  } else if (g != nullptr) {
    for (int64_t i = 0; i < n; ++i) o[i] = (x[i] - mean) * rstd * g[i];
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = (x[i] - mean) * rstd;
  }
}

TD_CLONES void axpy(float a, const float* x, float* y, int64_t n) { simd::zip(x, y, y, n, Axpy{simd::splat(a)}); }

TD_CLONES void bf16_to_f32(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = simd::as_float(static_cast<uint32_t>(s[i]) << 16);
}

namespace {
TD_CLONES void f32_to_bf16_generic(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t x = simd::as_bits(s[i]);
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;  // nearest even
    const uint32_t quiet = (x >> 16) | 0x40u;                         // NaN stays NaN
    d[i] = static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
  }
}

// F16C converts eight halves per instruction; the compiler does not
// vectorise _Float16 conversions on its own, so these use intrinsics.
__attribute__((target("avx2,f16c"))) void f16_to_f32_f16c(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) d[i] = _cvtsh_ss(s[i]);
}
__attribute__((target("avx2,f16c"))) void f32_to_f16_f16c(const float* s, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) d[i] = float_to_half(s[i]);
}
bool has_f16c() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"); }

// AVX512-BF16 rounds 16 floats to bfloat16 (nearest even, NaN kept) in one
// instruction; unlike the generic path it flushes float32 subnormals (below
// 1.2e-38) to zero.
__attribute__((target("avx512f,avx512bf16"))) void f32_to_bf16_avx512bf16(const float* s, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), __builtin_bit_cast(__m256i, h));
  }
  f32_to_bf16_generic(s + i, d + i, n - i);
}
}  // namespace

void f32_to_bf16(const float* s, uint16_t* d, int64_t n) {
  if (__builtin_cpu_supports("avx512bf16")) {
    f32_to_bf16_avx512bf16(s, d, n);
    return;
  }
  f32_to_bf16_generic(s, d, n);
}

void f16_to_f32(const uint16_t* s, float* d, int64_t n) {
  if (has_f16c()) {
    f16_to_f32_f16c(s, d, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) d[i] = half_to_float(s[i]);
}

void f32_to_f16(const float* s, uint16_t* d, int64_t n) {
  if (has_f16c()) {
    f32_to_f16_f16c(s, d, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_half(s[i]);
}

void load(const void* p, int32_t dt, int64_t s, int64_t n, float* dst) {
  switch (dt) {
    case TD_FLOAT32: {
      const float* x = static_cast<const float*>(p);
      if (s == 1) {
        std::memcpy(dst, x, static_cast<size_t>(n) * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = x[i * s];
      }
      return;
    }
    case TD_FLOAT16: {
      const uint16_t* x = static_cast<const uint16_t*>(p);
      if (s == 1) {
        f16_to_f32(x, dst, n);
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(x[i * s]);
      }
      return;
    }
    case TD_BFLOAT16: {
      const uint16_t* x = static_cast<const uint16_t*>(p);
      if (s == 1) {
        bf16_to_f32(x, dst, n);
      } else {
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(x[i * s]);
      }
      return;
    }
    case TD_INT32: {
      const int32_t* x = static_cast<const int32_t*>(p);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(x[i * s]);
      return;
    }
    case TD_INT64: {
      const int64_t* x = static_cast<const int64_t*>(p);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(x[i * s]);
      return;
    }
    case TD_UINT8: {
      const uint8_t* x = static_cast<const uint8_t*>(p);
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(x[i * s]);
      return;
    }
    default:
      for (int64_t i = 0; i < n; ++i) dst[i] = 0.0f;
  }
}

void store(const float* src, void* p, int32_t dt, int64_t s, int64_t n) {
  switch (dt) {
    case TD_FLOAT32: {
      float* y = static_cast<float*>(p);
      if (s == 1) {
        if (y != src) std::memmove(y, src, static_cast<size_t>(n) * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) y[i * s] = src[i];
      }
      return;
    }
    case TD_FLOAT16: {
      uint16_t* y = static_cast<uint16_t*>(p);
      if (s == 1) {
        f32_to_f16(src, y, n);
      } else {
        for (int64_t i = 0; i < n; ++i) y[i * s] = float_to_half(src[i]);
      }
      return;
    }
    case TD_BFLOAT16: {
      uint16_t* y = static_cast<uint16_t*>(p);
      if (s == 1) {
        f32_to_bf16(src, y, n);
      } else {
        for (int64_t i = 0; i < n; ++i) y[i * s] = float_to_bf16(src[i]);
      }
      return;
    }
    default:
      return;
  }
}

}  // namespace tandem::kernels::ops
