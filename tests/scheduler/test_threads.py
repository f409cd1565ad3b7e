"""Use from plain threads through anyio.from_thread, and the worker-thread orchestration option."""

from __future__ import annotations

import threading

import anyio
import anyio.from_thread
import anyio.to_thread
import numpy as np
import pytest

import engine
from engine import Out, Scalar
from engine import kernels as K
from scheduler import AsyncRuntime

from .conftest import Gate, add, eventually, filled, tagged


def test_plain_threads_through_a_blocking_portal(make_rt, anyio_backend):
    rt = make_rt(tagged, depth=3)
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    with anyio.from_thread.start_blocking_portal(backend=anyio_backend) as portal, \
            portal.wrap_async_context_manager(AsyncRuntime(rt)) as art:

        def worker(t: int) -> None:
            try:
                for j in range(20):
                    k = t * 100 + j
                    results[k] = portal.call(art.call, float(k), 10_000)
                fut = portal.call(art.dispatch, float(t), 0)
                portal.call(fut.wait_done)
                results[-1 - t] = fut.result()
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert portal.call(lambda: art.stats().completed) == 84
    assert not errors
    for k, v in results.items():
        np.testing.assert_array_equal(v, filled(float(k if k >= 0 else -1 - k)))


@pytest.mark.anyio
async def test_worker_threads_of_the_loop_use_from_thread_run(make_rt):
    rt = make_rt(add, depth=2, bounds={"B": 4})
    x = np.arange(8, dtype=np.float32).reshape(2, 4)

    async with AsyncRuntime(rt) as art:
        def blocking_code(k: int) -> np.ndarray:
            return anyio.from_thread.run(art.call, x, np.full((2, 4), float(k), np.float32))

        async with anyio.create_task_group() as tg:
            out: dict[int, np.ndarray] = {}

            async def one(k: int) -> None:
                out[k] = await anyio.to_thread.run_sync(blocking_code, k)

            for k in range(6):
                tg.start_soon(one, k)
    for k, v in out.items():
        np.testing.assert_array_equal(v, x + k)


LAUNCHES: list[tuple[int, float]] = []


@engine.program(callbacks={"gate": 0})
def recorded(run: engine.Run, value: Scalar(float), out: Out((8,))):
    if not run.planning:
        LAUNCHES.append((threading.get_ident(), value))
    run.host("gate")
    run.submit(K.fill, out=out, value=value)


@pytest.mark.anyio
async def test_runs_launch_in_admission_order_on_the_chosen_thread(make_rt, in_thread):
    gate = Gate()
    make_rt.gates.append(gate)
    rt = make_rt(recorded, depth=1, callbacks={"gate": gate})
    LAUNCHES.clear()
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        assert art.orchestrate_in_thread == in_thread
        first = await art.dispatch(-1.0)
        futs: dict[int, object] = {}

        async def dispatcher(i: int) -> None:
            futs[i] = await art.dispatch(float(i))

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(dispatcher, i)
                await eventually(lambda i=i: art.waiting == i + 1)
            gate.open()
        for i in range(20):
            np.testing.assert_array_equal(await futs[i], filled(float(i)))
        await first
    assert [v for _, v in LAUNCHES] == [-1.0] + [float(i) for i in range(20)]
    loop_thread = threading.get_ident()
    on_loop = [tid == loop_thread for tid, _ in LAUNCHES]
    assert all(on_loop) if not in_thread else not any(on_loop)
