#include "tandem/run_log.hpp"

#include "tandem/errors.hpp"

namespace tandem {

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

RunCounts RunLog::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

}  // namespace tandem
