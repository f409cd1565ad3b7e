"""Runtime.close(): idempotent, thread-safe, drains runs in flight, frees what it owns, joins the pool."""

import threading
import time

import numpy as np
import pytest

import engine
from engine import In, Out, Scalar

from .conftest import Gate, k_copy, pool_threads, pool_threads_within, settle, thread_ids


@engine.program
def copy_prog(run, x: In((4,)), y: Out((4,))):
    run.submit(k_copy, x, out=y)


def make_gated(**kwargs):
    gate = Gate()
    kern = gate.kernel()

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), key: Scalar(int)):
        run.submit(kern, x, out=y, key=key)

    return prog.prepare(**kwargs), gate


def test_close_is_idempotent():
    rt = copy_prog.prepare()
    assert not rt.closed
    rt.close()
    assert rt.closed
    rt.close()
    rt.close()
    assert rt.closed


def test_closed_error_is_a_runtime_error():
    assert issubclass(engine.ClosedError, RuntimeError)


def test_every_call_after_close_raises_closed_error():
    rt = copy_prog.prepare()
    x = np.ones(4, np.float32)
    t = rt.alloc_tensor((4,), "float32", init=x)
    buf = rt.malloc(16)
    h = rt.submit(x)
    np.testing.assert_array_equal(h.result(), x)
    rt.close()
    calls = {
        "__call__": lambda: rt(x),
        "submit": lambda: rt.submit(x),
        "alloc_tensor": lambda: rt.alloc_tensor((4,), "float32"),
        "free_tensor": lambda: rt.free_tensor(t),
        "malloc": lambda: rt.malloc(16),
        "free": lambda: rt.free(buf),
        "copy_to": lambda: rt.copy_to(buf, x),
        "copy_from": lambda: rt.copy_from(np.empty(4, np.float32), buf),
        "memory_stats": lambda: rt.memory_stats(),
        "to_numpy": lambda: t.to_numpy(),
    }
    for name, call in calls.items():
        with pytest.raises(engine.ClosedError):
            call()
    # a handle completed before close keeps its cached outcome
    np.testing.assert_array_equal(h.result(), x)
    assert h.exception() is None


def test_close_frees_the_tensors_and_buffers_the_runtime_still_owns(device_spy):
    rt = copy_prog.prepare()
    t = rt.alloc_tensor((64,), "float32")
    view = t[8:16]
    buf = rt.malloc(256)
    assert device_spy[0].stats()["live_allocations"] > 2
    rt.close()
    assert t.freed and view.freed and buf.freed
    stats = device_spy[0].stats()
    assert stats["live_allocations"] == 0 and stats["bytes_in_use"] == 0, stats


def test_close_joins_the_worker_pool():
    settle()
    before = thread_ids()
    rt = copy_prog.prepare(workers=3)
    rt(np.ones(4, np.float32))
    started = thread_ids() - before
    assert len(started) >= 3
    rt.close()
    assert not (started & thread_ids()), "close() left pool threads running"


def test_close_drains_runs_in_flight():
    rt, gate = make_gated(workers=2, depth=3)
    x = np.arange(4, dtype=np.float32)
    try:
        handles = [rt.submit(x, key=k) for k in (1, 2, 3)]
        assert gate.wait_started(1)
        events = []
        closer = threading.Thread(target=lambda: (rt.close(), events.append("closed")))
        closer.start()
        closer.join(0.2)
        assert closer.is_alive(), "close() returned while runs were still in flight"
        assert events == []
        gate.record("opening", 0)
        gate.open_all()
        closer.join(20)
        assert not closer.is_alive()
    finally:
        gate.open_all()
        rt.close()
    for k, h in zip((1, 2, 3), handles):
        assert h.done
        np.testing.assert_array_equal(h.result(), x + k)  # drained, not cancelled
    ends = [i for i, e in enumerate(gate.events) if e[0] == "end"]
    assert len(ends) == 3 and min(ends) > gate.events.index(("opening", 0))


def test_close_from_several_threads_at_once():
    rt, gate = make_gated(workers=2, depth=2)
    x = np.zeros(4, dtype=np.float32)
    try:
        handles = [rt.submit(x, key=k) for k in (1, 2)]
        errors, barrier = [], threading.Barrier(5)

        def closer():
            barrier.wait()
            try:
                rt.close()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=closer) for _ in range(4)]
        for t in threads:
            t.start()
        barrier.wait()
        time.sleep(0.05)
        gate.open_all()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors
        assert rt.closed
    finally:
        gate.open_all()
        rt.close()
    for k, h in zip((1, 2), handles):
        np.testing.assert_array_equal(h.result(), x + k)


