// Scheduler micro-benchmarks run from C++, so the figures measure the engine
// rather than the cost of crossing into Python per task.
#pragma once

#include <cstdint>
#include <string>

#include "tandem/engine.hpp"

namespace tandem {

struct GraphBenchResult {
  uint64_t tasks = 0;
  double submit_seconds = 0;  // host time spent submitting
  double total_seconds = 0;   // first submit to run completion
};

// shape "wide": n independent noop tasks; "chain": n noop tasks each
// read-writing the same bytes, so each depends on the previous one.
GraphBenchResult bench_noop_graph(Engine& engine, const std::string& shape, uint64_t n);

}  // namespace tandem
