// Timing records of the runs one scheduler launched, for its statistics.
//
// The log is a RunObserver: each run sealed with it (Engine::seal_observed)
// writes its own record where it completes (usually a pool worker) rather
// than the event loop writing it when it hears of the completion: the loop's
// per-run work is what bounds a small run's dispatch rate. Runs that are not
// native ones (the distributed runtime's) are recorded with launched() and
// record() directly. The log keeps the most recent `window` records, counts
// every run, and keeps cumulative histograms of every run's durations (what a
// metrics scrape reads: a window would lose the runs between two scrapes).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "tandem/observer.hpp"

namespace tandem {

struct RunCounts {
  uint64_t launched = 0;  // the others plus the runs not completed yet
  uint64_t completed = 0, failed = 0, cancelled = 0;
};

// Cumulative histogram of one duration over every run recorded: counts[i] runs
// took at most kBoundsNs[i] (and more than the bound before), the last count
// the runs above every bound.
struct DurationHistogram {
  // 10 us doubling up to about 10.5 s: from a tiny run's admission to a stalled request.
  static constexpr size_t kBuckets = 21;
  static std::array<int64_t, kBuckets> bounds_ns();
  std::array<uint64_t, kBuckets + 1> counts{};
  int64_t sum_ns = 0;
  uint64_t count = 0;
  void add(int64_t ns);
};

// The durations a run log keeps histograms of (RunLog::histograms()).
struct RunHistograms {
  DurationHistogram admission_wait;  // dispatch to slot lease, every run
  DurationHistogram orchestration;   // orchestration start to sealed run, every run
  DurationHistogram device;          // first task start to last task end, completed and failed runs that ran
  DurationHistogram latency;         // dispatch to completion, completed and failed runs
};

// Nearest-rank percentiles of one duration over a window's runs, in ns (all 0 without samples).
struct WindowPercentiles {
  int64_t p50 = 0, p90 = 0, p99 = 0;
  uint64_t samples = 0;
};

// What stats() reports over the window: the durations' percentiles (the runs each histogram above counts)
// and the overlap ratio, the time the host orchestrated while the device was busy over the time the device
// was busy (has_overlap false when the device never was).
struct WindowSummary {
  WindowPercentiles admission_wait, orchestration, device, latency;
  bool has_overlap = false;
  double overlap_ratio = 0.0;
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
  RunHistograms histograms() const;
  // summarize(recent()): computed after the lock is let go, so recording runs never wait for it.
  WindowSummary summary() const;
  // How many records were ever written (the next record's sequence number).
  uint64_t recorded() const;
  // The records with sequence number >= from still in the window, oldest first, and the sequence
  // number of the first one returned (> from when some were overwritten before being read).
  std::pair<uint64_t, std::vector<RunTiming>> since(uint64_t from) const;

 private:
  mutable std::mutex mu_;
  std::vector<RunTiming> ring_;
  size_t next_ = 0, filled_ = 0;
  RunCounts counts_;
  RunHistograms histograms_;
  uint64_t recorded_ = 0;
};

}  // namespace tandem
