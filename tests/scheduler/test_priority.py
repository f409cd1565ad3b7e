"""Priorities and admission timeouts of AsyncRuntime.dispatch/call/stream (asyncio and trio).

Runs are launched in admission order, and a run's id grows with its launch, so
sorting the dispatches by their run's id gives the order admission chose.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import anyio
import numpy as np
import pytest

from engine.errors import ClosedError
from scheduler import AsyncRuntime

from .conftest import baseline, eventually, filled, tagged

pytestmark = pytest.mark.anyio


async def _admission_order(art: AsyncRuntime, gate: Any, dispatches: list[tuple[float, dict[str, Any]]]) -> list[float]:
    """Queues the dispatches (value, options) in turn behind a run held at the gate; the order they got slots in."""
    launched: list[tuple[int, float]] = []

    async def one(value: float, options: dict[str, Any]) -> None:
        fut = await art.dispatch(value, np.empty(8, np.float32), **options)
        launched.append((fut.run_id, value))
        await fut

    held = await art.dispatch(-1.0, np.empty(8, np.float32))
    async with anyio.create_task_group() as tg:
        for i, (value, options) in enumerate(dispatches):
            tg.start_soon(one, value, options)
            await eventually(lambda: art.waiting == i + 1, "the dispatch to queue up")
        gate.open()
    await held
    return [v for _, v in sorted(launched)]


async def test_higher_priority_is_admitted_first_fifo_within_a_priority(gated_rt, in_thread):
    rt, gate = gated_rt(depth=1)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        order = await _admission_order(art, gate, [
            (0.0, {}), (5.0, {"priority": 5}), (1.0, {"priority": 1}), (5.1, {"priority": 5}),
            (0.1, {"priority": 0}), (3.0, {"priority": 3}), (-2.0, {"priority": -2}), (1.1, {"priority": 1}),
        ])
    assert order == [5.0, 5.1, 3.0, 1.0, 1.1, 0.0, 0.1, -2.0]


async def test_aging_admits_a_long_waiting_low_priority_before_a_newer_high_one(gated_rt):
    """With priority_aging=a, a priority step is worth a seconds of waiting: a low-priority dispatch
    that waited longer than that is not overtaken by a newer higher one; strict priorities would."""
    for aging, expected in ((0.02, [0.0, 1.0]), (None, [1.0, 0.0])):
        rt, gate = gated_rt(depth=1)
        async with AsyncRuntime(rt, priority_aging=aging) as art:
            held = await art.dispatch(-1.0, np.empty(8, np.float32))
            launched: list[tuple[int, float]] = []

            async def one(value: float, priority: int) -> None:
                fut = await art.dispatch(value, np.empty(8, np.float32), priority=priority)
                launched.append((fut.run_id, value))
                await fut

            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 0.0, 0)
                await eventually(lambda: art.waiting == 1)
                await anyio.sleep(0.1)  # five priority steps' worth of waiting at 0.02 s a step
                tg.start_soon(one, 1.0, 1)
                await eventually(lambda: art.waiting == 2)
                gate.open()
            await held
        assert [v for _, v in sorted(launched)] == expected, aging


async def test_a_dispatch_not_admitted_within_its_timeout_raises_and_reaches_nothing(gated_rt, in_thread):
    rt, gate = gated_rt(depth=1)
    before = baseline(rt)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        held = await art.dispatch(1.0, np.empty(8, np.float32))
        out = np.zeros(8, np.float32)
        with pytest.raises(TimeoutError, match="not admitted within its timeout of 0.05 s"):
            await art.dispatch(2.0, out, timeout=0.05)
        with pytest.raises(TimeoutError):
            await art.call(2.0, out, timeout=0)
        assert art.waiting == 0 and art.stats().dispatched == 1  # neither became a run
        assert gate.entered == 1
        gate.open()
        await held
        # The runtime goes on; a slot free at once admits whatever the timeout, even 0.
        np.testing.assert_array_equal(await art.call(3.0, out, timeout=0), filled(3.0))
        np.testing.assert_array_equal(out, filled(3.0))
        s = art.stats()
    assert (s.dispatched, s.completed, s.failed, s.cancelled) == (2, 2, 0, 0)
    assert baseline(rt) == before


async def test_a_timeout_does_not_disturb_the_waiters_around_it(gated_rt):
    rt, gate = gated_rt(depth=1)
    async with AsyncRuntime(rt) as art:
        held = await art.dispatch(-1.0, np.empty(8, np.float32))
        results: dict[str, Any] = {}

        async def one(name: str, value: float, **options: Any) -> None:
            try:
                results[name] = await art.call(value, np.empty(8, np.float32), **options)
            except TimeoutError as e:
                results[name] = e

        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "first", 1.0)
            await eventually(lambda: art.waiting == 1)
            tg.start_soon(partial(one, "impatient", 2.0, priority=9, timeout=0.05))
            await eventually(lambda: art.waiting == 2)
            tg.start_soon(one, "last", 3.0)
            await eventually(lambda: "impatient" in results and art.waiting == 2)
            gate.open()
        await held
    assert isinstance(results["impatient"], TimeoutError)
    np.testing.assert_array_equal(results["first"], filled(1.0))
    np.testing.assert_array_equal(results["last"], filled(3.0))


async def test_bad_priority_or_timeout_is_refused_before_anything(make_rt):
    rt = make_rt(tagged, depth=1)
    async with AsyncRuntime(rt) as art:
        out = np.empty(8, np.float32)
        for bad in (1.5, "high", True, None):
            with pytest.raises(TypeError, match="priority must be an int"):
                await art.dispatch(1.0, 0, out, priority=bad)
        for bad in (-1, float("nan"), float("inf"), "1", True):
            with pytest.raises(ValueError, match="timeout must be None or a finite number of seconds"):
                await art.call(1.0, 0, out, timeout=bad)
        with pytest.raises(TypeError, match="priority must be an int"):
            art.stream([(1.0, 0, out)], priority=2.0)
        assert art.stats().dispatched == 0
        np.testing.assert_array_equal(await art.call(4.0, 0, out, priority=-3, timeout=1), filled(4.0))
    with pytest.raises(ValueError, match="priority_aging must be a positive number of seconds or None"):
        AsyncRuntime(rt, priority_aging=0)


async def test_stream_items_take_the_stream_priority(gated_rt):
    """A stream at a higher priority overtakes a dispatch queued before it."""
    rt, gate = gated_rt(depth=1)
    async with AsyncRuntime(rt) as art:
        held = await art.dispatch(-1.0, np.empty(8, np.float32))
        order: list[tuple[int, float]] = []

        async def low() -> None:
            fut = await art.dispatch(0.0, np.empty(8, np.float32))
            order.append((fut.run_id, 0.0))
            await fut

        async def high() -> None:
            outs = [np.empty(8, np.float32) for _ in range(2)]
            async for y in art.stream([(7.0, outs[0]), (8.0, outs[1])], depth=1, priority=4):
                order.append((0, float(y[0])))  # outputs arrive in order; their admission is what is checked

        async with anyio.create_task_group() as tg:
            tg.start_soon(low)
            await eventually(lambda: art.waiting == 1)
            tg.start_soon(high)
            await eventually(lambda: art.waiting == 2)
            gate.open()
        await held
        s = art.stats()
    assert s.completed == 4
    # Run ids count launches: the stream's first item took the slot after the held run, the plain dispatch
    # queued before it came next (the stream dispatches item two only once item one's output is taken).
    assert [v for _, v in order if _ == 0] == [7.0, 8.0]
    assert [rid for rid, v in order if v == 0.0] == [held.run_id + 2]


async def test_close_fails_the_waiters_of_every_priority(gated_rt):
    rt, gate = gated_rt(depth=1)
    errors: list[BaseException] = []
    async with AsyncRuntime(rt) as art:
        held = await art.dispatch(-1.0, np.empty(8, np.float32))

        async def one(priority: int) -> None:
            try:
                await art.dispatch(float(priority), np.empty(8, np.float32), priority=priority)
            except ClosedError as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:
            for p in (0, 3, -1, 3):
                tg.start_soon(one, p)
            await eventually(lambda: art.waiting == 4)
            tg.start_soon(art.aclose)  # fails the waiters at once, then waits for the held run
            await eventually(lambda: len(errors) == 4, "the waiters to fail")
            gate.open()
        await held
    assert len(errors) == 4 and art.waiting == 0
