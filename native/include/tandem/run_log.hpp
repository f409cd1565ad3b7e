// Timing records of the runs one scheduler launched, for its statistics.
//
// Each run writes its own record where it completes (usually a pool worker)
// rather than the event loop writing it when it hears of the completion: the
// loop's per-run work is what bounds a small run's dispatch rate. The log
// keeps the most recent `window` records and counts every run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

namespace tandem {

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
};

struct RunCounts {
  uint64_t launched = 0;  // the others plus the runs not completed yet
  uint64_t completed = 0, failed = 0, cancelled = 0;
};

class RunLog {
 public:
  explicit RunLog(size_t window);  // window > 0
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  size_t window() const { return ring_.size(); }
  // A run that will record itself was launched (Engine::seal_logged calls it).
  void launched();
  void record(const RunTiming& timing);
  // The most recent min(recorded, window) records, oldest first.
  std::vector<RunTiming> recent() const;
  RunCounts counts() const;

 private:
  mutable std::mutex mu_;
  std::vector<RunTiming> ring_;
  size_t next_ = 0, filled_ = 0;
  RunCounts counts_;
};

}  // namespace tandem
