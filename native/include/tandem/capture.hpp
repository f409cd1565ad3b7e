// Captured runs: the tasks of one run, recorded relative to the memory they
// touched, replayed against another run's memory in one call.
//
// Every tensor argument of a recorded task is relative to a *base*: a region
// that may move from run to run (a slot's buffer for a parameter, the slot's
// scratch, a resident tensor passed as an argument) or stays put (a resident
// tensor the orchestration reached otherwise). A replay supplies each base's
// address, allocation id and origin (the base's byte offset within its
// allocation, from which the tracked byte ranges count), and the engine
// enters the recorded tasks into the task graph with their arguments moved
// there; dependency tracking works exactly as for submitted tasks, so a
// replayed run still orders after earlier runs that touched the same bytes.
#pragma once

#include <cstdint>
#include <vector>

#include "tandem/engine.hpp"

namespace tandem {

// Where a tensor argument was, relative to its base, when it was recorded.
struct RecordedRef {
  uint32_t base = 0;   // index into the replay's base table
  uintptr_t addr = 0;  // the base's address when recorded (its allocation's address plus origin)
  uint64_t origin = 0; // the base's byte offset within its allocation when recorded
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

class Recording {
 public:
  struct Arg {
    td_tensor view{};      // dtype, shape, strides and access as recorded; data is recomputed
    uint32_t base = 0;
    int64_t data_offset = 0;  // bytes from the base's address to element [0, 0, ...]
    uint64_t begin = 0, end = 0;  // tracked byte range, from the base's origin
  };
  struct Task {
    KernelPtr kernel;
    std::vector<Arg> args;
    std::vector<td_scalar> scalars;
  };

  // Appends one task: a call as it was submitted, and for each of its tensor
  // arguments the base it is relative to. Throws InvalidArgument when the
  // counts differ or an argument's tracked range starts before its base's origin.
  void add(const PreparedCall& call, const std::vector<RecordedRef>& refs);
  size_t size() const { return tasks_.size(); }
  // One more than the largest base index any task names.
  size_t base_count() const { return bases_; }
  const std::vector<Task>& tasks() const { return tasks_; }

 private:
  std::vector<Task> tasks_;
  size_t bases_ = 0;
};

}  // namespace tandem
