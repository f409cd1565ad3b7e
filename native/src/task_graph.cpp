#include "tandem/task_graph.hpp"

#include <algorithm>
#include <thread>

#include "tandem/engine.hpp"
#include "tandem/notifier.hpp"

namespace tandem {

void task_complete(Task* t, ReadyTasks& ready) {
  std::vector<Task*> dependents;
  t->lock.lock();
  t->finished.store(true, std::memory_order_release);
  dependents.swap(t->dependents);
  t->lock.unlock();
  for (Task* d : dependents) {
    if (d->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) ready.push_back(d);
  }
  for (uint32_t i = 0; i < t->n_block_dependents; ++i) {
    Task* d = t->block->task(t->block_dependents[i]);
    if (d->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) ready.push_back(d);
  }
}

// --- Run -------------------------------------------------------------------

Run::Run(Engine* engine, uint64_t id, bool notify, int64_t created_ns)
    : engine_(engine), id_(id), notify_(notify), created_ns_(created_ns) {}

bool Run::cancel() {
  if (done()) return false;
  cancelled_.store(true, std::memory_order_release);
  return true;
}

bool Run::wait(double timeout_s) {
  if (announced()) return true;  // before anything touches the engine, which may be gone by now
  using Clock = std::chrono::steady_clock;
  const bool forever = timeout_s < 0;
  const Clock::time_point deadline =
      forever ? Clock::time_point::max()
              : Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  // Help: the waiter runs this run's queued tasks until it is announced or the deadline passes.
  engine_->help(*this, deadline);
  if (announced()) return true;
  // Not helping (a closed engine, or the run done and about to be announced):
  // poll briefly, as a run finishing within the window is seen without a
  // futex sleep and wake-up (costly under a hypervisor), then sleep.
  const auto until = std::min(deadline, Clock::now() + std::chrono::microseconds(100));
  while (!announced() && Clock::now() < until) {
    for (int i = 0; i < 64 && !announced(); ++i) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    std::this_thread::yield();  // a runnable worker gets the core first
  }
  if (announced()) return true;
  std::unique_lock<std::mutex> lock(mu_);
  auto is_announced = [this] { return announced(); };
  if (forever) {
    cv_.wait(lock, is_announced);
    return true;
  }
  return cv_.wait_until(lock, deadline, is_announced);
}

RunFailure Run::failure() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

RunTimes Run::times() const {
  RunTimes t;
  std::lock_guard<std::mutex> lock(mu_);
  t.created_ns = created_ns_;
  t.sealed_ns = sealed_ns_;
  t.first_start_ns = first_start_ns_.load(std::memory_order_relaxed);
  t.last_end_ns = last_end_ns_.load(std::memory_order_relaxed);
  t.done_ns = done_ns_;
  t.busy_ns = busy_ns_.load(std::memory_order_relaxed);
  return t;
}

void Run::attach_accessor(std::shared_ptr<HostAccessor> accessor) { accessor_ = std::move(accessor); }

void Run::record_failure(uint32_t task_index, std::string_view kernel, const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_.load(std::memory_order_relaxed)) return;  // the first failure is the run's error
  failure_.task_index = static_cast<int32_t>(task_index);
  failure_.kernel = kernel;
  failure_.message = message;
  failed_.store(true, std::memory_order_release);
}

void Run::hold_slot(std::shared_ptr<SlotTable> slots, SlotLease lease) {
  accessor_ = slots->accessor(static_cast<size_t>(lease.index));
  slots_ = std::move(slots);
  lease_ = lease;
}

