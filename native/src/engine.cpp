#include "tandem/engine.hpp"

#include "tandem/capture.hpp"

#include <poll.h>

#include <algorithm>
#include <iterator>
#include <string_view>
#include <thread>

#include "tandem/errors.hpp"

namespace tandem {

namespace {
constexpr uint64_t kCompactEvery = 1u << 14;  // full tracker sweep period, in submissions

// Every core computes: the host thread needs little of one (it waits most of the time, and a
// thread waiting for a run runs its tasks meanwhile), so a core kept for it mostly idled.
int default_workers() {
  const unsigned cores = std::thread::hardware_concurrency();
  return cores > 0 ? static_cast<int>(cores) : 1;
}

uint64_t byte_extent_check(const TensorArg& a) {
  if (a.end < a.begin) throw InvalidArgument("tensor argument has a negative byte range");
  return a.end - a.begin;
}
}  // namespace

Engine::Engine(std::shared_ptr<Device> device, int workers, int spin_us, bool caller_runs)
    : device_(std::move(device)), epoch_(std::chrono::steady_clock::now()), caller_runs_(caller_runs) {
  if (!device_) throw InvalidArgument("an engine needs a device");
  if (spin_us < 0) throw InvalidArgument("spin_us must be >= 0");
  register_builtin_kernels(registry_);
  const int executors = workers > 0 ? workers : default_workers();
  pool_ = std::make_unique<WorkerPool>(caller_runs ? executors - 1 : executors, *this,
                                       std::chrono::microseconds(spin_us));
}

Engine::~Engine() { close(true); }

int64_t Engine::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - epoch_).count();
}

std::shared_ptr<Run> Engine::begin_run(bool notify) {
  std::lock_guard<std::mutex> lock(live_mu_);
  if (closed() || !admitting_) throw ClosedError("the engine is closed");
  auto run = std::make_shared<Run>(this, next_run_id_++, notify, now_ns());
  live_.emplace(run->id(), run);
  ++unfinished_;
  runs_started_.fetch_add(1, std::memory_order_relaxed);
  return run;
}

std::shared_ptr<Run> Engine::begin_run_leased(bool notify, const std::shared_ptr<SlotTable>& slots) {
  if (!slots) throw InvalidArgument("begin_run_leased needs a slot table");
  std::optional<SlotLease> lease = slots->try_lease();
  if (!lease) return nullptr;
  std::shared_ptr<Run> run;
  try {
    run = begin_run(notify);
  } catch (...) {
    slots->try_release(*lease);  // ours since try_lease: not stale
    throw;
  }
  run->hold_slot(slots, *lease);
  return run;
}

void Engine::stop_admitting() {
  std::lock_guard<std::mutex> lock(live_mu_);
  admitting_ = false;
}

bool Engine::wait_idle(double timeout_s) {
  std::unique_lock<std::mutex> lock(live_mu_);
  auto idle = [this] { return unfinished_ == 0; };
  if (timeout_s < 0) {
    live_cv_.wait(lock, idle);
    return true;
  }
  return live_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), idle);
}

PreparedCall Engine::prepare_call(KernelPtr kernel, std::vector<TensorArg> tensors, std::vector<int32_t> access,
                                  std::vector<td_scalar> scalars) {
  if (!kernel) throw InvalidArgument("submit: null kernel");
  if (access.size() != tensors.size()) {
    throw InvalidArgument("submit: " + std::to_string(tensors.size()) + " tensors but " +
                          std::to_string(access.size()) + " access tags");
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int32_t mode = access[i];
    if (mode != TD_READ && mode != TD_WRITE && mode != TD_READWRITE) {
      throw InvalidArgument("submit: access tag " + std::to_string(mode) + " is not read, write or read-write");
    }
    byte_extent_check(tensors[i]);
  }
  return PreparedCall{std::move(kernel), std::move(tensors), std::move(access), std::move(scalars)};
}

void Engine::submit(Run& run, KernelPtr kernel, std::vector<TensorArg> tensors, std::vector<int32_t> access,
                    std::vector<td_scalar> scalars) {
  submit_prepared(run, prepare_call(std::move(kernel), std::move(tensors), std::move(access), std::move(scalars)));
}

