// Who watches, apart from what runs (as Taskflow's executor observers).
//
// The engine executes tasks and completes runs; observers are told about it
// and decide what to keep. Two kinds:
//
// - TaskObserver: attached to an engine (Engine::add_observer), told about
//   every task a worker executes from then on. Tracing is one
//   (trace_recorder.hpp).
// - RunObserver: handed to one run when it is sealed
//   (Engine::seal_observed), told when that run is sealed and when it is done.
//   The scheduler's statistics are one (RunLog, run_log.hpp).
//
// Observers are plain C++ objects shared through std::shared_ptr: the engine
// or the run keeps an observer alive for as long as it may still call it.
#pragma once

#include <cstdint>
#include <string_view>

namespace tandem {

// One executed task, as its worker reports it. Tasks skipped because their
// run was cancelled or had failed are not reported.
struct TaskEvent {
  uint64_t run_id = 0;
  uint32_t task_index = 0;  // position within its run
  int32_t worker = 0;       // index of the worker that ran it
  int64_t start_ns = 0;     // engine clock (Engine::now_ns)
  int64_t end_ns = 0;
  // The kernel's name ("copy_back" for a copy-back task). Valid only during
  // the call: an observer that keeps it copies it.
  std::string_view kernel;
  bool ok = true;  // false: the task failed (its run fails)
};

class TaskObserver {
 public:
  virtual ~TaskObserver() = default;
  // Called on the worker thread that executed the task, right after it ran
  // and before its dependents are released, from several workers at once:
  // thread-safe, short, and it must not block on anything a task may hold
  // (nor take the GIL: a host task may hold it). The engine calls it
  // concurrently with add/remove of observers; see Engine::remove_observer.
  virtual void on_task(const TaskEvent& event) noexcept = 0;

 protected:
  TaskObserver() = default;
  TaskObserver(const TaskObserver&) = default;
  TaskObserver& operator=(const TaskObserver&) = default;
};

enum class RunKind : int32_t { Completed = 0, Failed = 1, Cancelled = 2 };

// Engine-clock timestamps (ns) of one run; first_start_ns / last_end_ns are -1 when no task ran.
struct RunTiming {
  int64_t dispatch_ns = 0;  // the caller asked for the run
  int64_t admit_ns = 0;     // it got its slot (the run began)
  int64_t launch_ns = 0;    // its orchestration started
  int64_t sealed_ns = 0;    // its orchestration ended
  int64_t first_start_ns = -1, last_end_ns = -1;
  int64_t done_ns = 0;  // it completed
  RunKind kind = RunKind::Completed;
  // Its tasks' execution time, summed (one worker: the time the device was busy with it, without the
  // gaps between its tasks that last_end - first_start includes); -1 where nobody measured it.
  int64_t busy_ns = -1;
};

class RunObserver {
 public:
  virtual ~RunObserver() = default;
  // The run was sealed with this observer: on_run_done follows exactly once.
  // Called on the sealing thread, under the engine's submit lock (so a run
  // sealed twice is reported once): short, and no calls into the engine.
  virtual void on_run_sealed() noexcept = 0;
  // The run completed (its accessor closed, its slot freed), whatever the
  // outcome. Called on the thread that completed it (usually a worker) before
  // the run turns done, so whoever sees the run done sees it reported; under
  // the run's lock: no calls into the run.
  virtual void on_run_done(const RunTiming& timing) noexcept = 0;

 protected:
  RunObserver() = default;
  RunObserver(const RunObserver&) = default;
  RunObserver& operator=(const RunObserver&) = default;
};

}  // namespace tandem
