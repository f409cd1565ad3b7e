#include "builtin.hpp"

#include "tandem/kernel.hpp"

namespace tandem {

void register_builtin_kernels(KernelRegistry& registry) {
  using namespace kernels;
  static constexpr BuiltinKernel kTable[] = {
      {"noop", noop},
      {"spin", spin},
      {"copy", copy},
      {"fill", fill},
  };
  for (const auto& k : kTable) registry.add(make_native_kernel(k.name, k.fn));
}

}  // namespace tandem
