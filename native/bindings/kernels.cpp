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

// A host buffer as a td_tensor; element strides from the buffer's byte strides.
td_tensor to_tensor(const py::buffer_info& info, int dtype, int access) {
  const auto size = static_cast<py::ssize_t>(td_dtype_size(dtype));
  if (size == 0) throw InvalidArgument("unknown dtype code " + std::to_string(dtype));
  if (info.itemsize != size)
    throw TypeMismatch("buffer item size " + std::to_string(info.itemsize) + " does not match dtype code " +
                       std::to_string(dtype));
  if (info.ndim > TD_MAX_DIMS) throw InvalidArgument("tensor has more than " + std::to_string(TD_MAX_DIMS) + " dims");
  td_tensor t{};
  t.data = info.ptr;
  t.dtype = dtype;
  t.ndim = static_cast<int32_t>(info.ndim);
  t.access = access;
  for (py::ssize_t d = 0; d < info.ndim; ++d) {
    if (info.strides[d] % size != 0) throw InvalidArgument("buffer stride is not a multiple of its item size");
    t.shape[d] = info.shape[d];
    t.strides[d] = info.strides[d] / size;
  }
  return t;
}

void call_kernel(const std::string& name, const std::vector<py::tuple>& tensors, const py::list& scalars) {
  const td_kernel_fn fn = kernels::find_builtin(name.c_str());
  if (fn == nullptr) throw InvalidArgument("unknown built-in kernel '" + name + "'");
  std::vector<py::buffer_info> infos;
  std::vector<td_tensor> ts;
  infos.reserve(tensors.size());
  ts.reserve(tensors.size());
  for (const py::tuple& item : tensors) {
    if (item.size() != 3) throw InvalidArgument("each tensor is a (buffer, dtype_code, access) tuple");
    const int dtype = item[1].cast<int>();
    const int access = item[2].cast<int>();
    infos.push_back(item[0].cast<py::buffer>().request((access & TD_WRITE) != 0));
    ts.push_back(to_tensor(infos.back(), dtype, access));
  }
  std::vector<td_scalar> ss;
  for (const py::handle& s : scalars) {
    td_scalar v{};
    if (py::isinstance<py::int_>(s)) {
      v.kind = TD_SCALAR_INT;
      v.value.i = s.cast<int64_t>();
    } else if (py::isinstance<py::float_>(s)) {
      v.kind = TD_SCALAR_FLOAT;
      v.value.f = s.cast<double>();
    } else {
      throw TypeMismatch("scalars must be int or float");
    }
    ss.push_back(v);
  }
  td_args args{ts.data(), static_cast<int32_t>(ts.size()), static_cast<int32_t>(ss.size()), ss.data(), -1, 0};
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
}

}  // namespace tandem::bindings
