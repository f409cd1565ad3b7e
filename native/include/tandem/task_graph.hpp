// Tasks, runs and the dependency tracker.
//
// A task is one kernel call over tagged tensor arguments. Dependencies are
// inferred from tags on overlapping spans of the same allocation
// (read-after-write, write-after-read, write-after-write). The tracker belongs
// to the engine, not to a run, so runs that share memory execute in submission
// order and runs over disjoint memory execute concurrently.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tandem/accessor.hpp"
#include "tandem/kernel.hpp"
#include "tandem/observer.hpp"
#include "tandem/slot_table.hpp"

namespace tandem {

// The bytes of an allocation a view touches, as dependency tracking sees them:
// its extent [begin, end), and for a view made of equal rows at a fixed pitch
// (a column slice of a matrix, one head of a [batch, seq, heads * dim] tensor)
// the pitch and the row width, in bytes. Every byte such a view touches lies at
// an offset whose residue modulo the pitch is in [begin % pitch, begin % pitch
// + width): two column slices of the same rows touch no common byte though
// their extents overlap, so tasks writing them need not be ordered. pitch 0:
// the whole extent counts.
struct Span {
  uint64_t begin = 0, end = 0;
  uint64_t pitch = 0, width = 0;
};

// The span of `view`, whose extent in its allocation is [begin, end).
Span span_of(const td_tensor& view, uint64_t begin, uint64_t end);
// False only when the two spans (of one allocation) surely share no byte.
bool may_overlap(const Span& a, const Span& b);
// True only when every byte of `inner` is surely in `outer`.
bool covers(const Span& outer, const Span& inner);

// A task argument: the kernel's view plus what dependency tracking needs.
struct TensorArg {
  td_tensor view{};
  uint64_t alloc_id = 0;  // allocation identity within the device; 0 = untracked
  uint64_t begin = 0;     // byte range [begin, end) relative to the allocation base
  uint64_t end = 0;
};

// The span dependency tracking sees for a tensor argument.
inline Span span_of(const TensorArg& a) { return span_of(a.view, a.begin, a.end); }

class Run;
class TaskBlock;

// A small test-and-set lock: held only for a few instructions (edge insertion).
class SpinLock {
 public:
  void lock() noexcept {
    while (flag_.test_and_set(std::memory_order_acquire)) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
  }
  void unlock() noexcept { flag_.clear(std::memory_order_release); }

 private:
  std::atomic_flag flag_ = ATOMIC_FLAG_INIT;
};

struct Task {
  enum class Op : uint8_t { Kernel, CopyBack };

  std::atomic<int32_t> pending{1};  // unfinished dependencies + the submission guard
  std::atomic<int32_t> refs{1};     // execution ref + one per tracker record
  std::atomic<bool> finished{false};
  SpinLock lock;                    // guards dependents against concurrent completion
  std::vector<Task*> dependents;

  Run* run = nullptr;  // alive while the task is unfinished
  uint64_t run_id = 0;
  // What runs: the kernel and its arguments. A submitted task owns them (kernel, tensors,
  // scalars); a replayed one points into its TaskBlock and the recording the block keeps.
  const Kernel* fn = nullptr;
  const td_tensor* tensor_data = nullptr;
  const td_scalar* scalar_data = nullptr;
  int32_t n_tensors = 0, n_scalars = 0;
  KernelPtr kernel;
  std::vector<td_tensor> tensors;
  std::vector<td_scalar> scalars;
  uint32_t index = 0;  // position within its run
  Op op = Op::Kernel;
  uintptr_t copy_base = 0;  // Op::CopyBack: region of the run's accessor
  TaskBlock* block = nullptr;  // set when the task lives in a block (freed with it)
  // Tasks of the same block that follow this one, fixed before any of them starts (a replay's
  // dependencies through private memory): no lock and no allocation to link them.
  const uint32_t* block_dependents = nullptr;
  uint32_t n_block_dependents = 0;

  // Points fn and the argument views at what the task owns (after filling kernel, tensors, scalars).
  void own_arguments() {
    fn = kernel.get();
    tensor_data = tensors.data();
    n_tensors = static_cast<int32_t>(tensors.size());
    scalar_data = scalars.data();
    n_scalars = static_cast<int32_t>(scalars.size());
  }
};

// The tasks of one replay, allocated together (a handful of allocations instead of several per
// task) and freed together once the last of them is released, by its execution or by the
// dependency tracker. `keep` holds what the tasks point into (the recording and its kernels).
class TaskBlock {
 public:
  TaskBlock(size_t tasks, size_t tensors, size_t scalars, std::shared_ptr<const void> keep)
      : live_(tasks), tasks_(new Task[tasks]), tensors_(new td_tensor[tensors]),
        scalars_(new td_scalar[scalars]), keep_(std::move(keep)) {
    for (size_t i = 0; i < tasks; ++i) tasks_[i].block = this;
  }
  TaskBlock(const TaskBlock&) = delete;
  TaskBlock& operator=(const TaskBlock&) = delete;

