"""AsyncRuntime drives any engine.backend.Backend through the protocol alone.

A small fake backend, written in pure Python against the protocol and
nothing else, runs dispatch, call, stream, back-pressure, cancellation and
stats. A guard around it refuses every attribute that is not a member of the
protocol, so the scheduler cannot reach past it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Mapping

import anyio
import pytest

import engine
from engine import _native
from engine.backend import Backend, CompletionSource, RunState
from engine.errors import RunCancelledError
from scheduler import AsyncRuntime

pytestmark = pytest.mark.anyio

PROTOCOL_MEMBERS = frozenset(n for n in dir(Backend) if not n.startswith("_"))


class FakeRun:
    """A run's state: completes when its work (a function of its arguments) has run on the fake's thread."""

    def __init__(self, run_id: int) -> None:
        self.id = run_id
        self._event = threading.Event()
        self.cancelled = False
        self.error: BaseException | None = None
        self.times_ns = {"created_ns": time.monotonic_ns(), "sealed_ns": -1, "first_start_ns": -1,
                         "last_end_ns": -1, "done_ns": -1, "busy_ns": 0}

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> bool:
        if self.done:
            return False
        self.cancelled = True
        return True

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def times(self) -> dict[str, int]:
        return dict(self.times_ns)

    def outcome(self) -> tuple[BaseException | None, bool]:
        return self.error, self.cancelled


class FakeCompletions:
    """A completion source over a pipe: readable while completed run ids are queued."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._ids: list[int] = []
        self._lock = threading.Lock()

    @property
    def notifier_fd(self) -> int:
        return self._r

    def post(self, run_id: int) -> None:
        with self._lock:
            self._ids.append(run_id)
        os.write(self._w, b"x")

    def drain_completed(self) -> list[int]:
        with self._lock:
            try:
                os.read(self._r, 4096)
            except BlockingIOError:
                pass
            ids, self._ids = self._ids, []
        return ids

    def now_ns(self) -> int:
        return time.monotonic_ns()

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


class FakeBackend:
    """`depth` slots; a run doubles its one number on a thread of its own, once its gate opens."""

    def __init__(self, depth: int = 2) -> None:
        self.depth = depth
        self.closed = False
        self._free = list(range(depth))
        self._lock = threading.Lock()
        self._completions = FakeCompletions()
        self._ids = iter(range(1, 1 << 30))
        self.gate = threading.Event()
        self.gate.set()
        self.launched: list[int] = []
        self.abandoned = 0
        self.threads: list[threading.Thread] = []

    # -- the protocol -------------------------------------------------------------------------
    def check_open(self) -> None:
        if self.closed:
            raise engine.ClosedError("the fake is closed")

    def completions(self) -> CompletionSource:
        return self._completions

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        self.check_open()
        if len(args) != 1 or not isinstance(args[0], (int, float)):
            raise TypeError("the fake takes one number")
        return args[0]

    def try_admit(self, notify: bool) -> tuple[RunState, int, int] | None:
        self.check_open()
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop(0)
        run = FakeRun(next(self._ids))
        return run, run.id, slot

    def abandon(self, lease: tuple[RunState, int, int]) -> None:
        self.abandoned += 1
        self._release(lease[2])

    def launch(self, call: Any, lease: tuple[RunState, int, int], dispatch_ns: int, log: Any,
               launch_ns: int = 0) -> tuple[RunState, int, Any]:
        run, run_id, slot = lease
        assert isinstance(run, FakeRun)
        if call == 13:
            self._release(slot)  # a failed launch gives its lease back, as the protocol says
            raise ValueError("the orchestration refused 13")
        if log is not None:
            log.launched()
        self.launched.append(run_id)
        box: list[Any] = []
        t = threading.Thread(target=self._execute, args=(run, slot, call, box, log, dispatch_ns), daemon=True)
        self.threads.append(t)
        t.start()
        return run, run_id, box

    def finish(self, run: RunState, run_id: int, payload: Any) -> tuple[Any, BaseException | None]:
        assert isinstance(run, FakeRun) and run.done
        error, cancelled = run.outcome()
        if error is not None:
            return None, error
        if cancelled:
            return None, RunCancelledError(f"run {run_id} was cancelled")
        return payload[0], None

    def set_tracing(self, on: bool) -> None:
        pass

    def export_trace(self, path: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    # -- the fake's device ----------------------------------------------------------------------
    def _execute(self, run: FakeRun, slot: int, x: Any, box: list[Any], log: Any, dispatch_ns: int) -> None:
        self.gate.wait()
        t0 = time.monotonic_ns()
        if not run.cancelled:
            if x < 0:
                run.error = ValueError(f"negative: {x}")
            else:
                box.append(2 * x)
        t1 = time.monotonic_ns()
        run.times_ns.update(first_start_ns=t0, last_end_ns=t1, done_ns=t1)
        self._release(slot)  # the slot frees before the run is seen done
        if log is not None:
            kind = 2 if run.cancelled else 1 if run.error is not None else 0
            log.record(dispatch_ns, run.times_ns["created_ns"], run.times_ns["created_ns"], t0, t0, t1, t1, kind)
        run._event.set()
        self._completions.post(run.id)

    def _release(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)


class ProtocolOnly:
    """Passes the protocol's members through to the fake and refuses everything else."""

    def __init__(self, inner: FakeBackend) -> None:
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name: str) -> Any:
        if name not in PROTOCOL_MEMBERS:
            raise AssertionError(f"the scheduler reached past the backend protocol: .{name}")
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AssertionError(f"the scheduler set .{name} on its backend")


