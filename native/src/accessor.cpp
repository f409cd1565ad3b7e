#include "tandem/accessor.hpp"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>

namespace tandem {

namespace {

std::string hex(uintptr_t v) {
  char buf[2 + 2 * sizeof(uintptr_t) + 1];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string span(uintptr_t addr, size_t nbytes) {
  return "span of " + std::to_string(nbytes) + " bytes at " + hex(addr);
}

// One past the last byte of [addr, addr + nbytes), saturated so that a huge
// length cannot wrap around and look small.
uintptr_t span_end(uintptr_t addr, size_t nbytes) {
  const uintptr_t room = std::numeric_limits<uintptr_t>::max() - addr;
  return nbytes > room ? std::numeric_limits<uintptr_t>::max() : addr + nbytes;
}

}  // namespace

HostAccessor::HostAccessor(Device* device) : device_(device) {}

HostAccessor::~HostAccessor() {
  // close() only throws if the device's mapping count is inconsistent, which
  // this accessor cannot cause; a destructor has nobody to report to anyway.
  try {
    close();
  } catch (...) {
  }
}

void HostAccessor::add(uintptr_t device_base, size_t size, void* host_view) {
  if (device_ == nullptr) throw InvalidArgument("accessor add: no device, so no region can be mapped");
  if (size == 0) throw InvalidArgument("accessor add: empty region at " + hex(device_base));
  if (host_view == nullptr) throw InvalidArgument("accessor add: null host view for region at " + hex(device_base));
  // The region must belong to one live allocation; resolve() says why not.
  const BufferRef owner = device_->resolve(device_base, size);

  std::lock_guard lock(mu_);
  const uintptr_t end = device_base + size;  // cannot wrap: resolve() placed it inside an allocation
  for (const Mapping& m : mappings_) {
    if (device_base < m.device_base + m.size && m.device_base < end) {
      throw InvalidArgument("accessor add: region of " + std::to_string(size) + " bytes at " + hex(device_base) +
                            " overlaps the registered region of " + std::to_string(m.size) + " bytes at " +
                            hex(m.device_base));
    }
  }
  // Reserve before registering with the device, so the push_back below
  // cannot throw and a failure here never strands a counted mapping.
  if (mappings_.size() == mappings_.capacity()) {
    mappings_.reserve(std::max<size_t>(8, 2 * mappings_.capacity()));
  }
  device_->note_mapped(+1);
  mappings_.push_back(Mapping{device_base, size, host_view, owner});
}

HostAccessor::Mapping HostAccessor::find_span(uintptr_t addr, size_t nbytes) const {
  std::lock_guard lock(mu_);
  const uintptr_t end = span_end(addr, nbytes);
  for (const Mapping& m : mappings_) {
    if (addr >= m.device_base && addr - m.device_base < m.size) {
      if (nbytes <= m.size - (addr - m.device_base)) return m;
      throw InvalidArgument("accessor: " + span(addr, nbytes) + " overruns the region of " +
                            std::to_string(m.size) + " bytes at " + hex(m.device_base));
    }
  }
  for (const Mapping& m : mappings_) {
    if (addr < m.device_base && end > m.device_base) {
      throw InvalidArgument("accessor: " + span(addr, nbytes) + " starts before the region at " +
                            hex(m.device_base));
    }
  }
  throw InvalidArgument("accessor: " + span(addr, nbytes) + " is not inside any registered region");
}

HostAccessor::Mapping HostAccessor::find_base(uintptr_t device_base) const {
  std::lock_guard lock(mu_);
  for (const Mapping& m : mappings_) {
    if (m.device_base == device_base) return m;
  }
  throw InvalidArgument("accessor: no region is registered at base " + hex(device_base));
}

// Transfers go through the device, which re-checks that the allocation behind
// the region is still live: a region whose memory was freed fails closed.
void HostAccessor::read(uintptr_t device_addr, void* dst, size_t nbytes) const {
  const Mapping m = find_span(device_addr, nbytes);
  device_->copy_d2h(dst, m.alloc, device_addr - m.alloc.addr, nbytes);
}

void HostAccessor::write(uintptr_t device_addr, const void* src, size_t nbytes) {
  const Mapping m = find_span(device_addr, nbytes);
  device_->copy_h2d(m.alloc, device_addr - m.alloc.addr, src, nbytes);
}

void HostAccessor::stage_in(uintptr_t device_base) {
  const Mapping m = find_base(device_base);
  device_->copy_h2d(m.alloc, m.device_base - m.alloc.addr, m.host_view, m.size);
}

void HostAccessor::copy_back(uintptr_t device_base) {
  const Mapping m = find_base(device_base);
  device_->copy_d2h(m.host_view, m.alloc, m.device_base - m.alloc.addr, m.size);
}

void HostAccessor::close() {
  std::lock_guard lock(mu_);
  if (mappings_.empty()) return;
  // Mappings exist only if add() succeeded, so device_ is non-null here.
  device_->note_mapped(-static_cast<long>(mappings_.size()));
  mappings_.clear();  // keeps the capacity for the next run
}

size_t HostAccessor::mapping_count() const {
  std::lock_guard lock(mu_);
  return mappings_.size();
}

size_t HostAccessor::mapped_bytes() const {
  std::lock_guard lock(mu_);
  size_t total = 0;
  for (const Mapping& m : mappings_) total += m.size;
  return total;
}

}  // namespace tandem
