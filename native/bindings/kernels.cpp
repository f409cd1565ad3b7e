// Built-in kernels for tests and benchmarks: run one synchronously on the
// calling thread over host buffers (numpy arrays, strided views included).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "../kernels/blas.hpp"
#include "../kernels/builtin.hpp"
#include "bindings.hpp"
#include "tandem/errors.hpp"
#include "tandem/kernel_abi.h"

namespace py = pybind11;

namespace tandem::bindings {

namespace {

// A buffer-protocol view of one argument, released on destruction. The raw
// protocol (not py::buffer_info) keeps per-call overhead well under a
// microsecond, which matters for small kernels.
class HostBuffer {
 public:
  HostBuffer(PyObject* obj, bool writable) {
    const int flags = PyBUF_STRIDES | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view_, flags) != 0) throw py::error_already_set();
    held_ = true;
  }
  HostBuffer(HostBuffer&& o) noexcept : view_(o.view_), held_(o.held_) { o.held_ = false; }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  HostBuffer& operator=(HostBuffer&&) = delete;
  ~HostBuffer() {
    if (held_) PyBuffer_Release(&view_);
  }
  const Py_buffer& view() const { return view_; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// A host buffer as a td_tensor; element strides from the buffer's byte strides.
td_tensor to_tensor(const Py_buffer& v, int dtype, int access) {
  const auto size = static_cast<Py_ssize_t>(td_dtype_size(dtype));
  if (size == 0) throw InvalidArgument("unknown dtype code " + std::to_string(dtype));
  if (v.itemsize != size)
    throw TypeMismatch("buffer item size " + std::to_string(v.itemsize) + " does not match dtype code " +
                       std::to_string(dtype));
  if (v.ndim > TD_MAX_DIMS) throw InvalidArgument("tensor has more than " + std::to_string(TD_MAX_DIMS) + " dims");
  td_tensor t{};
  t.data = v.buf;
  t.dtype = dtype;
  t.ndim = v.ndim;
  t.access = access;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.strides[d] % size != 0) throw InvalidArgument("buffer stride is not a multiple of its item size");
    t.shape[d] = v.shape[d];
    t.strides[d] = v.strides[d] / size;
  }
  return t;
}

void call_kernel(const std::string& name, const py::list& tensors, const py::list& scalars) {
  const td_kernel_fn fn = kernels::find_builtin(name.c_str());
  if (fn == nullptr) throw InvalidArgument("unknown built-in kernel '" + name + "'");
  const size_t nt = tensors.size(), ns = scalars.size();
  if (nt > 64 || ns > 64) throw InvalidArgument("too many kernel arguments");
  std::vector<HostBuffer> buffers;
  buffers.reserve(nt);
  td_tensor ts[64];
  td_scalar ss[64];
  for (size_t i = 0; i < nt; ++i) {
    PyObject* item = PyList_GET_ITEM(tensors.ptr(), static_cast<Py_ssize_t>(i));
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3)
      throw InvalidArgument("each tensor is a (buffer, dtype_code, access) tuple");
    const int dtype = py::handle(PyTuple_GET_ITEM(item, 1)).cast<int>();
    const int access = py::handle(PyTuple_GET_ITEM(item, 2)).cast<int>();
    buffers.emplace_back(PyTuple_GET_ITEM(item, 0), (access & TD_WRITE) != 0);
    ts[i] = to_tensor(buffers.back().view(), dtype, access);
  }
  for (size_t i = 0; i < ns; ++i) {
    const py::handle s = PyList_GET_ITEM(scalars.ptr(), static_cast<Py_ssize_t>(i));
    td_scalar v{};
    if (PyLong_Check(s.ptr())) {
      v.kind = TD_SCALAR_INT;
      v.value.i = s.cast<int64_t>();
    } else if (PyFloat_Check(s.ptr())) {
      v.kind = TD_SCALAR_FLOAT;
      v.value.f = PyFloat_AS_DOUBLE(s.ptr());
    } else {
      throw TypeMismatch("scalars must be int or float");
    }
    ss[i] = v;
  }
  td_args args{ts, static_cast<int32_t>(nt), static_cast<int32_t>(ns), ss, -1, 0};
  char err[512] = {0};
  int rc;
  {
    py::gil_scoped_release nogil;
    rc = fn(&args, err, sizeof err);
  }
  if (rc != 0) {
    err[sizeof err - 1] = '\0';
    throw std::runtime_error(err[0] ? err : ("kernel '" + name + "' failed with code " + std::to_string(rc)));
  }
}

}  // namespace

void bind_kernels(py::module_& m) {
  kernels::blas::use_caller_thread_only();
  m.def("call_kernel", &call_kernel, py::arg("name"), py::arg("tensors"), py::arg("scalars"),
        "Run a built-in kernel synchronously on this thread (GIL released) over host buffers given as\n"
        "(buffer, dtype_code, access) tuples. Raises RuntimeError with the kernel's message on failure.");
  m.def(
      "builtin_kernel_names",
      [] {
        size_t n = 0;
        const kernels::BuiltinKernel* table = kernels::builtin_table(&n);
        std::vector<std::string> names;
        for (size_t i = 0; i < n; ++i) names.emplace_back(table[i].name);
        return names;
      },
      "Names of the built-in kernels.");
  m.def("packed_matmul_whole_vectors", &kernels::packed_matmul_whole_vectors,
        "Whether matmul_packed runs its AVX-512 register block on this CPU (read once).");
}

}  // namespace tandem::bindings
