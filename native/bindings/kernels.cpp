#include "bindings.hpp"
namespace tandem::bindings {
void bind_kernels(pybind11::module_& m) {}
}
