// Vectorisable float32 math for the hot loops. Every function here is inline,
// branch-free (selects compile to blends) and calls nothing, so a plain loop
// over it auto-vectorises. Loops that use them are compiled in several ISA
// variants (TD_CLONES) and dispatched at load time, since the core itself
// targets x86-64-v2.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// AVX-512 / AVX2+FMA / baseline variants, picked by the CPU at load time.
#define TD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

namespace tandem::kernels::simd {

inline float as_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
inline uint32_t as_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// exp(a + b) where `a` carries the magnitude and |b| is small (< ~4). The sum
// is never formed in float: the range reduction subtracts n*ln2 from `a`
// first (exact for the large part), so callers that split an argument into an
// exact head and a small tail keep its full precision. Relative error ~2 ulp;
// underflows to 0 below about -103.9 and overflows to inf above 88.72.
inline float exp_parts(float a, float b) {
  a = a < -104.0f ? -104.0f : a;  // NaN compares false and passes through
  a = a > 89.0f ? 89.0f : a;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float t = (a + b) * 1.44269504088896341f + kRound;
  const float fn = t - kRound;
  const int32_t n = static_cast<int32_t>(as_bits(t) - as_bits(kRound));
  // Cody-Waite: ln2 = 0.693359375 (exact in 9 bits) - 2.12194440e-4.
  const float r = ((a - fn * 0.693359375f) + b) + fn * 2.12194440e-4f;
  // exp(r) on [-ln2/2, ln2/2] (Cephes expf polynomial, ~1 ulp).
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n in two factors so results down to the subnormal range stay exact and
  // n up to 128 overflows to inf as it should.
  const int32_t n1 = n >> 1;
  const int32_t n2 = n - n1;
  return p * as_float(static_cast<uint32_t>(n1 + 127) << 23) * as_float(static_cast<uint32_t>(n2 + 127) << 23);
}

inline float exp(float x) { return exp_parts(x, 0.0f); }

// tanh: odd polynomial below 0.625 (relative error < 1e-7, no cancellation
// near 0), 1 - 2 / (exp(2|x|) + 1) above.
inline float tanh(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  float p = -5.718891508877277e-3f;
  p = p * z + 2.065306343138218e-2f;
  p = p * z - 5.3744640201330185e-2f;
  p = p * z + 1.3331513106822968e-1f;
  p = p * z - 3.333328664302826e-1f;
  const float small = x + x * z * p;
  const float e = exp(2.0f * ax);
  const float big = std::copysign(1.0f - 2.0f / (e + 1.0f), x);
  return ax < 0.625f ? small : big;
}

inline float sigmoid_mul(float x, float u) { return x / (1.0f + exp(-u)); }

// gelu(x) = x * Phi(x), with Phi from erfc so the negative tail keeps its
// relative precision: erfc(z) = t * exp(-z^2 + P(t)), t = 1 / (1 + z/2)
// (Chebyshev fit, relative error < 1.2e-7 for all z >= 0). z^2 = x^2 / 2 is
// passed to exp_parts as an exact head and a tail.
inline float gelu_erf(float x) {
  const float ax = std::fabs(x);
  const float z = ax * 0.70710678118654752f;
  const float t = 1.0f / (1.0f + 0.5f * z);
  float p = 0.17087277f;
  p = p * t - 0.82215223f;
  p = p * t + 1.48851587f;
  p = p * t - 1.13520398f;
  p = p * t + 0.27886807f;
  p = p * t - 0.18628806f;
  p = p * t + 0.09678418f;
  p = p * t + 0.37409196f;
  p = p * t + 1.00002368f;
  p = p * t - 1.26551223f;
  const float sq = ax * ax;
  const float sq_lo = std::fma(ax, ax, -sq);  // exact rounding error of ax*ax
  const float e = t * exp_parts(-0.5f * sq, p - 0.5f * sq_lo);  // erfc(|x| / sqrt 2)
  const float phi = x >= 0.0f ? 1.0f - 0.5f * e : 0.5f * e;
  return x * phi;
}

// gelu with the tanh approximation: 0.5 x (1 + tanh(u)) = x * sigmoid(2u).
inline float gelu_tanh(float x) {
  const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return sigmoid_mul(x, 2.0f * u);
}

inline float silu(float x) { return sigmoid_mul(x, x); }

}  // namespace tandem::kernels::simd
