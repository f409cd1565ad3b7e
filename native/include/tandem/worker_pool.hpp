// The worker pool: N native threads taking ready tasks from one FIFO queue.
// Idle workers sleep on a condition variable (after a brief spin, so a task
// arriving microseconds later does not pay for a futex wake-up); a push wakes
// sleepers only for the tasks the spinning workers will not take. A worker runs
// a task's first newly ready dependent itself, without a trip through the queue.
// A thread waiting for a run may help: it takes that run's queued tasks like a
// worker until its condition holds (help_until), so a run waited for alone
// needs no cross-core wake-up to start or to report done. On Linux the workers
// are named tandem-pool-N.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
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

  // Queues ready tasks; wakes sleeping workers only for those the spinning ones leave over.
  void push(Task* t);
  void push(const std::vector<Task*>& ts) { push(ts.data(), ts.size()); }
  void push(Task* const* ts, size_t n);
  // Runs the queued tasks that mine() accepts on the calling thread (as worker
  // `index`) until done() or `deadline`. Idle, it polls for the spin time,
  // then sleeps until a task is queued or wake_helpers() is called. A ready
  // dependent it is handed that mine() refuses goes back to the queue.
  // Returns done().
  bool help_until(const std::function<bool()>& done, const std::function<bool(const Task*)>& mine,
                  std::chrono::steady_clock::time_point deadline, int index);
  // Runs queued tasks of any run on the calling thread (as worker `index`)
  // until none is queued or `interrupt()` (asked between tasks) is true.
  // Returns how many it ran. For a thread that drives the engine and has
  // nothing else to do until its next message: its runs start and finish
  // without a cross-thread wake-up.
  size_t run_queued(const std::function<bool()>& interrupt, int index);
  // Wakes sleeping helpers to re-check their condition; call it after the
  // condition turned true.
  void wake_helpers();
  // Lets the workers empty the queue, then joins them. Idempotent.
  void stop();
  int size() const { return static_cast<int>(threads_.size()); }
  size_t queued() const { return queued_.load(std::memory_order_relaxed); }
  // Sleeping workers woken by push() so far.
  uint64_t wakeups() const { return wakeups_.load(std::memory_order_relaxed); }

 private:
  void worker_main(int index);
  Task* pop();
  Task* try_pop_if(const std::function<bool(const Task*)>& accept);  // the first queued task accepted, or null
  void spin_while_empty() const;

  TaskRunner& runner_;
  const std::chrono::microseconds spin_;
  std::mutex mu_;
  std::condition_variable cv_;         // sleeping workers
  std::condition_variable helper_cv_;  // sleeping helpers
  std::deque<Task*> queue_;
  std::atomic<size_t> queued_{0};
  int sleeping_ = 0;          // workers asleep on cv_
  int spinning_ = 0;          // idle workers polling queued_ (pop()), each about to take a task
  std::atomic<uint64_t> wakeups_{0};
  int helpers_sleeping_ = 0;  // helpers asleep on helper_cv_
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace tandem
