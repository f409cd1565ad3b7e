#include <pybind11/pybind11.h>

#include <cstdio>
#include <memory>
#include <string>

#include "bindings.hpp"
#include "host_buffer.hpp"
#include "tandem/device.hpp"

namespace py = pybind11;
using namespace pybind11::literals;

namespace tandem::bindings {

namespace {

std::string hex(uint64_t v) {
  char buf[2 + 16 + 1];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

py::dict stats_dict(const DeviceStats& s) {
  return py::dict("capacity"_a = s.capacity, "bytes_in_use"_a = s.bytes_in_use, "peak_bytes"_a = s.peak_bytes,
                  "live_allocations"_a = s.live_allocations, "total_allocations"_a = s.total_allocations,
                  "h2d_bytes"_a = s.h2d_bytes, "d2h_bytes"_a = s.d2h_bytes, "d2d_bytes"_a = s.d2d_bytes,
                  "mapped_regions"_a = s.mapped_regions);
}

bool same(const BufferRef& a, const BufferRef& b) {
  return a.device_uid == b.device_uid && a.id == b.id && a.addr == b.addr && a.size == b.size;
}

}  // namespace

void bind_device(py::module_& m) {
  py::class_<BufferRef>(m, "Buffer",
                        "A handle to one device allocation: (device_uid, id, addr, size). A plain value; "
                        "the device checks it on every use, so a forged, freed or stale handle is refused.")
      .def(py::init([](uint64_t device_uid, uint64_t id, uint64_t addr, uint64_t size) {
             return BufferRef{device_uid, id, static_cast<uintptr_t>(addr), static_cast<size_t>(size)};
           }),
           "device_uid"_a, "id"_a, "addr"_a, "size"_a)
      .def_property_readonly("device_uid", [](const BufferRef& b) { return b.device_uid; })
      .def_property_readonly("id", [](const BufferRef& b) { return b.id; })
      .def_property_readonly("addr", [](const BufferRef& b) { return static_cast<uint64_t>(b.addr); })
      .def_property_readonly("size", [](const BufferRef& b) { return static_cast<uint64_t>(b.size); })
      .def("__repr__",
           [](const BufferRef& b) {
             return "Buffer(device_uid=" + hex(b.device_uid) + ", id=" + std::to_string(b.id) +
                    ", addr=" + hex(b.addr) + ", size=" + std::to_string(b.size) + ")";
           })
      .def("__eq__", &same, py::is_operator())
      .def("__hash__", [](const BufferRef& b) {
        return py::hash(py::make_tuple(b.device_uid, b.id, static_cast<uint64_t>(b.addr),
                                       static_cast<uint64_t>(b.size)));
      });

  py::class_<Device, std::shared_ptr<Device>>(
      m, "Device",
      "The embedded cpu device: a native memory arena. Each Device is independent (its own uid, "
      "allocations and counters). capacity is a limit in bytes; 0 means unlimited.")
      .def(py::init([](int64_t capacity) { return std::make_shared<Device>(to_size(capacity, "capacity")); }),
           "capacity"_a = 0)
      .def_property_readonly("uid", &Device::uid)
      .def(
          "alloc",
          [](Device& d, int64_t nbytes, int64_t align) {
            const size_t n = to_size(nbytes, "nbytes");
            const size_t a = to_size(align, "align");
            py::gil_scoped_release nogil;
            return d.alloc(n, a);
          },
          "nbytes"_a, "align"_a = 64,
          "Allocates nbytes (> 0) aligned to align (a power of two). Raises DeviceMemoryError past "
          "the capacity.")
      .def("free", &Device::free, "buf"_a, py::call_guard<py::gil_scoped_release>(),
           "Frees a live allocation of this device; a foreign, interior, freed or stale handle raises "
           "ValueError and changes nothing.")
      .def(
          "copy_h2d",
          [](Device& d, const BufferRef& dst, int64_t offset, py::object src) {
            const size_t off = to_size(offset, "offset");
            HostBuffer host(src, false, "copy_h2d source");
            py::gil_scoped_release nogil;
            d.copy_h2d(dst, off, host.data(), host.size());
          },
          "dst"_a, "offset"_a, "src"_a,
          "Copies all bytes of src (a C-contiguous buffer, e.g. a numpy array) into dst at offset.")
      .def(
          "copy_d2h",
          [](Device& d, py::object dst, const BufferRef& src, int64_t offset) {
            const size_t off = to_size(offset, "offset");
            HostBuffer host(dst, true, "copy_d2h destination");
            py::gil_scoped_release nogil;
            d.copy_d2h(host.data(), src, off, host.size());
          },
          "dst"_a, "src"_a, "offset"_a,
          "Fills all bytes of dst (a writable C-contiguous buffer) from src at offset.")
      .def(
          "copy_d2d",
          [](Device& d, const BufferRef& dst, int64_t dst_offset, const BufferRef& src, int64_t src_offset,
             int64_t nbytes) {
            const size_t doff = to_size(dst_offset, "dst_offset");
            const size_t soff = to_size(src_offset, "src_offset");
            const size_t n = to_size(nbytes, "nbytes");
            py::gil_scoped_release nogil;
            d.copy_d2d(dst, doff, src, soff, n);
          },
          "dst"_a, "dst_offset"_a, "src"_a, "src_offset"_a, "nbytes"_a)
      .def("check", &Device::check, "buf"_a, py::call_guard<py::gil_scoped_release>(),
           "Raises ValueError unless buf is a live allocation of this device.")
      .def(
          "resolve",
          [](const Device& d, uint64_t addr, int64_t nbytes) {
            const size_t n = to_size(nbytes, "nbytes");
            py::gil_scoped_release nogil;
            return d.resolve(static_cast<uintptr_t>(addr), n);
          },
          "addr"_a, "nbytes"_a, "The live allocation wholly containing [addr, addr + nbytes).")
      .def("stats", [](const Device& d) { return stats_dict(d.stats()); })
      .def("__repr__", [](const Device& d) {
        return "Device(uid=" + hex(d.uid()) + ", capacity=" + std::to_string(d.stats().capacity) + ")";
      });
}

}  // namespace tandem::bindings
