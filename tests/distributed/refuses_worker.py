"""A module that imports in the host but refuses to load inside a chip worker (a setup failure):
a worker process of the process transport, or a Ray actor of RayTransport."""

from __future__ import annotations

import multiprocessing
import sys

import engine
import engine.distributed as dist
from engine import Out
from engine import kernels as K

if multiprocessing.parent_process() is not None:
    raise RuntimeError("this module refuses to load in a chip worker")
_ray = sys.modules.get("ray")  # never imported here: the process transport's tests need no Ray
if _ray is not None and _ray.is_initialized() and _ray.get_runtime_context().get_actor_id() is not None:
    raise RuntimeError("this module refuses to load in a Ray chip worker")


@engine.program
def fill(run: engine.Run, y: Out((4,))):
    run.submit(K.fill, out=y, value=1.0)


@dist.program
def uses_fill(orch: dist.Orchestrator, y: Out((4,))):
    orch.submit(fill, y, worker=0)
