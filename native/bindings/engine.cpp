// Bindings for the engine, runs, kernels and tensor arguments. Thin: argument
// conversion and GIL handling only.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "bindings.hpp"
#include "host_buffer.hpp"
#include "interruptible.hpp"
#include "tandem/capture.hpp"
#include "tandem/engine.hpp"
#include "tandem/errors.hpp"
#include "tandem/run_log.hpp"

namespace py = pybind11;

namespace tandem::bindings {

namespace {

py::dtype numpy_dtype(int32_t code) {
  switch (code) {
    case TD_FLOAT32: return py::dtype("float32");
    case TD_FLOAT16: return py::dtype("float16");
    case TD_BFLOAT16: return py::dtype("uint16");  // bit storage, as engine.dtypes.bfloat16
    case TD_INT32: return py::dtype("int32");
    case TD_INT64: return py::dtype("int64");
    case TD_UINT8: return py::dtype("uint8");
    default: throw InvalidArgument("unknown dtype code " + std::to_string(code));
  }
}

// A numpy array viewing a tensor argument's memory (no copy). Read-only
// arguments give read-only arrays.
py::array tensor_as_array(const td_tensor& t) {
  const auto itemsize = static_cast<py::ssize_t>(td_dtype_size(t.dtype));
  std::vector<py::ssize_t> shape(t.shape, t.shape + t.ndim);
  std::vector<py::ssize_t> strides;
  for (int i = 0; i < t.ndim; ++i) strides.push_back(static_cast<py::ssize_t>(t.strides[i]) * itemsize);
  py::array a(numpy_dtype(t.dtype), shape, strides, t.data, py::none());
  if (t.access == TD_READ) {
    py::detail::array_proxy(a.ptr())->flags &= ~py::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  }
  return a;
}

// A Python callable run as a host task: fn(*arrays, *scalars), with the GIL.
class PyHostCallable final : public HostCallable {
 public:
  explicit PyHostCallable(py::function fn) : fn_(std::move(fn)) {}
  ~PyHostCallable() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      fn_ = py::function();
    } else {
      fn_.release();  // interpreter gone: nothing to decref into
    }
  }

  int call(const td_args& args, std::string& err) override {
    py::gil_scoped_acquire gil;
    try {
      py::tuple call_args(args.n_tensors + args.n_scalars);
      for (int i = 0; i < args.n_tensors; ++i) call_args[i] = tensor_as_array(args.tensors[i]);
      for (int i = 0; i < args.n_scalars; ++i) {
        const td_scalar& s = args.scalars[i];
        call_args[args.n_tensors + i] =
            s.kind == TD_SCALAR_INT ? py::object(py::int_(s.value.i)) : py::object(py::float_(s.value.f));
      }
      fn_(*call_args);
      return 0;
    } catch (py::error_already_set& e) {
      err = e.what();
      return 1;
    }
  }

 private:
  py::function fn_;
};

td_scalar to_scalar(const py::handle& h) {
  td_scalar s{};
  if (py::isinstance<py::bool_>(h) || py::isinstance<py::int_>(h)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (overflow != 0) throw InvalidArgument("an integer scalar argument does not fit in 64 bits");
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    s.kind = TD_SCALAR_INT;
    s.value.i = static_cast<int64_t>(v);
  } else if (py::isinstance<py::float_>(h)) {
    s.kind = TD_SCALAR_FLOAT;
    s.value.f = h.cast<double>();
  } else {
    throw TypeMismatch("a scalar argument must be an int, bool or float, not " +
                       std::string(py::str(py::type::of(h).attr("__name__"))));
  }
  return s;
}

py::object failure_of(const Run& r) {
  if (!r.failed()) return py::none();
  RunFailure f = r.failure();
  return py::make_tuple(f.task_index, f.kernel, f.message);
}

std::vector<td_scalar> to_scalars(const py::sequence& scalars) {
  std::vector<td_scalar> out;
  out.reserve(scalars.size());
  for (const auto& h : scalars) out.push_back(to_scalar(h));
  return out;
}