  Task* task(size_t i) { return &tasks_[i]; }
  td_tensor* tensors(size_t offset) { return &tensors_[offset]; }
  td_scalar* scalars(size_t offset) { return &scalars_[offset]; }
  // One task is done with; the last one frees the block.
  void release() {
    if (live_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  std::atomic<size_t> live_;
  std::unique_ptr<Task[]> tasks_;
  std::unique_ptr<td_tensor[]> tensors_;
  std::unique_ptr<td_scalar[]> scalars_;
  std::shared_ptr<const void> keep_;
};

inline void task_unref(Task* t) {
  if (t->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    if (t->block != nullptr) {
      t->block->release();
    } else {
      delete t;
    }
  }
}

// The tasks one completion made ready: nearly always none, one or two (a chain, a fork), held inline
// so that a worker completing a task allocates nothing; more spill to the heap.
class ReadyTasks {
 public:
  void push_back(Task* t) {
    if (size_ < kInline) {
      inline_[size_++] = t;
      return;
    }
    if (size_ == kInline) spill_.assign(inline_.begin(), inline_.end());
    spill_.push_back(t);
    ++size_;
  }
  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }
  Task* const* data() const { return size_ <= kInline ? inline_.data() : spill_.data(); }

 private:
  static constexpr size_t kInline = 8;
  std::array<Task*, kInline> inline_{};
  std::vector<Task*> spill_;
  size_t size_ = 0;
};

// Adds to `ready` the dependents whose last dependency was `t`.
void task_complete(Task* t, ReadyTasks& ready);
// `t` runs after `dep` (nothing, if dep has finished). Inline: the tracker calls it per edge.
inline void task_add_dependency(Task* dep, Task* t) {
  dep->lock.lock();
  if (!dep->finished.load(std::memory_order_relaxed)) {
    dep->dependents.push_back(t);
    t->pending.fetch_add(1, std::memory_order_relaxed);
  }
  dep->lock.unlock();
}

struct RunTimes {
  int64_t created_ns = 0, sealed_ns = 0, first_start_ns = -1, last_end_ns = -1, done_ns = -1;
  int64_t busy_ns = 0;  // summed task execution time
};

struct RunFailure {
  int32_t task_index = -1;
  std::string kernel;
  std::string message;
};

class Engine;
class Notifier;

// One run: a group of tasks that completes when its last task completes.
class Run {
 public:
  Run(Engine* engine, uint64_t id, bool notify, int64_t created_ns);
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  uint64_t id() const { return id_; }
  bool notify() const { return notify_; }
  bool sealed() const { return sealed_.load(std::memory_order_acquire); }
  bool done() const { return done_.load(std::memory_order_acquire); }
  bool announced() const { return announced_.load(std::memory_order_acquire); }
  bool cancelled() const { return cancelled_.load(std::memory_order_acquire); }
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  uint32_t task_count() const { return n_tasks_; }

  // Skips every task that has not started; returns false when already done.
  bool cancel();
  // Blocks until done and announced (timeout < 0: forever): once it returns
  // true, the run's id is on the notifier (for a notifying run).
  bool wait(double timeout_s);
  RunFailure failure() const;
  RunTimes times() const;

  // The accessor the run's host arguments are mapped through; closed when the
  // run completes, whatever the outcome.
  void attach_accessor(std::shared_ptr<HostAccessor> accessor);
  // The pipeline slot the run holds (Engine::begin_run_leased), -1 for none.
  int32_t slot() const { return lease_.index; }

 private:
  friend class Engine;
  void record_failure(uint32_t task_index, std::string_view kernel, const std::string& message);
  // Closes the accessor and releases the slot, reports the run to its
  // observer (if any), marks it done, announces its id on announce_to (if
  // any), then wakes its waiters.
  void finish(int64_t now_ns, Notifier* announce_to);
  void hold_slot(std::shared_ptr<SlotTable> slots, SlotLease lease);

  Engine* engine_;
  const uint64_t id_;
  const bool notify_;
  std::atomic<int64_t> outstanding_{1};  // unfinished tasks + the seal guard
  std::atomic<bool> sealed_{false};
  std::atomic<bool> done_{false};
  std::atomic<bool> announced_{false};  // done and its id pushed: what wait() waits for
  std::atomic<bool> cancelled_{false};
  std::atomic<bool> failed_{false};
  uint32_t n_tasks_ = 0;  // written under the engine's submit lock
  std::atomic<int64_t> busy_ns_{0};
  std::atomic<int64_t> first_start_ns_{-1};
  std::atomic<int64_t> last_end_ns_{-1};
  int64_t created_ns_, sealed_ns_ = 0, done_ns_ = -1;
  std::shared_ptr<HostAccessor> accessor_;
  std::shared_ptr<SlotTable> slots_;  // with lease_: the slot released at finish
  SlotLease lease_;
  std::shared_ptr<RunObserver> observer_;  // set when sealed (Engine::seal_observed), told at finish
  int64_t dispatch_ns_ = 0, launch_ns_ = 0;
  mutable std::mutex mu_;  // guards failure_, done_ns_ and the wait condition
  std::condition_variable cv_;
  RunFailure failure_;
};

// Engine-wide record of who last touched which bytes. Not thread-safe by
// itself: the engine calls it under its submit lock.
class DependencyTracker {
 public:
  ~DependencyTracker();
  // Adds edges from earlier conflicting tasks to `t`, then records t's access.
  void access(Task* t, uint64_t alloc, const Span& span, int32_t mode);
  // Drops every record whose task has finished; returns records kept.
  size_t compact();
  // Forgets an allocation (after it is freed).
  void forget(uint64_t alloc);
  // Ids of runs that still have unfinished tasks touching `alloc`.
  std::vector<uint64_t> busy_runs(uint64_t alloc) const;
  size_t record_count() const { return records_; }
  size_t allocation_count() const { return by_alloc_.size(); }

 private:
  struct Record {
    Span span;
    Task* task;
  };
  struct Lists {
    std::vector<Record> reads, writes;
    size_t reads_compact_at = 16, writes_compact_at = 16;
  };
  size_t compact_list(std::vector<Record>& list);
  size_t remove_covered(std::vector<Record>& list, const Span& span, const Task* keep);

  std::unordered_map<uint64_t, Lists> by_alloc_;
  size_t records_ = 0;
};

}  // namespace tandem
