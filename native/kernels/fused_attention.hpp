// Attention for one batch element in one pass over its query rows, where the
// CPU has AVX-512 (the attention kernel falls back to sgemm and row passes
// elsewhere, and for the shapes this does not take).
//
// Why: with short sequences and small heads (MiniLM: 128 x 128 scores per head,
// D = 32) the two products are small sgemm calls, each packing its operands
// again, and the softmax walks every score row four times (mask add, max,
// exp and sum, normalise). Here k^T is packed once per batch element into
// 16-key panels; per block of 8 query rows the scores are computed in
// registers with the scale and mask applied and the row maxima taken as they
// are stored, the exponentials and sums are one pass over a score tile that
// stays in L1, and the weighted sum of v rows is normalised as it is stored.
#pragma once

#include <cstdint>

namespace tandem::kernels {

// One batch element: q [sq, dk], k [len, dk], v [len, dv], out [sq, dv], each
// row-strided with unit column stride; mask rows [sq, len] (row stride
// mask_rs, 0 when one row serves every query) or null.
struct AttentionOperands {
  const float* q;
  int64_t q_rs;
  const float* k;
  int64_t k_rs;
  const float* v;
  int64_t v_rs;
  float* out;
  int64_t out_rs;
  const float* mask;
  int64_t mask_rs;
  int64_t sq, len, dk, dv;
  float scale;
};

// Whether fused_attention runs on this CPU and takes these sizes: AVX-512, at
// least 8 queries (one block of rows; a decode step's single query takes the
// sgemv path), dv a multiple of 16 up to 64, and a workspace of at most 1M floats.
bool fused_attention_fits(int64_t sq, int64_t len, int64_t dk, int64_t dv);

// Floats of workspace fused_attention needs for keys of length len.
int64_t fused_attention_workspace(int64_t len, int64_t dk);

// out = softmax(scale * q k^T + mask) v; a row with no finite score gives zeros.
// causal_offset < 0: every query sees every key; else query i sees keys
// [0, causal_offset + i].
void fused_attention(const AttentionOperands& a, int64_t causal_offset, float* workspace);

}  // namespace tandem::kernels
