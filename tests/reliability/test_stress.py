"""Stress: 10,000+ dispatches from 16 concurrent tasks with random cancellations and failing kernels.

Every run that survives must give the exact answer; every injected failure must
come back as a KernelError naming the failing kernel; cancellations (of the
future, by timeouts around call() and dispatch(), by cancel scopes) must
settle as RunCancelledError or leave no trace. Afterwards the device memory,
mappings, slots, the native run table and the pool are back at their
baseline, and the arguments of every run have been released.

TANDEM_LONG=1 runs 100,000 dispatches.
"""

from __future__ import annotations

import gc
import random
import threading
import weakref

import anyio
import numpy as np
import pytest

import engine
from scheduler import AsyncRuntime

from .conftest import PATIENCE_S, ProcessBaseline, assert_back_to, counters, record, size
from .stress_program import BOUND, Job, Tally, lookup, make_job, make_table

pytestmark = pytest.mark.anyio

TASKS = 16
# Plain calls and dispatches weigh more, so most runs survive; every way of cancelling still comes up often.
ACTIONS = ["call"] * 3 + ["dispatch"] * 3 + ["cancel-future", "timeout-call", "timeout-dispatch", "cancel-scope"]


async def _one(art: AsyncRuntime, job: Job, table_arg, table: np.ndarray, r: random.Random, tally: Tally) -> None:
    how = r.choice(ACTIONS)
    try:
        if how == "call":
            tally.result(job, table, await art.call(*job.args(table_arg)))
        elif how == "dispatch":
            fut = await art.dispatch(*job.args(table_arg))
            tally.result(job, table, await fut)
        elif how == "cancel-future":
            fut = await art.dispatch(*job.args(table_arg))
            if r.random() < 0.5:
                await anyio.sleep(0)
            if fut.cancel():
                with pytest.raises(engine.RunCancelledError):
                    await fut
                tally.cancelled += 1
                return
            tally.result(job, table, await fut)
        elif how == "timeout-call":
            done = False
            with anyio.move_on_after(r.choice([0, 1e-5, 1e-4, 1e-3])):
                y = await art.call(*job.args(table_arg))
                done = True
            if not done:
                tally.cancelled += 1  # the call cancelled its own run
                return
            tally.result(job, table, y)
        elif how == "timeout-dispatch":
            fut = None
            with anyio.move_on_after(r.choice([0, 1e-5, 1e-4])):
                fut = await art.dispatch(*job.args(table_arg))
            if fut is None:
                tally.cancelled += 1  # gave up waiting for admission: no trace
                return
            tally.result(job, table, await fut)
        else:
            fut = None
            with anyio.CancelScope() as scope:
                fut = await art.dispatch(*job.args(table_arg))
                if r.random() < 0.5:
                    scope.cancel()
                y = await fut
            if scope.cancel_called:
                if fut is not None and not fut.done():
                    fut.cancel()
                tally.cancelled += 1
                return
            tally.result(job, table, y)
    except (engine.KernelError, engine.RunCancelledError) as e:
        tally.error(job, e)


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_concurrent_dispatches_with_cancellations_and_failures(anyio_backend):
    total = size(10_000, 100_000, sanitized=1_000) if anyio_backend == "asyncio" else size(2_000, 20_000, 300)
    in_thread = anyio_backend == "trio"  # orchestration in a worker thread on one backend, on the loop on the other
    table = make_table(1)
    rng = random.Random(f"stress-{anyio_backend}")
    tally = Tally()
    refs: list[weakref.ref] = []
    with lookup.prepare(depth=4, workers=2, bounds={"B": BOUND}) as rt:
        table_dev = rt.alloc_tensor(table.shape, "float32", init=table)
        base = counters(rt)
        started = rt._engine.stats()["runs_started"]

        async def worker(k: int, seed: int) -> None:
            r = random.Random(seed)
            for i in range(total // TASKS):
                job = make_job(r)
                if i % 97 == 0:
                    refs.append(weakref.ref(job.x))
                table_arg = table_dev if r.random() < 0.5 else table
                await _one(art, job, table_arg, table, r, tally)

        async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
            async with anyio.create_task_group() as tg:
                for k in range(TASKS):
                    tg.start_soon(worker, k, rng.randrange(2**32))
            await art.drain()
            s = art.stats()
            assert s.in_flight == 0 and art.waiting == 0
            assert s.dispatched == s.completed + s.failed + s.cancelled
            # A caller that gave up after its run finished counts it as cancelled; the runtime saw the outcome.
            assert tally.failed <= s.failed <= tally.failed + tally.cancelled, (s, tally.__dict__)
            assert tally.ok <= s.completed <= tally.ok + tally.cancelled, (s, tally.__dict__)
            # still exact afterwards
            job = make_job(random.Random(5), fail_rate=0)
            np.testing.assert_array_equal(await art.call(*job.args(table_dev)), job.expected(table))
        assert tally.total == (total // TASKS) * TASKS
        assert tally.ok > 0 and tally.failed > 0 and tally.cancelled > 0, tally.__dict__
        runs = rt._engine.stats()["runs_started"] - started
        assert_back_to(rt, base)
        e = rt._engine.stats()
        assert e["runs_completed"] == e["runs_started"]
        rt.free_tensor(table_dev)
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive == 0, f"{alive} of {len(refs)} sampled run arguments are still referenced"
    record(dispatches=tally.total, dispatches_survived=tally.ok, dispatches_failed=tally.failed,
           dispatches_cancelled=tally.cancelled, faults_injected=tally.failed, native_runs=runs)


def test_sync_submitters_from_16_threads_with_cancellations_abandoned_handles_and_failures():
    """The same mix through Runtime.submit from plain threads: cancel(), wait(timeout), dropped handles."""
    total = size(3_200, 32_000, sanitized=320)
    table = make_table(2)
    process = ProcessBaseline()
    tally = Tally()
    lock = threading.Lock()
    errors: list[BaseException] = []
    with lookup.prepare(depth=4, workers=2, bounds={"B": BOUND}) as rt:
        table_dev = rt.alloc_tensor(table.shape, "float32", init=table)
        base = counters(rt)

        def submitter(seed: int) -> None:
            r = random.Random(seed)
            local = Tally()
            try:
                for _ in range(total // TASKS):
                    job = make_job(r)
                    h = rt.submit(*job.args(table_dev if r.random() < 0.5 else table))
                    how = r.choice(["result", "cancel", "wait-then-cancel", "drop", "exception"])
                    try:
                        if how == "result":
                            local.result(job, table, h.result(PATIENCE_S))
                        elif how == "exception":
                            err = h.exception(PATIENCE_S)
                            if err is None:
                                local.result(job, table, h.result())
                            else:
                                local.error(job, err)
                        elif how == "drop":
                            local.cancelled += 1  # never waited for: reaped by a later admission or close
                        else:
                            if how == "wait-then-cancel":
                                h.wait(r.choice([0, 1e-4, 1e-3]))
                            cancelled = h.cancel()
                            err = h.exception(PATIENCE_S)
                            if cancelled:
                                assert isinstance(err, (engine.RunCancelledError, engine.KernelError)), err
                            if err is None:
                                local.result(job, table, h.result())
                            else:
                                local.error(job, err)
                    except engine.KernelError as e:
                        local.error(job, e)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
            with lock:
                tally.ok += local.ok
                tally.failed += local.failed
                tally.cancelled += local.cancelled

        rng = random.Random("sync-stress")
        threads = [threading.Thread(target=submitter, args=(rng.randrange(2**32),)) for _ in range(TASKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10 * PATIENCE_S)
        assert not any(t.is_alive() for t in threads), "a submitter is stuck"
        assert not errors, errors[0]
        assert tally.total == (total // TASKS) * TASKS
        assert tally.ok > 0 and tally.failed > 0 and tally.cancelled > 0, tally.__dict__
        # Dropped handles keep their slots until an admission needs one and reaps the oldest run:
        # depth submissions in a row reap every dropped run.
        job = make_job(random.Random(3), fail_rate=0)
        handles = [rt.submit(*job.args(table)) for _ in range(rt.depth)]
        for h in handles:
            np.testing.assert_array_equal(h.result(PATIENCE_S), job.expected(table))
        assert_back_to(rt, base)
        rt.free_tensor(table_dev)
    process.check()
    record(dispatches=tally.total, dispatches_survived=tally.ok, dispatches_failed=tally.failed,
           dispatches_cancelled=tally.cancelled, faults_injected=tally.failed)
