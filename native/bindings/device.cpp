#include "bindings.hpp"
namespace tandem::bindings {
void bind_device(pybind11::module_& m) {}
}
