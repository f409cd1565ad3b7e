// attention(q, k, v, [mask,] out; scale, causal, kv_len)
//   out = softmax(scale * q @ k^T + mask) @ v over the first L = kv_len (or all)
//   key positions. q [..., Sq, D], k [..., Skv, D], v [..., Skv, Dv],
//   out [..., Sq, Dv], mask broadcast to [..., Sq, Skv]. causal aligns the last
//   query with the last valid key (query i sees keys j <= L - Sq + i), which is
//   what a decoder with a KV cache needs; for Sq == L it is the usual lower
//   triangle. A row with no finite score yields zeros.
// With AVX-512 and head sizes it takes (fused_attention.hpp), each batch element
// is one fused pass over its query rows. Otherwise query blocks are processed
// through sgemm so the score tile stays in cache; causal blocks stop at the
// last key they can see.
#include <algorithm>
#include <limits>
#include <vector>

#include "blas.hpp"
#include "builtin.hpp"
#include "fused_attention.hpp"
#include "rowops.hpp"
#include "util.hpp"

namespace tandem::kernels {

namespace {
constexpr int64_t kTileFloats = 32768;  // score tile budget: 128 KiB
constexpr int64_t kCausalBlock = 32;    // query rows per causal block
}

TANDEM_KERNEL(attention) {
  if (args->n_tensors != 4 && args->n_tensors != 5)
    return fail(err, err_len, "attention: expected tensors (q, k, v, [mask,] out), got %d", args->n_tensors);
  const td_tensor& q = args->tensors[0];
  const td_tensor& k = args->tensors[1];
  const td_tensor& v = args->tensors[2];
  const td_tensor* mask = args->n_tensors == 5 ? &args->tensors[3] : nullptr;
  const td_tensor& out = args->tensors[args->n_tensors - 1];
  const float scale = static_cast<float>(scalar_f(args, 0, 1.0));
  const bool causal = scalar_i(args, 1, 0) != 0;
  const int64_t kv_len = scalar_i(args, 2, -1);

  if (q.dtype != TD_FLOAT32 || k.dtype != TD_FLOAT32 || v.dtype != TD_FLOAT32 || out.dtype != TD_FLOAT32)
    return fail(err, err_len, "attention: q, k, v and out must be float32");
  const int nd = q.ndim;
  if (nd < 2 || k.ndim != nd || v.ndim != nd || out.ndim != nd)
    return fail(err, err_len, "attention: q, k, v and out must have one rank >= 2");
  for (int d = 0; d < nd - 2; ++d)
    if (k.shape[d] != q.shape[d] || v.shape[d] != q.shape[d] || out.shape[d] != q.shape[d])
      return fail(err, err_len, "attention: leading axes of q, k, v and out differ");
  const int64_t sq = q.shape[nd - 2], dk = q.shape[nd - 1];
  const int64_t skv = k.shape[nd - 2], dv = v.shape[nd - 1];
  if (k.shape[nd - 1] != dk || v.shape[nd - 2] != skv || out.shape[nd - 2] != sq || out.shape[nd - 1] != dv)
    return fail(err, err_len, "attention: expected q [..., Sq, D], k [..., Skv, D], v [..., Skv, Dv], out [..., Sq, Dv]");
  const int64_t len = kv_len < 0 ? skv : kv_len;
  if (len > skv || (sq > 0 && len < 1))
    return fail(err, err_len, "attention: kv_len %lld outside [1, %lld]", static_cast<long long>(kv_len),
                static_cast<long long>(skv));
  if (causal && len < sq)
    return fail(err, err_len, "attention: causal needs at least Sq=%lld keys, got %lld", static_cast<long long>(sq),
                static_cast<long long>(len));
  if (!blas::fits(sq) || !blas::fits(len) || !blas::fits(dk) || !blas::fits(dv))
    return fail(err, err_len, "attention: a dimension exceeds the 32-bit BLAS limit");
  int64_t full[TD_MAX_DIMS], ms[TD_MAX_DIMS] = {};
  for (int d = 0; d < nd - 2; ++d) full[d] = q.shape[d];
  full[nd - 2] = sq;
  full[nd - 1] = skv;
  if (mask != nullptr) {
    if (!is_float_dtype(mask->dtype)) return fail(err, err_len, "attention: mask must be a float tensor");
    if (!broadcast_strides(*mask, mask->ndim, nd, full, ms))
      return fail(err, err_len, "attention: mask does not broadcast to [..., Sq, Skv]");
  }
  if (numel(out) == 0) return 0;

  const int64_t offset = len - sq;  // causal: query i sees keys [0, offset + i]
  // The fused pass, for the sizes it takes (fused_attention.hpp), over operands with unit column strides and a
  // float32 mask read along its keys.
  const bool fused = fused_attention_fits(sq, len, dk, dv) && q.strides[nd - 1] == 1 && k.strides[nd - 1] == 1 &&
                     v.strides[nd - 1] == 1 && out.strides[nd - 1] == 1 &&
                     (mask == nullptr || (mask->dtype == TD_FLOAT32 && ms[nd - 1] == 1));
  std::vector<float> workspace(fused ? static_cast<size_t>(fused_attention_workspace(len, dk)) : 0);
  // Causal blocks stop at their last visible key, so smaller blocks skip more
  // of the masked triangle.
  const int64_t budget = std::max<int64_t>(1, kTileFloats / len);
  const int64_t block = std::min<int64_t>(sq, causal ? std::min<int64_t>(budget, kCausalBlock) : budget);
  std::vector<float> scores(static_cast<size_t>(block * len)), inv(static_cast<size_t>(block));
  std::vector<float> mbuf, stage, pq, pk, pv;  // staging and packing, only when needed
  if (mask != nullptr && !ops::direct(mask->dtype, ms[nd - 1], len)) mbuf.resize(static_cast<size_t>(len));
  const int64_t q_rs = q.strides[nd - 2], q_cs = q.strides[nd - 1];
  const int64_t o_rs = out.strides[nd - 2], o_cs = out.strides[nd - 1];
  const bool out_direct = (dv <= 1 || o_cs == 1) && (sq <= 1 || (o_rs >= std::max<int64_t>(dv, 1) && blas::fits(o_rs)));
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  Walker w(nd - 2, q.shape);
  w.add(q.strides);
  w.add(k.strides);
  w.add(v.strides);
  w.add(out.strides);
  w.add(ms);
  w.simplify();
  w.for_each([&](const int64_t* off) {
    if (fused) {
      const AttentionOperands a{reinterpret_cast<const float*>(elem_ptr(q, off[0])), q.strides[nd - 2],
                                reinterpret_cast<const float*>(elem_ptr(k, off[1])), k.strides[nd - 2],
                                reinterpret_cast<const float*>(elem_ptr(v, off[2])), v.strides[nd - 2],
                                reinterpret_cast<float*>(elem_ptr(out, off[3])), out.strides[nd - 2],
                                mask != nullptr ? reinterpret_cast<const float*>(elem_ptr(*mask, off[4])) : nullptr,
                                ms[nd - 2], sq, len, dk, dv, scale};
      fused_attention(a, causal ? offset : -1, workspace.data());
      return;
    }
    // k^T (D x L) and v (L x Dv) once per batch; blocks use their first columns / rows.
    const blas::Mat km{elem_ptr(k, off[1]), TD_FLOAT32, len, dk, k.strides[nd - 2], k.strides[nd - 1]};
    const blas::Mat vm{elem_ptr(v, off[2]), TD_FLOAT32, len, dv, v.strides[nd - 2], v.strides[nd - 1]};
    const blas::Operand kt = blas::operand(km.t(), pk);
    const blas::Operand vo = blas::operand(vm, pv);
    for (int64_t i0 = 0; i0 < sq; i0 += block) {
      const int64_t rows = std::min(block, sq - i0);
      const int64_t cols = causal ? std::min(len, offset + i0 + rows) : len;
      const blas::Mat qm{elem_ptr(q, off[0] + i0 * q_rs), TD_FLOAT32, rows, dk, q_rs, q_cs};
      blas::gemm(rows, cols, dk, scale, blas::operand(qm, pq), kt, 0.0f, scores.data(), cols);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const int64_t ci = causal ? std::min(len, offset + i + 1) : cols;
        float* s = scores.data() + r * cols;
        if (mask != nullptr) {
          const char* mp = elem_ptr(*mask, off[4] + i * ms[nd - 2]);
          ops::add(s, ops::view(mp, mask->dtype, ms[nd - 1], ci, mbuf.data()), s, ci);
        }
        const float mx = ops::max(s, ci);
        if (mx == kNegInf) {
          std::fill(s, s + cols, 0.0f);
          inv[static_cast<size_t>(r)] = 0.0f;
          continue;
        }
        inv[static_cast<size_t>(r)] = static_cast<float>(1.0 / ops::exp_sub_sum(s, mx, s, ci));
        std::fill(s + ci, s + cols, 0.0f);
      }
      const blas::Operand po{false, std::max<int64_t>(cols, 1), scores.data()};
      float* dst;
      int64_t ldd;
      if (out_direct) {
        dst = reinterpret_cast<float*>(elem_ptr(out, off[3] + i0 * o_rs));
        ldd = sq <= 1 ? std::max<int64_t>(dv, 1) : o_rs;
      } else {
        stage.resize(static_cast<size_t>(rows * dv));
        dst = stage.data();
        ldd = dv;
      }
      blas::gemm(rows, dv, cols, 1.0f, po, vo, 0.0f, dst, ldd);
      for (int64_t r = 0; r < rows; ++r) {
        float* orow = dst + r * ldd;
        ops::mul_s(orow, inv[static_cast<size_t>(r)], orow, dv);
        if (!out_direct) ops::store(orow, elem_ptr(out, off[3] + (i0 + r) * o_rs), TD_FLOAT32, o_cs, dv);
      }
    }
  });
  return 0;
}

}  // namespace tandem::kernels
