// The built-in kernel library: every kernel has the td_kernel_fn signature.
// To add one: declare it here, define it in a file of this folder, list it in
// builtin.cpp, and give it a signature in engine/kernels/builtins.py.
//
// Tensor order: inputs, then optional tensors that are present, then out.
// Scalars: positional, in the order the Python signature declares them.
#pragma once

#include <cstddef>

#include "tandem/kernel_abi.h"

namespace tandem::kernels {

#define TANDEM_KERNEL(name) int name(const td_args* args, char* err, size_t err_len)

// basic.cpp
TANDEM_KERNEL(noop);       // ()
TANDEM_KERNEL(spin);       // (; ns)
TANDEM_KERNEL(copy);       // (x, out)
TANDEM_KERNEL(fill);       // (out; value)
TANDEM_KERNEL(cast);       // (x, out)
TANDEM_KERNEL(transpose);  // (x, out)
TANDEM_KERNEL(embedding);  // (ids, table, out)
// matmul.cpp
TANDEM_KERNEL(matmul);  // (a, b, out; transpose_b, alpha, beta)
// packed_matmul.cpp
TANDEM_KERNEL(matmul_packed);  // (a, bp, out; alpha, beta), bp panel-packed [P, K, 16]
// elementwise.cpp
TANDEM_KERNEL(add);    // (a, b, out)
TANDEM_KERNEL(sub);    // (a, b, out)
TANDEM_KERNEL(mul);    // (a, b, out)
TANDEM_KERNEL(div);    // (a, b, out)
TANDEM_KERNEL(scale);  // (x, out; alpha)
TANDEM_KERNEL(relu);   // (x, out)
TANDEM_KERNEL(gelu);   // (x, out; approximate: 0 none, 1 tanh)
TANDEM_KERNEL(silu);   // (x, out)
TANDEM_KERNEL(tanh);   // (x, out)
TANDEM_KERNEL(exp);    // (x, out)
// norms.cpp
TANDEM_KERNEL(softmax);       // (x, [mask,] out; scale)
TANDEM_KERNEL(layernorm);     // (x, gamma, beta, out; eps)
TANDEM_KERNEL(rmsnorm);       // (x, gamma, out; eps)
TANDEM_KERNEL(l2_normalize);  // (x, out; eps)
// reduce.cpp
TANDEM_KERNEL(sum);        // (x, out)
TANDEM_KERNEL(mean);       // (x, out)
TANDEM_KERNEL(max);        // (x, out)
TANDEM_KERNEL(argmax);     // (x, out)
TANDEM_KERNEL(mean_pool);  // (x, mask, out)
// attention.cpp
TANDEM_KERNEL(attention);  // (q, k, v, [mask,] out; scale, causal, kv_len: -1 = all)

// Whether matmul_packed runs its AVX-512 register block on this CPU (8 rows x three whole-vector
// panels): then it outruns sgemm at every row count; its AVX2 block is for few rows.
bool packed_matmul_whole_vectors();

struct BuiltinKernel {
  const char* name;
  td_kernel_fn fn;
};

// The immutable table of built-ins: `*count` entries.
const BuiltinKernel* builtin_table(size_t* count);
// The built-in named `name`, or nullptr.
td_kernel_fn find_builtin(const char* name);

}  // namespace tandem::kernels
