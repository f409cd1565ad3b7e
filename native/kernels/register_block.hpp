// The register block every small-matrix kernel here is built on, where the
// CPU has AVX-512: R rows x NP 16-lane panels of accumulators, each step
// broadcasting one element of a's row into the FMAs of all NP panels. With
// 8 x 3 the 24 accumulators, the 3 panel loads and a broadcast fill 28 of the
// 32 registers and a step's 24 FMAs outnumber its 11 loads (matmul_packed;
// attention's scores and weighted sums, fused_attention.cpp).
#pragma once

#include <cstdint>

#include "simd.hpp"  // TD_INLINE

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // vectors never cross a call: everything here is force-inlined

namespace tandem::kernels {

// acc[r][p] += sum over k < depth of a[r * lda + k] * b[k * b_step + p * b_panel + lane].
template <int R, int NP>
TD_INLINE void accumulate_block(simd::vfloat (&acc)[R][NP], const float* a, int64_t lda, const float* b,
                                int64_t b_step, int64_t b_panel, int64_t depth) {
  for (int64_t k = 0; k < depth; ++k) {
    simd::vfloat panel[NP];
#pragma GCC unroll 3
    for (int p = 0; p < NP; ++p) panel[p] = simd::load(b + k * b_step + p * b_panel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const simd::vfloat x = simd::splat(a[r * lda + k]);
#pragma GCC unroll 3
      for (int p = 0; p < NP; ++p) acc[r][p] += x * panel[p];
    }
  }
}

}  // namespace tandem::kernels

#pragma GCC diagnostic pop
