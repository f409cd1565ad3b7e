#include <pybind11/pybind11.h>

#include "bindings.hpp"
#include "tandem/errors.hpp"
#include "tandem/slot_table.hpp"

namespace py = pybind11;

namespace tandem::bindings {

void bind_errors(py::module_& m) {
  py::register_exception<DeviceMemoryError>(m, "DeviceMemoryError", PyExc_MemoryError);
  py::register_exception<ClosedError>(m, "ClosedError", PyExc_RuntimeError);
  py::register_exception<StaleLease>(m, "StaleLeaseError", PyExc_ValueError);
  // InvalidArgument is a std::invalid_argument, which pybind11 maps to ValueError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TypeMismatch& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });
}

}  // namespace tandem::bindings
