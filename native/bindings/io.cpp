// Bindings for waiting on file descriptors (tandem/fd_wait.hpp). Thin: the
// wait runs with the GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#if defined(__linux__)
#include <sched.h>
#endif

#include "bindings.hpp"
#include "tandem/errors.hpp"
#include "tandem/fd_wait.hpp"

namespace py = pybind11;

namespace tandem::bindings {

void bind_io(py::module_& m) {
  m.def(
      "wait_readable",
      [](const std::vector<int>& fds, int64_t spin_us, int timeout_ms) {
        if (spin_us < 0) throw InvalidArgument("spin_us must be >= 0");
        py::gil_scoped_release nogil;
        return wait_readable(fds, std::chrono::microseconds(spin_us), timeout_ms);
      },
      py::arg("fds"), py::arg("spin_us"), py::arg("timeout_ms") = -1,
      "Indexes of the fds readable (or hung up): polls for up to spin_us, then sleeps up to timeout_ms "
      "(negative: no limit). Empty on timeout or when a signal interrupted the sleep. Releases the GIL.");
  m.def(
      "current_cpu",
      []() {
#if defined(__linux__)
        return sched_getcpu();
#else
        return -1;
#endif
      },
      "The CPU the calling thread runs on now (sched_getcpu), -1 where the system does not say.");
}

}  // namespace tandem::bindings
