"""The DistributedRuntime surface: failures, the memory handle, AsyncRuntime, cancellation, traces."""

from __future__ import annotations

import json
import os
import threading
import time

import anyio
import numpy as np
import pytest

import engine
import engine.distributed as dist
from scheduler import AsyncRuntime
from tests.distributed import programs as P
from tests.distributed.conftest import (BINDABLE, assert_follows_senders, callers_and_submitters, randn, reply_threads,
                                        sync_calls_then_submits)

B = 8


@pytest.fixture(scope="module")
def chain(prepare):
    return prepare(P.chain, depth=2, bounds={"B": B}, callbacks={"double": P.double})


@pytest.fixture(scope="module")
def failing(prepare):
    return prepare(P.fails_on_worker, depth=2, bounds={"B": B})


@pytest.fixture(scope="module")
def host_failing(prepare):
    return prepare(P.fails_on_host, depth=2, bounds={"B": B}, callbacks={"explode": P.explode})


@pytest.fixture(scope="module")
def limited(prepare):
    return prepare(P.accumulate, bounds={"B": 4}, memory_limit=1 << 20)


@pytest.fixture(scope="module")
def slow(prepare):
    return prepare(P.slow, depth=2)


# -- failures -------------------------------------------------------------------------------------------
def test_a_failing_kernel_on_a_worker_fails_that_run_only(failing):
    x = randn(np.random.default_rng(0), B, P.D)
    h = failing.submit(x)
    with pytest.raises(engine.KernelError) as info:
        h.result(timeout=30)
    err = info.value
    assert err.run_id == h.id and err.task_index == 0
    assert "failing on chip worker 1" in err.kernel and "boom in a host kernel" in err.message
    assert not failing.broken
    with pytest.raises(engine.KernelError):  # still usable, and fails the same way again
        failing(x)
    assert failing.memory_stats()["free_slots"] == 2


def test_a_failing_host_callback_skips_what_follows_it(host_failing):
    x = randn(np.random.default_rng(1), B, P.D)
    y = np.full((B, P.D), -1.0, np.float32)
    with pytest.raises(engine.KernelError, match="callback:explode.*ValueError: callback exploded"):
        host_failing(x, y)
    assert (y == -1.0).all()  # a failed run writes nothing back
    assert not host_failing.broken


def test_an_orchestration_error_leaves_no_trace(prepare):
    @dist.program
    def bad(orch, x: engine.In(("B", P.D)), y: engine.Out(("B", P.D))):
        orch.submit(P.scale, x, y, 1.0, worker=0)
        if not orch.planning:
            raise KeyError("orchestration broke")

    drt = prepare(bad, bounds={"B": B})
    with pytest.raises(KeyError, match="orchestration broke"):
        drt(np.zeros((B, P.D), np.float32))
    assert drt.memory_stats()["free_slots"] == 2
    assert not drt.broken


def test_submission_errors_in_the_orchestration(prepare):
    @dist.program(callbacks={"cb": ("in",)})
    def misuse(orch, x: engine.In(("B", P.D)), y: engine.Out(("B", P.D)), case: engine.Scalar(int)):
        if case == 1:
            orch.submit(P.scale, x, y, 1.0, worker=2)
        elif case == 2:
            orch.submit(P.scale, np.zeros((B, P.D), np.float32), y, 1.0, worker=0)
        elif case == 3:
            orch.submit(P.unused, worker=0)
        elif case == 4:
            orch.submit_sub("nope", x)
        elif case == 5:
            orch.submit_sub("cb", x, y)
        elif case == 6:
            orch.submit(P.scale, x, worker=0, factor=1.0)
        else:
            orch.submit(P.scale, x, y, 1.0, worker=0)

    drt = prepare(misuse, bounds={"B": B}, callbacks={"cb": lambda a: None})
    x = np.ones((B, P.D), np.float32)
    with pytest.raises(ValueError, match="worker 2 does not exist"):
        drt(x, case=1)
    with pytest.raises(TypeError, match="host array cannot go to a worker"):
        drt(x, case=2)
    with pytest.raises(ValueError, match="was not registered at prepare"):
        drt(x, case=3)
    with pytest.raises(ValueError, match="not a declared callback"):
        drt(x, case=4)
    with pytest.raises(TypeError, match="takes 1 tensors, got 2"):
        drt(x, case=5)
    with pytest.raises(TypeError, match="pass output 'y'"):
        drt(x, case=6)
    np.testing.assert_array_equal(drt(x, case=0), x)
    assert drt.memory_stats()["free_slots"] == 2


