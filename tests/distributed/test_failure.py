"""Workers that die, setups that fail, and what close() leaves behind (nothing)."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import threading

import anyio
import numpy as np
import pytest

import engine
import engine.distributed as dist
from scheduler import AsyncRuntime
from tests.distributed import programs as P
from tests.distributed.conftest import THREADS, WORKERS, assert_cleaned_up, assert_reaped, shm_present

DETECT = 20.0  # seconds: the bound on noticing a dead worker (it is noticed at once: the process sentinel)


def _ours_left() -> tuple[list[str], list[str]]:
    """Chip-worker processes still our children, and shared memory this process still owns."""
    procs = [p.name for p in multiprocessing.active_children() if p.name.startswith("tandem-chip-worker")]
    try:
        shm = [n for n in os.listdir("/dev/shm") if n.startswith(f"tandem_{os.getpid()}_")]
    except FileNotFoundError:
        shm = []
    return procs, shm


def _slow() -> dist.DistributedRuntime:
    return P.slow.prepare(workers=WORKERS, worker_threads=THREADS, depth=2)


def test_sigkill_fails_the_runs_in_flight_and_breaks_the_runtime():
    drt = _slow()
    try:
        assert drt.health() == [True, True]
        h1 = drt.submit(np.zeros(2, np.float32), 1_000_000_000)  # 1 s on each worker
        h2 = drt.submit(np.zeros(2, np.float32), 1_000_000_000)
        os.kill(drt.pids[1], signal.SIGKILL)
        for h in (h1, h2):
            with pytest.raises(dist.WorkerDiedError, match=r"chip worker 1 \(pid \d+\) was killed by SIGKILL") as info:
                h.result(timeout=DETECT)
            assert isinstance(info.value, RuntimeError) and info.value.worker == 1
        assert drt.broken
        assert drt.health()[1] is False
        with pytest.raises(dist.WorkerDiedError):
            drt.submit(np.zeros(2, np.float32), 1)
        with pytest.raises(dist.WorkerDiedError):
            drt.alloc_tensor((4,), worker_id=0)
        assert "broken" in repr(drt)
    finally:
        drt.close()
    assert_cleaned_up(drt)
    drt.close()  # idempotent


def test_a_worker_that_exits_on_its_own_is_reported_with_its_exit_code():
    drt = P.crashes.prepare(workers=WORKERS, worker_threads=THREADS, bounds={"B": 4})
    try:
        with pytest.raises(dist.WorkerDiedError, match="chip worker 0 .* exited with code 3"):
            drt.submit(np.ones((4, P.D), np.float32)).result(timeout=DETECT)
        assert drt.broken
    finally:
        drt.close()
    assert_cleaned_up(drt)


def test_async_futures_and_waiting_dispatches_fail_when_a_worker_dies():
    drt = P.slow.prepare(workers=WORKERS, worker_threads=THREADS, depth=1)

    async def main():
        async with AsyncRuntime(drt) as art:
            fut = await art.dispatch(np.zeros(2, np.float32), 1_000_000_000)
            outcome: dict[str, BaseException] = {}

            async def waiting_dispatch():  # depth 1: waits for admission behind `fut`
                try:
                    await art.dispatch(np.zeros(2, np.float32), 1)
                except BaseException as e:
                    outcome["waiting"] = e

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting_dispatch)
                await anyio.sleep(0.05)
                assert art.waiting == 1
                os.kill(drt.pids[0], signal.SIGKILL)
                with anyio.fail_after(DETECT):
                    with pytest.raises(dist.WorkerDiedError):
                        await fut
            return outcome["waiting"]

    try:
        waiting_error = anyio.run(main)
        assert isinstance(waiting_error, dist.WorkerDiedError)
    finally:
        drt.close()
    assert_cleaned_up(drt)


def test_close_drains_runs_in_flight():
    drt = _slow()
    handles = [drt.submit(np.zeros(2, np.float32), 50_000_000) for _ in range(4)]
    drt.close()
    for h in handles:
        np.testing.assert_array_equal(h.result(timeout=0), np.ones(2, np.float32))
    assert_cleaned_up(drt)
    with pytest.raises(engine.ClosedError):
        drt.submit(np.zeros(2, np.float32), 1)
    with pytest.raises(engine.ClosedError):
        drt.memory_stats()


def test_a_runtime_never_closed_is_cleaned_up_when_collected():
    drt = _slow()
    drt(np.zeros(2, np.float32), 1)
    pids, names = drt.pids, drt.shared_memory_names
    del drt
    gc.collect()
    assert_reaped(pids)
    assert shm_present(names) == []


def test_context_manager_closes():
    with _slow() as drt:
        drt(np.zeros(2, np.float32), 1)
    assert_cleaned_up(drt)


# -- setup failures -------------------------------------------------------------------------------------------
def test_a_worker_setup_error_is_reraised_and_nothing_is_left():
    from tests.distributed import refuses_worker

    with pytest.raises(RuntimeError, match="refuses to load in a chip worker"):
        refuses_worker.uses_fill.prepare(workers=WORKERS, worker_threads=THREADS)
    assert _ours_left() == ([], [])


def test_startup_timeout_stops_every_process_started():
    with pytest.raises(TimeoutError, match="startup_timeout"):
        P.slow.prepare(workers=WORKERS, worker_threads=THREADS, startup_timeout=0.001)
    assert _ours_left() == ([], [])


def test_errors_before_any_process_starts():
    def local_program():
        @engine.program
        def inner(run, y: engine.Out((4,))):
            pass

        @dist.program
        def outer(orch, y: engine.Out((4,))):
            orch.submit(inner, y, worker=0)

        return outer

    with pytest.raises(TypeError, match="must be defined at module level"):
        local_program().prepare(workers=2)
    with pytest.raises(ValueError, match="unknown callbacks"):
        P.chain.prepare(workers=2, bounds={"B": 4}, callbacks={"double": P.double, "other": P.double})
    with pytest.raises(ValueError, match="declared but not bound"):
        P.chain.prepare(workers=2, bounds={"B": 4})
    with pytest.raises(TypeError, match="must accept 3 tensor arguments"):
        P.tp_matmul.prepare(workers=2, bounds={"B": 4}, callbacks={"gather": P.double})
    with pytest.raises(ValueError, match="need bounds"):
        P.chain.prepare(workers=2, callbacks={"double": P.double})
    with pytest.raises(ValueError, match="never 'fork'"):
        P.slow.prepare(workers=2, start_method="fork")
    with pytest.raises(ValueError, match="workers must be positive"):
        P.slow.prepare(workers=0)
    with pytest.raises(ValueError, match="planning pass .* worker 1 does not exist"):
        P.pinned_wrong.prepare(workers=1, bounds={"B": 4})  # the planning pass submits to worker 1
    assert _ours_left() == ([], [])


def test_forkserver_start_method():
    with P.chain.prepare(workers=WORKERS, worker_threads=THREADS, bounds={"B": 4}, callbacks={"double": P.double},
                         start_method="forkserver") as drt:
        x = np.ones((4, P.D), np.float32)
        np.testing.assert_allclose(drt(x), 3.0 * x)
    assert_cleaned_up(drt)


def test_a_worker_killed_during_a_sync_call_fails_it():
    """drt(x) reads its own replies: a worker that dies meanwhile still fails the call (through the receiving
    thread, which watches the workers' exits while the caller reads)."""
    drt = _slow()
    try:
        drt(np.zeros(2, np.float32), 1)
        killer = threading.Timer(0.3, os.kill, (drt.pids[0], signal.SIGKILL))
        killer.start()
        with pytest.raises(dist.WorkerDiedError, match=r"chip worker 0 \(pid \d+\) was killed by SIGKILL"):
            drt(np.zeros(2, np.float32), 5_000_000_000)  # 5 s: killed long before
        killer.join()
        assert drt.broken
    finally:
        drt.close()
    assert_cleaned_up(drt)