void Engine::submit_prepared(Run& run, const PreparedCall& call) {
  const std::vector<TensorArg>& tensors = call.tensors;
  const std::vector<int32_t>& access = call.access;
  auto task = std::make_unique<Task>();
  task->tensors.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    td_tensor v = tensors[i].view;
    v.access = access[i];
    task->tensors.push_back(v);
  }
  task->scalars = call.scalars;
  task->kernel = call.kernel;
  task->own_arguments();
  task->run = &run;
  task->run_id = run.id();

  Task* t = task.release();
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (closed() || run.sealed()) {
      delete t;
      if (closed()) throw ClosedError("the engine is closed");
      throw InvalidArgument("run " + std::to_string(run.id()) + " is sealed: no more tasks");
    }
    t->index = run.n_tasks_++;
    run.outstanding_.fetch_add(1, std::memory_order_relaxed);
    for (size_t i = 0; i < tensors.size(); ++i) {
      const TensorArg& a = tensors[i];
      if (a.alloc_id != 0 && a.end > a.begin) {
        tracker_.access(t, a.alloc_id, span_of(a), access[i]);
      }
    }
    if (++submits_since_compact_ >= kCompactEvery) {
      submits_since_compact_ = 0;
      tracker_.compact();
    }
  }
  tasks_submitted_.fetch_add(1, std::memory_order_relaxed);
  if (t->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) pool_->push(t);
}

void Engine::replay(Run& run, const std::shared_ptr<const ReplayPlan>& plan, const std::vector<ScalarPatch>& patches,
                    const std::vector<ReplayCopyBack>& copy_backs) {
  if (!plan) throw InvalidArgument("replay: no plan");
  const Recording& rec = plan->recording();
  const std::vector<ReplayPlan::Entry>& entries = plan->entries();
  size_t n_patched = 0;
  for (const ScalarPatch& p : patches) {
    if (p.task >= entries.size() || p.scalars.size() != static_cast<size_t>(entries[p.task].n_scalars)) {
      throw InvalidArgument("replay: a scalar patch does not fit task " + std::to_string(p.task));
    }
    n_patched += p.scalars.size();
  }
  for (const ReplayCopyBack& c : copy_backs) {
    if (!rec.is_private(c.base)) throw InvalidArgument("replay: a copy back must read a private base");
  }
  // The tasks live in one block, built and linked to the earlier ones they follow through private
  // bases before any enters the graph: a failure leaves the run untouched, and no task can start
  // before its submission guard is dropped at the end. Their views are the plan's (the block keeps
  // it); only patched scalars are copied.
  const size_t n = entries.size() + copy_backs.size();
  auto block = std::make_unique<TaskBlock>(n, 0, n_patched, plan);
  for (size_t i = 0; i < entries.size(); ++i) {
    const ReplayPlan::Entry& e = entries[i];
    Task* t = block->task(i);
    t->fn = e.fn;
    t->tensor_data = plan->views(e);
    t->n_tensors = e.n_views;
    t->scalar_data = plan->scalars(e);
    t->n_scalars = e.n_scalars;
    t->run = &run;
    t->run_id = run.id();
    // Its dependencies through private memory, fixed: counted now, released by task_complete.
    t->pending.store(1 + e.n_deps, std::memory_order_relaxed);
    t->block_dependents = e.dependents;
    t->n_block_dependents = e.n_dependents;
  }
  size_t scalar_at = 0;
  for (const ScalarPatch& p : patches) {
    td_scalar* sc = block->scalars(scalar_at);
    std::copy(p.scalars.begin(), p.scalars.end(), sc);
    block->task(p.task)->scalar_data = sc;
    scalar_at += p.scalars.size();
  }
  for (size_t k = 0; k < copy_backs.size(); ++k) {
    Task* t = block->task(entries.size() + k);
    t->op = Task::Op::CopyBack;
    t->copy_base = copy_backs[k].device_base;
    t->run = &run;
    t->run_id = run.id();
    for (uint32_t dep : rec.writers(copy_backs[k].base)) task_add_dependency(block->task(dep), t);
  }
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (closed()) throw ClosedError("the engine is closed");
    if (run.sealed()) throw InvalidArgument("run " + std::to_string(run.id()) + " is sealed: no more tasks");
    const uint32_t first = run.n_tasks_;
    for (size_t i = 0; i < n; ++i) block->task(i)->index = first + static_cast<uint32_t>(i);
    run.n_tasks_ += static_cast<uint32_t>(n);
    run.outstanding_.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
    // Shared memory: ordered against other runs.
    for (const ReplayPlan::SharedAccess& a : plan->shared()) {
      tracker_.access(block->task(a.task), a.alloc_id, a.span, a.mode);
    }
    submits_since_compact_ += plan->shared().size();
    if (submits_since_compact_ >= kCompactEvery) {
      submits_since_compact_ = 0;
      tracker_.compact();
    }
  }
  tasks_submitted_.fetch_add(n, std::memory_order_relaxed);
  // The graph owns the tasks now (the last one released frees the block); each starts once its
  // guard and its dependencies are gone.
  TaskBlock* owned = block.release();
  std::vector<Task*> ready;
  ready.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    Task* t = owned->task(i);
    if (t->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) ready.push_back(t);
  }
  if (!ready.empty()) pool_->push(ready);
}

