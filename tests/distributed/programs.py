"""Programs the distributed tests run. Module level: chip workers import sub-programs by name."""

from __future__ import annotations

import os

import numpy as np

import engine
import engine.distributed as dist
from engine import In, InOut, Out, Scalar
from engine import kernels as K

D, H = 32, 64  # MLP widths
KD, N = 48, 64  # tensor-parallel matmul: x (B, KD) @ w (KD, N)


# -- single-device programs (run on a chip worker) ---------------------------------------------------
@engine.program
def mlp_shard(run: engine.Run, x: In(("B", D)), w1: In((D, H)), w2: In((H, D)), y: Out(("B", D))):
    h = run.scratch(("B", H), "float32")
    run.submit(K.matmul, x, w1, out=h)
    run.submit(K.gelu, h, out=h)
    run.submit(K.matmul, h, w2, out=y)


@engine.program
def matmul(run: engine.Run, x: In(("B", "K")), w: In(("K", "N")), y: Out(("B", "N"))):
    run.submit(K.matmul, x, w, out=y)


@engine.program
def add_into(run: engine.Run, x: In(("B", D)), acc: InOut(("B", D))):
    run.submit(K.add, acc, x, out=acc)


@engine.program
def scale(run: engine.Run, x: In(("B", D)), y: Out(("B", D)), factor: Scalar(float)):
    run.submit(K.scale, x, out=y, alpha=factor)


@engine.program
def spin(run: engine.Run, y: Out((1,)), ns: Scalar(int)):
    run.submit(K.spin, ns=ns)
    run.submit(K.fill, out=y, value=1.0)


@engine.program
def unused(run: engine.Run, y: Out((4,))):
    run.submit(K.fill, out=y, value=7.0)


@engine.host_kernel
def _raise(a, out):
    raise RuntimeError("boom in a host kernel")


@engine.program
def failing(run: engine.Run, x: In(("B", D)), y: Out(("B", D))):
    run.submit(_raise, x, out=y)


# -- distributed programs ---------------------------------------------------------------------------------
@dist.program
def dp_mlp(orch: dist.Orchestrator, x: In(("B", D)), w1: In((D, H)), w2: In((H, D)), y: Out(("B", D))):
    """Data parallel: batch shards, one per worker, weights staged with every run."""
    for i, (xs, ys) in enumerate(zip(orch.split(x), orch.split(y))):
        orch.submit(mlp_shard, xs, w1, w2, ys, worker=i)


@dist.program
def dp_mlp_resident(orch: dist.Orchestrator, x: In(("B", D)), w1: dist.PerWorker(In((D, H))),
                    w2: dist.PerWorker(In((H, D))), y: Out(("B", D))):
    """Data parallel with each worker's own resident copy of the weights."""
    for i, (xs, ys) in enumerate(zip(orch.split(x), orch.split(y))):
        orch.submit(mlp_shard, xs, w1[i], w2[i], ys, worker=i)


@dist.program(callbacks={"gather": ("in", "in", "out")})
def tp_matmul(orch: dist.Orchestrator, x: In(("B", KD)), w: In((KD, N)), y: Out(("B", N))):
    """Tensor parallel: column shards of w (strided views of the shared region), gathered on the host."""
    cols = N // orch.workers
    parts = []
    for i in range(orch.workers):
        part = orch.scratch(("B", cols), "float32")
        orch.submit(matmul, x, w[:, i * cols:(i + 1) * cols], part, worker=i)
        parts.append(part)
    orch.submit_sub("gather", *parts, y)


def gather(a: np.ndarray, b: np.ndarray, y: np.ndarray) -> None:
    np.concatenate([a, b], axis=1, out=y)


@dist.program(callbacks={"double": ("inout",)})
def chain(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D))):
    """worker 0 -> host callback (in place) -> worker 1: each step must see the previous one's output."""
    a = orch.scratch(("B", D), "float32")
    orch.submit(scale, x, a, 3.0, worker=0)
    orch.submit_sub("double", a)
    orch.submit(scale, a, y, 0.5, worker=1)


def double(a: np.ndarray) -> None:
    a *= 2.0


@dist.program
def accumulate(orch: dist.Orchestrator, x: In(("B", D)), acc: InOut(("B", D)), worker: Scalar(int)):
    """A resident accumulator on `worker`: runs must apply in dispatch order."""
    orch.submit(add_into, x, acc, worker=worker)


@engine.program
def double_then_add(run: engine.Run, x: In(("B", D)), acc: InOut(("B", D))):
    run.submit(K.scale, acc, out=acc, alpha=2.0)
    run.submit(K.add, acc, x, out=acc)


@dist.program
def horner(orch: dist.Orchestrator, x: In(("B", D)), acc: InOut(("B", D)), worker: Scalar(int)):
    """acc = 2 acc + x on `worker`: the result says in which order the runs applied."""
    orch.submit(double_then_add, x, acc, worker=worker)


@dist.program
def pinned_wrong(orch: dist.Orchestrator, x: In(("B", D)), acc: InOut(("B", D))):
    """Passes its resident argument to worker 1 whatever worker it lives on."""
    orch.submit(add_into, x, acc, worker=1)


