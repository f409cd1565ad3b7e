"""The programs the tooling runs: the demo's MLP, the overlap workload, the many-task program.

`tandem demo` and `tandem trace mlp` run the MLP; `tandem trace overlap` and the
overlap benchmark (benchmarks/overlap.py) run `spin`, so a trace shows exactly
the work the benchmark measures; `tandem demo` and benchmarks/capture.py run
`small_tasks` captured and uncaptured, and benchmarks/capture.py runs
`microbatch_pipeline` (engine.distributed) both ways too. Both also warm a
fresh runtime up the same way before measuring it (warm_up).

The parameters are annotated with engine specs (`In(...)`), which a type checker
does not read as types: mypy reports `valid-type` for them, as for any program.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import numpy as np

import engine
import engine.distributed as dist
from engine import In, Out, Scalar
from engine import kernels as K

D_IN, D_HIDDEN = 384, 1536

# A new runtime's first runs are slow: with two pool workers on the 2-vCPU VM, its first 10-50 runs take up to
# twice the steady time, until the scheduler has spread the threads over the cores (none with one worker).
WARM_UP_S = 0.2


def warm_up(step: Callable[[], object], seconds: float = WARM_UP_S) -> None:
    """Calls step() until `seconds` have passed (at least once), so what is measured next is the steady state."""
    t0 = time.perf_counter()
    step()
    while time.perf_counter() - t0 < seconds:
        step()


@engine.program
def mlp(run: engine.Run, x: In(("B", D_IN)), w1: In((D_IN, D_HIDDEN)), w2: In((D_HIDDEN, D_IN)),
        y: Out(("B", D_IN))) -> None:
    h = run.scratch(("B", D_HIDDEN), "float32")
    # Row tiles: one per pool worker, so the device's cores share the work.
    for xt, ht, yt in zip(run.split(x), run.split(h), run.split(y)):
        run.submit(K.matmul, xt, w1, out=ht)
        run.submit(K.gelu, ht, out=ht, approximate="tanh")
        run.submit(K.matmul, ht, w2, out=yt)


def mlp_weights(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(w1, w2) for `mlp`, scaled so activations stay near unit size."""
    w1 = (rng.standard_normal((D_IN, D_HIDDEN)) / math.sqrt(D_IN)).astype(np.float32)
    w2 = (rng.standard_normal((D_HIDDEN, D_IN)) / math.sqrt(D_HIDDEN)).astype(np.float32)
    return w1, w2


def python_work(seconds: float) -> None:
    """Busy Python work for `seconds` (the GIL stays held, as real orchestration holds it)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


SMALL = 64  # small_tasks works on SMALL x SMALL float32 tiles
SMALL_TASKS = 200


@engine.program
def small_tasks(run: engine.Run, x: In((SMALL, SMALL)), w: In((SMALL, SMALL)), y: Out((SMALL, SMALL))) -> None:
    """200 small tasks: a chain of elementwise and matmul steps over three scratch tiles."""
    a, b, c = (run.scratch((SMALL, SMALL)) for _ in range(3))
    run.submit(K.copy, x, out=a)
    for i in range(SMALL_TASKS // 2 - 1):
        if i % 3 == 0:
            run.submit(K.matmul, a, w, out=b)
        elif i % 3 == 1:
            run.submit(K.add, a, b, out=c)
        else:
            run.submit(K.relu, c, out=a)
        run.submit(K.scale, a, out=a, alpha=0.5)
    run.submit(K.copy, a, out=y)


def small_tasks_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """small_tasks in float32 numpy (the same operations in the same order)."""
    a = x.copy()
    b = c = np.zeros_like(x)
    for i in range(SMALL_TASKS // 2 - 1):
        if i % 3 == 0:
            b = a @ w
        elif i % 3 == 1:
            c = a + b
        else:
            a = np.maximum(c, 0)
        a = a * np.float32(0.5)
    return a


@engine.program
def spin(run: engine.Run, x: In((16,)), host_s: Scalar(float), device_ns: Scalar(int)) -> None:
    """`host_s` seconds of Python orchestration, then one `spin` task of `device_ns` on the device."""
    python_work(host_s)
    run.submit(K.spin, ns=device_ns)


MICRO_BATCHES = 8  # microbatch_pipeline's micro-batches a run


@engine.program
def pipeline_stage(run: engine.Run, x: In(("M", SMALL)), w: In((SMALL, SMALL)), y: Out(("M", SMALL)),
                   alpha: Scalar(float)) -> None:
    """y = alpha * relu(x @ w): one stage for one micro-batch."""
    run.submit(K.matmul, x, w, out=y)
    run.submit(K.relu, y, out=y)
    run.submit(K.scale, y, out=y, alpha=alpha)


@dist.program
def microbatch_pipeline(orch: dist.Orchestrator, x: In(("B", SMALL)), w0: In((SMALL, SMALL)),
                        w1: In((SMALL, SMALL)), y: Out(("B", SMALL)), alpha: Scalar(float)) -> None:
    """Two pipeline stages on chip workers 0 and 1 (w0, w1 resident there) over MICRO_BATCHES micro-batches, 16
    sub-program calls a run; `alpha` (a per-run value, say a temperature) goes straight into the second stage."""
    h = orch.scratch(("B", SMALL))
    for xs, hs, ys in zip(orch.split(x, MICRO_BATCHES), orch.split(h, MICRO_BATCHES), orch.split(y, MICRO_BATCHES)):
        orch.submit(pipeline_stage, xs, w0, hs, 1.0, worker=0)
        orch.submit(pipeline_stage, hs, w1, ys, alpha, worker=1)


def microbatch_pipeline_reference(x: np.ndarray, w0: np.ndarray, w1: np.ndarray, alpha: float) -> np.ndarray:
    h = np.maximum(x @ w0, 0)
    return np.float32(alpha) * np.maximum(h @ w1, 0)
