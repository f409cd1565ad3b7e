#include "tandem/run_log.hpp"

#include "tandem/errors.hpp"

namespace tandem {

std::array<int64_t, DurationHistogram::kBuckets> DurationHistogram::bounds_ns() {
  std::array<int64_t, kBuckets> bounds{};
  int64_t b = 10'000;
  for (int64_t& x : bounds) {
    x = b;
    b *= 2;
  }
  return bounds;
}

void DurationHistogram::add(int64_t ns) {
  if (ns < 0) ns = 0;  // clocks of different processes (the distributed runtime's) can disagree by a hair
  size_t i = 0;
  for (int64_t b = 10'000; i < kBuckets && ns > b; b *= 2) ++i;
  ++counts[i];
  sum_ns += ns;
  ++count;
}

RunLog::RunLog(size_t window) {
  if (window == 0) throw InvalidArgument("a run log needs a window of at least one run");
  ring_.resize(window);
}

void RunLog::launched() {
  std::lock_guard<std::mutex> lock(mu_);
  ++counts_.launched;
}

void RunLog::record(const RunTiming& timing) {
  std::lock_guard<std::mutex> lock(mu_);
  ring_[next_] = timing;
  next_ = next_ + 1 == ring_.size() ? 0 : next_ + 1;
  if (filled_ < ring_.size()) ++filled_;
  ++recorded_;
  histograms_.admission_wait.add(timing.admit_ns - timing.dispatch_ns);
  histograms_.orchestration.add(timing.sealed_ns - timing.launch_ns);
  if (timing.kind != RunKind::Cancelled) {
    if (timing.first_start_ns >= 0 && timing.last_end_ns >= timing.first_start_ns) {
      histograms_.device.add(timing.last_end_ns - timing.first_start_ns);
    }
    histograms_.latency.add(timing.done_ns - timing.dispatch_ns);
  }
  switch (timing.kind) {
    case RunKind::Completed: ++counts_.completed; break;
    case RunKind::Failed: ++counts_.failed; break;
    case RunKind::Cancelled: ++counts_.cancelled; break;
  }
}

std::vector<RunTiming> RunLog::recent() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<RunTiming> out;
  out.reserve(filled_);
  const size_t start = filled_ < ring_.size() ? 0 : next_;
  for (size_t i = 0; i < filled_; ++i) out.push_back(ring_[(start + i) % ring_.size()]);
  return out;
}

RunHistograms RunLog::histograms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return histograms_;
}

uint64_t RunLog::recorded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recorded_;
}

std::pair<uint64_t, std::vector<RunTiming>> RunLog::since(uint64_t from) const {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t oldest = recorded_ - filled_;
  const uint64_t first = from < oldest ? oldest : (from > recorded_ ? recorded_ : from);
  std::vector<RunTiming> out;
  out.reserve(recorded_ - first);
  // The record with sequence number s sits at (next_ - (recorded_ - s)) mod window.
  const size_t n = ring_.size();
  for (uint64_t s = first; s < recorded_; ++s) out.push_back(ring_[(next_ + n - (recorded_ - s) % n) % n]);
  return {first, std::move(out)};
}

RunCounts RunLog::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

}  // namespace tandem
