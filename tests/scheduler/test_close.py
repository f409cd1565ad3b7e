"""Closing: draining runs in flight, cancelling them, and what happens afterwards."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import engine
from scheduler import AsyncRuntime

from .conftest import baseline, eventually, filled, tagged

pytestmark = pytest.mark.anyio


async def test_aclose_drains_runs_in_flight_then_dispatch_raises_closed(gated_rt, in_thread):
    rt, gate = gated_rt(depth=2)
    base = baseline(rt)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        futs = [await art.dispatch(float(i)) for i in range(2)]
        waiter_error: list[BaseException] = []

        async def waiter():
            try:
                await art.dispatch(9.0)
            except engine.ClosedError as e:
                waiter_error.append(e)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await eventually(lambda: art.waiting == 1)
            tg.start_soon(art.aclose)
            await eventually(lambda: art.closed)
            assert waiter_error  # never admitted: it gets ClosedError
            with pytest.raises(engine.ClosedError):
                await art.dispatch(1.0)
            assert not any(f.done() for f in futs)  # aclose is still draining
            gate.open()
        for i, f in enumerate(futs):
            np.testing.assert_array_equal(f.result(), filled(float(i)))
        with pytest.raises(engine.ClosedError):
            await art.call(1.0)
        with pytest.raises(engine.ClosedError):
            async for _ in art.stream([(1.0,)]):
                pass
        await art.aclose()  # idempotent
    assert baseline(rt) == base
    assert not rt.closed  # the Runtime is the caller's


async def test_aclose_with_cancel_pending_cancels_runs_in_flight(gated_rt, in_thread):
    rt, gate = gated_rt(depth=3)
    base = baseline(rt)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        outs = [np.zeros(8, np.float32) for _ in range(3)]
        futs = [await art.dispatch(float(i + 1), outs[i]) for i in range(3)]
        await eventually(lambda: gate.entered == 1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(art.aclose, True)
            await eventually(lambda: all(f.cancelled() for f in futs))
            gate.open()  # the gate task in progress finishes; everything after it is skipped
    assert gate.entered == 1
    for out in outs:
        np.testing.assert_array_equal(out, np.zeros(8, np.float32))
    s = art.stats()
    assert (s.dispatched, s.cancelled, s.in_flight) == (3, 3, 0)
    assert baseline(rt) == base


async def test_concurrent_aclose_calls_all_wait_for_the_drain(gated_rt):
    rt, gate = gated_rt(depth=1)
    async with AsyncRuntime(rt) as art:
        fut = await art.dispatch(1.0)
        finished = []

        async def closer(k):
            await art.aclose()
            finished.append((k, fut.done()))

        async with anyio.create_task_group() as tg:
            for k in range(3):
                tg.start_soon(closer, k)
            await eventually(lambda: art.closed)
            await anyio.sleep(0.01)
            assert not finished
            gate.open()
        assert sorted(finished) == [(0, True), (1, True), (2, True)]


async def test_an_exception_in_the_body_cancels_the_runs_in_flight(make_rt, in_thread):
    rt = make_rt(tagged, depth=4)
    base = baseline(rt)
    futs = []
    with pytest.raises(KeyError):
        async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
            for i in range(4):
                futs.append(await art.dispatch(float(i), 20_000_000))  # 20 ms each on one worker
            raise KeyError("body failed")
    assert all(f.done() for f in futs)
    assert sum(f.cancelled() for f in futs) >= 3  # at most the one in progress completed
    assert art.stats().in_flight == 0
    assert baseline(rt) == base


async def test_a_cancelled_scope_around_the_context_still_closes_cleanly(make_rt, in_thread):
    rt = make_rt(tagged, depth=2)
    base = baseline(rt)
    futs = []
    with anyio.move_on_after(0.05) as scope:
        async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
            while True:
                futs.append(await art.dispatch(1.0, 5_000_000))
                await futs[-1]
    assert scope.cancelled_caught
    assert futs and all(f.done() for f in futs)
    assert art.stats().in_flight == 0
    assert baseline(rt) == base


async def test_close_runtime_option_closes_the_runtime(make_rt):
    rt = make_rt(tagged)
    async with AsyncRuntime(rt, close_runtime=True) as art:
        np.testing.assert_array_equal(await art.call(4.0, 0), filled(4.0))
    assert rt.closed


async def test_closing_the_runtime_underneath_delivers_the_runs(make_rt):
    rt = make_rt(tagged, depth=3)
    async with AsyncRuntime(rt) as art:
        futs = [await art.dispatch(float(i), 1_000_000) for i in range(3)]
        rt.close()  # blocking drain from the loop thread: finishes the runs itself
        for i, f in enumerate(futs):
            np.testing.assert_array_equal(await f, filled(float(i)))
        with pytest.raises(engine.ClosedError):
            await art.dispatch(1.0, 0)
