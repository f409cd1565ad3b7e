// The worker pool: N native threads taking ready tasks from one FIFO queue.
// Idle workers sleep on a condition variable (after a brief spin, so a task
// arriving microseconds later does not pay for a futex wake-up). A worker runs
// a task's first newly ready dependent itself, without a trip through the queue.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem {

struct Task;

class TaskRunner {
 public:
  virtual ~TaskRunner() = default;
  // Executes `t` on worker `worker`; may return a task to run next on the same worker.
  virtual Task* run_task(Task* t, int worker) = 0;
};

class WorkerPool {
 public:
  // spin: how long an idle worker polls for new work before it sleeps.
  WorkerPool(int threads, TaskRunner& runner, std::chrono::microseconds spin);
  ~WorkerPool();  // stop()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void push(Task* t);
  void push(const std::vector<Task*>& ts);
  // Lets the workers empty the queue, then joins them. Idempotent.
  void stop();
  int size() const { return static_cast<int>(threads_.size()); }
  size_t queued() const { return queued_.load(std::memory_order_relaxed); }

 private:
  void worker_main(int index);
  Task* pop();

  TaskRunner& runner_;
  const std::chrono::microseconds spin_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task*> queue_;
  std::atomic<size_t> queued_{0};
  int sleeping_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace tandem