void Engine::launch_replay(Run& run, const std::vector<StagedArg>& staged,
                           const std::shared_ptr<const ReplayPlan>& plan, const std::vector<ScalarPatch>& patches,
                           const std::vector<ReplayCopyBack>& copy_backs, std::shared_ptr<RunObserver> observer,
                           int64_t dispatch_ns, int64_t launch_ns) {
  if (!staged.empty()) {
    HostAccessor* acc = run.accessor_.get();
    if (acc == nullptr) throw InvalidArgument("launch_replay: host arguments for a run without an accessor");
    for (const StagedArg& s : staged) {
      acc->add(s.device_base, s.size, s.host);
      if (s.copy_in) acc->stage_in(s.device_base);
    }
  }
  replay(run, plan, patches, copy_backs);
  seal_observed(run, std::move(observer), dispatch_ns, launch_ns);
}

void Engine::submit_copy_back(Run& run, const TensorArg& arg, uintptr_t device_base) {
  auto task = std::make_unique<Task>();
  task->op = Task::Op::CopyBack;
  task->copy_base = device_base;
  task->run = &run;
  task->run_id = run.id();
  Task* t = task.release();
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (closed() || run.sealed()) {
      delete t;
      if (closed()) throw ClosedError("the engine is closed");
      throw InvalidArgument("run " + std::to_string(run.id()) + " is sealed: no more tasks");
    }
    t->index = run.n_tasks_++;
    run.outstanding_.fetch_add(1, std::memory_order_relaxed);
    if (arg.alloc_id != 0 && arg.end > arg.begin) {
      tracker_.access(t, arg.alloc_id, span_of(arg), TD_READ);
    }
  }
  tasks_submitted_.fetch_add(1, std::memory_order_relaxed);
  if (t->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) pool_->push(t);
}

void Engine::seal(Run& run) { seal_observed(run, nullptr, 0, 0); }

void Engine::seal_observed(Run& run, std::shared_ptr<RunObserver> observer, int64_t dispatch_ns,
                           int64_t launch_ns) {
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    if (run.sealed()) return;  // a run sealed already (by close, say) keeps what it had
    if (observer) {
      observer->on_run_sealed();
      run.observer_ = std::move(observer);
      run.dispatch_ns_ = dispatch_ns;
      run.launch_ns_ = launch_ns;
    }
    run.sealed_.store(true, std::memory_order_release);
    std::lock_guard<std::mutex> rlock(run.mu_);
    run.sealed_ns_ = now_ns();
  }
  if (run.outstanding_.fetch_sub(1, std::memory_order_acq_rel) == 1) finish_run(run);
}

void Engine::enqueue_ready(std::vector<Task*>& ready) {
  pool_->push(ready);
  ready.clear();
}

