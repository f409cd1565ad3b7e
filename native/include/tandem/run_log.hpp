// Timing records of the runs one scheduler launched, for its statistics.
//
// The log is a RunObserver: each run sealed with it (Engine::seal_observed)
// writes its own record where it completes (usually a pool worker) rather
// than the event loop writing it when it hears of the completion: the loop's
// per-run work is what bounds a small run's dispatch rate. Runs that are not
// native ones (the distributed runtime's) are recorded with launched() and
// record() directly. The log keeps the most recent `window` records and
// counts every run.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "tandem/observer.hpp"

namespace tandem {

struct RunCounts {
  uint64_t launched = 0;  // the others plus the runs not completed yet
  uint64_t completed = 0, failed = 0, cancelled = 0;
};

class RunLog final : public RunObserver {
 public:
  explicit RunLog(size_t window);  // window > 0
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  size_t window() const { return ring_.size(); }
  // A run that will record itself was launched.
  void launched();
  void record(const RunTiming& timing);
  // RunObserver: a run sealed with the log counts as launched, and records itself when done.
  void on_run_sealed() noexcept override { launched(); }
  void on_run_done(const RunTiming& timing) noexcept override { record(timing); }
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
