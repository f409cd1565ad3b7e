// Kernels and the per-runtime kernel registry.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "tandem/kernel_abi.h"

namespace tandem {

// A kernel implemented outside the C++ core (a Python callable, bound by the
// bindings). The implementation takes whatever lock its language needs (the
// GIL) inside call(); pool threads hold nothing while calling it.
class HostCallable {
 public:
  virtual ~HostCallable() = default;
  // Returns 0 on success; on failure fills `err` and returns non-zero.
  virtual int call(const td_args& args, std::string& err) = 0;
};

struct Kernel {
  std::string name;
  td_kernel_fn fn = nullptr;              // native kernel, or
  std::shared_ptr<HostCallable> host;     // host kernel (exactly one is set)
  std::shared_ptr<void> library;          // keeps a loaded shared library open

  bool is_host() const { return host != nullptr; }
};

using KernelPtr = std::shared_ptr<const Kernel>;

KernelPtr make_native_kernel(std::string name, td_kernel_fn fn);
KernelPtr make_host_kernel(std::string name, std::shared_ptr<HostCallable> host);
// Loads `symbol` from the shared library at `path` (dlopen/dlsym). Throws
// InvalidArgument naming the path or symbol when either cannot be found.
KernelPtr load_kernel(const std::string& path, const std::string& symbol, std::string name);

// Runs a kernel once on the calling thread: returns 0 or fills err.
int invoke_kernel(const Kernel& kernel, const td_args& args, std::string& err);

class KernelRegistry {
 public:
  // Throws InvalidArgument when the name is taken.
  void add(KernelPtr kernel);
  KernelPtr find(const std::string& name) const;  // nullptr when unknown
  KernelPtr get(const std::string& name) const;   // throws InvalidArgument when unknown
  std::vector<std::string> names() const;

 private:
  std::unordered_map<std::string, KernelPtr> kernels_;
};

// Registers every built-in kernel (native/kernels/) into `registry`.
void register_builtin_kernels(KernelRegistry& registry);

}  // namespace tandem
