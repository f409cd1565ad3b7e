// The engine: one per runtime. It owns the device handle, the kernel registry,
// the dependency tracker, the worker pool and the completion notifier. Nothing
// here is process-global: two engines in one process share nothing.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tandem/device.hpp"
#include "tandem/kernel.hpp"
#include "tandem/notifier.hpp"
#include "tandem/observer.hpp"
#include "tandem/task_graph.hpp"
#include "tandem/worker_pool.hpp"

namespace tandem {

class Recording;
class ReplayPlan;
struct ReplayBase;
struct ScalarPatch;
struct ReplayCopyBack;

// One host argument of a launch_replay: the slot region [device_base, device_base + size)
// mapped to the caller's array (borrowed: the caller keeps it alive until the run
// completes), copied in first when the run reads it.
struct StagedArg {
  uintptr_t device_base = 0;
  size_t size = 0;
  void* host = nullptr;
  bool copy_in = false;
};

struct EngineStats {
  uint64_t tasks_submitted = 0;
  uint64_t tasks_executed = 0;
  uint64_t tasks_skipped = 0;
  uint64_t runs_started = 0;
  uint64_t runs_completed = 0;
  size_t runs_live = 0;
  size_t tracker_records = 0;
  size_t tracker_allocations = 0;
  size_t queued = 0;
  int workers = 0;
  uint64_t notifier_writes = 0;    // wake-ups of the notifier's fd (one per batch of completions)
  uint64_t notifier_write_ns = 0;  // time the completing threads spent in those writes
  uint64_t worker_wakeups = 0;     // sleeping pool workers woken for queued tasks
};

// A kernel call checked and converted once, then submitted any number of
// times (the Python layer keeps the calls that orchestration repeats run
// after run). Made by Engine::prepare_call, which validates it.
struct PreparedCall {
  KernelPtr kernel;
  std::vector<TensorArg> tensors;
  std::vector<int32_t> access;
  std::vector<td_scalar> scalars;
};

class Engine final : public TaskRunner {
 public:
  // workers <= 0: one per core. spin_us: how long idle workers poll for
  // work before sleeping (lower it when other processes share the cores).
  // caller_runs: the thread that drives the engine is one of its `workers`:
  // the pool starts workers - 1 threads, and the driver runs queued tasks
  // itself (run_queued) when it has nothing else to do; a waiter (Run::wait,
  // quiesce) and close() then run any run's queued tasks, as nobody else may.
  static constexpr int kDefaultSpinUs = 200;
  Engine(std::shared_ptr<Device> device, int workers, int spin_us = kDefaultSpinUs, bool caller_runs = false);
  ~Engine() override;  // close(true)
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::shared_ptr<Device>& device() const { return device_; }
  KernelRegistry& registry() { return registry_; }
  Notifier& notifier() { return notifier_; }
  int workers() const { return pool_->size() + (caller_runs_ ? 1 : 0); }
  bool caller_runs() const { return caller_runs_; }
  size_t queued_tasks() const { return pool_->queued(); }
  int64_t now_ns() const;

  // Runs. notify: push the run's id to the notifier when it completes.
  // Throws ClosedError once close() or stop_admitting() was called.
  std::shared_ptr<Run> begin_run(bool notify);
  // A run holding a free slot of `slots` (with the slot's accessor attached),
  // or null when every slot is leased. The run releases the slot when it
  // completes, before it turns done.
  std::shared_ptr<Run> begin_run_leased(bool notify, const std::shared_ptr<SlotTable>& slots);
  // From now on begin_run throws ClosedError; runs already begun go on.
  void stop_admitting();
  // Blocks until no run is live (every begun run sealed and completed), or
  // the timeout passes (false; timeout < 0: forever).
  bool wait_idle(double timeout_s);
  // The calling thread runs the run's queued tasks until it is announced or
  // `deadline` passes: a waiter helps instead of sleeping, so a run waited for
  // alone pays no cross-core wake-up at its start or end. Only its own run's
  // tasks: a thread waiting for a slot goes back to orchestrating as soon as
  // the run it waits for is done. Returns at once for a run done already or a
  // closed engine. Run::wait calls it.
  void help(Run& run, std::chrono::steady_clock::time_point deadline);
  // The driving thread of a caller_runs engine runs queued tasks (of any
  // run) until none is queued or `interrupt()`, asked between tasks (not
  // before the first: a call with work queued runs at least one task), is
  // true. Returns how many ran; 0 on a closed engine.
  size_t run_queued(const std::function<bool()>& interrupt);
  // The same, interrupted once `stop_fd` is readable (a message for the
  // driver; polled at most every 20 us between tasks; -1: never).
  size_t run_queued_until_readable(int stop_fd);
  // Enters a task into the graph; it may start at once. Throws ClosedError
  // after close(), InvalidArgument for a sealed run or bad arguments.
  void submit(Run& run, KernelPtr kernel, std::vector<TensorArg> tensors, std::vector<int32_t> access,
              std::vector<td_scalar> scalars);
  // The same call, checked once (InvalidArgument as submit) and submitted by submit_prepared.
  static PreparedCall prepare_call(KernelPtr kernel, std::vector<TensorArg> tensors, std::vector<int32_t> access,
                                   std::vector<td_scalar> scalars);
  void submit_prepared(Run& run, const PreparedCall& call);
  // Enters every task of a recording into the run, in order, as `plan`
  // materialized it against its bases, with the scalars of the patched tasks
  // replaced, then the copy backs of its outputs: the work of one
  // orchestration in one call. Accesses to private bases are linked by the
  // dependencies the recording computed; accesses to shared ones go through
  // the tracker, under one lock. Throws InvalidArgument (before entering
  // anything) for mismatched patches or copy backs, and as submit for a
  // closed engine or a sealed run.
  void replay(Run& run, const std::shared_ptr<const ReplayPlan>& plan, const std::vector<ScalarPatch>& patches,
              const std::vector<ReplayCopyBack>& copy_backs);
  // The whole launch of a replayed run, in one call: maps each staged argument
  // into the run's accessor (copying in those it reads), replays the plan, then
  // seals the run (seal_observed with `observer`, which may be null). On a
  // throw the run is left unsealed, as after a failed replay: the caller cancels
  // and seals it.
  void launch_replay(Run& run, const std::vector<StagedArg>& staged, const std::shared_ptr<const ReplayPlan>& plan,
                     const std::vector<ScalarPatch>& patches, const std::vector<ReplayCopyBack>& copy_backs,
                     std::shared_ptr<RunObserver> observer, int64_t dispatch_ns, int64_t launch_ns);
  // A task that copies a region of the run's accessor back to its host view,
  // ordered after every earlier writer of `arg`'s bytes.
  void submit_copy_back(Run& run, const TensorArg& arg, uintptr_t device_base);
  // No more tasks for this run; it completes when its last task does.
  void seal(Run& run);
  // seal(), and the run reports to `observer` (if any): on_run_sealed now,
  // on_run_done with its timings when it completes. dispatch_ns: when the
  // caller asked for it; launch_ns: when its orchestration started (0: when it
  // began). A run sealed already keeps what it had (observer not told).
  void seal_observed(Run& run, std::shared_ptr<RunObserver> observer, int64_t dispatch_ns, int64_t launch_ns);