def test_close_waits_for_a_run_still_being_orchestrated():
    """A run is in flight from admission: close() must not tear the engine down under its orchestration."""
    entered, proceed = threading.Event(), threading.Event()
    order = []

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,))):
        if not run.planning:
            entered.set()
            proceed.wait(20)
        h = run.scratch((4,))
        run.submit(k_copy, x, out=h)
        run.submit(k_copy, h, out=y)
        if not run.planning:
            order.append("orchestrated")

    rt = prog.prepare(workers=2)
    x = np.arange(4, dtype=np.float32)
    outcome = {}

    def submitter():
        try:
            outcome["value"] = rt.submit(x).result(20)
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    sub = threading.Thread(target=submitter)
    sub.start()
    try:
        assert entered.wait(10)
        closer = threading.Thread(target=lambda: (rt.close(), order.append("closed")))
        closer.start()
        closer.join(0.2)
        proceed.set()
        closer.join(20)
        sub.join(20)
    finally:
        proceed.set()
        rt.close()
    assert order == ["orchestrated", "closed"], (f"close() returned before the admitted run finished: {order}; "
                                                 f"the run saw {outcome!r}")
    assert "error" not in outcome, f"the admitted run failed: {outcome.get('error')!r}"
    np.testing.assert_array_equal(outcome["value"], x)


def test_submit_blocked_on_back_pressure_when_close_is_called():
    """A submit waiting for a slot either gets admitted (and drained) or raises ClosedError; it never hangs."""
    rt, gate = make_gated(workers=2, depth=1)
    x = np.zeros(4, np.float32)
    outcome = {}
    try:
        h = rt.submit(x, key=1)
        assert gate.wait_started(1)

        def blocked():
            try:
                outcome["value"] = rt.submit(x, key=2).result(20)
            except BaseException as e:  # noqa: BLE001
                outcome["error"] = e

        t = threading.Thread(target=blocked)
        t.start()
        t.join(0.1)
        assert t.is_alive(), "submit did not block although depth runs were in flight"
        closer = threading.Thread(target=rt.close)
        closer.start()
        time.sleep(0.05)
        gate.open_all()
        closer.join(20)
        t.join(20)
        assert not t.is_alive() and not closer.is_alive()
    finally:
        gate.open_all()
        rt.close()
    np.testing.assert_array_equal(h.result(), x + 1)
    if "error" in outcome:
        assert isinstance(outcome["error"], engine.ClosedError), repr(outcome["error"])
    else:
        np.testing.assert_array_equal(outcome["value"], x + 2)


def test_garbage_collected_runtime_releases_its_pool():
    settle()
    before = pool_threads()
    rt = copy_prog.prepare(workers=2)
    rt(np.ones(4, np.float32))
    assert len(pool_threads() - before) == 2  # its two workers, by name
    del rt
    settle()
    assert pool_threads_within(before), "the collected runtime's pool threads are still running"


def test_close_drains_a_run_a_waiting_thread_is_running():
    """close() with a run's task running on the thread that waits for it (a helping waiter): drained, not cut."""
    rt, gate = make_gated(workers=1, depth=2)
    x = np.arange(4, dtype=np.float32)
    outcome = []
    try:
        first = rt.submit(x, key=1)
        assert gate.wait_started(1)  # the only worker is held
        second = rt.submit(x, key=2)
        waiter = threading.Thread(target=lambda: outcome.append(second.exception(20)))
        waiter.start()
        assert gate.wait_started(2)  # so the waiting thread runs the second run's task
        closer = threading.Thread(target=rt.close)
        closer.start()
        closer.join(0.2)
        assert closer.is_alive(), "close() returned while a waiter was running a task"
        gate.open_all()
        closer.join(20)
        waiter.join(20)
        assert not closer.is_alive() and not waiter.is_alive()
    finally:
        gate.open_all()
        rt.close()
    assert outcome == [None]
    np.testing.assert_array_equal(first.result(), x + 1)
    np.testing.assert_array_equal(second.result(), x + 2)
