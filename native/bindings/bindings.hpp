// Each part of the core binds itself in its own file; module.cpp calls them.
#pragma once

#include <pybind11/pybind11.h>

namespace tandem::bindings {

void bind_errors(pybind11::module_& m);
void bind_device(pybind11::module_& m);
void bind_accessor(pybind11::module_& m);
void bind_slots(pybind11::module_& m);
void bind_kernels(pybind11::module_& m);
void bind_observers(pybind11::module_& m);
void bind_engine(pybind11::module_& m);
void bind_io(pybind11::module_& m);

}  // namespace tandem::bindings
