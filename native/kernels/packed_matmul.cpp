// matmul_packed(a, bp, [bias,] out; alpha, beta, activation):
// out = act(alpha * a @ B + beta * out + bias) with
// B [K, N] given panel-packed, as engine.kernels.pack_panels() lays it out once
// for a resident weight: bp [P, K, 16], bp[p, k, j] = B[k, 16 p + j], zero past
// N (P = ceil(N / 16)). a [..., M, K] and out [..., M, N], float32, each with
// unit column stride and its leading axes collapsible into rows.
//
// Why: at few rows (a batch-1 forward, a decode step) a matmul is bound by
// reading its weights, and sgemm packs the whole weight matrix on every call
// before it computes. Packed once, a panel streams from memory in one
// sequential pass per call while a register block of out accumulates. Where
// the CPU has AVX-512 the block is 8 rows x three panels of whole 16-lane
// vectors (24 accumulators of the 32 registers; each broadcast element of a
// feeds three FMAs). Elsewhere it is 6 rows x one panel in two 8-lane halves
// (the BLIS Haswell shape for AVX2's 16 registers).
// Rows of a are read from cache: a whole row block of a is a few kB at these sizes.
//
// The epilogue (bias [N], then GELU when activation is 1) runs over each row
// block of out once its panels are done, while it is still in cache: the add
// and the activation a model would otherwise run as tasks of their own.
//
// Splitting across workers: a slice bp[p0:p1] with out[:, 16 p0 : 16 p1] is
// itself a packed operand (its own panels), so a matmul splits by columns
// along panels without copying anything.
#include <algorithm>

#include "builtin.hpp"
#include "register_block.hpp"
#include "rowops.hpp"
#include "simd.hpp"  // TD_CLONES, TD_INLINE
#include "util.hpp"

// Vector values never cross a call boundary (block() is force-inlined into the clones); the
// warning comes at the end of the unit, so it stays off for all of it, as in rowops.cpp.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace tandem::kernels {

namespace {

constexpr int kNR = 16;  // columns per panel (engine.kernels.packing.PANEL)
constexpr int kMR = 6;

// Eight lanes: a half panel row. The accumulators are kept as 2 x MR separate 32-byte vectors
// (a 64-byte vector type would be split piecewise on AVX2 and spilled).
using v8 = simd::vhalf;
TD_INLINE v8 load8(const float* p) { return simd::load_as<v8>(p); }

using v16 = simd::vfloat;

// One row of one panel of out from its 16 accumulated lanes: times alpha, plus beta * out (not read
// when beta == 0: NaN in it ignored), the first `cols` columns stored.
TD_INLINE void store_row(float* cr, v16 v, int cols, float alpha, float beta) {
  if (alpha != 1.0f) v *= alpha;
  if (cols == kNR) {
    if (beta != 0.0f) v += beta * simd::load(cr);
    simd::store(cr, v);
    return;
  }
  float tmp[kNR];
  simd::store(tmp, v);
  for (int j = 0; j < cols; ++j) cr[j] = beta != 0.0f ? tmp[j] + beta * cr[j] : tmp[j];
}

// out rows [0, MR) x panel columns [0, cols) of one panel.
template <int MR>
TD_INLINE void block(const float* a, int64_t lda, const float* panel, int64_t k, float* c, int64_t ldc, int cols,
                     float alpha, float beta) {
  v8 lo[MR], hi[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) lo[r] = hi[r] = v8{};
  for (int64_t kk = 0; kk < k; ++kk) {
    const v8 b0 = load8(panel + kk * kNR), b1 = load8(panel + kk * kNR + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float x = a[r * lda + kk];  // scalar * vector: one broadcast from memory
      lo[r] += x * b0;
      hi[r] += x * b1;
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) store_row(c + r * ldc, simd::join(lo[r], hi[r]), cols, alpha, beta);
}

// The AVX-512 shape: out rows [0, MR) x NP panels side by side (the last one cols wide), one
// 16-lane accumulator per row and panel (register_block.hpp).
constexpr int kMRWhole = 8;
constexpr int kNPWhole = 3;

template <int MR, int NP>
TD_INLINE void block_whole(const float* a, int64_t lda, const float* panels, int64_t k, float* c, int64_t ldc,
                           int cols, float alpha, float beta) {
  v16 acc[MR][NP];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j) acc[r][j] = v16{};
  accumulate_block<MR, NP>(acc, a, lda, panels, kNR, k * kNR, k);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 3
    for (int j = 0; j < NP; ++j)
      store_row(c + r * ldc + j * kNR, acc[r][j], j == NP - 1 ? cols : kNR, alpha, beta);
}

// Every row of out against NP panels: blocks of kMRWhole rows, then one of the m % kMRWhole left.
template <int NP>
TD_INLINE void panels_whole(const float* a, int64_t lda, const float* panels, int64_t k, float* c, int64_t ldc,
                            int64_t m, int cols, float alpha, float beta) {
  int64_t i = 0;
  for (; i + kMRWhole <= m; i += kMRWhole)
    block_whole<kMRWhole, NP>(a + i * lda, lda, panels, k, c + i * ldc, ldc, cols, alpha, beta);
  const float* ar = a + i * lda;
  float* cr = c + i * ldc;
  switch (m - i) {
    case 7: block_whole<7, NP>(ar, lda, panels, k, cr, ldc, cols, alpha, beta); break;
    case 6: block_whole<6, NP>(ar, lda, panels, k, cr, ldc, cols, alpha, beta); break;
    case 5: block_whole<5, NP>(ar, lda, panels, k, cr, ldc, cols, alpha, beta); break;
    case 4: block_whole<4, NP>(ar, lda, panels, k, cr, ldc, cols, alpha, beta); break;
    case 3: block_whole<3, NP>(ar, lda, panels, k, cr, ldc, cols, alpha, beta); break;
    case 2: block_whole<2, NP>(ar, lda, panels, k, cr, ldc, cols, alpha, beta); break;
    case 1: block_whole<1, NP>(ar, lda, panels, k, cr, ldc, cols, alpha, beta); break;
    default: break;
  }
}

// One cloned function per panel-group width, and one for a panel of the narrow path, each a call from
// packed_gemm(): inlined into it, their blocks made one function so large that GCC spent minutes compiling
// each of its clones. A call per group of panels costs nothing beside the group's work (every row of a).
#define TD_PANELS_WHOLE(NP)                                                                                    \
  TD_CLONES void panels_whole_##NP(const float* a, int64_t lda, const float* panels, int64_t k, float* c,      \
                                   int64_t ldc, int64_t m, int cols, float alpha, float beta) {                \
    panels_whole<NP>(a, lda, panels, k, c, ldc, m, cols, alpha, beta);                                         \
  }
