#include "bindings.hpp"
namespace tandem::bindings {
void bind_accessor(pybind11::module_& m) {}
}
