#include "noop_graph.hpp"

#include <chrono>
#include <memory>
#include <vector>

#include "tandem/device.hpp"
#include "tandem/engine.hpp"
#include "tandem/errors.hpp"

namespace tandem::bench {

GraphResult noop_graph(int workers, const std::string& shape, uint64_t n) {
  if (shape != "wide" && shape != "chain") throw InvalidArgument("shape must be 'wide' or 'chain', not '" + shape + "'");
  if (n == 0) throw InvalidArgument("n must be at least 1");
  // Scope-owned: the engine's destructor stops the pool, then the device's frees `buf`.
  Engine engine(std::make_shared<Device>(0), workers);
  KernelPtr noop = engine.registry().get("noop");
  const BufferRef buf = engine.device()->alloc(64);
  std::vector<TensorArg> args;
  std::vector<int32_t> access;
  if (shape == "chain") {
    TensorArg a;
    a.view.data = reinterpret_cast<void*>(buf.addr);
    a.view.dtype = TD_FLOAT32;
    a.view.ndim = 1;
    a.view.shape[0] = 16;
    a.view.strides[0] = 1;
    a.alloc_id = buf.id;
    a.begin = 0;
    a.end = 64;
    args.push_back(a);
    access.push_back(TD_READWRITE);
  }
  GraphResult r;
  r.tasks = n;
  using clock = std::chrono::steady_clock;
  const PreparedCall call = Engine::prepare_call(noop, args, access, {});
  auto run = engine.begin_run(false);
  const auto t0 = clock::now();
  for (uint64_t i = 0; i < n; ++i) engine.submit_prepared(*run, call);
  const auto t1 = clock::now();
  engine.seal(*run);
  run->wait(-1);
  const auto t2 = clock::now();
  r.submit_seconds = std::chrono::duration<double>(t1 - t0).count();
  r.total_seconds = std::chrono::duration<double>(t2 - t0).count();
  return r;
}

}  // namespace tandem::bench
