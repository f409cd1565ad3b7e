// Waiting for file descriptors the way the worker pool waits for tasks: poll
// without sleeping for a bounded spin, then sleep in poll(2). Under a
// hypervisor waking a sleeping thread costs tens of microseconds (a cross-CPU
// interrupt and a halt exit); a reply that arrives within the spin is read
// without one. Used by engine.distributed's host and chip workers.
#pragma once

#include <chrono>
#include <vector>

namespace tandem {

// Blocks until at least one of `fds` is readable or has hung up or failed,
// polling for up to `spin` first, then sleeping for up to `timeout_ms`
// (negative: no limit). Returns the indexes into `fds` of those ready, in
// order; empty when the timeout passed. Interrupted by a signal, it returns
// early with nothing ready (the caller decides whether to wait again).
std::vector<int> wait_readable(const std::vector<int>& fds, std::chrono::microseconds spin, int timeout_ms);

}  // namespace tandem
