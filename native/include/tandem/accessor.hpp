// The per-run host-tensor accessor: a table mapping device regions to host
// views. It owns the mappings it adds and releases exactly those on close().
// There is no process-global region table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "tandem/device.hpp"

namespace tandem {

class HostAccessor {
 public:
  // A null device admits no region. The device is not owned: it must outlive
  // the accessor (the engine and the bindings hold it by shared_ptr).
  explicit HostAccessor(Device* device);
  ~HostAccessor();  // calls close()
  HostAccessor(const HostAccessor&) = delete;
  HostAccessor& operator=(const HostAccessor&) = delete;

  // Registers [device_base, device_base + size) <-> host_view[0, size).
  // The region must lie inside one live allocation of the device and must not
  // overlap a region already registered here. size > 0, host_view non-null.
  // host_view is borrowed: the caller keeps it valid while mapped.
  void add(uintptr_t device_base, size_t size, void* host_view);

  // Device -> dst and src -> device. The span must lie wholly inside one
  // registered region; otherwise nothing is read or written (InvalidArgument).
  void read(uintptr_t device_addr, void* dst, size_t nbytes) const;
  void write(uintptr_t device_addr, const void* src, size_t nbytes);

  // Whole-region transfers between a registered region and its host view.
  void stage_in(uintptr_t device_base);   // host view -> device
  void copy_back(uintptr_t device_base);  // device -> host view

  // Releases every mapping (idempotent). The table keeps its capacity, so a
  // slot's accessor is reused run after run without allocating.
  void close();
  size_t mapping_count() const;
  size_t mapped_bytes() const;

 private:
  struct Mapping {
    uintptr_t device_base;
    size_t size;
    void* host_view;
    BufferRef alloc;  // the allocation holding the region, re-checked on every copy
  };
  // Both return a copy, so the transfer itself runs without the table lock.
  Mapping find_span(uintptr_t addr, size_t nbytes) const;
  Mapping find_base(uintptr_t device_base) const;

  Device* const device_;
  // Guards the table only; the bindings release the GIL, so Python threads can
  // reach one accessor concurrently.
  mutable std::mutex mu_;
  std::vector<Mapping> mappings_;
};

}  // namespace tandem