TD_PANELS_WHOLE(3)
TD_PANELS_WHOLE(2)
TD_PANELS_WHOLE(1)
#undef TD_PANELS_WHOLE
static_assert(kNPWhole == 3, "one panels_whole_NP per group width up to kNPWhole");

// Every row of out against one panel, in blocks of kMR rows (the narrow path).
TD_CLONES void panel_rows(const float* a, int64_t lda, const float* panel, int64_t k, float* cp, int64_t ldc,
                          int64_t m, int cols, float alpha, float beta) {
  int64_t i = 0;
  for (; i + kMR <= m; i += kMR) block<kMR>(a + i * lda, lda, panel, k, cp + i * ldc, ldc, cols, alpha, beta);
  switch (m - i) {
    case 5: block<5>(a + i * lda, lda, panel, k, cp + i * ldc, ldc, cols, alpha, beta); break;
    case 4: block<4>(a + i * lda, lda, panel, k, cp + i * ldc, ldc, cols, alpha, beta); break;
    case 3: block<3>(a + i * lda, lda, panel, k, cp + i * ldc, ldc, cols, alpha, beta); break;
    case 2: block<2>(a + i * lda, lda, panel, k, cp + i * ldc, ldc, cols, alpha, beta); break;
    case 1: block<1>(a + i * lda, lda, panel, k, cp + i * ldc, ldc, cols, alpha, beta); break;
    default: break;
  }
}

TD_CLONES void packed_gemm(const float* a, int64_t lda, const float* bp, int64_t k, float* c, int64_t ldc, int64_t m,
                           int64_t n, float alpha, float beta) {
  const int64_t panels = (n + kNR - 1) / kNR;
  if (simd::kWholeVectors) {  // AVX-512 (see simd.hpp): whole-vector blocks over three panels at a time
    for (int64_t p = 0; p < panels; p += kNPWhole) {
      const int np = static_cast<int>(std::min<int64_t>(kNPWhole, panels - p));
      const int cols = static_cast<int>(std::min<int64_t>(kNR, n - (p + np - 1) * kNR));  // of the group's last
      const float* group = bp + p * k * kNR;
      float* cp = c + p * kNR;
      if (np == 3) panels_whole_3(a, lda, group, k, cp, ldc, m, cols, alpha, beta);
      else if (np == 2) panels_whole_2(a, lda, group, k, cp, ldc, m, cols, alpha, beta);
      else panels_whole_1(a, lda, group, k, cp, ldc, m, cols, alpha, beta);
    }
    return;
  }
  for (int64_t p = 0; p < panels; ++p) {
    const int cols = static_cast<int>(std::min<int64_t>(kNR, n - p * kNR));
    panel_rows(a, lda, bp + p * k * kNR, k, c + p * kNR, ldc, m, cols, alpha, beta);
  }
}

