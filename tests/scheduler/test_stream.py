"""AsyncRuntime.stream(): order, depth, failing items, leaving early, cancellation."""

from __future__ import annotations

import gc

import anyio
import numpy as np
import pytest

import engine
from scheduler import AsyncRuntime, StreamItemError

from .conftest import baseline, double, eventually, filled, maybe_fail, tagged

pytestmark = pytest.mark.anyio


def batches(n: int) -> list[np.ndarray]:
    return [np.full((2, 4), float(i), np.float32) for i in range(n)]


async def test_outputs_come_in_input_order_from_a_sync_iterable(make_rt, in_thread):
    rt = make_rt(tagged, depth=3)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        # Later items finish sooner on the device; the stream still yields in input order.
        items = [(float(i), (20 - i) * 20_000) for i in range(20)]
        got = [y async for y in art.stream(items)]
    assert len(got) == 20
    for i, y in enumerate(got):
        np.testing.assert_array_equal(y, filled(float(i)))


async def test_single_arrays_and_generators_and_async_sources(make_rt):
    rt = make_rt(double, depth=2, bounds={"B": 4})
    xs = batches(7)
    async with AsyncRuntime(rt) as art:
        got = [y async for y in art.stream(x for x in xs)]  # a generator of single arrays
        for x, y in zip(xs, got):
            np.testing.assert_array_equal(y, 2 * x)

        async def agen():
            for x in xs:
                await anyio.sleep(0)
                yield (x,)

        got = [y async for y in art.stream(agen())]
        assert len(got) == 7
        for x, y in zip(xs, got):
            np.testing.assert_array_equal(y, 2 * x)
        assert [y async for y in art.stream([])] == []


async def test_keeps_depth_runs_in_flight(make_rt):
    depth, n = 3, 12
    rt = make_rt(tagged, depth=4)  # the runtime allows more than the stream asks for
    pulled = []
    ahead = []
    in_flight = []

    def source():
        for i in range(n):
            pulled.append(i)
            yield (float(i), 1_000_000)

    async with AsyncRuntime(rt) as art:
        async for y in art.stream(source(), depth=depth):
            i = int(y[0])
            ahead.append(len(pulled) - (i + 1))  # dispatched and not yet handed out
            in_flight.append(art.in_flight)
    # Refilled before each output is handed over: `depth` runs stay dispatched until the source runs out.
    assert ahead == [min(depth, n - i - 1) for i in range(n)]
    assert max(in_flight) <= depth
    with pytest.raises(ValueError):
        art.stream([], depth=0)


async def test_unordered_yields_index_output_pairs(make_rt, in_thread):
    rt = make_rt(tagged, depth=4)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        got = [p async for p in art.stream([(float(i), 10_000) for i in range(15)], ordered=False)]
    assert sorted(i for i, _ in got) == list(range(15))
    for i, y in got:
        np.testing.assert_array_equal(y, filled(float(i)))


async def test_an_item_with_bad_arguments_raises_with_its_index_after_the_earlier_outputs(make_rt):
    rt = make_rt(tagged, depth=3)
    base = baseline(rt)
    items = [(float(i), 0) for i in range(3)] + [("not a number", 0)] + [(9.0, 0)] * 5
    got = []
    async with AsyncRuntime(rt) as art:
        with pytest.raises(StreamItemError) as info:
            async for y in art.stream(items):
                got.append(y)
        assert info.value.index == 3
        assert isinstance(info.value.__cause__, (TypeError, ValueError))
        assert info.value.error is info.value.__cause__
        await art.drain()
        assert art.stats().dispatched == 3  # nothing after the failing item was dispatched
    assert [y[0] for y in got] == [0.0, 1.0, 2.0]
    assert baseline(rt) == base


