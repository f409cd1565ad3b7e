// A blocking native wait with the GIL released, in slices: between slices it
// takes the GIL back for PyErr_CheckSignals, so Ctrl-C in the main thread
// raises KeyboardInterrupt from the wait (what it waits for goes on) instead of
// once the wait ends. None or a negative timeout waits until done.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <optional>

namespace tandem::bindings {

// wait_slice(seconds) -> bool: the native wait, true once done. done() -> bool: a
// non-blocking check, for a timeout that ran out between slices.
template <class WaitSlice, class Done>
bool wait_interruptible(WaitSlice&& wait_slice, std::optional<double> timeout, Done&& done) {
  constexpr double kSlice = 0.05;  // seconds between signal checks
  const bool forever = !timeout || *timeout < 0;
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    double slice = kSlice;
    if (!forever) {
      const double left = *timeout - std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (!(left > 0)) return done();
      slice = std::min(slice, left);
    }
    bool finished;
    {
      pybind11::gil_scoped_release nogil;
      finished = wait_slice(slice);
    }
    if (finished) return true;
    if (PyErr_CheckSignals() != 0) throw pybind11::error_already_set();
  }
}

}  // namespace tandem::bindings
