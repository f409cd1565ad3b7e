// The built-in kernel library: every kernel has the td_kernel_fn signature.
// To add one: declare it here, define it in a file of this folder, list it in
// builtin.cpp.
#pragma once

#include "tandem/kernel_abi.h"

namespace tandem::kernels {

#define TANDEM_KERNEL(name) int name(const td_args* args, char* err, size_t err_len)

// basic.cpp
TANDEM_KERNEL(noop);
TANDEM_KERNEL(spin);
TANDEM_KERNEL(copy);
TANDEM_KERNEL(fill);

struct BuiltinKernel {
  const char* name;
  td_kernel_fn fn;
};

}  // namespace tandem::kernels
