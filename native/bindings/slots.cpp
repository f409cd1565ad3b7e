// Bindings for the pipeline slot table. Thin: argument conversion and GIL handling only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.hpp"
#include "interruptible.hpp"
#include "tandem/slot_table.hpp"

namespace py = pybind11;

namespace tandem::bindings {

void bind_slots(py::module_& m) {
  py::class_<SlotTable, std::shared_ptr<SlotTable>>(
      m, "SlotTable",
      "Pipeline slots, one per accessor: each leased to one run at a time; a stale lease is rejected")
      .def(py::init<std::vector<std::shared_ptr<HostAccessor>>>(), py::arg("accessors"))
      .def(py::init<size_t>(), py::arg("depth"), "depth slots without accessors")
      .def_property_readonly("depth", &SlotTable::depth)
      .def_property_readonly("free_count", &SlotTable::free_count)
      .def("accessor", &SlotTable::accessor, py::arg("index"))
      .def(
          "try_lease",
          [](SlotTable& t) -> py::object {
            auto lease = t.try_lease();
            if (!lease) return py::none();
            return py::make_tuple(lease->index, lease->generation);
          },
          "(index, generation) of a free slot, or None when every slot is leased")
      .def(
          "release", [](SlotTable& t, int32_t index, uint64_t generation) { t.release(SlotLease{index, generation}); },
          py::arg("index"), py::arg("generation"))
      .def(
          "wait_free",
          [](const SlotTable& t, std::optional<double> timeout) {
            return wait_interruptible([&t](double slice) { return t.wait_free(slice); }, timeout,
                                      [&t] { return t.free_count() > 0; });
          },
          py::arg("timeout") = py::none(), "Blocks until a slot is free (False on timeout)");
}

}  // namespace tandem::bindings