std::vector<ScalarPatch> to_patches(const py::sequence& patches) {
  std::vector<ScalarPatch> out;
  out.reserve(patches.size());
  for (const auto& item : patches) {
    auto pair = item.cast<py::tuple>();
    if (pair.size() != 2) throw InvalidArgument("replay: a patch is (task index, scalars)");
    out.push_back(ScalarPatch{pair[0].cast<uint32_t>(), to_scalars(pair[1].cast<py::sequence>())});
  }
  return out;
}

std::vector<ReplayCopyBack> to_copy_backs(const std::vector<std::tuple<uint32_t, uintptr_t>>& copy_backs) {
  std::vector<ReplayCopyBack> out;
  out.reserve(copy_backs.size());
  for (const auto& [base, device_base] : copy_backs) out.push_back(ReplayCopyBack{base, device_base});
  return out;
}

std::shared_ptr<RunObserver> to_observer(const py::object& log) {
  // None checked here: casting it to a holder costs pybind11 a failed attribute lookup.
  if (log.is_none()) return nullptr;
  return log.cast<std::shared_ptr<RunLog>>();
}

TensorArg make_tensor_arg(uintptr_t addr, int32_t dtype, const std::vector<int64_t>& shape,
                          const std::vector<int64_t>& strides, uint64_t alloc_id, uint64_t begin, uint64_t end) {
  if (td_dtype_size(dtype) == 0) throw InvalidArgument("unknown dtype code " + std::to_string(dtype));
  if (shape.size() > TD_MAX_DIMS) throw InvalidArgument("at most " + std::to_string(TD_MAX_DIMS) + " dims");
  if (shape.size() != strides.size()) throw InvalidArgument("shape and strides differ in length");
  if (end < begin) throw InvalidArgument("byte range end < begin");
  TensorArg a;
  a.view.data = reinterpret_cast<void*>(addr);
  a.view.dtype = dtype;
  a.view.ndim = static_cast<int32_t>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    a.view.shape[i] = shape[i];
    a.view.strides[i] = strides[i];
  }
  a.alloc_id = alloc_id;
  a.begin = begin;
  a.end = end;
  return a;
}

}  // namespace