# -- the memory handle ----------------------------------------------------------------------------------------
def test_memory_handle_with_worker_ids(chain):
    drt = chain
    assert isinstance(drt, engine.DeviceMemoryHandle)
    before = [drt.memory_stats(worker_id=i)["live_allocations"] for i in range(2)]
    buf = drt.malloc(64, worker_id=1)
    assert buf.nbytes == 64
    assert drt.memory_stats(worker_id=1)["live_allocations"] == before[1] + 1
    assert drt.memory_stats(worker_id=0)["live_allocations"] == before[0]
    src = np.arange(16, dtype=np.float32)
    drt.copy_to(buf, src)
    dst = np.zeros(16, np.float32)
    drt.copy_from(dst, buf)
    np.testing.assert_array_equal(dst, src)
    drt.free(buf)
    with pytest.raises(ValueError, match="already freed"):
        drt.free(buf)
    with pytest.raises(ValueError, match="worker_id 2 does not exist"):
        drt.malloc(64, worker_id=2)

    t = drt.alloc_tensor((4, 6), "float32", init=np.arange(24, dtype=np.float32).reshape(4, 6), worker_id=0)
    np.testing.assert_array_equal(t[1:3, ::2].to_numpy(), np.arange(24, dtype=np.float32).reshape(4, 6)[1:3, ::2])
    with pytest.raises(ValueError, match="freed with free_tensor"):
        drt.free(engine.DeviceBuffer(t._alloc))
    drt.free_tensor(t)
    assert t.freed
    with pytest.raises(ValueError, match="already freed"):
        drt.free_tensor(t)
    summed = drt.memory_stats()
    assert summed["workers"] == 2 and summed["depth"] == 2
    assert summed["live_allocations"] == sum(drt.memory_stats(worker_id=i)["live_allocations"] for i in range(2))


def test_foreign_and_freed_tensors_are_rejected(limited, chain):
    acc_rt = limited
    foreign = chain.alloc_tensor((4, P.D), "float32", worker_id=0)
    with pytest.raises(ValueError, match="another runtime"):
        acc_rt(np.ones((4, P.D), np.float32), foreign, 0)
    own = acc_rt.alloc_tensor((4, P.D), "float32", worker_id=0)
    acc_rt.free_tensor(own)
    with pytest.raises(ValueError, match="freed"):
        acc_rt(np.ones((4, P.D), np.float32), own, 0)
    chain.free_tensor(foreign)


# -- async -------------------------------------------------------------------------------------------------------
def test_async_runtime_works_unchanged(chain):
    rng = np.random.default_rng(2)
    xs = [randn(rng, B, P.D) for _ in range(16)]

    async def main():
        async with AsyncRuntime(chain) as art:
            fut = await art.dispatch(xs[0])
            first = await fut
            called = await art.call(xs[1])
            streamed = [y async for y in art.stream(xs)]
            stats = art.stats()
        return first, called, streamed, stats

    first, called, streamed, stats = anyio.run(main)
    np.testing.assert_allclose(first, xs[0] * 3.0, rtol=1e-6)
    np.testing.assert_allclose(called, xs[1] * 3.0, rtol=1e-6)
    assert len(streamed) == len(xs)
    for x, y in zip(xs, streamed):
        np.testing.assert_allclose(y, x * 3.0, rtol=1e-6)
    assert stats.completed == 18 and stats.failed == 0 and stats.in_flight == 0
    assert stats.device.samples == 18


def test_async_failures_and_trio(failing):
    x = np.ones((B, P.D), np.float32)

    async def main():
        async with AsyncRuntime(failing) as art:
            with pytest.raises(engine.KernelError):
                await art.call(x)
            return art.stats()

    for backend in ("asyncio", "trio"):
        stats = anyio.run(main, backend=backend)
        assert stats.failed == 1


