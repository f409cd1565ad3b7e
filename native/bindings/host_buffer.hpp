// Glue shared by the device and accessor bindings: borrowing the memory of a
// Python buffer-protocol object, and checked conversion of sizes.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "tandem/errors.hpp"

namespace tandem::bindings {

// A C-contiguous view of a buffer-protocol object (numpy array, bytearray,
// memoryview, ...), held for the lifetime of this object. Construct and
// destroy it with the GIL held; use data() freely in between.
class HostBuffer {
 public:
  HostBuffer(pybind11::handle obj, bool writable, const char* what) {
    if (!PyObject_CheckBuffer(obj.ptr())) {
      throw pybind11::type_error(std::string(what) +
                                 ": expected an object supporting the buffer protocol (e.g. a numpy "
                                 "array), got " +
                                 std::string(pybind11::str(pybind11::type::handle_of(obj).attr("__name__"))));
    }
    const int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj.ptr(), &view_, flags) != 0) {
      // The exporter says why (not contiguous, read-only): a bad value.
      pybind11::error_already_set err;
      throw pybind11::value_error(std::string(what) + ": " + err.what());
    }
  }
  ~HostBuffer() { PyBuffer_Release(&view_); }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  void* data() const { return view_.buf; }
  size_t size() const { return static_cast<size_t>(view_.len); }

 private:
  Py_buffer view_{};
};

// Python ints are signed: a negative size or offset is a bad value
// (ValueError), not a failed overload (TypeError).
inline size_t to_size(int64_t v, const char* what) {
  if (v < 0) throw InvalidArgument(std::string(what) + " must be non-negative, got " + std::to_string(v));
  return static_cast<size_t>(v);
}

}  // namespace tandem::bindings