Task* Engine::run_task(Task* t, int worker) {
  Run& run = *t->run;
  const bool skip = run.cancelled() || run.failed();
  if (skip) {
    tasks_skipped_.fetch_add(1, std::memory_order_relaxed);
  } else {
    const int64_t t0 = now_ns();
    int rc = 0;
    std::string err;
    if (t->op == Task::Op::Kernel) {
      td_args args{};
      args.tensors = t->tensor_data;
      args.n_tensors = t->n_tensors;
      args.scalars = t->scalar_data;
      args.n_scalars = t->n_scalars;
      args.worker = worker;
      try {
        rc = invoke_kernel(*t->fn, args, err);
      } catch (const std::exception& e) {
        rc = 1;
        err = e.what();
      }
    } else {
      try {
        if (!run.accessor_) throw InvalidArgument("copy-back without an attached accessor");
        run.accessor_->copy_back(t->copy_base);
      } catch (const std::exception& e) {
        rc = 1;
        err = e.what();
      }
    }
    const int64_t t1 = now_ns();
    run.busy_ns_.fetch_add(t1 - t0, std::memory_order_relaxed);
    // Only the run's first task sets it: the others read it set and skip the locked exchange.
    if (run.first_start_ns_.load(std::memory_order_relaxed) < 0) {
      int64_t expected = -1;
      run.first_start_ns_.compare_exchange_strong(expected, t0, std::memory_order_relaxed);
    }
    int64_t last = run.last_end_ns_.load(std::memory_order_relaxed);
    while (last < t1 && !run.last_end_ns_.compare_exchange_weak(last, t1, std::memory_order_relaxed)) {
    }
    tasks_executed_.fetch_add(1, std::memory_order_relaxed);
    const std::string_view kname =
        t->op == Task::Op::Kernel ? std::string_view(t->fn->name) : std::string_view("copy_back");
    if (rc != 0) run.record_failure(t->index, kname, err);
    // Nobody observing costs this one load; the event is built only for observers.
    if (observed_.load(std::memory_order_relaxed)) {
      notify_observers(TaskEvent{run.id(), t->index, worker, t0, t1, kname, rc == 0});
    }
  }

  ReadyTasks ready;
  task_complete(t, ready);
  Task* next = nullptr;
  if (!ready.empty()) {
    next = ready.data()[0];
    if (ready.size() > 1) pool_->push(ready.data() + 1, ready.size() - 1);
  }
  const bool run_done = run.outstanding_.fetch_sub(1, std::memory_order_acq_rel) == 1;
  task_unref(t);
  if (run_done) finish_run(run);
  return next;
}

void Engine::finish_run(Run& run) {
  // Leave the live table before waiters wake, so whoever sees the run done
  // also sees it gone from stats(); `keep` holds the run until we return.
  std::shared_ptr<Run> keep;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    auto it = live_.find(run.id());
    if (it != live_.end()) {
      keep = std::move(it->second);
      live_.erase(it);
    }
  }
  runs_completed_.fetch_add(1, std::memory_order_relaxed);
  run.finish(now_ns(), run.notify() ? &notifier_ : nullptr);
  // While unfinished_ still counts this run, so close() cannot stop the pool under us.
  pool_->wake_helpers();
  std::lock_guard<std::mutex> lock(live_mu_);
  --unfinished_;
  live_cv_.notify_all();  // under the lock: a closer woken by it may destroy the engine right after
}

bool Engine::Helping::enter(const Run* run) {
  // A run not done here finishes (under this lock) after we count ourselves
  // in, so close() waits for us to leave before it stops the pool.
  std::lock_guard<std::mutex> lock(engine_.live_mu_);
  if ((run != nullptr && run->done()) || engine_.closed_.load(std::memory_order_acquire)) return false;
  ++engine_.helpers_;
  entered_ = true;
  return true;
}

Engine::Helping::~Helping() {
  if (!entered_) return;
  std::lock_guard<std::mutex> lock(engine_.live_mu_);
  --engine_.helpers_;
  engine_.live_cv_.notify_all();  // under the lock, as in finish_run
}

void Engine::help(Run& run, std::chrono::steady_clock::time_point deadline) {
  Helping helping(*this);
  if (!helping.enter(&run)) return;
  // On a caller_runs engine the run may wait for another run's queued tasks that no pool thread will take.
  const Run* own = caller_runs_ ? nullptr : &run;
  pool_->help_until([&run] { return run.announced(); },
                    [own](const Task* t) { return own == nullptr || t->run == own; }, deadline, -1);
}

size_t Engine::run_queued(const std::function<bool()>& interrupt) {
  Helping helping(*this);
  if (!helping.enter(nullptr)) return 0;
  return pool_->run_queued(interrupt, -1);
}

size_t Engine::run_queued_until_readable(int stop_fd) {
  if (stop_fd < 0) return run_queued([] { return false; });
  using Clock = std::chrono::steady_clock;
  constexpr auto kEvery = std::chrono::microseconds(20);  // a poll() is a syscall: not between every small task
  Clock::time_point next = Clock::now() + kEvery;
  return run_queued([&] {
    const Clock::time_point now = Clock::now();
    if (now < next) return false;
    next = now + kEvery;
    pollfd p{stop_fd, POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  });
}

std::shared_ptr<Run> Engine::find_live(uint64_t id) {
  std::lock_guard<std::mutex> lock(live_mu_);
  auto it = live_.find(id);
  return it == live_.end() ? nullptr : it->second;
}

void Engine::quiesce(uint64_t alloc_id) {
  std::vector<uint64_t> ids;
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    ids = tracker_.busy_runs(alloc_id);
  }
  for (uint64_t id : ids) {
    if (auto run = find_live(id)) run->wait(-1);
  }
}