def test_cancel_skips_work_not_yet_sent(slow):
    y = np.zeros(2, np.float32)
    h1 = slow.submit(y, 300_000_000)  # both workers busy for 0.3 s
    h2 = slow.submit(np.zeros(2, np.float32), 1)
    assert h2.cancel() is True
    with pytest.raises(engine.RunCancelledError):
        h2.result(timeout=30)
    np.testing.assert_array_equal(h1.result(timeout=30), np.ones(2, np.float32))
    assert h1.cancel() is False  # already done


def test_waits_time_out_and_every_waiter_sees_the_run_done(slow):
    h = slow.submit(np.zeros(2, np.float32), 200_000_000)  # 0.2 s on each worker
    assert h.wait(0.01) is False and not h.done  # a timeout, not an error
    seen: list[bool] = []
    waiters = [threading.Thread(target=lambda: seen.append(h.wait(30))) for _ in range(3)]
    for t in waiters:
        t.start()
    np.testing.assert_array_equal(h.result(timeout=30), np.ones(2, np.float32))
    for t in waiters:
        t.join(30)
    assert seen == [True, True, True] and h.done and h.wait(0) is True


def test_export_trace_has_a_track_per_worker_and_the_host(chain, tmp_path):
    chain.set_tracing(True)
    try:
        for _ in range(3):
            chain(np.ones((B, P.D), np.float32))
        chain.export_trace(tmp_path / "trace.json")
    finally:
        chain.set_tracing(False)
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    names = {(e["name"], e.get("tid")) for e in trace if e.get("ph") == "X"}
    assert ("scale", 0) in names and ("scale", 1) in names and ("callback:double", -1) in names
    assert any(name == "orchestration" for name, _ in names)


def test_device_memory_errors_come_from_the_worker(limited):
    drt = limited
    with pytest.raises(engine.DeviceMemoryError):
        drt.alloc_tensor((1 << 20,), "float32", worker_id=1)  # 4 MiB on a 1 MiB device
    t = drt.alloc_tensor((1024,), "float32", worker_id=1)  # still usable
    drt.free_tensor(t)


def test_orchestration_in_a_thread_and_concurrent_submitters(chain):
    xs = [randn(np.random.default_rng(100 + i), B, P.D) for i in range(16)]

    async def main():
        async with AsyncRuntime(chain, orchestrate_in_thread=True) as art:
            return [y async for y in art.stream(xs)]

    for x, y in zip(xs, anyio.run(main)):
        np.testing.assert_allclose(y, x * 3.0, rtol=1e-6)

    errors: list[BaseException] = []

    def submitter(k: int) -> None:
        try:
            for x in xs[k::4]:
                np.testing.assert_allclose(chain(x), x * 3.0, rtol=1e-6)
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert chain.memory_stats()["free_slots"] == 2


@pytest.mark.parametrize("spin_us", [0, 50])
def test_readers_that_sleep_at_once_or_poll_briefly_lose_nothing(prepare, spin_us):
    """The transport's readers (each worker, the host's receiving thread) sleep at once with spin_us=0, and with a
    short spin sleep between the runs of a slow caller: a request sent while the receiving thread sleeps still gets
    its reply read, for sync calls, runs in flight together, memory calls and awaited runs."""
    drt = prepare(P.chain, depth=2, bounds={"B": B}, callbacks={"double": P.double},
                  transport=dist.ProcessTransport(2, spin_us=spin_us))
    rng = np.random.default_rng(5)
    xs = [randn(rng, B, P.D) for _ in range(6)]
    for x in xs[:3]:
        np.testing.assert_allclose(drt(x), x * 3.0, rtol=1e-6)
        threading.Event().wait(0.002)  # longer than the spin: the readers are asleep when the next run starts
    handles = [drt.submit(x) for x in xs]
    for x, h in zip(xs, handles):
        np.testing.assert_allclose(h.result(timeout=60), x * 3.0, rtol=1e-6)
    t = drt.alloc_tensor((4,), init=np.arange(4, dtype=np.float32), worker_id=1)
    np.testing.assert_array_equal(t.to_numpy(), np.arange(4, dtype=np.float32))
    drt.free_tensor(t)

    async def main():
        async with AsyncRuntime(drt) as art:
            return [y async for y in art.stream(xs)]

    for x, y in zip(xs, anyio.run(main)):
        np.testing.assert_allclose(y, x * 3.0, rtol=1e-6)


