#include "tandem/trace_recorder.hpp"

#include <new>
#include <utility>

namespace tandem {

void TraceRecorder::on_task(const TaskEvent& event) noexcept {
  try {
    // The name is copied before the lock: other workers wait only for the append.
    TraceEvent ev{event.run_id, event.task_index, event.worker, event.start_ns, event.end_ns,
                  std::string(event.kernel), event.ok};
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(ev));
  } catch (const std::bad_alloc&) {
    // A worker must not throw: the trace loses the event, the task does not fail.
    std::lock_guard<std::mutex> lock(mu_);
    ++dropped_;
  }
}

std::vector<TraceEvent> TraceRecorder::drain() {
  std::vector<TraceEvent> out;
  std::lock_guard<std::mutex> lock(mu_);
  out.swap(events_);
  return out;
}

uint64_t TraceRecorder::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

}  // namespace tandem
