#include "tandem/slot_table.hpp"

#include <algorithm>
#include <chrono>
#include <string>

namespace tandem {

SlotTable::SlotTable(size_t depth)
    : accessors_(depth), generation_(depth, 0), leased_(depth, false), free_ring_(depth, -1) {
  if (depth == 0) throw InvalidArgument("a slot table needs at least one slot");
  for (size_t i = 0; i < depth; ++i) free_ring_[i] = static_cast<int32_t>(i);
  free_count_ = depth;
}

SlotTable::SlotTable(std::vector<std::shared_ptr<HostAccessor>> accessors) : SlotTable(accessors.size()) {
  for (size_t i = 0; i < accessors.size(); ++i) {
    if (!accessors[i]) throw InvalidArgument("slot " + std::to_string(i) + " has no accessor");
    // Two slots sharing an accessor would share one run's host mappings.
    if (std::count(accessors.begin(), accessors.end(), accessors[i]) > 1) {
      throw InvalidArgument("slot " + std::to_string(i) + " shares its accessor with another slot");
    }
  }
  accessors_ = std::move(accessors);
}

size_t SlotTable::free_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_count_;
}

const std::shared_ptr<HostAccessor>& SlotTable::accessor(size_t index) const {
  if (index >= accessors_.size()) {
    throw InvalidArgument("slot " + std::to_string(index) + " out of range (depth " +
                          std::to_string(accessors_.size()) + ")");
  }
  return accessors_[index];
}

std::optional<SlotLease> SlotTable::try_lease() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_count_ == 0) return std::nullopt;
  const int32_t i = free_ring_[free_head_];
  free_head_ = (free_head_ + 1) % free_ring_.size();
  --free_count_;
  leased_[i] = true;
  return SlotLease{i, generation_[i]};
}

void SlotTable::release(const SlotLease& lease) {
  if (try_release(lease)) return;
  std::lock_guard<std::mutex> lock(mu_);
  const auto i = static_cast<size_t>(lease.index);
  if (lease.index < 0 || i >= accessors_.size()) {
    throw StaleLease("release of slot " + std::to_string(lease.index) + ": no such slot (depth " +
                     std::to_string(accessors_.size()) + ")");
  }
  throw StaleLease("stale lease of slot " + std::to_string(i) + ": generation " + std::to_string(lease.generation) +
                   ", slot is at " + std::to_string(generation_[i]) + (leased_[i] ? "" : " and free"));
}

bool SlotTable::try_release(const SlotLease& lease) noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto i = static_cast<size_t>(lease.index);
    if (lease.index < 0 || i >= accessors_.size() || !leased_[i] || generation_[i] != lease.generation) return false;
    ++generation_[i];
    leased_[i] = false;
    free_ring_[(free_head_ + free_count_) % free_ring_.size()] = lease.index;
    ++free_count_;
  }
  freed_.notify_all();
  return true;
}

bool SlotTable::wait_free(double timeout_s) const {
  std::unique_lock<std::mutex> lock(mu_);
  auto any_free = [this] { return free_count_ > 0; };
  if (timeout_s < 0) {
    freed_.wait(lock, any_free);
    return true;
  }
  return freed_.wait_for(lock, std::chrono::duration<double>(timeout_s), any_free);
}

}  // namespace tandem