void Engine::forget_allocation(uint64_t alloc_id) {
  std::lock_guard<std::mutex> lock(submit_mu_);
  tracker_.forget(alloc_id);
}

void Engine::close(bool cancel_pending) {
  std::lock_guard<std::mutex> close_lock(close_mu_);
  {
    // Under both locks, so no submit or begin_run slips in after the flag.
    std::lock_guard<std::mutex> slock(submit_mu_);
    std::lock_guard<std::mutex> llock(live_mu_);
    closed_.store(true, std::memory_order_release);
  }
  std::vector<std::shared_ptr<Run>> runs;
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    for (auto& kv : live_) runs.push_back(kv.second);
  }
  for (auto& run : runs) {
    if (cancel_pending) run->cancel();
    seal(*run);  // an orchestration cut short by close still completes
  }
  runs.clear();
  const auto drained = [this] { return unfinished_ == 0 && helpers_ == 0; };
  if (caller_runs_) {
    // What is queued runs here (cancelled runs skip their tasks): no pool thread may be left to take it.
    const auto never = [] { return false; };
    for (;;) {
      pool_->run_queued(never, -1);
      std::unique_lock<std::mutex> lock(live_mu_);
      if (live_cv_.wait_for(lock, std::chrono::milliseconds(1), drained)) break;
    }
  } else {
    std::unique_lock<std::mutex> lock(live_mu_);
    live_cv_.wait(lock, drained);
  }
  if (pool_) pool_->stop();
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    tracker_.compact();
  }
}

void Engine::notify_observers(const TaskEvent& event) const {
  // The list read here stays valid (and its observers alive) while we call
  // them, whatever add/remove do meanwhile. Null or empty: removed since the
  // flag was read.
  const std::shared_ptr<const TaskObservers> observers = std::atomic_load(&observers_);
  if (!observers) return;
  for (const auto& observer : *observers) observer->on_task(event);
}

bool Engine::add_observer(std::shared_ptr<TaskObserver> observer) {
  if (!observer) throw InvalidArgument("add_observer: null observer");
  std::shared_ptr<const TaskObservers> old;  // released after the lock
  std::lock_guard<std::mutex> lock(observers_mu_);
  old = std::atomic_load(&observers_);
  if (old && std::find(old->begin(), old->end(), observer) != old->end()) return false;
  auto next = old ? std::make_shared<TaskObservers>(*old) : std::make_shared<TaskObservers>();
  next->push_back(std::move(observer));
  std::atomic_store(&observers_, std::shared_ptr<const TaskObservers>(std::move(next)));
  observed_.store(true, std::memory_order_release);
  return true;
}

bool Engine::remove_observer(const std::shared_ptr<TaskObserver>& observer) {
  std::shared_ptr<const TaskObservers> old;  // released after the lock
  std::lock_guard<std::mutex> lock(observers_mu_);
  old = std::atomic_load(&observers_);
  if (!old) return false;
  auto it = std::find(old->begin(), old->end(), observer);
  if (it == old->end()) return false;
  std::shared_ptr<const TaskObservers> next;  // null when none is left
  if (old->size() > 1) {
    auto rest = std::make_shared<TaskObservers>(old->begin(), it);
    rest->insert(rest->end(), std::next(it), old->end());
    next = std::move(rest);
  }
  observed_.store(next != nullptr, std::memory_order_release);
  std::atomic_store(&observers_, std::move(next));
  return true;
}

EngineStats Engine::stats() const {
  EngineStats s;
  s.tasks_submitted = tasks_submitted_.load();
  s.tasks_executed = tasks_executed_.load();
  s.tasks_skipped = tasks_skipped_.load();
  s.runs_started = runs_started_.load();
  s.runs_completed = runs_completed_.load();
  {
    std::lock_guard<std::mutex> lock(live_mu_);
    s.runs_live = live_.size();
  }
  {
    std::lock_guard<std::mutex> lock(submit_mu_);
    s.tracker_records = tracker_.record_count();
    s.tracker_allocations = tracker_.allocation_count();
  }
  s.queued = pool_ ? pool_->queued() : 0;
  s.workers = pool_ ? pool_->size() : 0;
  s.notifier_writes = notifier_.writes();
  s.notifier_write_ns = notifier_.write_ns();
  s.worker_wakeups = pool_ ? pool_->wakeups() : 0;
  return s;
}

}  // namespace tandem
