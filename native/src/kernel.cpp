#include "tandem/kernel.hpp"

#include <dlfcn.h>

#include <algorithm>

#include "tandem/errors.hpp"

namespace tandem {

KernelPtr make_native_kernel(std::string name, td_kernel_fn fn) {
  if (fn == nullptr) throw InvalidArgument("kernel '" + name + "': null function");
  auto k = std::make_shared<Kernel>();
  k->name = std::move(name);
  k->fn = fn;
  return k;
}

KernelPtr make_host_kernel(std::string name, std::shared_ptr<HostCallable> host) {
  if (!host) throw InvalidArgument("host kernel '" + name + "': null callable");
  auto k = std::make_shared<Kernel>();
  k->name = std::move(name);
  k->host = std::move(host);
  return k;
}

KernelPtr load_kernel(const std::string& path, const std::string& symbol, std::string name) {
  void* handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = ::dlerror();
    throw InvalidArgument("cannot load kernel library '" + path + "': " + (why ? why : "unknown error"));
  }
  // The handle closes when the last kernel loaded from it goes away.
  std::shared_ptr<void> library(handle, [](void* h) { ::dlclose(h); });
  ::dlerror();
  void* sym = ::dlsym(handle, symbol.c_str());
  if (sym == nullptr) {
    throw InvalidArgument("kernel library '" + path + "' has no symbol '" + symbol + "'");
  }
  auto k = std::make_shared<Kernel>();
  k->name = std::move(name);
  k->fn = reinterpret_cast<td_kernel_fn>(sym);
  k->library = std::move(library);
  return k;
}

int invoke_kernel(const Kernel& kernel, const td_args& args, std::string& err) {
  if (kernel.host) return kernel.host->call(args, err);
  char buf[512];
  buf[0] = '\0';
  int rc = kernel.fn(&args, buf, sizeof buf);
  if (rc != 0) {
    buf[sizeof buf - 1] = '\0';
    err = buf[0] ? buf : "kernel returned error code " + std::to_string(rc);
  }
  return rc;
}

void KernelRegistry::add(KernelPtr kernel) {
  if (!kernel) throw InvalidArgument("cannot register a null kernel");
  auto [it, inserted] = kernels_.emplace(kernel->name, kernel);
  if (!inserted) throw InvalidArgument("a kernel named '" + kernel->name + "' is already registered");
}

KernelPtr KernelRegistry::find(const std::string& name) const {
  auto it = kernels_.find(name);
  return it == kernels_.end() ? nullptr : it->second;
}

KernelPtr KernelRegistry::get(const std::string& name) const {
  auto k = find(name);
  if (!k) throw InvalidArgument("unknown kernel '" + name + "'");
  return k;
}

std::vector<std::string> KernelRegistry::names() const {
  std::vector<std::string> out;
  out.reserve(kernels_.size());
  for (const auto& kv : kernels_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace tandem
