#include "fused_attention.hpp"

#include <algorithm>
#include <limits>

#include "register_block.hpp"
#include "simd.hpp"  // TD_CLONES, TD_INLINE

// Vector values never cross a call boundary (the blocks are force-inlined into the clones).
#pragma GCC diagnostic ignored "-Wpsabi"

namespace tandem::kernels {

namespace {

using v16 = simd::vfloat;
constexpr int kLanes = simd::kWidth;  // keys per panel of k^T, columns per panel of v
constexpr int kRows = 8;              // query rows per block
constexpr int kPanels = 3;            // panels per register block (register_block.hpp)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Workspace bound, in floats (4 MiB: k^T of 16K keys at D = 56): a longer context keeps the sgemm path, whose
// tile is bounded and which reads k in place, rather than copying all of k.
constexpr int64_t kMaxWorkspace = int64_t{1} << 20;

TD_INLINE int64_t round_up(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// Lanes [0, 16) of the panel starting at key `col`, as (lane index + col) vectors.
TD_INLINE v16 lane_index(int64_t col) {
  v16 idx;
  for (int l = 0; l < kLanes; ++l) idx[l] = static_cast<float>(col + l);
  return idx;
}

// Scores of R query rows against NP panels of keys from column c0: scale * q k^T + mask, -inf past
// `visible` keys and (causal) past each row's last key; stored into the tile, row maxima updated.
template <int R, int NP>
TD_INLINE void score_block(const AttentionOperands& a, const float* q, const float* kt, int64_t lp, int64_t c0,
                           int64_t visible, int64_t first_query, int64_t causal_offset, float* tile, v16* row_max) {
  v16 acc[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int p = 0; p < NP; ++p) acc[r][p] = v16{};
  accumulate_block<R, NP>(acc, q, a.q_rs, kt + c0, lp, kLanes, a.dk);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    // Keys this row sees: all visible ones, or (causal) those up to its own position.
    const int64_t sees = causal_offset < 0 ? visible : std::min(visible, causal_offset + first_query + r + 1);
    const float* mask_row = a.mask != nullptr ? a.mask + (first_query + r) * a.mask_rs : nullptr;
#pragma GCC unroll 3
    for (int p = 0; p < NP; ++p) {
      const int64_t col = c0 + p * kLanes;
      v16 s = acc[r][p] * a.scale;
      if (col + kLanes <= sees) {
        if (mask_row != nullptr) s += simd::load(mask_row + col);
      } else {  // the row's last panel: the mask read only where it exists, -inf past the keys it sees
        if (mask_row != nullptr) {
          float m[kLanes] = {};
          for (int64_t j = col; j < std::min(sees, col + kLanes); ++j) m[j - col] = mask_row[j];
          s += simd::load(m);
        }
        s = lane_index(col) < static_cast<float>(sees) ? s : simd::splat(kNegInf);
      }
      simd::store(tile + r * lp + col, s);
      row_max[r] = s > row_max[r] ? s : row_max[r];  // NaN lanes pass by: exp spreads them
    }
  }
}

template <int R>
TD_INLINE void score_rows(const AttentionOperands& a, const float* q, const float* kt, int64_t lp, int64_t visible,
                          int64_t first_query, int64_t causal_offset, float* tile, v16* row_max) {
  const int64_t panels = round_up(visible) / kLanes;
  int64_t p = 0;
  for (; p + kPanels <= panels; p += kPanels)
    score_block<R, kPanels>(a, q, kt, lp, p * kLanes, visible, first_query, causal_offset, tile, row_max);
  if (panels - p == 2) score_block<R, 2>(a, q, kt, lp, p * kLanes, visible, first_query, causal_offset, tile, row_max);
  if (panels - p == 1) score_block<R, 1>(a, q, kt, lp, p * kLanes, visible, first_query, causal_offset, tile, row_max);
}

// out rows of R queries, NP panels of v columns from v0: (sum over the visible keys of p * v) * inv.
template <int R, int NP>
TD_INLINE void output_block(const AttentionOperands& a, const float* tile, int64_t lp, int64_t visible,
                            const float* inv, float* out, int64_t v0) {
  v16 acc[R][NP];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int p = 0; p < NP; ++p) acc[r][p] = v16{};
  accumulate_block<R, NP>(acc, tile, lp, a.v + v0, a.v_rs, kLanes, visible);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int p = 0; p < NP; ++p) simd::store(out + r * a.out_rs + v0 + p * kLanes, acc[r][p] * inv[r]);
}

template <int R>
TD_INLINE void output_rows(const AttentionOperands& a, const float* tile, int64_t lp, int64_t visible,
                           const float* inv, float* out) {
  const int64_t panels = a.dv / kLanes;
  int64_t p = 0;
  for (; p + kPanels <= panels; p += kPanels) output_block<R, kPanels>(a, tile, lp, visible, inv, out, p * kLanes);
  if (panels - p == 2) output_block<R, 2>(a, tile, lp, visible, inv, out, p * kLanes);
  if (panels - p == 1) output_block<R, 1>(a, tile, lp, visible, inv, out, p * kLanes);
}

