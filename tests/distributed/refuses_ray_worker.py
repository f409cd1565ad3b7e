"""A module that imports in the driver but refuses to load inside a Ray actor (a chip worker's setup failure)."""

from __future__ import annotations

import ray

import engine
import engine.distributed as dist
from engine import Out
from engine import kernels as K

if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
    raise RuntimeError("this module refuses to load in a Ray chip worker")


@engine.program
def fill(run: engine.Run, y: Out((4,))):
    run.submit(K.fill, out=y, value=1.0)


@dist.program
def uses_fill(orch: dist.Orchestrator, y: Out((4,))):
    orch.submit(fill, y, worker=0)
