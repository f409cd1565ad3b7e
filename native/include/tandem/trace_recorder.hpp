// Tracing as a task observer: attach a TraceRecorder to an engine
// (Engine::add_observer) and it records every task executed from then on,
// until it is removed; drain() takes what it has recorded so far.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/observer.hpp"

namespace tandem {

// One recorded task: a TaskEvent that owns its kernel name.
struct TraceEvent {
  uint64_t run_id = 0;
  uint32_t task_index = 0;
  int32_t worker = 0;
  int64_t start_ns = 0, end_ns = 0;
  std::string kernel;
  bool ok = true;
};

class TraceRecorder final : public TaskObserver {
 public:
  TraceRecorder() = default;
  TraceRecorder(const TraceRecorder&) = delete;
  TraceRecorder& operator=(const TraceRecorder&) = delete;

  void on_task(const TaskEvent& event) noexcept override;
  // The events recorded since the last drain, in the order workers reported
  // them; the recorder starts afresh.
  std::vector<TraceEvent> drain();
  // Events lost because memory ran out while recording them.
  uint64_t dropped() const;

 private:
  mutable std::mutex mu_;  // held by workers only for one append
  std::vector<TraceEvent> events_;
  uint64_t dropped_ = 0;
};

}  // namespace tandem
