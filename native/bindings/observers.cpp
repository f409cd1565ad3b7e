// Bindings for the observers: tracing (TraceRecorder, a TaskObserver) and the
// run log (RunLog, a RunObserver). Thin: argument conversion and GIL handling only.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>

#include "bindings.hpp"
#include "tandem/errors.hpp"
#include "tandem/observer.hpp"
#include "tandem/run_log.hpp"
#include "tandem/trace_recorder.hpp"

namespace py = pybind11;

namespace tandem::bindings {

namespace {
py::tuple timing_tuple(const RunTiming& t) {
  return py::make_tuple(t.dispatch_ns, t.admit_ns, t.launch_ns, t.sealed_ns, t.first_start_ns, t.last_end_ns,
                        t.done_ns, static_cast<int32_t>(t.kind), t.busy_ns);
}
}  // namespace

void bind_observers(py::module_& m) {
  // The base Engine.add_observer takes. Observers are native: one called per
  // task on the workers cannot be a Python object (workers never take the GIL for it).
  py::class_<TaskObserver, std::shared_ptr<TaskObserver>>(
      m, "TaskObserver", "Told about every task an engine executes while attached (Engine.add_observer)");

  py::class_<TraceRecorder, TaskObserver, std::shared_ptr<TraceRecorder>>(
      m, "TraceRecorder", "A task observer that records each executed task until drained")
      .def(py::init<>())
      .def(
          "drain",
          [](TraceRecorder& r) {
            std::vector<TraceEvent> events;
            {
              py::gil_scoped_release nogil;  // workers hold the recorder's lock while appending
              events = r.drain();
            }
            py::list out;
            for (const TraceEvent& ev : events) {
              out.append(py::make_tuple(ev.run_id, ev.task_index, ev.worker, ev.start_ns, ev.end_ns, ev.kernel, ev.ok));
            }
            return out;
          },
          "(run_id, task_index, worker, start_ns, end_ns, kernel name, ok) of each task recorded since the last drain")
      .def_property_readonly("dropped", &TraceRecorder::dropped, "events lost because memory ran out");

  py::class_<RunLog, std::shared_ptr<RunLog>>(m, "RunLog",
                                             "Timing records of launched runs, written by each run as it completes")
      .def(py::init<size_t>(), py::arg("window"))
      .def_property_readonly("window", &RunLog::window)
      .def(
          "record",
          [](RunLog& log, int64_t dispatch_ns, int64_t admit_ns, int64_t launch_ns, int64_t sealed_ns,
             int64_t first_start_ns, int64_t last_end_ns, int64_t done_ns, int32_t kind, int64_t busy_ns) {
            if (kind < 0 || kind > 2) throw InvalidArgument("run kind must be 0 (completed), 1 (failed) or 2 (cancelled)");
            log.record(RunTiming{dispatch_ns, admit_ns, launch_ns, sealed_ns, first_start_ns, last_end_ns, done_ns,
                                 static_cast<RunKind>(kind), busy_ns});
          },
          py::arg("dispatch_ns"), py::arg("admit_ns"), py::arg("launch_ns"), py::arg("sealed_ns"),
          py::arg("first_start_ns"), py::arg("last_end_ns"), py::arg("done_ns"), py::arg("kind"),
          py::arg("busy_ns") = -1,
          "A record for a run that is not a native one (the distributed runtime's)")
      .def(
          "recent",
          [](const RunLog& log) {
            py::list out;
            for (const RunTiming& t : log.recent()) out.append(timing_tuple(t));
            return out;
          },
          "(dispatch, admit, launch, sealed, first_start, last_end, done, kind, busy) of the most recent runs, oldest "
          "first")
      .def(
          "summary",
          [](const RunLog& log) {
            WindowSummary w;
            {
              py::gil_scoped_release released;  // sorting a full window takes a while: other threads go on
              w = log.summary();
            }
            auto pct = [](const WindowPercentiles& p) { return py::make_tuple(p.p50, p.p90, p.p99, p.samples); };
            return py::make_tuple(pct(w.admission_wait), pct(w.orchestration), pct(w.device), pct(w.latency),
                                  w.has_overlap ? py::cast(w.overlap_ratio) : py::none());
          },
          "((p50, p90, p99, samples) in ns of admission_wait, orchestration, device and latency, overlap ratio or "
          "None) over the window, as stats() reports them")
      .def(
          "since",
          [](const RunLog& log, uint64_t from) -> py::object {
            auto [first, records] = log.since(from);
            py::list out;
            for (const RunTiming& t : records) out.append(timing_tuple(t));
            return py::make_tuple(first, out);
          },
          py::arg("seq"),
          "(first, records): the records numbered seq and later still in the window, oldest first; first is "
          "the number of the first one (> seq when older ones were overwritten)")
      .def_property_readonly("recorded", &RunLog::recorded, "records ever written: the next record's number")
      .def_static(
          "histogram_bounds_ns", []() -> py::object { return py::tuple(py::cast(DurationHistogram::bounds_ns())); },
          "upper bounds (ns) of the histograms' buckets; one more bucket holds what lies above")
      .def(
          "histograms",
          [](const RunLog& log) {
            const RunHistograms h = log.histograms();
            py::dict out;
            auto put = [&out](const char* name, const DurationHistogram& d) {
              out[name] = py::make_tuple(py::tuple(py::cast(d.counts)), d.sum_ns, d.count);
            };
            put("admission_wait", h.admission_wait);
            put("orchestration", h.orchestration);
            put("device", h.device);
            put("latency", h.latency);
            return out;
          },
          "{name: (bucket counts, sum_ns, count)} over every run: admission_wait, orchestration, device, latency")
      .def("launched", &RunLog::launched, "Counts a launched run that is not a native one (it records itself later)")
      .def(
          "counts",
          [](const RunLog& log) {
            const RunCounts c = log.counts();
            return py::make_tuple(c.launched, c.completed, c.failed, c.cancelled);
          },
          "(launched, completed, failed, cancelled): every run so far, not only the window's");
}

}  // namespace tandem::bindings
