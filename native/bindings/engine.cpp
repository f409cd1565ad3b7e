#include "bindings.hpp"
namespace tandem::bindings {
void bind_engine(pybind11::module_& m) {}
}
