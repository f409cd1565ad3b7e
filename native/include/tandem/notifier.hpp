// Completion notifier: completed run ids queue up here. An event loop watches
// fd() (an eventfd); threads use wait(). One wake-up delivers every run
// completed since the previous drain.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

namespace tandem {

class Notifier {
 public:
  Notifier();
  ~Notifier();
  Notifier(const Notifier&) = delete;
  Notifier& operator=(const Notifier&) = delete;

  int fd() const { return fd_; }
  void push(uint64_t run_id);
  // Takes every id queued so far and resets the fd to not-readable.
  std::vector<uint64_t> drain();
  // Blocks until something is queued or the timeout passes (negative: forever).
  // Returns whether something is queued.
  bool wait(double timeout_s);
  size_t pending() const;
  // The fd writes so far (one per batch: a drain re-arms it) and the time spent in them. Waking a
  // reader asleep in epoll is what costs: under a hypervisor the write waits for the sleeping
  // CPU to be kicked (tens of us), on whichever thread completed the run (a pool worker).
  uint64_t writes() const { return writes_.load(std::memory_order_relaxed); }
  uint64_t write_ns() const { return write_ns_.load(std::memory_order_relaxed); }

 private:
  int fd_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> ready_;
  bool signalled_ = false;  // fd currently readable
  std::atomic<uint64_t> writes_{0};
  std::atomic<uint64_t> write_ns_{0};
};

}  // namespace tandem