void bind_engine(py::module_& m) {
  py::class_<Kernel, std::shared_ptr<Kernel>>(m, "Kernel", "A kernel registered in an engine")
      .def_property_readonly("name", [](const Kernel& k) { return k.name; })
      .def_property_readonly("is_host", &Kernel::is_host)
      .def("__repr__", [](const Kernel& k) { return "<Kernel " + k.name + (k.is_host() ? " (host)>" : ">"); });

  py::class_<TensorArg>(m, "TensorArg", "A tensor argument: a strided view plus its tracked byte range")
      .def(py::init(&make_tensor_arg), py::arg("addr"), py::arg("dtype"), py::arg("shape"), py::arg("strides"),
           py::arg("alloc_id"), py::arg("begin"), py::arg("end"))
      .def_property_readonly("addr", [](const TensorArg& a) { return reinterpret_cast<uintptr_t>(a.view.data); })
      .def_property_readonly("alloc_id", [](const TensorArg& a) { return a.alloc_id; })
      .def_property_readonly("byte_range", [](const TensorArg& a) { return py::make_tuple(a.begin, a.end); })
      .def(
          "may_overlap",
          [](const TensorArg& a, const TensorArg& b) { return may_overlap(span_of(a), span_of(b)); },
          py::arg("other"),
          "Whether the two views may share a byte, were they in one allocation (dependency tracking's rule: "
          "False only when they surely do not, as column slices of the same rows)");

  py::class_<PreparedCall, std::shared_ptr<PreparedCall>>(m, "PreparedCall",
                                                         "A kernel call checked once (Engine.prepare_call)")
      .def_property_readonly("kernel", [](const PreparedCall& c) { return std::const_pointer_cast<Kernel>(c.kernel); })
      .def_property_readonly("tensor_count", [](const PreparedCall& c) { return c.tensors.size(); })
      .def_property_readonly("tensors", [](const PreparedCall& c) { return c.tensors; },
                             "its tensor arguments (copies), in the kernel's order")
      .def_property_readonly("access", [](const PreparedCall& c) { return c.access; });

  py::class_<Recording, std::shared_ptr<Recording>>(m, "Recording",
                                                   "The tasks of one run, relative to the bases they touched")
      .def(py::init<>())
      .def(
          "add",
          [](Recording& r, const PreparedCall& call, const std::vector<std::tuple<uint32_t, uintptr_t, uint64_t>>& refs) {
            std::vector<RecordedRef> out;
            out.reserve(refs.size());
            for (const auto& [base, addr, origin] : refs) out.push_back(RecordedRef{base, addr, origin});
            r.add(call, out);
          },
          py::arg("call"), py::arg("refs"),
          "Appends a submitted call; refs: (base index, the base's address, its origin) per tensor argument")
      .def("seal", &Recording::seal, py::arg("private_bases"),
           "Ends the recording; the dependencies through private bases are computed once, here")
      .def_property_readonly("sealed", &Recording::sealed)
      .def_property_readonly("task_count", &Recording::size)
      .def_property_readonly("base_count", &Recording::base_count);

  py::class_<ReplayPlan, std::shared_ptr<ReplayPlan>>(
      m, "ReplayPlan", "A sealed recording materialized against one base table, for every replay on those bases")
      .def(py::init([](std::shared_ptr<Recording> recording,
                       const std::vector<std::tuple<uintptr_t, uint64_t, uint64_t>>& bases) {
             std::vector<ReplayBase> b;
             b.reserve(bases.size());
             for (const auto& [addr, alloc_id, origin] : bases) b.push_back(ReplayBase{addr, alloc_id, origin});
             return std::make_shared<ReplayPlan>(std::move(recording), b);
           }),
           py::arg("recording"), py::arg("bases"), "bases: (address, alloc id, origin) per base the recording names")
      .def_property_readonly("task_count", [](const ReplayPlan& p) { return p.entries().size(); })
      .def_property_readonly("shared_accesses", [](const ReplayPlan& p) { return p.shared().size(); });

  py::class_<Run, std::shared_ptr<Run>>(m, "Run", "One run: a group of tasks completing together")
      .def_property_readonly("id", &Run::id)
      .def_property_readonly("done", &Run::done)
      .def_property_readonly("sealed", &Run::sealed)
      .def_property_readonly("cancelled", &Run::cancelled)
      .def_property_readonly("failed", &Run::failed)
      .def_property_readonly("task_count", &Run::task_count)
      .def("cancel", &Run::cancel)
      .def(
          "wait",
          [](Run& r, std::optional<double> timeout) {
            return wait_interruptible([&r](double slice) { return r.wait(slice); }, timeout, [&r] { return r.done(); });
          },
          py::arg("timeout") = py::none())
      .def_property_readonly("slot", &Run::slot, "the pipeline slot the run holds, -1 for none")
      .def("failure", &failure_of, "(task index, kernel, message) of the run's first failure, or None")
      .def("times",
           [](const Run& r) {
             RunTimes t = r.times();
             py::dict d;
             d["created_ns"] = t.created_ns;
             d["sealed_ns"] = t.sealed_ns;
             d["first_start_ns"] = t.first_start_ns;
             d["last_end_ns"] = t.last_end_ns;
             d["done_ns"] = t.done_ns;
             d["busy_ns"] = t.busy_ns;
             return d;
           })
      .def("attach_accessor", &Run::attach_accessor)
      .def(
          "outcome", [](const Run& r) { return py::make_tuple(failure_of(r), r.cancelled()); },
          "(failure or None, cancelled) of a completed run: what finishing it needs, in one call");

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine", "Worker pool, task graph and notifier of one runtime")
      .def(py::init<std::shared_ptr<Device>, int, int, bool>(), py::arg("device"), py::arg("workers") = 0,
           py::arg("spin_us") = Engine::kDefaultSpinUs, py::arg("caller_runs") = false)
      .def_property_readonly("device", &Engine::device)
      .def_property_readonly("workers", &Engine::workers)
      .def_property_readonly("caller_runs", &Engine::caller_runs)
      .def_property_readonly("queued_tasks", &Engine::queued_tasks)
      .def("run_queued", &Engine::run_queued_until_readable, py::arg("stop_fd") = -1,
           py::call_guard<py::gil_scoped_release>(),
           "Runs queued tasks on this thread until none is queued or stop_fd is readable; how many ran")
      .def_property_readonly("closed", &Engine::closed)
      .def_property_readonly("notifier_fd", [](Engine& e) { return e.notifier().fd(); })
      .def("now_ns", &Engine::now_ns)
      .def("kernel", [](Engine& e, const std::string& name) { return std::const_pointer_cast<Kernel>(e.registry().get(name)); })
      .def("has_kernel", [](Engine& e, const std::string& name) { return e.registry().find(name) != nullptr; })
      .def("kernel_names", [](Engine& e) { return e.registry().names(); })
      .def(
          "register_host_kernel",
          [](Engine& e, const std::string& name, py::function fn) {
            auto k = make_host_kernel(name, std::make_shared<PyHostCallable>(std::move(fn)));
            e.registry().add(k);
            return std::const_pointer_cast<Kernel>(k);
          },
          py::arg("name"), py::arg("fn"))
      .def(
          "load_kernel",
          [](Engine& e, const std::string& path, const std::string& symbol, std::optional<std::string> name) {
            auto k = load_kernel(path, symbol, name ? *name : symbol);
            e.registry().add(k);
            return std::const_pointer_cast<Kernel>(k);
          },
          py::arg("path"), py::arg("symbol"), py::arg("name") = py::none())
      .def(
          "begin_run", &Engine::begin_run, py::arg("notify") = false)
      .def(
          "begin_run_leased",
          [](Engine& e, bool notify, const std::shared_ptr<SlotTable>& slots) -> py::object {
            auto run = e.begin_run_leased(notify, slots);
            if (!run) return py::none();
            // The id and slot with the run: the admitting caller needs both at once.
            const uint64_t id = run->id();
            const int32_t slot = run->slot();
            return py::make_tuple(std::move(run), id, slot);
          },
          py::arg("notify"), py::arg("slots"),
          "(run, run id, slot) of a run holding a free slot (its accessor attached), or None when every slot is leased")
      .def("stop_admitting", &Engine::stop_admitting)
      .def(
          "wait_idle",
          [](Engine& e, std::optional<double> timeout) {
            return wait_interruptible([&e](double slice) { return e.wait_idle(slice); }, timeout,
                                      [&e] { return e.wait_idle(0); });
          },
          py::arg("timeout") = py::none(), "Blocks until every begun run completed (False on timeout)")
      .def(
          "submit",
          [](Engine& e, Run& run, const std::shared_ptr<Kernel>& kernel, std::vector<TensorArg> tensors,
             std::vector<int32_t> access, const py::sequence& scalars) {
            e.submit(run, kernel, std::move(tensors), std::move(access), to_scalars(scalars));
          },
          py::arg("run"), py::arg("kernel"), py::arg("tensors"), py::arg("access"), py::arg("scalars") = py::tuple())
      .def_static(
          "prepare_call",
          [](const std::shared_ptr<Kernel>& kernel, std::vector<TensorArg> tensors, std::vector<int32_t> access,
             const py::sequence& scalars) {
            return std::make_shared<PreparedCall>(
                Engine::prepare_call(kernel, std::move(tensors), std::move(access), to_scalars(scalars)));
          },
          py::arg("kernel"), py::arg("tensors"), py::arg("access"), py::arg("scalars") = py::tuple(),
          "The call checked and converted once, for submit_prepared")
      .def("submit_prepared", &Engine::submit_prepared, py::arg("run"), py::arg("call"))
      .def(
          "replay",
          [](Engine& e, Run& run, const std::shared_ptr<ReplayPlan>& plan, const py::sequence& patches,
             const std::vector<std::tuple<uint32_t, uintptr_t>>& copy_backs) {
            const std::vector<ScalarPatch> p = to_patches(patches);
            const std::vector<ReplayCopyBack> c = to_copy_backs(copy_backs);
            py::gil_scoped_release nogil;
            e.replay(run, plan, p, c);
          },
          py::arg("run"), py::arg("plan"), py::arg("patches") = py::tuple(), py::arg("copy_backs") = py::tuple(),
          "Enters the tasks of a plan's recording into the run, at the plan's bases; patches: (task index, "
          "scalars) for tasks whose scalars differ from the recording's; copy_backs: (private base, its slot "
          "buffer's address) per output to copy back after the tasks that write it")
      .def(
          "launch_replay",
          [](Engine& e, Run& run, const py::sequence& staged, const std::shared_ptr<ReplayPlan>& plan,
             const py::sequence& patches, const std::vector<std::tuple<uint32_t, uintptr_t>>& copy_backs,
             const py::object& log, int64_t dispatch_ns, int64_t launch_ns) {
            std::vector<StagedArg> s;
            s.reserve(staged.size());
            for (const auto& item : staged) {
              auto t = item.cast<py::tuple>();
              if (t.size() != 4) {
                throw InvalidArgument("launch_replay: a staged argument is (device_base, size, host, copy_in)");
              }
              const size_t n = to_size(t[1].cast<int64_t>(), "size");
              HostBuffer host(t[2], true, "staged host array");  // borrowed: the caller keeps it alive
              if (host.size() < n) {
                throw InvalidArgument("launch_replay: a staged host array is smaller than its region");
              }
              s.push_back(StagedArg{t[0].cast<uintptr_t>(), n, host.data(), t[3].cast<bool>()});
            }
            const std::vector<ScalarPatch> p = to_patches(patches);
            const std::vector<ReplayCopyBack> c = to_copy_backs(copy_backs);
            std::shared_ptr<RunObserver> observer = to_observer(log);
            py::gil_scoped_release nogil;
            e.launch_replay(run, s, plan, p, c, std::move(observer), dispatch_ns, launch_ns);
          },
          py::arg("run"), py::arg("staged"), py::arg("plan"), py::arg("patches"), py::arg("copy_backs"),
          py::arg("log"), py::arg("dispatch_ns") = 0, py::arg("launch_ns") = 0,
          "A replayed run's launch in one call: staged (device_base, size, host array, copy_in) arguments mapped "
          "into the run's accessor (copied in where copy_in), the plan replayed as replay() does, the run sealed "
          "as seal_logged() does. The caller keeps the host arrays alive until the run completes")
      .def("submit_copy_back", &Engine::submit_copy_back, py::arg("run"), py::arg("arg"), py::arg("device_base"))
      .def("seal", &Engine::seal, py::arg("run"))
      .def(
          "seal_logged",
          [](Engine& e, Run& run, const py::object& log, int64_t dispatch_ns, int64_t launch_ns) {
            e.seal_observed(run, to_observer(log), dispatch_ns, launch_ns);
          },
          py::arg("run"), py::arg("log"), py::arg("dispatch_ns"), py::arg("launch_ns") = 0,
          "seal(); the run records its timings in log (a RunLog, or None for none) when it completes")
      .def("quiesce", &Engine::quiesce, py::arg("alloc_id"), py::call_guard<py::gil_scoped_release>())
      .def("forget_allocation", &Engine::forget_allocation, py::arg("alloc_id"))
      .def("close", &Engine::close, py::arg("cancel_pending") = false, py::call_guard<py::gil_scoped_release>())
      .def("drain_completed", [](Engine& e) { return e.notifier().drain(); })
      .def(
          "wait_completed",
          [](Engine& e, std::optional<double> timeout) { return e.notifier().wait(timeout ? *timeout : -1.0); },
          py::arg("timeout") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("add_observer", &Engine::add_observer, py::arg("observer"),
           "Attaches a task observer (a TraceRecorder): told about every task executed from now on. "
           "False when attached already")
      .def("remove_observer", &Engine::remove_observer, py::arg("observer"),
           "Detaches a task observer: no task completing after this returns reaches it. False when not attached")
      .def("stats", [](const Engine& e) {
        EngineStats s = e.stats();
        py::dict d;
        d["tasks_submitted"] = s.tasks_submitted;
        d["tasks_executed"] = s.tasks_executed;
        d["tasks_skipped"] = s.tasks_skipped;
        d["runs_started"] = s.runs_started;
        d["runs_completed"] = s.runs_completed;
        d["runs_live"] = s.runs_live;
        d["tracker_records"] = s.tracker_records;
        d["tracker_allocations"] = s.tracker_allocations;
        d["queued"] = s.queued;
        d["workers"] = s.workers;
        d["notifier_writes"] = s.notifier_writes;
        d["notifier_write_ns"] = s.notifier_write_ns;
        d["worker_wakeups"] = s.worker_wakeups;
        return d;
      });
}

}  // namespace tandem::bindings
