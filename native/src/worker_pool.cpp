#include "tandem/worker_pool.hpp"

#include <chrono>

#include "tandem/task_graph.hpp"

namespace tandem {

// Idle workers poll for spin_ before sleeping: a task that arrives within that
// window is picked up without a futex wake-up, which costs tens of microseconds
// under a hypervisor (a cross-CPU interrupt). Bounded, so an idle pool sleeps.
WorkerPool::WorkerPool(int threads, TaskRunner& runner, std::chrono::microseconds spin)
    : runner_(runner), spin_(spin) {
  threads_.reserve(static_cast<size_t>(threads));
  try {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this, i] { worker_main(i); });
  } catch (...) {
    stop();
    throw;
  }
}

WorkerPool::~WorkerPool() { stop(); }

void WorkerPool::push(Task* t) {
  bool wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(t);
    queued_.fetch_add(1, std::memory_order_relaxed);
    wake = sleeping_ > 0;
  }
  if (wake) cv_.notify_one();
}

void WorkerPool::push(const std::vector<Task*>& ts) {
  if (ts.empty()) return;
  int wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (Task* t : ts) queue_.push_back(t);
    queued_.fetch_add(ts.size(), std::memory_order_relaxed);
    wake = sleeping_;
  }
  if (wake > 1 && ts.size() > 1) {
    cv_.notify_all();
  } else if (wake > 0) {
    cv_.notify_one();
  }
}

Task* WorkerPool::pop() {
  if (spin_.count() > 0 && queued_.load(std::memory_order_relaxed) == 0) {
    const auto until = std::chrono::steady_clock::now() + spin_;
    do {
      for (int i = 0; i < 64 && queued_.load(std::memory_order_relaxed) == 0; ++i) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      }
      // Yield between polls: when the cores are oversubscribed the spin must
      // not keep a runnable thread (the host orchestrating) off its core.
      std::this_thread::yield();
    } while (queued_.load(std::memory_order_relaxed) == 0 && std::chrono::steady_clock::now() < until);
  }
  std::unique_lock<std::mutex> lock(mu_);
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
  for (auto& th : threads_) {
    if (th.joinable()) th.join();
  }
  threads_.clear();
}

}  // namespace tandem
