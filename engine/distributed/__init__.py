"""engine.distributed: one orchestration over several chip workers, each its own process.

    import engine
    import engine.distributed as dist
    from engine import In, Out, kernels as K

    @engine.program                       # a single-device program, defined at module level
    def shard(run, x: In(("B", 64)), w: In((64, 64)), y: Out(("B", 64))):
        run.submit(K.matmul, x, w, out=y)

    @dist.program
    def data_parallel(orch, x: In(("B", 64)), w: dist.PerWorker(In((64, 64))), y: Out(("B", 64))):
        for i, (xs, ys) in enumerate(zip(orch.split(x), orch.split(y))):
            orch.submit(shard, xs, w[i], ys, worker=i)

    drt = data_parallel.prepare(workers=2, depth=2, bounds={"B": 256})
    w = [drt.alloc_tensor((64, 64), init=w_np, worker_id=i) for i in range(drt.workers)]
    y = drt(x, w)

A chip worker is a process with its own device and worker pool; every
single-device program the orchestration submits is registered on every
worker at prepare. Host tensors reach workers through shared memory owned by
the runtime (one region per pipeline slot), resident tensors are pinned to
one worker, host callbacks (orch.submit_sub) run on the host, and
dependencies between submissions follow the read/write rules of one device.
scheduler.AsyncRuntime works over a DistributedRuntime unchanged.
prepare(capture=True) records each orchestration once per capture key and
slot and replays its submissions after (engine.distributed.capture).

prepare(transport=RayTransport(...)) runs the chip workers as Ray actors,
on one machine or across a cluster (engine.distributed.ray_transport): the
same surface, regions copied per submission instead of shared.
"""

from engine.distributed.errors import WorkerDiedError
from engine.distributed.orchestrator import Orchestrator
from engine.distributed.program import DistributedProgram, PerWorker, program
from engine.distributed.runtime import DistributedRuntime
from engine.distributed.ray_transport import RayTransport
from engine.distributed.transport import ProcessTransport, Region, Transport

__all__ = ["DistributedProgram", "DistributedRuntime", "Orchestrator", "PerWorker", "ProcessTransport", "RayTransport",
           "Region", "Transport", "WorkerDiedError", "program"]
