"""Fixtures for the scheduler tests: both anyio backends, programs, and a gate that holds the device.

The gate is a host callback that blocks its pool worker on a threading.Event
(which releases the GIL). With one pool worker, a run whose first task is the
gate keeps every later task queued until the test opens it, so tests can
observe back-pressure and cancellation without relying on timing.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import anyio
import numpy as np
import pytest

import engine
from engine import In, Out, Scalar
from engine import kernels as K

# Generous bound for waiting on something that should happen promptly (not a performance figure).
PATIENCE_S = 20.0


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


# -- programs ------------------------------------------------------------------------------------
@engine.program
def add(run: engine.Run, x: In(("B", 4)), y: In(("B", 4)), z: Out(("B", 4))):
    run.submit(K.add, x, y, out=z)


@engine.program
def double(run: engine.Run, x: In(("B", 4)), y: Out(("B", 4))):
    run.submit(K.add, x, x, out=y)


@engine.program
def tagged(run: engine.Run, value: Scalar(float), ns: Scalar(int), out: Out((8,))):
    """out[...] = value after `ns` nanoseconds of device work."""
    if ns > 0:
        run.submit(K.spin, ns=ns)
    run.submit(K.fill, out=out, value=value)


@engine.program(callbacks={"gate": 0})
def gated(run: engine.Run, value: Scalar(float), out: Out((8,))):
    """Waits at the gate on the device, then out[...] = value."""
    run.host("gate")
    run.submit(K.fill, out=out, value=value)


@engine.program
def noop(run: engine.Run):
    run.submit(K.noop)


@engine.program
def spin(run: engine.Run, ns: Scalar(int)):
    run.submit(K.spin, ns=ns)


@engine.host_kernel
def _boom(out):
    raise RuntimeError("boom")


@engine.program
def maybe_fail(run: engine.Run, value: Scalar(float), fail: Scalar(int), out: Out((8,))):
    """out[...] = value, or a KernelError from the 'boom' host kernel when fail."""
    run.submit(K.fill, out=out, value=value)
    if fail:
        run.submit(_boom, out=out)


@engine.program
def bad_orchestration(run: engine.Run, fail: Scalar(int), out: Out((8,))):
    run.submit(K.fill, out=out, value=1.0)
    if fail:
        raise RuntimeError("orchestration failed")


class Gate:
    """A device-side barrier: tasks entering it block until open() (per runtime)."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._lock = threading.Lock()
        self.entered = 0

    def __call__(self) -> None:
        with self._lock:
            self.entered += 1
        self._open.wait()

    def open(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._open.clear()


@pytest.fixture(params=[False, True], ids=["loop", "thread"])
def in_thread(request: pytest.FixtureRequest) -> bool:
    """Both places orchestration can run: the loop thread and a worker thread."""
    return request.param


@pytest.fixture
def make_rt() -> Any:
    """make_rt(prog, **prepare_kwargs) -> Runtime (one pool worker unless given); closed at teardown."""
    made: list[engine.Runtime] = []
    gates: list[Gate] = []

    def make(prog: engine.Program, **kwargs: Any) -> engine.Runtime:
        kwargs.setdefault("workers", 1)
        rt = prog.prepare(**kwargs)
        made.append(rt)
        return rt

    make.gates = gates  # type: ignore[attr-defined]
    yield make
    for g in gates:
        g.open()  # never leave a worker blocked
    for rt in made:
        rt.close()


@pytest.fixture
def gated_rt(make_rt: Any) -> Callable[..., tuple[engine.Runtime, Gate]]:
    """gated_rt(depth=...) -> (Runtime of `gated`, its Gate)."""

    def make(**kwargs: Any) -> tuple[engine.Runtime, Gate]:
        gate = Gate()
        make_rt.gates.append(gate)
        rt = make_rt(gated, callbacks={"gate": gate}, **kwargs)
        return rt, gate

    return make


async def eventually(cond: Callable[[], bool], what: str = "condition") -> None:
    """Yields to the loop until cond() holds (fails after PATIENCE_S: something is stuck)."""
    with anyio.fail_after(PATIENCE_S):
        while not cond():
            await anyio.sleep(0.001)


def baseline(rt: engine.Runtime) -> dict[str, int]:
    """The memory and slot counters that must come back after runs are gone."""
    s = rt.memory_stats()
    return {k: s[k] for k in ("bytes_in_use", "live_allocations", "mapped_regions", "free_slots")}


def filled(value: float) -> np.ndarray:
    return np.full(8, value, np.float32)