async def test_a_failing_run_raises_with_its_index_and_cancels_the_rest(make_rt, in_thread):
    rt = make_rt(maybe_fail, depth=3)
    base = baseline(rt)
    got = []
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        with pytest.raises(StreamItemError) as info:
            async for y in art.stream([(float(i), int(i == 4)) for i in range(12)]):
                got.append(y[0])
        assert info.value.index == 4
        assert isinstance(info.value.__cause__, engine.KernelError)
        await art.drain()
        s = art.stats()
        assert s.failed == 1 and s.in_flight == 0
        assert s.dispatched <= 4 + 3  # the window never ran past depth
    assert got == [0.0, 1.0, 2.0, 3.0]
    assert baseline(rt) == base


async def test_a_failing_source_raises_with_the_index_it_failed_at(make_rt):
    rt = make_rt(tagged, depth=2)

    def source():
        yield (0.0, 0)
        yield (1.0, 0)
        raise LookupError("source broke")

    async with AsyncRuntime(rt) as art:
        got = []
        with pytest.raises(StreamItemError) as info:
            async for y in art.stream(source()):
                got.append(y[0])
        assert info.value.index == 2 and isinstance(info.value.__cause__, LookupError)
        assert got == [0.0, 1.0]


async def test_leaving_the_loop_early_cancels_the_rest(make_rt, in_thread):
    rt = make_rt(tagged, depth=4)
    base = baseline(rt)
    pulled = []

    def source():
        for i in range(100):
            pulled.append(i)
            # 20 ms of device work per run: the window cannot drain while the consumer,
            # on a loaded machine, takes a while to act on its break.
            yield (float(i), 20_000_000)

    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        async for y in art.stream(source()):
            if y[0] == 1.0:
                break
        gc.collect()  # CPython already finalised the iterator; this is for other interpreters
        assert len(pulled) <= 2 + 4  # consumed + the window
        await art.drain()
        s = art.stats()
        assert s.in_flight == 0
        assert s.cancelled >= 2  # the window minus at most the run in progress when we left
        assert s.completed + s.cancelled == s.dispatched
    assert baseline(rt) == base


async def test_aclose_and_async_with_end_a_stream_explicitly(make_rt):
    rt = make_rt(tagged, depth=3)
    async with AsyncRuntime(rt) as art:
        s = art.stream([(float(i), 2_000_000) for i in range(50)])
        assert (await s.__anext__())[0] == 0.0
        await s.aclose()
        with pytest.raises(StopAsyncIteration):
            await s.__anext__()
        async with art.stream([(float(i), 2_000_000) for i in range(50)]) as s2:
            async for y in s2:
                break
        await art.drain()
        st = art.stats()
        assert st.cancelled >= 2 and st.in_flight == 0


async def test_a_timeout_around_the_stream_cancels_its_runs(gated_rt, in_thread):
    rt, gate = gated_rt(depth=3)
    base = baseline(rt)
    outs = [np.zeros(8, np.float32) for _ in range(10)]
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        with anyio.move_on_after(0.05) as scope:
            async for _ in art.stream([(float(i + 1), outs[i]) for i in range(10)]):
                pass
        assert scope.cancelled_caught
        await eventually(lambda: gate.entered == 1)
        gate.open()
        await art.drain()
        s = art.stats()
        assert (s.dispatched, s.cancelled, s.in_flight) == (3, 3, 0)
    for out in outs:  # the run in progress stopped after its gate; the others never started
        np.testing.assert_array_equal(out, np.zeros(8, np.float32))
    assert gate.entered == 1
    assert baseline(rt) == base


async def test_closing_the_async_runtime_ends_a_stream_with_closed_error(gated_rt):
    rt, gate = gated_rt(depth=2)
    got = []
    async with AsyncRuntime(rt) as art:
        async def consume():
            with pytest.raises(engine.ClosedError):
                async for y in art.stream([(float(i),) for i in range(10)]):
                    got.append(y[0])

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await eventually(lambda: art.in_flight == 2)
            tg.start_soon(art.aclose)
            await eventually(lambda: art.closed)
            gate.open()
    assert got == [0.0, 1.0]  # runs in flight at close were drained and delivered