  // Task observers. An attached observer is told (TaskObserver::on_task)
  // about the tasks executed after add_observer returns: surely every task
  // submitted after it returns; one already queued or running may or may not
  // be reported. Both calls are safe while tasks run, from any thread, and
  // workers never wait for them.
  //
  // Removal is not a barrier: a worker that took the list of observers before
  // remove_observer replaced it may still be calling the removed observer, or
  // be about to, when remove_observer returns (for a task that completed
  // during the call); that worker's copy of the list keeps the observer alive
  // until its call returns. No task completing after remove_observer returns
  // reaches it, and once close() returns no observer is called at all.
  //
  // add_observer: false (and nothing changes) when it is attached already;
  // InvalidArgument for null. remove_observer: false when it was not attached.
  bool add_observer(std::shared_ptr<TaskObserver> observer);
  bool remove_observer(const std::shared_ptr<TaskObserver>& observer);

  // Waits until no unfinished task touches the allocation (before freeing it).
  void quiesce(uint64_t alloc_id);
  void forget_allocation(uint64_t alloc_id);

  // Drains runs in flight (cancelling them first when cancel_pending), then
  // stops the pool. Idempotent and safe from several threads.
  void close(bool cancel_pending);
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  EngineStats stats() const;

  Task* run_task(Task* t, int worker) override;

 private:
  // A thread running tasks outside the pool (help, run_queued) for as long as it lives: counted in
  // helpers_ once enter() succeeds, so close() waits for it to leave.
  class Helping {
   public:
    explicit Helping(Engine& engine) : engine_(engine) {}
    ~Helping();
    Helping(const Helping&) = delete;
    Helping& operator=(const Helping&) = delete;
    // False (not counted) on a closed engine, or when `run` is given and done already.
    bool enter(const Run* run);

   private:
    Engine& engine_;
    bool entered_ = false;
  };
  friend class Run;
  void finish_run(Run& run);
  void enqueue_ready(std::vector<Task*>& ready);
  void notify_observers(const TaskEvent& event) const;
  std::shared_ptr<Run> find_live(uint64_t id);

  std::shared_ptr<Device> device_;
  KernelRegistry registry_;
  Notifier notifier_;
  const std::chrono::steady_clock::time_point epoch_;

  mutable std::mutex submit_mu_;  // guards tracker_ and run task counts
  DependencyTracker tracker_;
  uint64_t submits_since_compact_ = 0;

  mutable std::mutex live_mu_;
  std::condition_variable live_cv_;
  std::unordered_map<uint64_t, std::shared_ptr<Run>> live_;
  size_t unfinished_ = 0;  // runs begun and not through Run::finish: live_ plus those finishing
  const bool caller_runs_;
  size_t helpers_ = 0;     // threads inside help() or run_queued(): close() waits for them to leave
  uint64_t next_run_id_ = 1;

  std::atomic<bool> closed_{false};
  bool admitting_ = true;  // guarded by live_mu_
  std::mutex close_mu_;
  std::atomic<uint64_t> tasks_submitted_{0}, tasks_executed_{0}, tasks_skipped_{0};
  std::atomic<uint64_t> runs_started_{0}, runs_completed_{0};

  // Task observers: an immutable list, replaced whole (under observers_mu_,
  // which only add/remove take) and read by workers with std::atomic_load,
  // only when observed_ says the list is not empty. A worker holding a list
  // keeps its observers alive.
  using TaskObservers = std::vector<std::shared_ptr<TaskObserver>>;
  std::mutex observers_mu_;
  std::shared_ptr<const TaskObservers> observers_;
  std::atomic<bool> observed_{false};

  std::unique_ptr<WorkerPool> pool_;  // last: its threads stop before the rest goes
};

}  // namespace tandem
