"""dispatch(), call() and RunFuture: outputs, ordering, back-pressure, errors."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest

import engine
from scheduler import AsyncRuntime, InvalidStateError, RunFuture

from .conftest import add, baseline, eventually, filled, maybe_fail, noop, bad_orchestration, tagged

pytestmark = pytest.mark.anyio


async def test_call_returns_the_outputs(make_rt):
    rt = make_rt(add, depth=2, bounds={"B": 8})
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    y = np.ones((3, 4), np.float32)
    async with AsyncRuntime(rt) as art:
        z = await art.call(x, y)
        np.testing.assert_array_equal(z, x + y)
        out = np.zeros((3, 4), np.float32)
        assert await art.call(x, y, out) is out  # a caller's Out array is filled and returned
        np.testing.assert_array_equal(out, x + y)


async def test_dispatch_returns_while_the_device_still_runs(gated_rt):
    rt, gate = gated_rt(depth=2)
    async with AsyncRuntime(rt) as art:
        fut = await art.dispatch(1.0)
        assert isinstance(fut, RunFuture)
        await eventually(lambda: gate.entered == 1)
        assert not fut.done() and not fut.cancelled()
        with pytest.raises(InvalidStateError):
            fut.result()
        with pytest.raises(InvalidStateError):
            fut.exception()
        gate.open()
        np.testing.assert_array_equal(await fut, filled(1.0))
        assert fut.done() and not fut.cancelled()
        assert fut.exception() is None
        np.testing.assert_array_equal(fut.result(), filled(1.0))
        assert not fut.cancel()  # done: nothing to cancel


async def test_a_future_is_awaitable_many_times_from_several_tasks(gated_rt):
    rt, gate = gated_rt(depth=1)
    async with AsyncRuntime(rt) as art:
        fut = await art.dispatch(2.0)
        got = []

        async def waiter():
            got.append(await fut)

        async with anyio.create_task_group() as tg:
            for _ in range(5):
                tg.start_soon(waiter)
            await anyio.sleep(0)
            gate.open()
        assert len(got) == 5 and all(g is got[0] for g in got)
        np.testing.assert_array_equal(await fut, filled(2.0))
        np.testing.assert_array_equal(await fut, filled(2.0))


async def test_cancelling_one_awaiter_leaves_the_run_to_the_others(gated_rt):
    rt, gate = gated_rt(depth=1)
    async with AsyncRuntime(rt) as art:
        fut = await art.dispatch(3.0)
        with anyio.move_on_after(0.01):
            await fut
        assert not fut.done()
        gate.open()
        np.testing.assert_array_equal(await fut, filled(3.0))


async def test_runs_pipeline_up_to_depth_then_dispatch_waits(gated_rt):
    rt, gate = gated_rt(depth=2)
    async with AsyncRuntime(rt) as art:
        f1 = await art.dispatch(1.0)
        f2 = await art.dispatch(2.0)
        assert art.in_flight == 2 and rt.memory_stats()["free_slots"] == 0
        third: list[RunFuture] = []

        async def dispatch_third():
            third.append(await art.dispatch(3.0))

        async with anyio.create_task_group() as tg:
            tg.start_soon(dispatch_third)
            await eventually(lambda: art.waiting == 1)
            assert not third  # back-pressure: it waits instead of raising
            gate.open()
        assert [(await f).tolist()[0] for f in (f1, f2, third[0])] == [1.0, 2.0, 3.0]


async def test_waiters_are_admitted_in_fifo_order(gated_rt):
    rt, gate = gated_rt(depth=1)
    async with AsyncRuntime(rt) as art:
        first = await art.dispatch(-1.0)
        order: list[tuple[int, int]] = []

        async def dispatcher(i: int):
            fut = await art.dispatch(float(i))
            order.append((i, fut.run_id))
            await fut

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(dispatcher, i)
                await eventually(lambda i=i: art.waiting == i + 1)  # i+1 waiters, queued in this order
            gate.open()
        await first
    run_ids = [rid for _, rid in sorted(order)]
    assert run_ids == sorted(run_ids)  # launched (and numbered) in the order they queued


async def test_dispatch_from_many_tasks_at_once(make_rt):
    rt = make_rt(tagged, depth=4)
    results: dict[int, np.ndarray] = {}
    async with AsyncRuntime(rt) as art:
        async def worker(i: int):
            for j in range(10):
                results[i * 100 + j] = await art.call(float(i * 100 + j), 0)

        async with anyio.create_task_group() as tg:
            for i in range(30):
                tg.start_soon(worker, i)
    assert len(results) == 300
    for k, v in results.items():
        np.testing.assert_array_equal(v, filled(float(k)))


async def test_argument_errors_raise_from_dispatch_before_admission(gated_rt, make_rt):
    rt, gate = gated_rt(depth=1)
    other = make_rt(add, bounds={"B": 4})
    foreign = other.alloc_tensor((8,), "float32")
    async with AsyncRuntime(rt) as art:
        held = await art.dispatch(1.0)  # the only slot is taken: a waiting dispatch would hang
        before = rt._engine.stats()["runs_started"]
        with pytest.raises(TypeError):
            await art.dispatch()  # arity
        with pytest.raises(TypeError):
            await art.dispatch(1.0, np.zeros(7, np.float32))  # shape
        with pytest.raises(TypeError):
            await art.dispatch(1.0, np.zeros(8, np.int32))  # dtype
        with pytest.raises(ValueError):
            await art.dispatch(1.0, foreign)  # another runtime's tensor
        with pytest.raises(TypeError):
            await art.call(1.0, nope=3)
        assert art.waiting == 0 and rt._engine.stats()["runs_started"] == before
        gate.open()
        await held
        assert art.stats().dispatched == 1


async def test_a_kernel_failure_raises_from_that_future_only(make_rt):
    rt = make_rt(maybe_fail, depth=4)
    async with AsyncRuntime(rt) as art:
        futs = [await art.dispatch(float(i), int(i == 2)) for i in range(5)]
        for i, fut in enumerate(futs):
            if i == 2:
                with pytest.raises(engine.KernelError) as info:
                    await fut
                assert info.value.kernel == "_boom" or "_boom" in str(info.value)
                assert isinstance(fut.exception(), engine.KernelError)
                assert not fut.cancelled()
            else:
                np.testing.assert_array_equal(await fut, filled(float(i)))
        np.testing.assert_array_equal(await art.call(9.0, 0), filled(9.0))
        s = art.stats()
        assert (s.completed, s.failed, s.cancelled) == (5, 1, 0)


async def test_an_orchestration_error_raises_from_dispatch_and_frees_the_slot(make_rt):
    rt = make_rt(bad_orchestration, depth=1)
    base = baseline(rt)
    async with AsyncRuntime(rt) as art:
        with pytest.raises(RuntimeError, match="orchestration failed"):
            await art.dispatch(1)
        np.testing.assert_array_equal(await art.call(0), filled(1.0))
        await art.drain()
        assert baseline(rt) == base


async def test_orchestration_error_of_a_waiter_goes_to_that_waiter(make_rt):
    rt = make_rt(bad_orchestration, depth=1)
    async with AsyncRuntime(rt) as art:
        outcomes: dict[int, object] = {}

        async def one(i: int, fail: int):
            try:
                outcomes[i] = await art.call(fail)
            except RuntimeError as e:
                outcomes[i] = e

        async with anyio.create_task_group() as tg:
            for i in range(6):
                tg.start_soon(one, i, i % 2)
        for i in range(6):
            if i % 2:
                assert isinstance(outcomes[i], RuntimeError)
            else:
                np.testing.assert_array_equal(outcomes[i], filled(1.0))


async def test_several_async_runtimes_in_one_loop(make_rt):
    rts = [make_rt(tagged, depth=2) for _ in range(3)]
    async with AsyncRuntime(rts[0]) as a0, AsyncRuntime(rts[1]) as a1, AsyncRuntime(rts[2]) as a2:
        got: dict[tuple[int, int], np.ndarray] = {}

        async def use(k: int, art: AsyncRuntime):
            for j in range(20):
                got[(k, j)] = await art.call(float(k * 1000 + j), 10_000)

        async with anyio.create_task_group() as tg:
            for k, art in enumerate((a0, a1, a2)):
                tg.start_soon(use, k, art)
    for (k, j), v in got.items():
        np.testing.assert_array_equal(v, filled(float(k * 1000 + j)))
    assert len(got) == 60


async def test_one_async_runtime_per_runtime_and_entry_rules(make_rt):
    rt = make_rt(noop)
    art = AsyncRuntime(rt)
    with pytest.raises(RuntimeError, match="enter"):
        await art.dispatch()
    async with art:
        with pytest.raises(RuntimeError, match="already driven"):
            async with AsyncRuntime(rt):
                pass
        assert await art.call() is None
    with pytest.raises(RuntimeError, match="entered once"):
        async with art:
            pass
    async with AsyncRuntime(rt) as again:  # free again once the first closed
        await again.call()
    with pytest.raises(TypeError):
        AsyncRuntime(object())  # type: ignore[arg-type]


async def test_runtime_is_the_wrapped_runtime_before_during_and_after(gated_rt, make_rt):
    rt, gate = gated_rt(depth=2)
    art = AsyncRuntime(rt)
    assert art.runtime is rt
    async with art:
        assert art.runtime is rt
        fut = await art.dispatch(1.0)
        free = art.runtime.memory_stats()["free_slots"]
        gate.open()
        assert free == rt.depth - 1  # the run held one of the wrapped runtime's slots
        await fut
    assert art.runtime is rt and not rt.closed  # left open for synchronous use
    other = make_rt(noop)
    assert AsyncRuntime(other).runtime is other


async def test_done_callbacks_are_called_once_with_the_done_future_on_the_loop_thread(gated_rt):
    rt, gate = gated_rt(depth=2)
    async with AsyncRuntime(rt) as art:
        loop_thread = threading.get_ident()
        fut = await art.dispatch(4.0)
        calls = []
        fut.add_done_callback(lambda f: calls.append(("first", f, f.done(), threading.get_ident())))
        fut.add_done_callback(lambda f: calls.append(("second", f, f.done(), threading.get_ident())))
        await eventually(lambda: gate.entered == 1)
        pending_calls = list(calls)
        gate.open()  # before asserting: a failure with the worker held at the gate would hang the close
        assert pending_calls == []
        await eventually(fut.done, "the pump settles the future")  # nobody awaits it
        assert calls == [("first", fut, True, loop_thread), ("second", fut, True, loop_thread)]
        np.testing.assert_array_equal(fut.result(), filled(4.0))
        np.testing.assert_array_equal(await fut, filled(4.0))
        await art.call(5.0)
        assert len(calls) == 2  # once each: awaiting and later completions call nothing again
        late = []
        fut.add_done_callback(late.append)
        assert late == [fut]  # already done: called at once


async def test_a_cancelled_future_calls_its_done_callbacks_once(gated_rt):
    rt, gate = gated_rt(depth=2)
    async with AsyncRuntime(rt) as art:
        fut = await art.dispatch(6.0)
        calls = []
        fut.add_done_callback(lambda f: calls.append((f, f.cancelled())))
        cancelled = fut.cancel()
        gate.open()  # the loop has not turned since cancel(): only cancel() can have called back
        assert cancelled and calls == [(fut, True)]
        await art.drain()  # the device lets go of the run; finishing it calls nothing again
        assert calls == [(fut, True)]
        with pytest.raises(engine.RunCancelledError):
            fut.result()
        late = []
        fut.add_done_callback(late.append)
        assert late == [fut]


def count_wakeups(art: AsyncRuntime) -> list[int]:
    """Makes the completion pump of `art` (not entered yet) append to the returned list on every wake-up."""
    wakeups: list[int] = []
    real = art._on_completions

    def counting() -> None:
        wakeups.append(1)
        real()

    art._on_completions = counting  # type: ignore[method-assign]  # the pump binds it at entry
    return wakeups


async def test_one_wakeup_delivers_every_run_completed_since_the_last(make_rt):
    rt = make_rt(tagged, depth=8)
    art = AsyncRuntime(rt)
    wakeups = count_wakeups(art)
    async with art:
        futs = [await art.dispatch(float(i), 0) for i in range(8)]
        for f in futs:  # block the loop until the device finished all eight
            assert f.native is not None and f.native.wait(PATIENCE)
        assert not any(f.done() for f in futs)
        before = len(wakeups)
        await eventually(lambda: all(f.done() for f in futs))
        assert len(wakeups) - before == 1
        for i, f in enumerate(futs):
            np.testing.assert_array_equal(f.result(), filled(float(i)))


PATIENCE = 20.0


async def test_awaiting_a_run_the_device_already_finished_completes_it_without_the_pump(make_rt):
    rt = make_rt(tagged, depth=2)
    art = AsyncRuntime(rt)
    wakeups = count_wakeups(art)
    async with art:
        before = baseline(rt)
        fut = await art.dispatch(3.0, 0)
        assert fut.native is not None and fut.native.wait(PATIENCE)  # the loop has not turned
        assert not fut.done() and not wakeups
        np.testing.assert_array_equal(await fut, filled(3.0))  # finished here, not by the pump
        assert not wakeups and art.in_flight == 0 and art.stats().completed == 1
        await anyio.sleep(0.05)
        assert not wakeups  # finishing early drained the notifier too: the pump has nothing to wake for
        np.testing.assert_array_equal(await art.call(4.0, 0), filled(4.0))
        assert art.stats().completed == 2 and baseline(rt) == before


async def test_an_error_while_completing_reaches_the_future_instead_of_hanging_it(make_rt):
    rt = make_rt(tagged, depth=2)
    async with AsyncRuntime(rt) as art:
        before = baseline(rt)
        real = art._finish

        def broken(*args):
            raise RuntimeError("bookkeeping bug")

        art._finish = broken
        fut = await art.dispatch(1.0, 0)
        await eventually(fut.done, "the pump settles the future")  # by the pump: nobody awaits it yet
        assert isinstance(fut.exception(), RuntimeError) and "bookkeeping bug" in str(fut.exception())
        assert art.in_flight == 0 and baseline(rt) == before  # the run was finished and its slot freed first
        assert art.stats().failed == 1
        art._finish = real
        np.testing.assert_array_equal(await art.call(2.0, 0), filled(2.0))


async def test_an_asyncio_loop_without_add_reader_gets_the_pump_task(make_rt, anyio_backend, monkeypatch):
    if anyio_backend != "asyncio":
        pytest.skip("add_reader is an asyncio loop method")
    import asyncio

    loop = asyncio.get_running_loop()

    def unsupported(*args, **kwargs):
        raise NotImplementedError

    monkeypatch.setattr(loop, "add_reader", unsupported)
    rt = make_rt(tagged, depth=2)
    async with AsyncRuntime(rt) as art:
        futs = [await art.dispatch(float(i), 0) for i in range(4)]
        await eventually(lambda: all(f.done() for f in futs), "the pump task delivers completions")
        for i, f in enumerate(futs):
            np.testing.assert_array_equal(f.result(), filled(float(i)))