void Run::finish(int64_t now_ns, Notifier* announce_to) {
  if (accessor_) accessor_->close();
  // Free before done: whoever sees the run done may lease the slot at once.
  // Only this run holds this lease, so it cannot be stale.
  if (slots_) slots_->try_release(lease_);
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ns_ = now_ns;
    if (observer_) {  // before done: whoever sees the run done finds it reported
      RunTiming t;
      t.dispatch_ns = dispatch_ns_;
      t.admit_ns = created_ns_;
      t.launch_ns = launch_ns_ != 0 ? launch_ns_ : created_ns_;
      t.sealed_ns = sealed_ns_;
      t.first_start_ns = first_start_ns_.load(std::memory_order_relaxed);
      t.last_end_ns = last_end_ns_.load(std::memory_order_relaxed);
      t.done_ns = now_ns;
      t.kind = cancelled() ? RunKind::Cancelled : failed() ? RunKind::Failed : RunKind::Completed;
      t.busy_ns = busy_ns_.load(std::memory_order_relaxed);
      observer_->on_run_done(t);
    }
    done_.store(true, std::memory_order_release);
    // The id goes out after done() turns true (a drainer can finish the run at
    // once) and before wait() can return (a waiter then finds it queued).
    if (announce_to != nullptr) announce_to->push(id_);
    announced_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

// --- DependencyTracker -------------------------------------------------------

Span span_of(const td_tensor& v, uint64_t begin, uint64_t end) {
  Span s{begin, end, 0, 0};
  if (v.ndim < 2 || v.strides[v.ndim - 1] != 1) return s;
  const int64_t pitch = v.strides[v.ndim - 2], width = v.shape[v.ndim - 1];
  if (width <= 0 || pitch <= width) return s;  // rows that touch or overlap: the extent is exact enough
  for (int d = 0; d < v.ndim - 2; ++d) {
    // Every other axis must step by whole rows, so each byte's residue is its column's.
    if (v.shape[d] > 1 && (v.strides[d] < 0 || v.strides[d] % pitch != 0)) return s;
  }
  const uint64_t size = td_dtype_size(v.dtype);
  s.pitch = static_cast<uint64_t>(pitch) * size;
  s.width = static_cast<uint64_t>(width) * size;
  return s;
}

bool may_overlap(const Span& a, const Span& b) {
  if (!(a.begin < b.end && b.begin < a.end)) return false;
  if (a.pitch == 0 || a.pitch != b.pitch) return true;
  // The residues: a's window starts at 0 once shifted by a.begin; b's at d, and may wrap past the pitch.
  const uint64_t p = a.pitch;
  const uint64_t d = (b.begin % p + p - a.begin % p) % p;
  return d < a.width || d + b.width > p;
}

bool covers(const Span& outer, const Span& inner) {
  return outer.pitch == 0 && outer.begin <= inner.begin && inner.end <= outer.end;
}

namespace {
inline bool is_finished(const Task* t) { return t->finished.load(std::memory_order_acquire); }

}  // namespace

DependencyTracker::~DependencyTracker() {
  for (auto& kv : by_alloc_) {
    for (auto& r : kv.second.reads) task_unref(r.task);
    for (auto& r : kv.second.writes) task_unref(r.task);
  }
}

size_t DependencyTracker::compact_list(std::vector<Record>& list) {
  size_t removed = 0;
  auto keep_end = std::remove_if(list.begin(), list.end(), [&](const Record& r) {
    if (!is_finished(r.task)) return false;
    task_unref(r.task);
    ++removed;
    return true;
  });
  list.erase(keep_end, list.end());
  records_ -= removed;
  return removed;
}

size_t DependencyTracker::remove_covered(std::vector<Record>& list, const Span& span, const Task* keep) {
  // A record wholly covered by a new write is redundant: anything that would
  // conflict with it also conflicts with the new write, which is ordered after it.
  size_t removed = 0;
  auto keep_end = std::remove_if(list.begin(), list.end(), [&](const Record& r) {
    if (r.task == keep) return false;
    if (!covers(span, r.span) && !is_finished(r.task)) return false;
    task_unref(r.task);
    ++removed;
    return true;
  });
  list.erase(keep_end, list.end());
  records_ -= removed;
  return removed;
}

void DependencyTracker::access(Task* t, uint64_t alloc, const Span& span, int32_t mode) {
  Lists& lists = by_alloc_[alloc];
  const bool writes = (mode & TD_WRITE) != 0;
  Task* last = nullptr;  // skip immediate duplicate edges
  for (const Record& r : lists.writes) {
    if (r.task != t && r.task != last && may_overlap(span, r.span) && !is_finished(r.task)) {
      task_add_dependency(r.task, t);
      last = r.task;
    }
  }
  if (writes) {
    for (const Record& r : lists.reads) {
      if (r.task != t && r.task != last && may_overlap(span, r.span) && !is_finished(r.task)) {
        task_add_dependency(r.task, t);
        last = r.task;
      }
    }
    remove_covered(lists.writes, span, t);
    remove_covered(lists.reads, span, t);
  }
  std::vector<Record>& list = writes ? lists.writes : lists.reads;
  size_t& compact_at = writes ? lists.writes_compact_at : lists.reads_compact_at;
  t->refs.fetch_add(1, std::memory_order_relaxed);
  list.push_back(Record{span, t});
  ++records_;
  if (list.size() >= compact_at) {
    compact_list(list);
    compact_at = std::max<size_t>(16, 2 * list.size());
  }
}

size_t DependencyTracker::compact() {
  for (auto it = by_alloc_.begin(); it != by_alloc_.end();) {
    compact_list(it->second.reads);
    compact_list(it->second.writes);
    if (it->second.reads.empty() && it->second.writes.empty()) {
      it = by_alloc_.erase(it);
    } else {
      ++it;
    }
  }
  return records_;
}

void DependencyTracker::forget(uint64_t alloc) {
  auto it = by_alloc_.find(alloc);
  if (it == by_alloc_.end()) return;
  for (auto& r : it->second.reads) task_unref(r.task);
  for (auto& r : it->second.writes) task_unref(r.task);
  records_ -= it->second.reads.size() + it->second.writes.size();
  by_alloc_.erase(it);
}

std::vector<uint64_t> DependencyTracker::busy_runs(uint64_t alloc) const {
  std::vector<uint64_t> runs;
  auto it = by_alloc_.find(alloc);
  if (it == by_alloc_.end()) return runs;
  for (const auto* list : {&it->second.reads, &it->second.writes}) {
    for (const Record& r : *list) {
      if (!is_finished(r.task) && std::find(runs.begin(), runs.end(), r.task->run_id) == runs.end()) {
        runs.push_back(r.task->run_id);
      }
    }
  }
  return runs;
}

}  // namespace tandem
