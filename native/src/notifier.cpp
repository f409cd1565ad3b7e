#include "tandem/notifier.hpp"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>

namespace tandem {

Notifier::Notifier() : fd_(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  if (fd_ < 0) throw std::runtime_error(std::string("eventfd failed: ") + std::strerror(errno));
}

Notifier::~Notifier() { ::close(fd_); }

void Notifier::push(uint64_t run_id) {
  bool signal = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready_.push_back(run_id);
    if (!signalled_) signalled_ = signal = true;
  }
  if (signal) {
    // Only the first completion since the last drain writes: one wake-up per batch.
    const uint64_t one = 1;
    const auto t0 = std::chrono::steady_clock::now();
    ssize_t rc;
    do {
      rc = ::write(fd_, &one, sizeof one);
    } while (rc < 0 && errno == EINTR);
    const auto spent = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0);
    write_ns_.fetch_add(static_cast<uint64_t>(spent.count()), std::memory_order_relaxed);
    writes_.fetch_add(1, std::memory_order_relaxed);
  }
  cv_.notify_all();
}

std::vector<uint64_t> Notifier::drain() {
  std::vector<uint64_t> out;
  std::lock_guard<std::mutex> lock(mu_);
  if (signalled_) {
    uint64_t value;
    ssize_t rc;
    do {
      rc = ::read(fd_, &value, sizeof value);
    } while (rc < 0 && errno == EINTR);
    signalled_ = false;
  }
  out.swap(ready_);
  return out;
}

bool Notifier::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  auto has = [this] { return !ready_.empty(); };
  if (timeout_s < 0) {
    cv_.wait(lock, has);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), has);
}

size_t Notifier::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ready_.size();
}

}  // namespace tandem
