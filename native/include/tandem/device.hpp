// The embedded `cpu` device: a native memory arena, separate from user arrays.
// One object per device; two devices in one process share nothing.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <shared_mutex>

#include "tandem/errors.hpp"

namespace tandem {

// A handle to one allocation. `id` is unique within its device for the device's
// lifetime, so a handle outliving its allocation is detected even when the
// address has been reused by a newer allocation.
struct BufferRef {
  uint64_t device_uid = 0;
  uint64_t id = 0;
  uintptr_t addr = 0;
  size_t size = 0;
};

struct DeviceStats {
  size_t capacity = 0;          // 0: unlimited
  size_t bytes_in_use = 0;
  size_t peak_bytes = 0;
  size_t live_allocations = 0;
  uint64_t total_allocations = 0;
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  uint64_t d2d_bytes = 0;
  size_t mapped_regions = 0;    // host-accessor mappings currently registered
};

// Thread-safe. Copies hold the device lock shared (they run in parallel, and a
// concurrent free cannot release memory under a running copy); alloc, free and
// note_mapped hold it exclusively.
class Device {
 public:
  // capacity: the most bytes allocated at once; 0 means unlimited.
  explicit Device(size_t capacity = 0);
  ~Device();  // frees every allocation still live
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  uint64_t uid() const { return uid_; }

  // nbytes > 0; align a power of two (below alignof(max_align_t) it is
  // rounded up, which still satisfies the request).
  // Throws DeviceMemoryError past the capacity (the device stays usable).
  BufferRef alloc(size_t nbytes, size_t align = 64);

  // Throws InvalidArgument naming the problem (foreign, interior, already
  // freed, stale after reuse); on error nothing changes.
  void free(const BufferRef& buf);

  // Copies check provenance of the handle and that [offset, offset+nbytes)
  // lies inside the allocation; on error nothing is copied.
  void copy_h2d(const BufferRef& dst, size_t dst_offset, const void* src, size_t nbytes);
  void copy_d2h(void* dst, const BufferRef& src, size_t src_offset, size_t nbytes);
  // Overlapping spans (within one allocation) are allowed.
  void copy_d2d(const BufferRef& dst, size_t dst_offset, const BufferRef& src, size_t src_offset,
                size_t nbytes);

  // Checks that `buf` is a live allocation of this device (same errors as free).
  void check(const BufferRef& buf) const;
  // The live allocation wholly containing [addr, addr + nbytes); throws
  // InvalidArgument saying why not (outside any allocation, or overrunning one).
  BufferRef resolve(uintptr_t addr, size_t nbytes) const;

  // Bookkeeping of host-accessor mappings, so leaks are observable. A delta
  // that would take the count below zero throws InvalidArgument.
  void note_mapped(long delta);

  DeviceStats stats() const;

 private:
  struct Allocation {
    uint64_t id;
    size_t size;
    void* raw;  // what the system allocator returned
  };
  using Table = std::map<uintptr_t, Allocation>;  // keyed by base address

  void check_locked(const BufferRef& buf) const;
  void check_span_locked(const BufferRef& buf, size_t offset, size_t nbytes, const char* what) const;
  // The live allocation whose [base, base + size) contains addr, or end().
  Table::const_iterator owner_locked(uintptr_t addr) const;
  bool id_live_locked(uint64_t id) const;

  const uint64_t uid_;
  mutable std::shared_mutex mu_;
  Table live_;
  uint64_t next_id_ = 1;
  DeviceStats stats_;  // all but the copy counters; guarded by mu_ (exclusive)
  // Copies update these under the shared lock, hence atomics.
  std::atomic<uint64_t> h2d_bytes_{0};
  std::atomic<uint64_t> d2h_bytes_{0};
  std::atomic<uint64_t> d2d_bytes_{0};
};

}  // namespace tandem
