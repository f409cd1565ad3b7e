// Pipeline slots: `depth` buffer sets, each leased to exactly one run at a time.
//
// A slot is named by its index; its host-tensor accessor lives here, and its
// device buffers are the runtime's. A lease carries the slot's generation:
// releasing advances it, so a stale lease (released already, or from an
// earlier run) is rejected and a slot is never released twice. The engine
// leases a slot when it begins a run and the run releases it when it
// completes, before anyone can see the run done: whoever reacts to a
// completion finds the slot free again.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "tandem/accessor.hpp"
#include "tandem/errors.hpp"

namespace tandem {

struct SlotLease {
  int32_t index = -1;
  uint64_t generation = 0;
};

struct StaleLease : InvalidArgument {
  using InvalidArgument::InvalidArgument;
};

class SlotTable {
 public:
  // One slot per accessor (non-null, distinct), all free, at generation 0.
  explicit SlotTable(std::vector<std::shared_ptr<HostAccessor>> accessors);
  // `depth` slots without accessors, for runs whose host data goes elsewhere
  // (the distributed runtime's, which complete in other processes).
  explicit SlotTable(size_t depth);
  SlotTable(const SlotTable&) = delete;
  SlotTable& operator=(const SlotTable&) = delete;

  size_t depth() const { return accessors_.size(); }
  size_t free_count() const;
  // Null for a slot without one.
  const std::shared_ptr<HostAccessor>& accessor(size_t index) const;

  // A free slot, the one released longest ago first; nullopt when all are leased.
  std::optional<SlotLease> try_lease();
  // Gives the slot back; throws StaleLease unless `lease` still holds it.
  void release(const SlotLease& lease);
  // The same, reporting a stale lease by returning false (for a completing run's worker thread).
  bool try_release(const SlotLease& lease) noexcept;
  // Blocks until a slot is free (true) or the timeout passes (false; timeout < 0: forever).
  bool wait_free(double timeout_s) const;

 private:
  std::vector<std::shared_ptr<HostAccessor>> accessors_;  // set at construction only
  mutable std::mutex mu_;
  mutable std::condition_variable freed_;
  std::vector<uint64_t> generation_;
  std::vector<bool> leased_;
  // The free slots in release order: a ring of `depth` entries, so releasing never allocates.
  std::vector<int32_t> free_ring_;
  size_t free_head_ = 0, free_count_ = 0;
};

}  // namespace tandem