@pytest.mark.parametrize("spin_us", [-1, 1.5, True, "200"])
def test_a_bad_spin_is_refused_before_any_process_starts(spin_us):
    with pytest.raises(ValueError, match="spin_us"):
        dist.ProcessTransport(2, spin_us=spin_us)


# -- the receiving thread follows the threads that send -----------------------------------------------------
@pytest.mark.skipif(len(BINDABLE) < 2, reason="needs two CPUs this process may bind threads to")
@pytest.mark.parametrize("follow", [True, False])
def test_the_receiving_thread_moves_to_the_cpu_of_the_sender_that_woke_it(prepare, follow):
    """A request that wakes the asleep receiving thread takes it to the sender's CPU (that one CPU), each time the
    sender runs somewhere else; with follow_sender=False it stays where it was."""
    drt = prepare(P.slow, depth=2, transport=dist.ProcessTransport(2, follow_sender=follow))
    assert_follows_senders(drt, drt._transport._thread, follow)
    assert drt.memory_stats()["free_slots"] == 2


@pytest.mark.parametrize("follow", [1, None, "yes"])
def test_a_bad_follow_sender_is_refused_before_any_process_starts(follow):
    with pytest.raises(ValueError, match="follow_sender"):
        dist.ProcessTransport(2, follow_sender=follow)


# -- the chip workers' CPUs ---------------------------------------------------------------------------------
def _thread_cpus(pid: int) -> list[set[int]]:
    """The CPUs each thread of process `pid` may run on."""
    return [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]


@pytest.mark.skipif(len(BINDABLE) < 2, reason="needs two CPUs this process may bind threads to")
@pytest.mark.parametrize("pin", [True, False])
def test_each_chip_worker_is_bound_to_cpus_of_its_own(pin):
    """pin_workers: every thread of worker i (its serving thread, its pool) on the i-th CPU this process may use;
    unbound, every thread may use them all. The runs compute the same either way."""
    drt = P.slow.prepare(workers=2, worker_threads=1, depth=2, transport=dist.ProcessTransport(2, pin_workers=pin))
    try:
        np.testing.assert_array_equal(drt(np.zeros(2, np.float32), 1), np.ones(2, np.float32))
        for i, pid in enumerate(drt.pids):
            assert all(cpus == ({BINDABLE[i]} if pin else set(BINDABLE)) for cpus in _thread_cpus(pid))
    finally:
        drt.close()


def test_workers_are_bound_only_when_all_their_threads_fit():
    cpus = dist.transport.worker_cpus
    assert cpus(2, 1, [0, 1]) == [(0,), (1,)]
    assert cpus(2, 1, [2, 5, 7]) == [(2,), (5,)]  # in order, skipping what this process may not use
    assert cpus(2, 2, [0, 1, 2, 3]) == [(0, 1), (2, 3)]
    assert cpus(2, 2, [0, 1]) == [(), ()]  # more threads than CPUs: the scheduler shares them out
    assert cpus(3, 1, [0, 1]) == [(), (), ()]
    assert cpus(1, 1, [0, 1]) == [()]  # one worker: nobody to keep apart


@pytest.mark.parametrize("pin", [1, None, "yes"])
def test_a_bad_pin_workers_is_refused_before_any_process_starts(pin):
    with pytest.raises(ValueError, match="pin_workers"):
        dist.ProcessTransport(2, pin_workers=pin)


