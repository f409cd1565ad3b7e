#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "bindings.hpp"
#include "host_buffer.hpp"
#include "tandem/accessor.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace tandem::bindings {

namespace {

// Below this many bytes a staging copy keeps the GIL (see map()).
constexpr size_t kCopyKeepsGil = size_t{64} << 10;

// A Python buffer that must hold at least `nbytes`, so the C++ side, which
// only sees a pointer, can never run past its end.
void require_len(const HostBuffer& b, size_t nbytes, const char* what) {
  if (b.size() < nbytes) {
    throw InvalidArgument(std::string(what) + " holds " + std::to_string(b.size()) + " bytes, fewer than the " +
                          std::to_string(nbytes) + " requested");
  }
}

// The data pointer of host_view once it is checked to be a writable C-contiguous buffer of at least
// nbytes: what add() and map() hand the accessor (which keeps only the pointer).
void* checked_view(py::handle host_view, size_t nbytes) {
  HostBuffer host(host_view, true, "host_view");
  require_len(host, nbytes, "host_view");
  return host.data();
}

}  // namespace

void bind_accessor(py::module_& m) {
  py::class_<HostAccessor, std::shared_ptr<HostAccessor>>(
      m, "HostAccessor",
      "A per-run table mapping device regions to host views. It owns the mappings it adds and "
      "releases exactly those on close(); it can be reused by add() after close().")
      .def(py::init([](std::shared_ptr<Device> device) {
             Device* raw = device.get();
             // The deleter holds the device, so it outlives the accessor wherever
             // the last reference to the accessor ends up (Python or a native run).
             return std::shared_ptr<HostAccessor>(new HostAccessor(raw),
                                                  [keep = std::move(device)](HostAccessor* a) { delete a; });
           }),
           "device"_a.none(true), "A HostAccessor over device; None admits no region.")
      .def(
          "add",
          [](HostAccessor& acc, uint64_t device_base, int64_t size, py::object host_view) {
            const size_t n = to_size(size, "size");
            acc.add(static_cast<uintptr_t>(device_base), n, host_view.is_none() ? nullptr : checked_view(host_view, n));
          },
          "device_base"_a, "size"_a, "host_view"_a,
          "Maps [device_base, device_base + size) to the first size bytes of host_view (a writable "
          "C-contiguous buffer, e.g. a numpy array). Only the pointer is kept: the CALLER must keep "
          "host_view alive, and must not resize or reallocate it, until close(). The region must lie "
          "inside one live allocation and must not overlap a region already mapped here.")
      .def(
          "map",
          [](HostAccessor& acc, uint64_t device_base, int64_t size, py::handle host_view, bool copy_in) {
            const size_t n = to_size(size, "size");
            acc.add(static_cast<uintptr_t>(device_base), n, checked_view(host_view, n));
            if (!copy_in) return;
            // A small copy costs less than handing the GIL over and taking it back.
            if (n < kCopyKeepsGil) {
              acc.stage_in(static_cast<uintptr_t>(device_base));
            } else {
              py::gil_scoped_release nogil;
              acc.stage_in(static_cast<uintptr_t>(device_base));
            }
          },
          "device_base"_a, "size"_a, "host_view"_a, "copy_in"_a,
          "add() and, when copy_in, stage_in() in one call: a run's staging of one host argument. The GIL "
          "is released for copies of 64 KiB or more.")
      .def(
          "read",
          [](const HostAccessor& acc, uint64_t device_addr, py::object dst, int64_t nbytes) {
            const size_t n = to_size(nbytes, "nbytes");
            HostBuffer host(dst, true, "read destination");
            require_len(host, n, "read destination");
            py::gil_scoped_release nogil;
            acc.read(static_cast<uintptr_t>(device_addr), host.data(), n);
          },
          "device_addr"_a, "dst"_a, "nbytes"_a,
          "Copies nbytes from device_addr into dst. The span must lie inside one mapped region; "
          "otherwise ValueError and dst is untouched.")
      .def(
          "write",
          [](HostAccessor& acc, uint64_t device_addr, py::object src, int64_t nbytes) {
            const size_t n = to_size(nbytes, "nbytes");
            HostBuffer host(src, false, "write source");
            require_len(host, n, "write source");
            py::gil_scoped_release nogil;
            acc.write(static_cast<uintptr_t>(device_addr), host.data(), n);
          },
          "device_addr"_a, "src"_a, "nbytes"_a,
          "Copies nbytes of src to device_addr. The span must lie inside one mapped region; "
          "otherwise ValueError and the device is untouched.")
      .def(
          "stage_in", [](HostAccessor& acc, uint64_t base) { acc.stage_in(static_cast<uintptr_t>(base)); },
          "device_base"_a, py::call_guard<py::gil_scoped_release>(),
          "Copies the whole host view of the region mapped at device_base to the device.")
      .def(
          "copy_back", [](HostAccessor& acc, uint64_t base) { acc.copy_back(static_cast<uintptr_t>(base)); },
          "device_base"_a, py::call_guard<py::gil_scoped_release>(),
          "Copies the region mapped at device_base back to its host view.")
      .def("close", &HostAccessor::close, "Releases every mapping; idempotent.")
      .def("mapping_count", &HostAccessor::mapping_count)
      .def("mapped_bytes", &HostAccessor::mapped_bytes);
}

}  // namespace tandem::bindings