@pytest.fixture
def fake():
    inner = FakeBackend(depth=2)
    yield inner, ProtocolOnly(inner)
    inner.gate.set()
    for t in inner.threads:
        t.join(20)
    inner._completions.close()


def test_the_fake_satisfies_the_declared_protocol(fake):
    inner, guarded = fake
    assert isinstance(inner, Backend)
    assert isinstance(inner.completions(), CompletionSource)
    assert isinstance(FakeRun(1), RunState)
    assert {"bind", "try_admit", "abandon", "launch", "finish", "completions", "check_open"} <= PROTOCOL_MEMBERS


def test_the_engine_runtimes_satisfy_the_protocol():
    for cls in (engine.Runtime,):
        missing = [n for n in PROTOCOL_MEMBERS if not hasattr(cls, n) and n not in ("depth",)]
        assert not missing, missing
    from engine.distributed import DistributedRuntime

    assert not [n for n in PROTOCOL_MEMBERS if not hasattr(DistributedRuntime, n) and n != "depth"]
    assert not issubclass(DistributedRuntime, engine.Runtime)  # one protocol, no virtual subclassing


async def test_dispatch_call_and_stream_through_the_protocol_alone(fake):
    inner, guarded = fake
    async with AsyncRuntime(guarded) as art:
        assert art.runtime is guarded
        fut = await art.dispatch(5)
        assert await fut == 10
        assert await art.call(21) == 42
        assert [y async for y in art.stream([1, 2, 3, 4, 5])] == [2, 4, 6, 8, 10]
        unordered = sorted([pair async for pair in art.stream([3, 1, 2], ordered=False)])
        assert unordered == [(0, 6), (1, 2), (2, 4)]
        await art.drain()
        stats = art.stats()
    assert stats.dispatched == stats.completed == 10 and stats.failed == stats.cancelled == 0
    assert stats.latency.samples == 10
    assert sorted(inner._free) == [0, 1]


async def test_back_pressure_errors_and_cancellation_through_the_protocol(fake):
    inner, guarded = fake
    inner.gate.clear()  # runs hold their slots until the gate opens
    async with AsyncRuntime(guarded) as art:
        a = await art.dispatch(1)
        b = await art.dispatch(2)
        with anyio.move_on_after(0.2) as scope:  # both slots held: the third waits for admission
            await art.dispatch(3)
        assert scope.cancelled_caught and art.waiting == 0 and len(inner.launched) == 2
        async with anyio.create_task_group() as tg:
            results: list[Any] = []

            async def third() -> None:
                results.append(await art.call(3))

            tg.start_soon(third)
            await anyio.sleep(0.05)
            assert art.waiting == 1
            assert b.cancel()
            inner.gate.set()
        assert results == [6]
        assert await a == 2
        with pytest.raises(RunCancelledError):
            await b
        with pytest.raises(ValueError, match="negative"):
            await art.call(-1)  # the run's error, from its future
        with pytest.raises(ValueError, match="refused 13"):
            await art.dispatch(13)  # the launch's error, from dispatch; its slot came back
        with pytest.raises(TypeError, match="one number"):
            await art.dispatch("x")  # bind's error, before admission
        assert await art.call(4) == 8
        # b's future settled when it was cancelled; its run counts once the device lets go of it.
        await art.drain()
        stats = art.stats()
    assert stats.completed == 3 and stats.failed == 1 and stats.cancelled == 1
    assert sorted(inner._free) == [0, 1]


async def test_close_runtime_closes_the_backend(fake):
    inner, guarded = fake
    async with AsyncRuntime(guarded, close_runtime=True) as art:
        assert await art.call(1) == 2
    assert inner.closed
    with pytest.raises(engine.ClosedError):
        async with AsyncRuntime(guarded):
            pass


def test_a_non_backend_is_refused():
    with pytest.raises(TypeError, match="Backend"):
        AsyncRuntime(object())  # type: ignore[arg-type]
    _native.RunLog(4)  # the stats log the scheduler hands to launch() is the engine's native one
