"""Fault injection: each fault ends in a clear error, a usable (or cleanly closed) runtime, nothing leaked.

* device memory exhausted during prepare(), at every allocation it makes;
* device memory exhausted mid-run: by a resident allocation while runs are in
  flight, by an orchestration that allocates, by a host task that allocates;
* a host callback raising anything (BaseException subclasses, an exception
  whose message cannot be formatted, a megabyte-long message);
* a kernel (native or host) failing in the middle of a graph, at a random
  position, among pipelined runs that share a resident accumulator;
* close() while runs are in flight, from threads and under an AsyncRuntime.

(KeyboardInterrupt while a synchronous caller waits: test_interrupt.py.)
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import engine
from engine import In, InOut, Out, Scalar
from engine import kernels as K
from scheduler import AsyncRuntime

from .conftest import PATIENCE_S, ProcessBaseline, assert_back_to, counters, eventually, record, size

F32 = np.float32


# -- device memory exhausted during prepare() -----------------------------------------------------
@engine.program
def mlp(run: engine.Run, x: In(("B", 16)), w: In((16, 32)), y: Out(("B", 32))):
    h = run.scratch(("B", 32))
    run.submit(K.matmul, x, w, out=h)
    run.submit(K.relu, h, out=y)


def test_prepare_fails_cleanly_when_memory_runs_out_at_each_of_its_allocations(device_spy):
    process = ProcessBaseline()
    depth = 3
    with mlp.prepare(depth=depth, workers=2, bounds={"B": 8}) as rt:
        sizes = [a.size for a in sorted(rt._owned.values(), key=lambda a: a.id)]
    need = sum(sizes)
    # A limit one byte short of each successive allocation makes exactly that allocation fail.
    limits = [sum(sizes[:i]) + sizes[i] - 1 for i in range(len(sizes))] + [1]
    for limit in limits:
        with pytest.raises(engine.DeviceMemoryError, match="exhausted"):
            mlp.prepare(depth=depth, workers=2, bounds={"B": 8}, memory_limit=limit)
        dev = device_spy[-1].stats()
        assert (dev["live_allocations"], dev["bytes_in_use"], dev["mapped_regions"]) == (0, 0, 0), dev
        record(faults_injected=1)
    gc.collect()
    process.check()  # every pool that was started got joined; every eventfd closed
    # Exactly enough memory: it works, and the next byte is refused without harm.
    x, w = np.ones((8, 16), F32), np.ones((16, 32), F32)
    with mlp.prepare(depth=depth, workers=2, bounds={"B": 8}, memory_limit=need + 64) as rt:
        base = counters(rt)
        np.testing.assert_array_equal(rt(x, w), x @ w)
        with pytest.raises(engine.DeviceMemoryError):
            rt.alloc_tensor((32,), "float32")
        record(faults_injected=1)
        np.testing.assert_array_equal(rt(x, w), x @ w)
        assert_back_to(rt, base)


# -- device memory exhausted mid-run ---------------------------------------------------------------
class Gate:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def __call__(self, *arrays: np.ndarray) -> None:
        self.entered.release()
        assert self.release.wait(PATIENCE_S), "the gate was never opened"


@engine.program(callbacks={"gate": 0})
def gated_scale(run: engine.Run, x: In((64,)), y: Out((64,))):
    run.host("gate")
    run.submit(K.scale, x, out=y, alpha=3.0)


def test_resident_allocation_beyond_the_limit_while_runs_are_in_flight():
    gate = Gate()
    limit = 4 * 1024
    with gated_scale.prepare(depth=3, workers=1, memory_limit=limit, callbacks={"gate": gate}) as rt:
        base = counters(rt)
        xs = [np.full(64, i, F32) for i in range(3)]
        handles = [rt.submit(x) for x in xs]
        assert gate.entered.acquire(timeout=PATIENCE_S)
        held = []
        with pytest.raises(engine.DeviceMemoryError, match="exhausted"):
            while True:  # fill the device while the runs wait on it
                held.append(rt.alloc_tensor((64,), "float32", init=np.full(64, len(held), F32)))
        record(faults_injected=1)
        assert rt.memory_stats()["bytes_in_use"] <= limit
        gate.release.set()
        for x, h in zip(xs, handles):
            np.testing.assert_array_equal(h.result(PATIENCE_S), 3 * x)
        for i, t in enumerate(held):  # what was allocated is intact
            np.testing.assert_array_equal(t.to_numpy(), np.full(64, i, F32))
            rt.free_tensor(t)
        assert_back_to(rt, base)
        np.testing.assert_array_equal(rt(xs[1]), 3 * xs[1])


def _allocating_program(holder: dict) -> engine.Program:
    """A program whose orchestration allocates a resident tensor per run (e.g. a growing cache), after
    it has submitted work, and hands it to one more task."""

    @engine.program
    def grow(run: engine.Run, x: In((64,)), y: Out((64,))):
        h = run.scratch((64,))
        run.submit(K.scale, x, out=h, alpha=2.0)
        if run.planning:
            run.submit(K.copy, h, out=y)
            return
        extra = holder["rt"].alloc_tensor((256,), "float32")  # DeviceMemoryError once the device is full
        holder["made"].append(extra)
        run.submit(K.copy, h, out=extra[0:64])
        run.submit(K.copy, extra[0:64], out=y)

    return grow


@pytest.mark.parametrize("route", ["call", "submit", "async"])
def test_memory_exhausted_inside_an_orchestration_fails_that_dispatch_only(route):
    holder: dict = {"made": []}
    prog = _allocating_program(holder)
    with prog.prepare(depth=2, workers=2, memory_limit=6 * 1024) as rt:
        holder["rt"] = rt
        base = counters(rt)
        x = np.arange(64, dtype=F32)
        outcomes = []

        def one() -> np.ndarray:
            if route == "call":
                return rt(x)
            if route == "submit":
                return rt.submit(x).result(PATIENCE_S)

            async def main() -> np.ndarray:
                async with AsyncRuntime(rt) as art:
                    return await art.call(x)

            return anyio.run(main)

        for _ in range(40):
            try:
                outcomes.append(one())
            except engine.DeviceMemoryError as e:
                assert "exhausted" in str(e)
                outcomes.append(e)
                break
        assert isinstance(outcomes[-1], engine.DeviceMemoryError), "the device never ran out"
        record(faults_injected=1)
        for y in outcomes[:-1]:
            np.testing.assert_array_equal(y, 2 * x)
        # the failed dispatch released its slot, mapping and run; what the program allocated is intact
        eventually(lambda: rt._engine.stats()["runs_live"] == 0, "runs_live back to 0")
        c = counters(rt)
        assert (c["free_slots"], c["mapped_regions"], c["runs_live"]) == (base["free_slots"], 0, 0), c
        for t in holder["made"]:
            np.testing.assert_array_equal(t.to_numpy()[:64], 2 * x)
            rt.free_tensor(t)
        holder["made"].clear()
        assert_back_to(rt, base)
        np.testing.assert_array_equal(one(), 2 * x)  # usable again once memory is back
        for t in holder["made"]:
            rt.free_tensor(t)


def test_memory_exhausted_inside_a_host_task_fails_that_run_with_a_kernel_error():
    state: dict = {}

    @engine.host_kernel(name="spill")
    def spill(h: np.ndarray, out: np.ndarray) -> None:
        # A host task that needs device memory of its own (a spill buffer, say).
        state["buffers"].append(state["rt"].alloc_tensor((1024,), "float32"))
        np.copyto(out, h)

    @engine.program
    def prog(run: engine.Run, x: In((64,)), y: Out((64,))):
        h = run.scratch((64,))
        run.submit(K.scale, x, out=h, alpha=2.0)
        run.submit(spill, h, out=y)

    with prog.prepare(depth=2, workers=2, memory_limit=12 * 1024) as rt:
        state.update(rt=rt, buffers=[])
        base = counters(rt)
        x = np.arange(64, dtype=F32)
        err = None
        for _ in range(20):
            try:
                np.testing.assert_array_equal(rt(x), 2 * x)
            except engine.KernelError as e:
                err = e
                break
        assert err is not None, "the device never ran out"
        assert err.kernel.startswith("host:spill") and "exhausted" in err.message, err
        record(faults_injected=1)
        for t in state["buffers"]:
            rt.free_tensor(t)
        state["buffers"].clear()
        assert_back_to(rt, base)
        np.testing.assert_array_equal(rt(x), 2 * x)
        for t in state["buffers"]:
            rt.free_tensor(t)


# -- host callbacks raising -----------------------------------------------------------------------
class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("cannot format this exception")


class InterruptingStr(Exception):
    def __str__(self) -> str:
        raise KeyboardInterrupt


EXCEPTIONS = {
    "RuntimeError": lambda: RuntimeError("callback failed"),
    "KeyboardInterrupt": KeyboardInterrupt,
    "SystemExit": lambda: SystemExit(3),
    "MemoryError": MemoryError,
    "StopIteration": StopIteration,
    "GeneratorExit": GeneratorExit,
    "BaseException": lambda: BaseException("base"),
    "broken __str__": BrokenStr,
    "__str__ raising KeyboardInterrupt": InterruptingStr,
    "megabyte message": lambda: ValueError("x" * 1_000_000),
}


@engine.program(callbacks={"cb": 1})
def chain(run: engine.Run, x: In((8,)), acc: InOut((8,)), y: Out((8,)), cb_at: Scalar(int), n: Scalar(int)):
    """h = x, then n times h += x with the callback at position cb_at; y = h; acc += h."""
    h = run.scratch((8,))
    run.submit(K.copy, x, out=h)
    for i in range(n):
        if i == cb_at:
            run.host("cb", h)
        run.submit(K.add, h, x, out=h)
    run.submit(K.copy, h, out=y)
    run.submit(K.add, acc, h, out=acc)


def _marker_callback(exc_factory):
    def cb(a: np.ndarray) -> None:
        if a[0] <= -1000:  # runs marked by their input fail
            raise exc_factory()

    return cb


@pytest.mark.parametrize("exc", sorted(EXCEPTIONS))
def test_a_raising_host_callback_fails_its_run_only(exc):
    with chain.prepare(depth=3, workers=2, callbacks={"cb": _marker_callback(EXCEPTIONS[exc])}) as rt:
        base = counters(rt)
        acc = rt.alloc_tensor((8,), "float32", init=np.zeros(8, F32))
        with_acc = counters(rt)
        n, cb_at = 5, 2
        xs = [np.full(8, i + 1, F32) for i in range(6)]
        xs[3] = np.full(8, -1000, F32)
        ys = [np.full(8, -7, F32) for _ in xs]
        handles = [rt.submit(x, acc, y, cb_at, n) for x, y in zip(xs, ys)]
        want_acc = np.zeros(8, F32)
        for i, (x, y, h) in enumerate(zip(xs, ys, handles)):
            if i == 3:
                err = h.exception(PATIENCE_S)
                assert isinstance(err, engine.KernelError), err
                assert err.kernel == "callback:cb" and err.task_index == 1 + cb_at, err
                assert type(EXCEPTIONS[exc]()).__name__ in err.message
                np.testing.assert_array_equal(y, -7)  # its copy-back never ran
            else:
                h.result(PATIENCE_S)
                np.testing.assert_array_equal(y, x * (n + 1))
                want_acc += x * (n + 1)
        np.testing.assert_array_equal(acc.to_numpy(), want_acc)  # the failed run added nothing
        record(faults_injected=1)
        assert_back_to(rt, with_acc)
        rt.free_tensor(acc)
        assert_back_to(rt, base)


# -- a kernel failing in the middle of a graph ---------------------------------------------------------
@engine.host_kernel(name="host_fail")
def host_fail(h: np.ndarray, out: np.ndarray) -> None:
    raise RuntimeError("host kernel failed mid-graph")


@engine.program
def graph(run: engine.Run, x: In((8,)), ids: In((8,), "int32"), table: In((4, 8)), acc: InOut((8,)),
          y: Out((8,)), n: Scalar(int), fail_at: Scalar(int), how: Scalar(int)):
    """A chain h <- h + x (n steps) with a side branch, a failing task at fail_at (how: 1 native, 2 host)."""
    h = run.scratch((8,))
    side = run.scratch((8,))
    e = run.scratch((8, 8))  # the failing lookup's output (carved on every run, so planning sizes it)
    run.submit(K.copy, x, out=h)
    run.submit(K.scale, x, out=side, alpha=2.0)  # independent of the failure
    for i in range(n):
        if i == fail_at and how == 1:  # the lookup fails (an id outside the table); h then reads its output
            run.submit(K.embedding, ids, table, out=e)
            run.submit(K.add, h, e[0], out=h)
            continue
        if i == fail_at and how == 2:
            run.submit(host_fail, h, out=h)
        run.submit(K.add, h, x, out=h)
    run.submit(K.add, h, side, out=y)
    run.submit(K.add, acc, y, out=acc)


faults = settings(max_examples=size(30, 300, sanitized=10), deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@faults
@given(data=st.data(), n=st.integers(1, 12), depth=st.integers(1, 3), workers=st.integers(1, 3),
       runs=st.integers(2, 8))
def test_a_kernel_failing_mid_graph_fails_that_run_and_spares_the_others(data, n, depth, workers, runs):
    table = np.arange(32, dtype=F32).reshape(4, 8)
    plan = data.draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, n - 1)), min_size=runs, max_size=runs))
    with graph.prepare(depth=depth, workers=workers) as rt:
        acc = rt.alloc_tensor((8,), "float32", init=np.zeros(8, F32))
        base = counters(rt)
        jobs = []
        for r, (how, fail_at) in enumerate(plan):
            x = np.full(8, r + 1, F32)
            ids = np.arange(8, dtype=np.int32) % 4
            if how == 1:
                ids[fail_at % 8] = 4 + fail_at  # outside the table: the native kernel fails
            y = np.full(8, -7, F32)
            jobs.append((how, fail_at, x, y, rt.submit(x, ids, table, acc, y, n, fail_at, how)))
        want = np.zeros(8, F32)
        for how, fail_at, x, y, h in jobs:
            err = h.exception(PATIENCE_S)
            if how == 0:
                assert err is None, err
                np.testing.assert_array_equal(y, x * (n + 1) + 2 * x)
                want += y
            else:
                assert isinstance(err, engine.KernelError), err
                # tasks: copy, scale, then per step (the failing task first at fail_at) an add
                assert err.task_index == 2 + fail_at, (err, how, fail_at)
                if how == 1:
                    assert err.kernel == "embedding" and "out of range" in err.message, err
                else:
                    assert err.kernel.startswith("host:host_fail:") and "mid-graph" in err.message, err
                np.testing.assert_array_equal(y, -7)
                record(faults_injected=1)
        np.testing.assert_array_equal(acc.to_numpy(), want)
        assert_back_to(rt, base)


# -- close() while runs are in flight ------------------------------------------------------------------------
@engine.program
def spin_fill(run: engine.Run, value: Scalar(float), ns: Scalar(int), y: Out((16,))):
    if ns:
        run.submit(K.spin, ns=ns)
    run.submit(K.fill, out=y, value=value)


@pytest.mark.parametrize("seed", range(size(4, 40, sanitized=2)))
def test_close_from_another_thread_while_threads_submit(device_spy, seed):
    process = ProcessBaseline()
    r = random.Random(seed)
    rt = spin_fill.prepare(depth=r.randint(1, 4), workers=r.randint(1, 3))
    results: list = []
    lock = threading.Lock()
    refs: list = []

    def submitter(k: int) -> None:
        rr = random.Random(seed * 100 + k)
        i = 0
        while True:
            value = float(k * 10_000 + i)
            y = np.zeros(16, F32)
            refs.append(weakref.ref(y))
            try:
                h = rt.submit(value, rr.choice([0, 0, 50_000, 300_000]), y)
            except engine.ClosedError:
                return
            with lock:
                results.append((value, y, h))
            i += 1

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(r.choice([0.0, 0.005, 0.02, 0.05]))
    rt.close()
    for t in threads:
        t.join(PATIENCE_S)
    assert not any(t.is_alive() for t in threads)
    assert rt.closed
    record(faults_injected=1)
    # every run that was admitted before close was drained, with the right answer
    for value, y, h in results:
        assert h.done
        np.testing.assert_array_equal(h.result(), np.full(16, value, F32))
        np.testing.assert_array_equal(y, value)
    record(dispatches=len(results), dispatches_survived=len(results))
    if results:
        del value, y, h  # the loop's last items
    dev = device_spy[-1].stats()
    assert (dev["live_allocations"], dev["bytes_in_use"], dev["mapped_regions"]) == (0, 0, 0), dev
    results.clear()
    process.check()
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive == 0, f"{alive} arguments of drained runs are still referenced"


@pytest.mark.parametrize("how", ["aclose", "aclose-cancel", "runtime-close"])
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
@pytest.mark.anyio
async def test_closing_while_async_dispatches_are_in_flight(device_spy, how, anyio_backend):
    rt = spin_fill.prepare(depth=3, workers=2)
    outcomes = {"ok": 0, "cancelled": 0, "closed": 0}

    async def dispatcher(k: int, art: AsyncRuntime) -> None:
        r = random.Random(k)
        i = 0
        while True:
            value = float(k * 10_000 + i)
            try:
                y = await art.call(value, r.choice([0, 100_000, 400_000]))
            except engine.ClosedError:
                outcomes["closed"] += 1
                return
            except engine.RunCancelledError:
                outcomes["cancelled"] += 1
                continue
            np.testing.assert_array_equal(y, np.full(16, value, F32))
            outcomes["ok"] += 1
            i += 1

    async with AsyncRuntime(rt) as art:
        async with anyio.create_task_group() as tg:
            for k in range(12):
                tg.start_soon(dispatcher, k, art)
            while outcomes["ok"] < 20:
                await anyio.sleep(0.001)
            if how == "runtime-close":
                # The Runtime closed underneath: runs in flight are drained and delivered, new ones refused.
                await anyio.to_thread.run_sync(rt.close)
                await art.aclose()
            else:
                await art.aclose(cancel_pending=how == "aclose-cancel")
    assert outcomes["closed"] == 12, outcomes
    rt.close()
    record(faults_injected=1, dispatches=sum(outcomes.values()), dispatches_survived=outcomes["ok"])
    dev = device_spy[-1].stats()
    assert (dev["live_allocations"], dev["bytes_in_use"], dev["mapped_regions"]) == (0, 0, 0), dev
