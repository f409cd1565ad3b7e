#include "builtin.hpp"

#include <cstring>

#include "blas.hpp"
#include "tandem/kernel.hpp"

namespace tandem {

namespace kernels {

namespace {
constexpr BuiltinKernel kTable[] = {
    {"noop", noop},
    {"spin", spin},
    {"copy", copy},
    {"fill", fill},
    {"cast", cast},
    {"transpose", transpose},
    {"embedding", embedding},
    {"matmul", matmul},
    {"matmul_packed", matmul_packed},
    {"add", add},
    {"sub", sub},
    {"mul", mul},
    {"div", div},
    {"scale", scale},
    {"relu", relu},
    {"gelu", gelu},
    {"silu", silu},
    {"tanh", tanh},
    {"exp", exp},
    {"softmax", softmax},
    {"layernorm", layernorm},
    {"rmsnorm", rmsnorm},
    {"l2_normalize", l2_normalize},
    {"sum", sum},
    {"mean", mean},
    {"max", max},
    {"argmax", argmax},
    {"mean_pool", mean_pool},
    {"attention", attention},
};
}  // namespace

const BuiltinKernel* builtin_table(size_t* count) {
  *count = sizeof kTable / sizeof kTable[0];
  return kTable;
}

td_kernel_fn find_builtin(const char* name) {
  for (const auto& k : kTable)
    if (std::strcmp(k.name, name) == 0) return k.fn;
  return nullptr;
}

}  // namespace kernels

void register_builtin_kernels(KernelRegistry& registry) {
  kernels::blas::use_caller_thread_only();
  for (const auto& k : kernels::kTable) registry.add(make_native_kernel(k.name, k.fn));
}

}  // namespace tandem