// Each row of the tile in place: exp(s - max) over the visible panels, and 1 / its sum (0 for a row
// that sees no finite score, whose tile row becomes zeros).
TD_INLINE void softmax_rows(int rows, float* tile, int64_t lp, int64_t visible, const v16* row_max, float* inv) {
  const int64_t cols = round_up(visible);
  for (int r = 0; r < rows; ++r) {
    float lanes[kLanes];
    simd::store(lanes, row_max[r]);
    float mx = kNegInf;
    for (float x : lanes) mx = x > mx ? x : mx;
    float* s = tile + r * lp;
    if (mx == kNegInf) {
      std::fill(s, s + cols, 0.0f);
      inv[r] = 0.0f;
      continue;
    }
    const v16 m = simd::splat(mx);
    double total = 0.0;
    for (int64_t c = 0; c < cols;) {  // float lanes over 512 keys at a time, each block's total in double
      const int64_t end = std::min(cols, c + 512);
      v16 sum{};
      for (; c < end; c += kLanes) {
        const v16 e = simd::exp(simd::load(s + c) - m);
        simd::store(s + c, e);
        sum += e;
      }
      simd::store(lanes, sum);
      for (float x : lanes) total += x;
    }
    inv[r] = static_cast<float>(1.0 / total);
  }
}

template <int R>
TD_INLINE void query_block(const AttentionOperands& a, int64_t i0, const float* kt, int64_t lp, int64_t causal_offset,
                           float* tile) {
  // Keys the block sees at all: every one, or (causal) up to its last row's position.
  const int64_t visible = causal_offset < 0 ? a.len : std::min(a.len, causal_offset + i0 + R);
  v16 row_max[R];
  for (int r = 0; r < R; ++r) row_max[r] = simd::splat(kNegInf);
  score_rows<R>(a, a.q + i0 * a.q_rs, kt, lp, visible, i0, causal_offset, tile, row_max);
  float inv[R];
  softmax_rows(R, tile, lp, visible, row_max, inv);
  output_rows<R>(a, tile, lp, visible, inv, a.out + i0 * a.out_rs);
}

// One cloned function per block height, each a call from attend(): inlined into it, the eight made one
// function so large that GCC spent minutes compiling each of its clones. A call per block of query rows
// costs nothing beside the block's work (each block reads every visible key).
#define TD_QUERY_BLOCK(R)                                                                                   \
  TD_CLONES void query_block_##R(const AttentionOperands& a, int64_t i0, const float* kt, int64_t lp,        \
                                 int64_t causal_offset, float* tile) {                                       \
    query_block<R>(a, i0, kt, lp, causal_offset, tile);                                                      \
  }
TD_QUERY_BLOCK(8)
TD_QUERY_BLOCK(7)
TD_QUERY_BLOCK(6)
TD_QUERY_BLOCK(5)
TD_QUERY_BLOCK(4)
TD_QUERY_BLOCK(3)
TD_QUERY_BLOCK(2)
TD_QUERY_BLOCK(1)
#undef TD_QUERY_BLOCK

TD_CLONES void attend(const AttentionOperands& a, int64_t causal_offset, float* workspace) {
  const int64_t lp = round_up(a.len);
  float* kt = workspace;  // k^T [dk, lp], zero past len
  float* tile = workspace + a.dk * lp;  // scores of one block of query rows [kRows, lp]
  for (int64_t d = 0; d < a.dk; ++d) std::fill(kt + d * lp + a.len, kt + (d + 1) * lp, 0.0f);
  for (int64_t d = 0; d < a.dk; ++d) {  // each row of k^T written in order (GCC keeps it scalar: ~10% of the pass)
    float* row = kt + d * lp;
    const float* col = a.k + d;
    for (int64_t j = 0; j < a.len; ++j) row[j] = col[j * a.k_rs];
  }
  static_assert(kRows == 8, "one query_block_R per block height below kRows");
  int64_t i = 0;
  for (; i + kRows <= a.sq; i += kRows) query_block_8(a, i, kt, lp, causal_offset, tile);
  switch (a.sq - i) {
    case 7: query_block_7(a, i, kt, lp, causal_offset, tile); break;
    case 6: query_block_6(a, i, kt, lp, causal_offset, tile); break;
    case 5: query_block_5(a, i, kt, lp, causal_offset, tile); break;
    case 4: query_block_4(a, i, kt, lp, causal_offset, tile); break;
    case 3: query_block_3(a, i, kt, lp, causal_offset, tile); break;
    case 2: query_block_2(a, i, kt, lp, causal_offset, tile); break;
    case 1: query_block_1(a, i, kt, lp, causal_offset, tile); break;
    default: break;
  }
}

}  // namespace

int64_t fused_attention_workspace(int64_t len, int64_t dk) { return (dk + kRows) * round_up(len); }

bool fused_attention_fits(int64_t sq, int64_t len, int64_t dk, int64_t dv) {
  return simd::kWholeVectors && sq >= kRows && dk >= 1 && dv >= kLanes && dv <= 4 * kLanes && dv % kLanes == 0 &&
         fused_attention_workspace(len, dk) <= kMaxWorkspace;
}

void fused_attention(const AttentionOperands& a, int64_t causal_offset, float* workspace) {
  attend(a, causal_offset, workspace);
}

}  // namespace tandem::kernels
