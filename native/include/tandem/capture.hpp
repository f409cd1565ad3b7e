// Captured runs: the tasks of one run, recorded relative to the memory they
// touched, replayed against another run's memory in one call.
//
// Every tensor argument of a recorded task is relative to a *base*: a region
// that may move from run to run (a slot's buffer for a parameter, the slot's
// scratch, a resident tensor passed as an argument) or stays put (a resident
// tensor the orchestration reached otherwise). A replay supplies each base's
// address, allocation id and origin (the base's byte offset within its
// allocation, from which the tracked byte ranges count).
//
// Bases are *private* or *shared*. A slot's buffers and scratch are private
// to the run holding the slot: runs before it on the slot completed before it
// got the slot, runs after it start after it completes. So the dependencies
// among a run's accesses to private bases are the same on every replay: they
// are computed once, when the recording is sealed, and a replay links its
// tasks by them without the dependency tracker. Accesses to shared bases
// (resident tensors, which other runs touch too) go through the tracker as a
// submit's do, so a replayed run still orders after earlier runs that touched
// the same bytes (a KV cache written by step N, read by step N+1).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "tandem/engine.hpp"

namespace tandem {

// Where a tensor argument was, relative to its base, when it was recorded.
struct RecordedRef {
  uint32_t base = 0;    // index into the replay's base table
  uintptr_t addr = 0;   // the base's address when recorded (its allocation's address plus origin)
  uint64_t origin = 0;  // the base's byte offset within its allocation when recorded
};

// A base as one replay has it.
struct ReplayBase {
  uintptr_t addr = 0;     // allocation address plus origin
  uint64_t alloc_id = 0;  // 0: untracked
  uint64_t origin = 0;
};

// A task's scalars as one replay has them (a Scalar parameter passed through to a kernel).
struct ScalarPatch {
  uint32_t task = 0;
  std::vector<td_scalar> scalars;
};

// An output's copy back to its host array, appended to a replay: it runs after
// every recorded task that writes its (private) base.
struct ReplayCopyBack {
  uint32_t base = 0;
  uintptr_t device_base = 0;  // the slot buffer's address (the region of the run's accessor)
};

class Recording {
 public:
  struct Arg {
    td_tensor view{};             // dtype, shape, strides and access as recorded; data is recomputed
    uint32_t base = 0;
    int64_t data_offset = 0;      // bytes from the base's address to element [0, 0, ...]
    Span span;  // tracked bytes, from the base's origin (end == begin: untracked)
  };
  struct Task {
    KernelPtr kernel;
    std::vector<Arg> args;
    std::vector<td_scalar> scalars;
    std::vector<uint32_t> deps;        // earlier tasks it follows through private bases (set by seal)
    std::vector<uint32_t> dependents;  // the later tasks that follow it so (the reverse of deps)
  };

  // Appends one task: a call as it was submitted, and for each of its tensor
  // arguments the base it is relative to. Throws InvalidArgument when the
  // counts differ, an argument's tracked range starts before its base's
  // origin, or the recording is sealed.
  void add(const PreparedCall& call, const std::vector<RecordedRef>& refs);
  // Ends the recording. private_bases: the bases private to a run (see
  // above); the dependencies through them are computed here with the
  // tracker's rules (read-after-write, write-after-read, write-after-write
  // on overlapping bytes; a write covering earlier accesses stands for them).
  void seal(const std::vector<uint32_t>& private_bases);

  size_t size() const { return tasks_.size(); }
  // One more than the largest base index any task names.
  size_t base_count() const { return bases_; }
  bool sealed() const { return sealed_; }
  bool is_private(uint32_t base) const { return base < private_.size() && private_[base]; }
  const std::vector<Task>& tasks() const { return tasks_; }
  // The tasks that write a private base (what its copy back follows).
  const std::vector<uint32_t>& writers(uint32_t base) const;

 private:
  std::vector<Task> tasks_;
  size_t bases_ = 0;
  bool sealed_ = false;
  std::vector<bool> private_;
  std::vector<std::vector<uint32_t>> writers_;
};

// A recording materialized against one base table: every task's argument
// views with their addresses, its scalars, its fixed dependencies and its
// accesses to shared bases, laid out flat. Built once per (recording, bases)
// and reused by every replay with the same bases (a slot's runs with the same
// resident arguments), so a replay writes its tasks and reads one compact
// table instead of rebuilding ~150 bytes per tensor argument from the
// recording. Immutable once built: replays on several threads share it.
class ReplayPlan {
 public:
  struct Entry {
    const Kernel* fn = nullptr;
    uint32_t first_view = 0, first_scalar = 0;
    int32_t n_views = 0, n_scalars = 0;
    int32_t n_deps = 0;                   // earlier tasks it follows through private bases
    const uint32_t* dependents = nullptr;  // into the recording
    uint32_t n_dependents = 0;
  };
  // An access to a shared base, entered into the dependency tracker per replay.
  struct SharedAccess {
    uint32_t task = 0;
    int32_t mode = 0;
    uint64_t alloc_id = 0;
    Span span;  // in the allocation
  };

  // Throws InvalidArgument when the recording is not sealed or names more bases than given.
  ReplayPlan(std::shared_ptr<const Recording> recording, const std::vector<ReplayBase>& bases);

  const Recording& recording() const { return *recording_; }
  const std::vector<Entry>& entries() const { return entries_; }
  const td_tensor* views(const Entry& e) const { return views_.data() + e.first_view; }
  const td_scalar* scalars(const Entry& e) const { return scalars_.data() + e.first_scalar; }
  const std::vector<SharedAccess>& shared() const { return shared_; }

 private:
  std::shared_ptr<const Recording> recording_;
  std::vector<Entry> entries_;
  std::vector<td_tensor> views_;
  std::vector<td_scalar> scalars_;
  std::vector<SharedAccess> shared_;
};

}  // namespace tandem
