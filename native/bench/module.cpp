// tandem._bench: the benchmark helpers of the tooling package, a module of its
// own so the core extension (engine._native) carries no benchmark code. Thin:
// argument conversion and GIL handling only.
#include <pybind11/pybind11.h>

#include <string>

#include "noop_graph.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_bench, m) {
  m.doc() = "Tandem's native benchmark helpers (tandem bench tasks)";
  m.def(
      "noop_graph",
      [](int workers, const std::string& shape, uint64_t n) {
        tandem::bench::GraphResult r;
        {
          py::gil_scoped_release nogil;
          r = tandem::bench::noop_graph(workers, shape, n);
        }
        return py::make_tuple(r.tasks, r.submit_seconds, r.total_seconds);
      },
      py::arg("workers"), py::arg("shape"), py::arg("n"),
      "(tasks, submit seconds, total seconds) of one run of n noop tasks, submitted from C++ on a fresh engine "
      "with `workers` pool threads (0: the default). shape 'wide': independent tasks; 'chain': each depends on "
      "the previous one");
}