// Rows of t: its axes before the last collapse into one of stride *row_stride (elements).
bool rows_of(const td_tensor& t, int64_t* rows, int64_t* row_stride) {
  *rows = 1;
  for (int d = 0; d < t.ndim - 1; ++d) *rows *= t.shape[d];
  return collapse(t, 0, t.ndim - 2, row_stride);
}

}  // namespace

bool packed_matmul_whole_vectors() { return simd::kWholeVectors; }

TANDEM_KERNEL(matmul_packed) {
  if (args->n_tensors != 3 && args->n_tensors != 4)
    return fail(err, err_len, "matmul_packed: expected tensors (a, bp, [bias,] out), got %d", args->n_tensors);
  const td_tensor& a = args->tensors[0];
  const td_tensor& bp = args->tensors[1];
  const td_tensor* bias = args->n_tensors == 4 ? &args->tensors[2] : nullptr;
  const td_tensor& out = args->tensors[args->n_tensors - 1];
  const float alpha = static_cast<float>(scalar_f(args, 0, 1.0));
  const float beta = static_cast<float>(scalar_f(args, 1, 0.0));
  const int64_t activation = scalar_i(args, 2, 0);
  if (activation != 0 && activation != 1)
    return fail(err, err_len, "matmul_packed: activation %lld is not 0 (none) or 1 (gelu)",
                static_cast<long long>(activation));
  if (a.dtype != TD_FLOAT32 || bp.dtype != TD_FLOAT32 || out.dtype != TD_FLOAT32)
    return fail(err, err_len, "matmul_packed: a, bp and out must be float32 (got %s, %s, %s)", dtype_name(a.dtype),
                dtype_name(bp.dtype), dtype_name(out.dtype));
  if (a.ndim < 2 || out.ndim < 2 || bp.ndim != 3 || bp.shape[2] != kNR)
    return fail(err, err_len, "matmul_packed: a and out must be at least 2-d and bp [panels, K, %d]", kNR);
  const int64_t k = a.shape[a.ndim - 1], n = out.shape[out.ndim - 1], panels = bp.shape[0];
  if (bp.shape[1] != k || panels != (n + kNR - 1) / kNR)
    return fail(err, err_len, "matmul_packed: bp [%lld, %lld, %d] does not pack a K=%lld x N=%lld operand",
                static_cast<long long>(panels), static_cast<long long>(bp.shape[1]), kNR, static_cast<long long>(k),
                static_cast<long long>(n));
  if (bp.strides[2] != 1 || (k > 1 && bp.strides[1] != kNR) || (panels > 1 && bp.strides[0] != k * kNR))
    return fail(err, err_len, "matmul_packed: bp must be contiguous (a slice of panels of a packed operand)");
  int64_t m = 0, lda = 0, m_out = 0, ldc = 0;
  if (!rows_of(a, &m, &lda) || !rows_of(out, &m_out, &ldc) || a.strides[a.ndim - 1] != 1 ||
      out.strides[out.ndim - 1] != 1)
    return fail(err, err_len, "matmul_packed: a and out need unit column strides and rows in one stride");
  if (bias != nullptr && (bias->dtype != TD_FLOAT32 || bias->ndim != 1 || bias->shape[0] != n ||
                          (n > 1 && bias->strides[0] != 1)))
    return fail(err, err_len, "matmul_packed: bias must be a contiguous float32 [N=%lld] vector",
                static_cast<long long>(n));
  if (m_out != m) return fail(err, err_len, "matmul_packed: a has %lld rows, out %lld", static_cast<long long>(m),
                              static_cast<long long>(m_out));
  if (m == 0 || n == 0) return 0;
  float* c = static_cast<float*>(out.data);
  // Row blocks small enough that the epilogue finds them in cache (and the weights are read once
  // per block: one block whenever M <= kRowBlock, the case this kernel is for).
  constexpr int64_t kRowBlock = 128;
  for (int64_t r0 = 0; r0 < m; r0 += kRowBlock) {
    const int64_t rows = std::min(kRowBlock, m - r0);
    packed_gemm(static_cast<const float*>(a.data) + r0 * lda, lda, static_cast<const float*>(bp.data), k, c + r0 * ldc,
                ldc, rows, n, alpha, beta);
    for (int64_t r = r0; r < r0 + rows; ++r) {
      float* row = c + r * ldc;
      if (bias != nullptr) ops::add(row, static_cast<const float*>(bias->data), row, n);
      if (activation == 1) ops::gelu(row, row, n);
    }
  }
  return 0;
}

}  // namespace tandem::kernels
