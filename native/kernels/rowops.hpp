// Vectorised primitives over dense float32 runs, the building blocks of the
// elementwise, normalisation, reduction and attention kernels, plus element
// conversion between float32 and the storage types. Each is compiled in
// AVX-512, AVX2+FMA and baseline variants (see simd.hpp). Output runs may
// alias input runs exactly (in-place), never partially.
#pragma once

#include <cstdint>

#include "tandem/kernel_abi.h"

namespace tandem::kernels::ops {

// o = a (op) b, elementwise.
void add(const float* a, const float* b, float* o, int64_t n);
void sub(const float* a, const float* b, float* o, int64_t n);
void mul(const float* a, const float* b, float* o, int64_t n);
void div(const float* a, const float* b, float* o, int64_t n);
// o = a (op) s for one scalar s.
void add_s(const float* a, float s, float* o, int64_t n);
void sub_s(const float* a, float s, float* o, int64_t n);
void mul_s(const float* a, float s, float* o, int64_t n);
void div_s(const float* a, float s, float* o, int64_t n);

void relu(const float* x, float* o, int64_t n);
void gelu(const float* x, float* o, int64_t n);
void gelu_tanh(const float* x, float* o, int64_t n);
void silu(const float* x, float* o, int64_t n);
void tanh(const float* x, float* o, int64_t n);
void exp(const float* x, float* o, int64_t n);

// Sum with float lanes over blocks and a double total: error stays near
// one ulp of the result for any n.
double sum(const float* x, int64_t n);
// Maximum; NaN when any element is NaN; -inf for n == 0.
float max(const float* x, int64_t n);
// Index of the first maximum (of the first NaN, when there is one).
int64_t argmax(const float* x, int64_t n);
// sum((x - c)^2), and sum(x^2).
double sum_sq_dev(const float* x, int64_t n, float c);
double sum_sq(const float* x, int64_t n);

// o = x * scale (+ mask); returns max(o).
float scale_mask_max(const float* x, const float* mask, float scale, float* o, int64_t n);
// o = exp(x - c); returns sum(o).
double exp_sub_sum(const float* x, float c, float* o, int64_t n);

// o = (x - mean) * rstd * g + b; g or b may be null (1 and 0).
void norm_affine(const float* x, const float* g, const float* b, float mean, float rstd, float* o, int64_t n);
// y += a * x.
void axpy(float a, const float* x, float* y, int64_t n);

// Dense element conversion.
void f16_to_f32(const uint16_t* s, float* d, int64_t n);
void f32_to_f16(const float* s, uint16_t* d, int64_t n);
void bf16_to_f32(const uint16_t* s, float* d, int64_t n);
void f32_to_bf16(const float* s, uint16_t* d, int64_t n);

// Reads n elements of td_dtype `dt` at `p` (stride `s` elements, any sign) as
// float32 into dst. Every dtype is accepted; integers convert by value.
void load(const void* p, int32_t dt, int64_t s, int64_t n, float* dst);
// Writes n float32 values to a float32, float16 or bfloat16 run (rounding to
// nearest even).
void store(const float* src, void* p, int32_t dt, int64_t s, int64_t n);

// A float32 view of a run: the run itself when it is dense float32, else its
// converted copy in `buf` (n floats).
inline const float* view(const void* p, int32_t dt, int64_t s, int64_t n, float* buf) {
  if (dt == TD_FLOAT32 && (s == 1 || n <= 1)) return static_cast<const float*>(p);
  load(p, dt, s, n, buf);
  return buf;
}
// True when results can be written straight into the run.
inline bool direct(int32_t dt, int64_t s, int64_t n) { return dt == TD_FLOAT32 && (s == 1 || n <= 1); }

}  // namespace tandem::kernels::ops
