"""Every way a dispatch or a run can be cancelled, with orchestration on the loop and in a thread."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import engine
from scheduler import AsyncRuntime

from .conftest import baseline, eventually, filled, tagged

pytestmark = pytest.mark.anyio

SENTINEL = -7.0


def untouched() -> np.ndarray:
    return np.full(8, SENTINEL, np.float32)


async def test_cancelled_while_waiting_for_admission_leaves_no_trace(gated_rt, in_thread):
    rt, gate = gated_rt(depth=1)
    base = baseline(rt)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        held = await art.dispatch(1.0)
        started = rt._engine.stats()["runs_started"]
        out = untouched()
        with anyio.CancelScope() as scope:
            async def waiting():
                await art.dispatch(2.0, out)

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting)
                await eventually(lambda: art.waiting == 1)
                scope.cancel()
        assert scope.cancelled_caught
        assert art.waiting == 0
        gate.open()
        np.testing.assert_array_equal(await held, filled(1.0))
        await art.drain()
        assert rt._engine.stats()["runs_started"] == started  # nothing reached the engine
        s = art.stats()
        assert (s.dispatched, s.completed, s.cancelled, s.in_flight) == (1, 1, 0, 0)
        np.testing.assert_array_equal(out, untouched())
        assert baseline(rt) == base
        # The slot it waited for went to the next dispatch as usual.
        np.testing.assert_array_equal(await art.call(3.0), filled(3.0))


@pytest.mark.parametrize("timeout", ["fail_after", "move_on_after"])
async def test_timeouts_around_a_waiting_dispatch_leave_no_trace(gated_rt, in_thread, timeout):
    rt, gate = gated_rt(depth=1)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        held = await art.dispatch(1.0)
        started = rt._engine.stats()["runs_started"]
        if timeout == "fail_after":
            with pytest.raises(TimeoutError):
                with anyio.fail_after(0.02):
                    await art.dispatch(2.0)
        else:
            with anyio.move_on_after(0.02) as scope:
                await art.dispatch(2.0)
            assert scope.cancelled_caught
        assert art.waiting == 0 and rt._engine.stats()["runs_started"] == started
        gate.open()
        await held
        assert art.stats().dispatched == 1


async def test_cancelled_future_skips_device_work_not_started(gated_rt, in_thread):
    rt, gate = gated_rt(depth=2)
    base = baseline(rt)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        first = await art.dispatch(1.0)
        await eventually(lambda: gate.entered == 1)  # the only worker is busy at the gate
        out = untouched()
        second = await art.dispatch(2.0, out)
        assert second.cancel()
        assert second.cancelled() and second.done()
        assert not second.cancel()  # once
        with pytest.raises(engine.RunCancelledError):
            await second
        with pytest.raises(engine.RunCancelledError):
            second.result()
        with pytest.raises(engine.RunCancelledError):
            second.exception()
        gate.open()
        np.testing.assert_array_equal(await first, filled(1.0))  # the other run is untouched
        await art.drain()
        assert gate.entered == 1  # the cancelled run's gate task never started
        np.testing.assert_array_equal(out, untouched())  # nor its fill, nor its copy-back
        s = art.stats()
        assert (s.dispatched, s.completed, s.cancelled, s.in_flight) == (2, 1, 1, 0)
        assert baseline(rt) == base


async def test_cancelled_future_lets_work_in_progress_finish_and_discards_the_result(gated_rt, in_thread):
    rt, gate = gated_rt(depth=1)
    base = baseline(rt)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        out = untouched()
        fut = await art.dispatch(1.0, out)
        await eventually(lambda: gate.entered == 1)  # in progress
        assert fut.cancel()
        nxt = None

        async def next_run():
            nonlocal nxt
            nxt = await art.call(5.0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(next_run)
            await eventually(lambda: art.waiting == 1)  # the slot is still held: the gate task runs
            gate.open()
        np.testing.assert_array_equal(nxt, filled(5.0))
        np.testing.assert_array_equal(out, untouched())  # the rest of the cancelled run was skipped
        await art.drain()
        assert baseline(rt) == base


async def test_timeout_around_call_cancels_the_run(gated_rt, in_thread):
    rt, gate = gated_rt(depth=2)
    base = baseline(rt)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        blocker = await art.dispatch(0.0)
        await eventually(lambda: gate.entered == 1)
        out = untouched()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.02):
                await art.call(1.0, out)
        gate.open()
        await blocker
        await art.drain()
        np.testing.assert_array_equal(out, untouched())
        assert gate.entered == 1
        s = art.stats()
        assert (s.cancelled, s.in_flight) == (1, 0)
        assert baseline(rt) == base


async def test_cancelling_one_run_leaves_the_others(gated_rt, in_thread):
    rt, gate = gated_rt(depth=6)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        outs = [untouched() for _ in range(6)]
        futs = [await art.dispatch(float(i), outs[i]) for i in range(6)]
        await eventually(lambda: gate.entered == 1)
        for i in (2, 4):
            assert futs[i].cancel()
        gate.open()
        for i, f in enumerate(futs):
            if i in (2, 4):
                with pytest.raises(engine.RunCancelledError):
                    await f
                np.testing.assert_array_equal(outs[i], untouched())
            else:
                np.testing.assert_array_equal(await f, filled(float(i)))
        await art.drain()
        assert art.stats().cancelled == 2


async def test_a_dispatch_in_an_already_cancelled_scope_follows_the_backend_convention(make_rt, anyio_backend):
    """trio: every await of the API is a checkpoint, so nothing is admitted. asyncio: a dispatch that
    finds a slot free does not suspend and launches; the cancellation lands at the next suspension
    and the run's future is intact."""
    rt = make_rt(tagged, depth=2)
    async with AsyncRuntime(rt) as art:
        started = rt._engine.stats()["runs_started"]
        launched = []
        with anyio.CancelScope() as scope:
            scope.cancel()
            launched.append(await art.dispatch(1.0, 0))
            await anyio.sleep(0)  # a suspension: cancelled here under either backend
            launched.append("not reached")
        assert scope.cancelled_caught
        if anyio_backend == "trio":
            assert launched == [] and rt._engine.stats()["runs_started"] == started
            assert art.stats().dispatched == 0
        else:
            assert len(launched) == 1
            np.testing.assert_array_equal(await launched[0], np.full(8, 1.0, np.float32))
        await art.drain()
        assert art.in_flight == 0 and rt.memory_stats()["free_slots"] == 2
