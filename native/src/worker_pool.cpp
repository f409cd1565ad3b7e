#include "tandem/worker_pool.hpp"

#include <algorithm>
#include <chrono>
#include <string>
#include <thread>

#if defined(__linux__)
#include <pthread.h>
#endif

#include "tandem/task_graph.hpp"

namespace tandem {

// Idle workers poll for spin_ before sleeping: a task that arrives within that
// window is picked up without a futex wake-up, which costs tens of microseconds
// under a hypervisor (a cross-CPU interrupt). Bounded, so an idle pool sleeps.
WorkerPool::WorkerPool(int threads, TaskRunner& runner, std::chrono::microseconds spin)
    : runner_(runner), spin_(spin) {
  threads_.reserve(static_cast<size_t>(threads));
  try {
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([this, i] { worker_main(i); });
#if defined(__linux__)
      // Named here, not by the thread itself, so every worker carries its name once the pool exists:
      // profilers, top -H and debuggers tell the pool's threads from the process's others (the
      // kernel keeps 15 characters).
      pthread_setname_np(threads_.back().native_handle(), ("tandem-pool-" + std::to_string(i)).substr(0, 15).c_str());
#endif
    }
  } catch (...) {
    stop();
    throw;
  }
}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::push(Task* t) { push(&t, 1); }

void WorkerPool::push(Task* const* ts, size_t n) {
  if (n == 0) return;
  int wake, sleepers, helpers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.insert(queue_.end(), ts, ts + n);
    queued_.fetch_add(n, std::memory_order_relaxed);
    // A spinning worker takes a queued task without being woken, and waking a sleeper costs the
    // pushing thread a futex call (tens of microseconds under a hypervisor, where it is an
    // interrupt to a halted vCPU): wake sleepers only for the tasks the spinners leave over.
    // Counted under mu_, as the spinners leave their count (pop()): none of these tasks is missed.
    // (A sleeper woken by an earlier push counts as asleep until it runs again: pushes in quick
    // succession may wake one worker more than needed, never one fewer.)
    const size_t takers = static_cast<size_t>(spinning_);
    const size_t uncovered = queue_.size() > takers ? queue_.size() - takers : 0;
    sleepers = sleeping_;
    wake = static_cast<int>(std::min(uncovered, static_cast<size_t>(sleepers)));
    helpers = helpers_sleeping_;
  }
  if (wake > 0) {
    wakeups_.fetch_add(static_cast<uint64_t>(wake), std::memory_order_relaxed);
    if (wake == sleepers && wake > 1) {
      cv_.notify_all();
    } else {
      for (int i = 0; i < wake; ++i) cv_.notify_one();
    }
  }
  // Helpers take only their own run's tasks: each sleeping one checks whether this is its.
  if (helpers > 0) helper_cv_.notify_all();
}

void WorkerPool::spin_while_empty() const {
  for (int i = 0; i < 64 && queued_.load(std::memory_order_relaxed) == 0; ++i) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  // Yield between polls: when the cores are oversubscribed the spin must
  // not keep a runnable thread (the host orchestrating) off its core.
  std::this_thread::yield();
}

Task* WorkerPool::pop() {
  std::unique_lock<std::mutex> lock(mu_);
  if (spin_.count() > 0 && queue_.empty()) {
    ++spinning_;  // a taker push() need not wake anyone for, until it leaves the count below
    lock.unlock();
    const auto until = std::chrono::steady_clock::now() + spin_;
    do {
      spin_while_empty();
    } while (queued_.load(std::memory_order_relaxed) == 0 && std::chrono::steady_clock::now() < until);
    lock.lock();
    --spinning_;  // and takes a task below if one is queued, whether or not the spin saw it
  }
  while (queue_.empty()) {
    if (stopping_) return nullptr;
    ++sleeping_;
    cv_.wait(lock);
    --sleeping_;
  }
  Task* t = queue_.front();
  queue_.pop_front();
  queued_.fetch_sub(1, std::memory_order_relaxed);
  return t;
}

Task* WorkerPool::try_pop_if(const std::function<bool(const Task*)>& accept) {
  if (queued_.load(std::memory_order_relaxed) == 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    if (accept(*it)) {
      Task* t = *it;
      queue_.erase(it);
      queued_.fetch_sub(1, std::memory_order_relaxed);
      return t;
    }
  }
  return nullptr;
}

bool WorkerPool::help_until(const std::function<bool()>& done, const std::function<bool(const Task*)>& mine,
                            std::chrono::steady_clock::time_point deadline, int index) {
  auto idle_since = std::chrono::steady_clock::now();
  for (;;) {
    if (done()) return true;
    if (Task* t = try_pop_if(mine)) {
      do {
        t = runner_.run_task(t, index);
      } while (t != nullptr && mine(t));
      if (t != nullptr) push(t);  // another run's: a worker's, not this waiter's
      idle_since = std::chrono::steady_clock::now();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) return done();
    if (now - idle_since < spin_) {
      spin_while_empty();
      continue;
    }
    std::unique_lock<std::mutex> lock(mu_);
    // Checked under the lock that push() and wake_helpers() take: no wake-up is lost.
    if (done() || stopping_) return done();
    if (std::any_of(queue_.begin(), queue_.end(), mine)) continue;
    ++helpers_sleeping_;
    if (deadline == std::chrono::steady_clock::time_point::max()) {
      helper_cv_.wait(lock);  // no deadline: wait_until(max) may overflow in the clock's arithmetic
    } else {
      helper_cv_.wait_until(lock, deadline);
    }
    --helpers_sleeping_;
    idle_since = std::chrono::steady_clock::now();
  }
}

size_t WorkerPool::run_queued(const std::function<bool()>& interrupt, int index) {
  const auto any = [](const Task*) { return true; };
  // `interrupt` is asked between tasks only, never before the first: a call with work queued always
  // runs some, so a caller interrupted as often as it is called (a steady stream of messages) still
  // makes progress, and how much a call runs does not hang on how fast the thread reached it.
  size_t ran = 0;
  for (;;) {
    Task* t = try_pop_if(any);
    if (t == nullptr) break;
    // A task's first ready dependent comes back to run here, as on a worker; asked to stop,
    // the thread queues it for whoever runs next.
    do {
      t = runner_.run_task(t, index);
      ++ran;
    } while (t != nullptr && !interrupt());
    if (t != nullptr) {
      push(t);
      break;
    }
    if (interrupt()) break;
  }
  return ran;
}

void WorkerPool::wake_helpers() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (helpers_sleeping_ == 0) return;
  }
  helper_cv_.notify_all();
}

void WorkerPool::worker_main(int index) {
  Task* next = nullptr;
  for (;;) {
    Task* t = next != nullptr ? next : pop();
    if (t == nullptr) return;
    next = runner_.run_task(t, index);
  }
}

void WorkerPool::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  helper_cv_.notify_all();
  for (auto& th : threads_) {
    if (th.joinable()) th.join();
  }
  threads_.clear();
}

}  // namespace tandem
