// Vectorised float32 math for the hot loops, written on GCC vector extensions
// (16 lanes) so the instruction sequence is exactly what is written here: the
// compiler maps each operation to one AVX-512 instruction, two AVX2 ones or
// four SSE ones, in whichever TD_CLONES variant the CPU selects at load time
// (the core itself targets x86-64-v2). Every function is force-inlined into
// those variants; none takes a branch per lane, selects become blends.
//
// Accuracy (float32, measured against float64 over dense grids): exp ~1e-7
// relative, results below 2^-124 flush to zero; tanh < 4e-7; erf < 5e-7;
// silu < 2e-7.
#pragma once

#include <cstdint>
#include <cstring>

// AVX-512 / AVX2+FMA / baseline variants, picked by the CPU at load time.
// (Defining TD_CLONES empty builds the baseline alone, to check it.)
#ifndef TD_CLONES
#define TD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define TD_WHOLE_VECTORS_WITH_AVX512 1
#endif

#define TD_INLINE inline __attribute__((always_inline))

// Vector values never cross a call boundary here (everything is inlined and
// arguments go by reference), so GCC's warning that returning 64-byte vectors
// changes the ABI without AVX-512 does not apply.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"

namespace tandem::kernels::simd {

constexpr int kWidth = 16;
typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));

TD_INLINE float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
TD_INLINE uint32_t as_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

TD_INLINE vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
TD_INLINE void store(float* p, const vfloat& v) { std::memcpy(p, &v, sizeof v); }
// s in every lane, as a shuffle of lane 0: one broadcast (with AVX-512 often folded into the FMA
// that reads s, {1to16}). Written 0 + s, it costs a scalar add before every broadcast (0 + s turns
// -0 into +0, so the compiler may not drop it), one per FMA row of a matmul block; and the
// foldable forms (s - 0, a vector of s) GCC lowers in these clones to sixteen masked broadcasts.
TD_INLINE vfloat splat(float s) { return __builtin_shuffle(vfloat{s}, vint{}); }
TD_INLINE vint bits(const vfloat& v) { return __builtin_bit_cast(vint, v); }
TD_INLINE vfloat from_bits(const vint& v) { return __builtin_bit_cast(vfloat, v); }
// The math below is written once over a vector type V. With AVX-512 it runs on whole 16-lane
// vectors (a comparison is one mask instruction, a select one masked move); without, on 8-lane
// halves: GCC lowers comparisons and selects of 64-byte vectors lane by lane there (scalar
// compares, blends and spills), while 32-byte ones become one vcmpps / vblendvps each. Which one
// is a property of the CPU, read once: a TD_CLONES variant cannot know at compile time which
// clone it is, and the branch on a constant is free in a loop. (matmul_packed picks its
// whole-vector register block by the same constant.)
typedef float vhalf __attribute__((vector_size(32)));
#ifdef TD_WHOLE_VECTORS_WITH_AVX512
inline const bool kWholeVectors = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
#else
constexpr bool kWholeVectors = false;  // a one-variant build (TD_CLONES given: the sanitizers') checks halves
#endif
template <class V>
using mask_of = decltype(V{} < V{});
template <class V>
TD_INLINE V splat_as(float s) {
  return V{} + s;
}
template <class V>
TD_INLINE mask_of<V> bits_of(const V& v) {
  return __builtin_bit_cast(mask_of<V>, v);
}
template <class V>
TD_INLINE V abs(const V& v) {
  return __builtin_bit_cast(V, bits_of(v) & 0x7fffffff);
}
template <class V>
TD_INLINE V sign_of(const V& v) {
  return __builtin_bit_cast(V, bits_of(v) & static_cast<int32_t>(0x80000000u));
}
// Clamps that keep NaN (a NaN lane compares false and passes through).
template <class V>
TD_INLINE V at_least(const V& v, float lo) {
  return v < splat_as<V>(lo) ? splat_as<V>(lo) : v;
}
template <class V>
TD_INLINE V at_most(const V& v, float hi) {
  return v > splat_as<V>(hi) ? splat_as<V>(hi) : v;
}
// A 16-lane vector's 8-lane halves, and back.
TD_INLINE vhalf low_half(const vfloat& x) {
  vhalf h;
  std::memcpy(&h, &x, sizeof h);
  return h;
}
TD_INLINE vhalf high_half(const vfloat& x) {
  vhalf h;
  std::memcpy(&h, reinterpret_cast<const char*>(&x) + sizeof h, sizeof h);
  return h;
}
TD_INLINE vfloat join(const vhalf& lo, const vhalf& hi) {
  vfloat r;
  std::memcpy(&r, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&r) + sizeof lo, &hi, sizeof hi);
  return r;
}

constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;  // ln 2 = kLn2Hi - kLn2Lo, kLn2Hi exact in 9 bits
constexpr float kLn2Lo = 2.12194440e-4f;
constexpr float kExpMin = -86.5f;       // below: 0 (the result would be under 2^-124)
constexpr float kExpMax = 88.72283935546875f;  // above: inf

// exp(x) = 2^n exp(r): n = round(x log2e), r = x - n ln2 in [-ln2/2, ln2/2].
template <class V>
TD_INLINE V exp_of(const V& x) {
  using M = mask_of<V>;
  typedef uint32_t U __attribute__((vector_size(sizeof(V))));
  const M under = x < splat_as<V>(kExpMin);
  const M over = x > splat_as<V>(kExpMax);
  const V xc = at_most(at_least(x, kExpMin), kExpMax);
  const V t = xc * kLog2e + kRound;  // t's low mantissa bits hold n
  const V fn = t - kRound;
  const V r = (xc - fn * kLn2Hi) + fn * kLn2Lo;
  // Cephes expf polynomial, ~1 ulp on the reduced range.
  V p = splat_as<V>(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^(n-1) built from t's bits, times 2p: n reaches 128 at the top of the range.
  const U biased = __builtin_bit_cast(U, bits_of(t) + (126 - 0x4B400000));
  V y = (p + p) * __builtin_bit_cast(V, biased << 23);
  y = under ? splat_as<V>(0.0f) : y;
  return over ? splat_as<V>(__builtin_inff()) : y;
}
TD_INLINE vfloat exp(const vfloat& x) {
  if (kWholeVectors) return exp_of(x);
  return join(exp_of(low_half(x)), exp_of(high_half(x)));
}

// tanh(x) = x P(x^2) / Q(x^2) on [-9, 9] (a rational fit, relative error <
// 4e-7), +-1 beyond, where float32 tanh rounds to 1.
template <class V>
TD_INLINE V tanh_of(const V& x) {
  using M = mask_of<V>;
  const M saturated = abs(x) > splat_as<V>(9.0f);
  const V xc = at_most(at_least(x, -9.0f), 9.0f);
  const V z = xc * xc;
  V p = splat_as<V>(1.3442281954212376e-08f);
  p = p * z + 2.067957575491164e-05f;
  p = p * z + 0.003500196849927306f;
  p = p * z + 0.13385017216205597f;
  p = p * z + 1.0f;
  V q = splat_as<V>(7.81454559728445e-07f);
  q = q * z + 0.0003292941546533257f;
  q = q * z + 0.025894857943058014f;
  q = q * z + 0.467183381319046f;
  q = q * z + 1.0f;
  const V y = xc * p / q;
  return saturated ? __builtin_bit_cast(V, bits_of(splat_as<V>(1.0f)) | bits_of(sign_of(x))) : y;
}
TD_INLINE vfloat tanh(const vfloat& x) {
  if (kWholeVectors) return tanh_of(x);
  return join(tanh_of(low_half(x)), tanh_of(high_half(x)));
}

// x * sigmoid(u) = x / (1 + exp(-u)): both tails keep their relative precision.
TD_INLINE vfloat mul_sigmoid(const vfloat& x, const vfloat& u) { return x / (exp(-u) + 1.0f); }

TD_INLINE vfloat silu(const vfloat& x) { return mul_sigmoid(x, x); }

// gelu with the tanh approximation: 0.5 x (1 + tanh(u)) = x * sigmoid(2u).
TD_INLINE vfloat gelu_tanh(const vfloat& x) {
  const vfloat u = (x + x * x * x * 0.044715f) * 0.7978845608028654f;
  return mul_sigmoid(x, u + u);
}

// erf(z) = z P(z^2) / Q(z^2) on [-3.9, 3.9] (a rational fit, relative error
// < 5e-7), +-1 beyond, where float32 erf rounds to 1.
template <class V>
TD_INLINE V erf_of(const V& z) {
  const V zc = at_most(at_least(z, -3.9f), 3.9f);
  const V s = zc * zc;
  V p = splat_as<V>(2.084872448904207e-06f);
  p = p * s + 0.0002839842636603862f;
  p = p * s + 0.003670047502964735f;
  p = p * s + 0.05245712026953697f;
  p = p * s + 0.1880134493112564f;
  p = p * s + 1.1283791065216064f;
  V q = splat_as<V>(3.840496719931252e-05f);
  q = q * s + 0.0011417078785598278f;
  q = q * s + 0.014776499010622501f;
  q = q * s + 0.11314265429973602f;
  q = q * s + 0.49995559453964233f;
  q = q * s + 1.0f;
  return zc * p / q;
}
TD_INLINE vfloat erf(const vfloat& z) {
  if (kWholeVectors) return erf_of(z);
  return join(erf_of(low_half(z)), erf_of(high_half(z)));
}

// gelu(x) = 0.5 x (1 + erf(x / sqrt 2)), the formulation torch uses: relative
// error < 2e-6 for x > -1; further out 1 + erf cancels, leaving an absolute
// error below 2.5e-7 |x| (where the values are below 0.16 |x|).
TD_INLINE vfloat gelu_erf(const vfloat& x) {
  const vfloat h = x * 0.5f;
  return h + h * erf(x * 0.70710678118654752f);
}

// f over a partial block of len < kWidth elements, zero-padded.
template <class F>
TD_INLINE void map_part(const float* x, float* o, int64_t len, const F& f) {
  float block[kWidth] = {};
  const size_t bytes = static_cast<size_t>(len) * sizeof(float);
  std::memcpy(block, x, bytes);
  store(block, f(load(block)));
  std::memcpy(o, block, bytes);
}
template <class F>
TD_INLINE void zip_part(const float* a, const float* b, float* o, int64_t len, const F& f) {
  float ba[kWidth] = {}, bb[kWidth] = {};
  const size_t bytes = static_cast<size_t>(len) * sizeof(float);
  std::memcpy(ba, a, bytes);
  std::memcpy(bb, b, bytes);
  store(ba, f(load(ba), load(bb)));
  std::memcpy(o, ba, bytes);
}

// Elements before `o` reaches a 64-byte boundary: aligned stores never
// straddle two cache lines, which is most of what a streaming loop costs.
TD_INLINE int64_t align_head(const float* o, int64_t n) {
  const auto misalign = static_cast<int64_t>(reinterpret_cast<uintptr_t>(o) & 63u);
  const int64_t head = misalign % 4 == 0 ? ((64 - misalign) & 63) / 4 : 0;
  return head < n ? head : n;
}

// o[i] = f(x[i]) over a run, 16 lanes at a time. o may be x itself.
template <class F>
TD_INLINE void map(const float* x, float* o, int64_t n, const F& f) {
  int64_t i = align_head(o, n);
  if (i > 0) map_part(x, o, i, f);
  // Two independent vectors per step: the math functions are long
  // dependency chains, and interleaving two keeps the FP pipes busy.
  for (; i + 2 * kWidth <= n; i += 2 * kWidth) {
    const vfloat a = f(load(x + i));
    const vfloat b = f(load(x + i + kWidth));
    store(o + i, a);
    store(o + i + kWidth, b);
  }
  for (; i + kWidth <= n; i += kWidth) store(o + i, f(load(x + i)));
  if (i < n) map_part(x + i, o + i, n - i, f);
}

template <class V>
TD_INLINE V load_as(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <class V>
TD_INLINE void store_as(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}

// o[i] = f(a[i], b[i]) over a run, in accesses of one V (two per step). o may be a or b.
template <class V, class F>
TD_INLINE void zip_as(const float* a, const float* b, float* o, int64_t n, const F& f) {
  constexpr int64_t w = sizeof(V) / sizeof(float);
  int64_t i = align_head(o, n);
  if (i > 0) zip_part(a, b, o, i, f);
  for (; i + 2 * w <= n; i += 2 * w) {
    const V r0 = f(load_as<V>(a + i), load_as<V>(b + i));
    const V r1 = f(load_as<V>(a + i + w), load_as<V>(b + i + w));
    store_as(o + i, r0);
    store_as(o + i + w, r1);
  }
  for (; i + w <= n; i += w) store_as(o + i, f(load_as<V>(a + i), load_as<V>(b + i)));
  if (i < n) zip_part(a + i, b + i, o + i, n - i, f);
}

template <class F>
TD_INLINE void zip(const float* a, const float* b, float* o, int64_t n, const F& f) {
  zip_as<vfloat>(a, b, o, n, f);
}

// zip in 32-byte (8-lane) accesses, for an f that is plain lane arithmetic (called on 8-
// and 16-lane vectors). For a memory-bound stream whose inputs sit at another offset in
// the cache line than the output, a 32-byte access crosses a line half as often as a
// 64-byte one: measured 3-7% faster on Zen 4 with the inputs 16 or 32 bytes off the
// output's alignment, and never slower when all three agree.
template <class F>
TD_INLINE void zip_narrow(const float* a, const float* b, float* o, int64_t n, const F& f) {
  zip_as<vhalf>(a, b, o, n, f);
}

}  // namespace tandem::kernels::simd

#pragma GCC diagnostic pop
