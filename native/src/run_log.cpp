#include "tandem/run_log.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

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

namespace {

WindowPercentiles percentiles_of(std::vector<int64_t>& ns) {
  WindowPercentiles out;
  const size_t n = ns.size();
  if (n == 0) return out;
  // Nearest rank, ceil(p / 100 * n) - 1 in doubles; each selection leaves the smaller values before it, so
  // the next (lower) rank is looked for among those only.
  auto index = [n](double p) {
    const auto k = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(n)));
    return k == 0 ? 0 : k - 1;
  };
  auto end = ns.end();
  for (auto [p, into] : {std::pair{99.0, &out.p99}, std::pair{90.0, &out.p90}, std::pair{50.0, &out.p50}}) {
    const auto at = ns.begin() + static_cast<std::ptrdiff_t>(index(p));
    std::nth_element(ns.begin(), at, end);
    *into = *at;
    end = at + 1;
  }
  out.samples = n;
  return out;
}

using Spans = std::vector<std::pair<int64_t, int64_t>>;

void sort_spans(Spans& spans) {
  if (!std::is_sorted(spans.begin(), spans.end())) std::sort(spans.begin(), spans.end());  // usually they are
}

// The length of the union of [start, end) intervals sorted by start (empty ones count nothing). Each
// interval adds what reaches past every earlier one's end: those all start at or before it, so what they
// cover from its start on is one piece, up to the furthest end.
int64_t covered(const Spans& spans) {
  int64_t total = 0, reach = std::numeric_limits<int64_t>::min();
  for (const auto& [start, end] : spans) {
    if (end <= start) continue;
    const int64_t from = std::max(start, reach);
    if (end > from) total += end - from;
    reach = std::max(reach, end);
  }
  return total;
}

// The summary of records in any order (RunLog::summary() passes its window's).
WindowSummary summarize(const std::vector<RunTiming>& records) {
  std::vector<int64_t> admission, orchestration, device, latency;
  Spans host_busy, device_busy;
  for (std::vector<int64_t>* v : {&admission, &orchestration, &device, &latency}) v->reserve(records.size());
  host_busy.reserve(records.size());
  device_busy.reserve(records.size());
  for (const RunTiming& r : records) {
    admission.push_back(r.admit_ns - r.dispatch_ns);
    orchestration.push_back(r.sealed_ns - r.launch_ns);
    host_busy.emplace_back(r.launch_ns, r.sealed_ns);
    const bool ran = r.first_start_ns >= 0 && r.last_end_ns >= r.first_start_ns;
    if (ran) device_busy.emplace_back(r.first_start_ns, r.last_end_ns);
    if (r.kind != RunKind::Cancelled) {
      if (ran) device.push_back(r.last_end_ns - r.first_start_ns);
      latency.push_back(r.done_ns - r.dispatch_ns);
    }
  }
  WindowSummary out;
  out.admission_wait = percentiles_of(admission);
  out.orchestration = percentiles_of(orchestration);
  out.device = percentiles_of(device);
  out.latency = percentiles_of(latency);
  // |host ∩ device| = |host| + |device| - |host ∪ device|, each a union of intervals.
  sort_spans(host_busy);
  sort_spans(device_busy);
  Spans either(host_busy.size() + device_busy.size());
  std::merge(host_busy.begin(), host_busy.end(), device_busy.begin(), device_busy.end(), either.begin());
  const int64_t busy = covered(device_busy);
  if (busy > 0) {
    const int64_t both = covered(host_busy) + busy - covered(either);
    out.has_overlap = true;
    out.overlap_ratio = static_cast<double>(both) / static_cast<double>(busy);
  }
  return out;
}

}  // namespace

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

WindowSummary RunLog::summary() const { return summarize(recent()); }

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