@dist.program(programs=[unused])
def slow(orch: dist.Orchestrator, y: Out((2,)), ns: Scalar(int)):
    """Each worker spins for ns nanoseconds (keeps runs in flight)."""
    for i in range(orch.workers):
        orch.submit(spin, y[i:i + 1], ns, worker=i)


@dist.program
def spin_on(orch: dist.Orchestrator, y: Out((1,)), ns: Scalar(int), worker: Scalar(int)):
    """One worker spins for ns nanoseconds."""
    orch.submit(spin, y, ns, worker=worker)


@dist.program
def fails_on_worker(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D))):
    orch.submit(failing, x, y, worker=1)


@dist.program(callbacks={"explode": ("in",)})
def fails_on_host(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D))):
    orch.submit_sub("explode", x)
    orch.submit(scale, x, y, 1.0, worker=0)


def explode(a: np.ndarray) -> None:
    raise ValueError("callback exploded")


@engine.host_kernel
def _exit_process(a, out):
    os._exit(3)  # a worker that crashes on its own


@engine.program
def crash(run: engine.Run, x: In(("B", D)), y: Out(("B", D))):
    run.submit(_exit_process, x, out=y)


@dist.program
def crashes(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D))):
    orch.submit(crash, x, y, worker=0)


@dist.program
def fan_out(orch: dist.Orchestrator, x: In(("R", D)), y: Out(("R", D))):
    """Worker 0 writes a; then one submission per row on worker 1 reads it: a reply releases them all at once."""
    a = orch.scratch(("R", D), "float32")
    orch.submit(scale, x, a, 2.0, worker=0)
    for r in range(x.shape[0]):
        orch.submit(scale, a[r:r + 1], y[r:r + 1], 0.5, worker=1)


@dist.program
def scaled_on(orch: dist.Orchestrator, x: In(("B", D)), acc: InOut(("B", D)), y: Out(("B", D)),
              factor: Scalar(float), worker: Scalar(int)):
    """The same submissions run after run, with a scalar and a resident that may change."""
    orch.submit(scale, x, y, factor, worker=worker)
    orch.submit(add_into, x, acc, worker=worker)


@dist.program
def pipeline(orch: dist.Orchestrator, x: In(("B", D)), wa: In((D, D)), wb: In((D, D)), y: Out(("B", D))):
    """Pipeline parallel: stage 1 and a scaling on worker 0 (one after the other there), stage 2 on worker 1.

    y = 2 (x wa) wb
    """
    h = orch.scratch(("B", D), "float32")
    h2 = orch.scratch(("B", D), "float32")
    orch.submit(matmul, x, wa, h, worker=0)
    orch.submit(scale, h, h2, 2.0, worker=0)
    orch.submit(matmul, h2, wb, y, worker=1)


# Resident tensors a program reaches by itself (not through its arguments), keyed by name: see reaches_resident.
REACHED: dict[str, object] = {}


@dist.program
def reaches_resident(orch: dist.Orchestrator, y: Out(("B", D))):
    """y = REACHED["w"], a resident tensor on worker 0 that the function finds by name, not as an argument."""
    # prepare's planning pass runs before any resident tensor exists: it submits the same program on scratch
    w = orch.scratch(("B", D), "float32") if orch.planning else REACHED["w"]
    orch.submit(scale, w, y, 1.0, worker=0)


@dist.program
def tags_run_id(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D))):
    """Scales by a factor taken from the run's id: what a captured program must not do."""
    orch.submit(scale, x, y, float(orch.run_id % 2 + 1), worker=0)


@dist.program
def branches_on(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D)), factor: Scalar(float)):
    """y = factor x for a factor above 1, else y = x: the orchestration reads factor (a comparison)."""
    orch.submit(scale, x, y, factor if factor > 1.0 else 1.0, worker=0)


@dist.program
def widens(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D)), n: Scalar(int)):
    """y = n x: an int Scalar passed straight into the sub-program's float one (whose check may refuse it)."""
    orch.submit(scale, x, y, n, worker=0)


KEPT: list = []


@dist.program
def keeps_scalar(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D)), factor: Scalar(float)):
    """Keeps its Scalar beyond the orchestration: what a captured program must not do."""
    KEPT.append(factor)
    orch.submit(scale, x, y, 1.0, worker=0)


@dist.program
def steps(orch: dist.Orchestrator, x: In(("B", D)), acc: InOut(("B", D)), y: Out(("B", D)), a: Scalar(float),
          k: Scalar(int)):
    """A few submissions over two workers that pass `a` through and branch on `k` (for the property test)."""
    orch.submit(scale, x, y, a, worker=k % 2)
    if k >= 2 or orch.planning:  # the planning pass sizes every sub-program it may submit
        orch.submit(add_into, y, acc, worker=k % 2)
    orch.submit(scale, y, y, a if k == 3 else 0.5, worker=k % 2)


@dist.program
def falls_back(orch: dist.Orchestrator, x: In(("B", D)), y: Out(("B", D)), factor: Scalar(float)):
    """A submission refused and caught (no such worker), then another without the Scalar: y = x."""
    try:
        orch.submit(scale, x, y, factor, worker=orch.workers)
    except ValueError:
        pass
    orch.submit(scale, x, y, 1.0, worker=0)
