#include "bindings.hpp"
#include "tandem/kernel_abi.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "Tandem native core: device memory, host-tensor accessor, task graph, worker pool";
  m.attr("ABI_VERSION") = TD_ABI_VERSION;
  m.attr("MAX_DIMS") = TD_MAX_DIMS;
  tandem::bindings::bind_errors(m);
  tandem::bindings::bind_device(m);
  tandem::bindings::bind_accessor(m);
  tandem::bindings::bind_slots(m);
  tandem::bindings::bind_kernels(m);
  tandem::bindings::bind_observers(m);
  tandem::bindings::bind_engine(m);
  tandem::bindings::bind_io(m);
}