# -- the caller reading its own replies --------------------------------------------------------------------
def test_a_sync_call_reads_its_replies_on_its_own_thread(slow, chain):
    """drt(x) hands its replies to the dispatcher on the calling thread (no hand-off from the receiving thread
    to the caller); a submitted run's replies are read by the receiving thread, and the two alternate freely."""
    seen = sync_calls_then_submits(slow, 60)
    np.testing.assert_array_equal(slow(np.zeros(2, np.float32), 1), np.ones(2, np.float32))  # back to the caller
    assert set(seen) == {threading.get_ident()}

    # A host callback's thread sends the step after it: the receiving thread reads that reply, the caller the first.
    seen = reply_threads(chain)
    x = randn(np.random.default_rng(7), B, P.D)
    np.testing.assert_allclose(chain(x), x * 3.0, rtol=1e-6)
    assert len(seen) == 2 and seen[0] == threading.get_ident()


def test_a_sync_call_holds_no_handle_and_its_error_is_raised(chain, failing):
    """drt(x) waits for its own run: nothing stays registered in flight, the slot is free again, and a failing run
    raises its error from the call."""
    x = randn(np.random.default_rng(8), B, P.D)
    np.testing.assert_allclose(chain(x), x * 3.0, rtol=1e-6)
    assert chain._inflight == {} and chain.memory_stats()["free_slots"] == 2
    with pytest.raises(engine.KernelError, match="failing on chip worker 1"):
        failing(x)
    assert failing._inflight == {} and failing.memory_stats()["free_slots"] == 2
    np.testing.assert_allclose(chain(x), x * 3.0, rtol=1e-6)


def _slow_double(a: np.ndarray) -> None:  # longer than a reader's spin: the caller sleeps while it runs
    threading.Event().wait(0.02)
    a *= 2.0


@pytest.mark.parametrize("program", ["host callback last", "host callback between workers"])
def test_a_sync_call_whose_run_completes_on_another_thread_returns_at_once(prepare, monkeypatch, program):
    """drt(x) reads its own replies; when its run completes on another thread (its last submission a host
    callback, or its last reply read by the receiving thread once the callback thread's request handed the
    connections back), that thread wakes it: the call does not wait for its next look at the run, here
    made a minute long (it was 2 ms, and a sync call of such a program took 2.66 ms against 0.17 submitted)."""
    from engine.distributed import transport

    monkeypatch.setattr(transport, "_CALLER_LOOK_MS", 60_000)
    rng = np.random.default_rng(9)
    if program == "host callback last":
        drt = prepare(P.tp_matmul, depth=2, bounds={"B": B}, callbacks={"gather": P.gather})
        x, w = randn(rng, B, P.KD), randn(rng, P.KD, P.N)
        args, expected = (x, w), x @ w
    else:
        drt = prepare(P.chain, depth=2, bounds={"B": B}, callbacks={"double": _slow_double})
        x = randn(rng, B, P.D)
        args, expected = (x,), x * 3.0
    for _ in range(5):
        t0 = time.monotonic()
        np.testing.assert_allclose(drt(*args), expected, rtol=1e-5, atol=1e-5)
        assert time.monotonic() - t0 < 30.0  # far below the look: woken, not timed out
    assert drt._inflight == {} and drt.memory_stats()["free_slots"] == 2


def test_a_caller_that_reads_its_replies_can_time_out_and_wait_again(slow):
    transport = slow._transport
    with transport.caller_reads() as reads:
        assert reads is True
        with transport.caller_reads() as again:
            assert again is False  # one reader at a time
        h = slow.submit(np.zeros(2, np.float32), 200_000_000)  # 0.2 s on each worker
        assert h.wait(0.01) is False and not h.done
        np.testing.assert_array_equal(h.result(timeout=30), np.ones(2, np.float32))
    assert transport.read_until(lambda: False, 0.0) is None  # outside it: this thread does not read
    np.testing.assert_array_equal(slow(np.zeros(2, np.float32), 1), np.ones(2, np.float32))


def test_sync_callers_and_submitters_together_lose_no_reply(prepare):
    """A caller reading its replies, the receiving thread reading others', both on two workers' connections at once
    (a wait may report both ready, and the other reader take one meanwhile): for a few seconds every call and
    every submitted run gets its result, and no reader blocks on a message another took."""
    drt = prepare(P.slow, depth=4)
    assert min(callers_and_submitters(drt, 3.0, 30)) > 0
    assert drt.memory_stats()["free_slots"] == 4
