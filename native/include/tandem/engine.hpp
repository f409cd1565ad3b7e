// The engine: one per runtime. It owns the device handle, the kernel registry,
// the dependency tracker, the worker pool and the completion notifier. Nothing
// here is process-global: two engines in one process share nothing.
#pragma once

#include <atomic>
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
#include "tandem/task_graph.hpp"
#include "tandem/worker_pool.hpp"

namespace tandem {

struct TraceEvent {
  uint64_t run_id;
  uint32_t task_index;
  int32_t worker;
  int64_t start_ns, end_ns;
  std::string name;
  bool ok;
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
  // workers <= 0: max(1, cores - 1). spin_us: how long idle workers poll for
  // work before sleeping (lower it when other processes share the cores).
  static constexpr int kDefaultSpinUs = 200;
  Engine(std::shared_ptr<Device> device, int workers, int spin_us = kDefaultSpinUs);
  ~Engine() override;  // close(true)
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const std::shared_ptr<Device>& device() const { return device_; }
  KernelRegistry& registry() { return registry_; }
  Notifier& notifier() { return notifier_; }
  int workers() const { return pool_->size(); }
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
  // Enters a task into the graph; it may start at once. Throws ClosedError
  // after close(), InvalidArgument for a sealed run or bad arguments.
  void submit(Run& run, KernelPtr kernel, std::vector<TensorArg> tensors, std::vector<int32_t> access,
              std::vector<td_scalar> scalars);
  // The same call, checked once (InvalidArgument as submit) and submitted by submit_prepared.
  static PreparedCall prepare_call(KernelPtr kernel, std::vector<TensorArg> tensors, std::vector<int32_t> access,
                                   std::vector<td_scalar> scalars);
  void submit_prepared(Run& run, const PreparedCall& call);
  // A task that copies a region of the run's accessor back to its host view,
  // ordered after every earlier writer of `arg`'s bytes.
  void submit_copy_back(Run& run, const TensorArg& arg, uintptr_t device_base);
  // No more tasks for this run; it completes when its last task does.
  void seal(Run& run);
  // seal(), and the run records its timings in `log` (if any) when it
  // completes. dispatch_ns: when the caller asked for it; launch_ns: when its
  // orchestration started (0: when it began).
  void seal_logged(Run& run, std::shared_ptr<RunLog> log, int64_t dispatch_ns, int64_t launch_ns);

  // Waits until no unfinished task touches the allocation (before freeing it).
  void quiesce(uint64_t alloc_id);
  void forget_allocation(uint64_t alloc_id);

  // Drains runs in flight (cancelling them first when cancel_pending), then
  // stops the pool. Idempotent and safe from several threads.
  void close(bool cancel_pending);
  bool closed() const { return closed_.load(std::memory_order_acquire); }

  void set_tracing(bool on) { tracing_.store(on, std::memory_order_release); }
  std::vector<TraceEvent> drain_trace();
  EngineStats stats() const;

  Task* run_task(Task* t, int worker) override;

 private:
  friend class Run;
  void finish_run(Run& run);
  void enqueue_ready(std::vector<Task*>& ready);
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
  uint64_t next_run_id_ = 1;

  std::atomic<bool> closed_{false};
  bool admitting_ = true;  // guarded by live_mu_
  std::mutex close_mu_;
  std::atomic<bool> tracing_{false};
  std::atomic<uint64_t> tasks_submitted_{0}, tasks_executed_{0}, tasks_skipped_{0};
  std::atomic<uint64_t> runs_started_{0}, runs_completed_{0};

  std::mutex trace_mu_;
  std::vector<TraceEvent> trace_;

  std::unique_ptr<WorkerPool> pool_;  // last: its threads stop before the rest goes
};

}  // namespace tandem
