// Scheduler micro-benchmarks run from C++, so the figures measure the engine
// rather than the cost of crossing into Python per task. Built into the
// tooling's own module (tandem._bench), not into the core library.
#pragma once

#include <cstdint>
#include <string>

namespace tandem::bench {

struct GraphResult {
  uint64_t tasks = 0;
  double submit_seconds = 0;  // host time spent submitting
  double total_seconds = 0;   // first submit to run completion
};

// One run of n `noop` tasks on an engine of its own (a fresh cpu Device and a
// pool of `workers` threads; workers <= 0: the engine's default), timed from
// the first submit. shape "wide": independent tasks; "chain": each task
// read-writes the same bytes, so each depends on the previous one.
// Throws InvalidArgument for another shape or n == 0.
GraphResult noop_graph(int workers, const std::string& shape, uint64_t n);

}  // namespace tandem::bench
