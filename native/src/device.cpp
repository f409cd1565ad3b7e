#include "tandem/device.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>

namespace tandem {

namespace {

std::string hex(uint64_t v) {
  char buf[2 + 16 + 1];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string describe(const BufferRef& b) {
  return "buffer (id " + std::to_string(b.id) + ", addr " + hex(b.addr) + ", size " +
         std::to_string(b.size) + ")";
}

// A fresh random identity per device: handles from one device are recognised
// as foreign by any other without a process-wide counter. 0 is reserved for
// "no device" (a default-constructed BufferRef).
uint64_t random_uid() {
  std::random_device rd;
  uint64_t uid = 0;
  while (uid == 0) uid = (uint64_t{rd()} << 32) ^ uint64_t{rd()};
  return uid;
}

}  // namespace

Device::Device(size_t capacity) : uid_(random_uid()) { stats_.capacity = capacity; }

Device::~Device() {
  for (auto& [addr, a] : live_) std::free(a.raw);
}

BufferRef Device::alloc(size_t nbytes, size_t align) {
  if (nbytes == 0) throw InvalidArgument("alloc: nbytes must be positive");
  if (align == 0 || (align & (align - 1)) != 0) {
    throw InvalidArgument("alloc: align " + std::to_string(align) + " is not a power of two");
  }
  // posix_memalign wants a power of two multiple of sizeof(void*); rounding up
  // to max_align_t keeps every allocation suitably aligned for any type.
  const size_t eff_align = align < alignof(std::max_align_t) ? alignof(std::max_align_t) : align;

  std::unique_lock lock(mu_);
  const size_t in_use = stats_.bytes_in_use;
  if (stats_.capacity != 0 && nbytes > stats_.capacity - in_use) {
    throw DeviceMemoryError("device memory exhausted: requested " + std::to_string(nbytes) +
                            " bytes with " + std::to_string(in_use) + " of " +
                            std::to_string(stats_.capacity) + " bytes in use");
  }
  if (nbytes > SIZE_MAX - in_use) {
    throw DeviceMemoryError("device memory exhausted: requested " + std::to_string(nbytes) + " bytes");
  }
  void* raw = nullptr;
  if (::posix_memalign(&raw, eff_align, nbytes) != 0 || raw == nullptr) {
    throw DeviceMemoryError("device memory exhausted: the system refused " + std::to_string(nbytes) +
                            " bytes aligned to " + std::to_string(align));
  }
  const auto addr = reinterpret_cast<uintptr_t>(raw);
  const uint64_t id = next_id_;
  try {
    live_.emplace(addr, Allocation{id, nbytes, raw});
  } catch (...) {
    std::free(raw);
    throw;
  }
  ++next_id_;
  stats_.bytes_in_use = in_use + nbytes;
  if (stats_.bytes_in_use > stats_.peak_bytes) stats_.peak_bytes = stats_.bytes_in_use;
  ++stats_.live_allocations;
  ++stats_.total_allocations;
  return BufferRef{uid_, id, addr, nbytes};
}

void Device::free(const BufferRef& buf) {
  std::unique_lock lock(mu_);
  check_locked(buf);
  auto it = live_.find(buf.addr);
  std::free(it->second.raw);
  stats_.bytes_in_use -= it->second.size;
  --stats_.live_allocations;
  live_.erase(it);
}

void Device::copy_h2d(const BufferRef& dst, size_t dst_offset, const void* src, size_t nbytes) {
  std::shared_lock lock(mu_);
  check_span_locked(dst, dst_offset, nbytes, "copy_h2d destination");
  if (nbytes == 0) return;
  if (src == nullptr) throw InvalidArgument("copy_h2d: null host source");
  std::memcpy(reinterpret_cast<void*>(dst.addr + dst_offset), src, nbytes);
  h2d_bytes_.fetch_add(nbytes, std::memory_order_relaxed);
}

void Device::copy_d2h(void* dst, const BufferRef& src, size_t src_offset, size_t nbytes) {
  std::shared_lock lock(mu_);
  check_span_locked(src, src_offset, nbytes, "copy_d2h source");
  if (nbytes == 0) return;
  if (dst == nullptr) throw InvalidArgument("copy_d2h: null host destination");
  std::memcpy(dst, reinterpret_cast<const void*>(src.addr + src_offset), nbytes);
  d2h_bytes_.fetch_add(nbytes, std::memory_order_relaxed);
}

void Device::copy_d2d(const BufferRef& dst, size_t dst_offset, const BufferRef& src, size_t src_offset,
                      size_t nbytes) {
  std::shared_lock lock(mu_);
  check_span_locked(dst, dst_offset, nbytes, "copy_d2d destination");
  check_span_locked(src, src_offset, nbytes, "copy_d2d source");
  if (nbytes == 0) return;
  // memmove: source and destination may be overlapping spans of one allocation.
  std::memmove(reinterpret_cast<void*>(dst.addr + dst_offset),
               reinterpret_cast<const void*>(src.addr + src_offset), nbytes);
  d2d_bytes_.fetch_add(nbytes, std::memory_order_relaxed);
}

void Device::check(const BufferRef& buf) const {
  std::shared_lock lock(mu_);
  check_locked(buf);
}

BufferRef Device::resolve(uintptr_t addr, size_t nbytes) const {
  std::shared_lock lock(mu_);
  auto it = owner_locked(addr);
  if (it == live_.end()) {
    throw InvalidArgument("resolve: address " + hex(addr) + " is outside any allocation of this device");
  }
  const Allocation& a = it->second;
  const size_t room = it->first + a.size - addr;
  if (nbytes > room) {
    throw InvalidArgument("resolve: span of " + std::to_string(nbytes) + " bytes at " + hex(addr) +
                          " overruns allocation id " + std::to_string(a.id) + " (base " +
                          hex(it->first) + ", size " + std::to_string(a.size) + ") by " +
                          std::to_string(nbytes - room) + " bytes");
  }
  return BufferRef{uid_, a.id, it->first, a.size};
}

void Device::note_mapped(long delta) {
  std::unique_lock lock(mu_);
  if (delta >= 0) {
    stats_.mapped_regions += static_cast<size_t>(delta);
    return;
  }
  // Modular negation: well defined even for LONG_MIN.
  const size_t release = size_t{0} - static_cast<size_t>(delta);
  if (release > stats_.mapped_regions) {
    throw InvalidArgument("note_mapped: releasing " + std::to_string(release) + " mappings but only " +
                          std::to_string(stats_.mapped_regions) + " are registered");
  }
  stats_.mapped_regions -= release;
}

DeviceStats Device::stats() const {
  std::shared_lock lock(mu_);
  DeviceStats s = stats_;
  s.h2d_bytes = h2d_bytes_.load(std::memory_order_relaxed);
  s.d2h_bytes = d2h_bytes_.load(std::memory_order_relaxed);
  s.d2d_bytes = d2d_bytes_.load(std::memory_order_relaxed);
  return s;
}

Device::Table::const_iterator Device::owner_locked(uintptr_t addr) const {
  auto it = live_.upper_bound(addr);  // first base above addr
  if (it == live_.begin()) return live_.end();
  --it;
  return addr - it->first < it->second.size ? it : live_.end();
}

bool Device::id_live_locked(uint64_t id) const {
  // Only reached on the error path, so a scan beats keeping a second index.
  for (const auto& [addr, a] : live_) {
    if (a.id == id) return true;
  }
  return false;
}

void Device::check_locked(const BufferRef& b) const {
  if (b.device_uid != uid_) {
    throw InvalidArgument("foreign " + describe(b) + ": it belongs to device " + hex(b.device_uid) +
                          ", not to this device " + hex(uid_));
  }
  if (b.id == 0 || b.id >= next_id_) {
    throw InvalidArgument("foreign " + describe(b) + ": this device never issued that allocation id");
  }
  auto owner = owner_locked(b.addr);
  if (owner != live_.end() && owner->first == b.addr) {
    const Allocation& a = owner->second;
    if (a.id == b.id) {
      if (a.size != b.size) {
        throw InvalidArgument("foreign " + describe(b) + ": the allocation at that address has size " +
                              std::to_string(a.size));
      }
      return;
    }
    if (a.id > b.id && !id_live_locked(b.id)) {
      throw InvalidArgument("stale " + describe(b) + ": it was freed and its address reused by allocation id " +
                            std::to_string(a.id));
    }
    throw InvalidArgument("foreign " + describe(b) + ": the address is the base of allocation id " +
                          std::to_string(a.id) + ", not of id " + std::to_string(b.id));
  }
  const bool live = id_live_locked(b.id);
  if (owner != live_.end()) {
    if (!live && owner->second.id > b.id) {
      throw InvalidArgument("stale " + describe(b) + ": it was freed and its address reused inside allocation id " +
                            std::to_string(owner->second.id));
    }
    throw InvalidArgument("interior " + describe(b) + ": the address lies " +
                          std::to_string(b.addr - owner->first) + " bytes inside allocation id " +
                          std::to_string(owner->second.id) + " (base " + hex(owner->first) +
                          "), not at its base");
  }
  if (!live) throw InvalidArgument(describe(b) + " was already freed");
  throw InvalidArgument("foreign " + describe(b) + ": this device never allocated that address");
}

void Device::check_span_locked(const BufferRef& buf, size_t offset, size_t nbytes, const char* what) const {
  check_locked(buf);
  if (offset > buf.size || nbytes > buf.size - offset) {
    throw InvalidArgument(std::string(what) + ": span [" + std::to_string(offset) + ", " +
                          std::to_string(offset) + " + " + std::to_string(nbytes) +
                          ") overruns the allocation of " + std::to_string(buf.size) + " bytes");
  }
}

}  // namespace tandem
