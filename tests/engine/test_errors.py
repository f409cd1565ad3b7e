"""Failures: a failing kernel fails its own run only; orchestration errors leave the runtime usable."""

import pickle
import threading

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar

from .conftest import Gate, k_add, k_copy


class Boom(Exception):
    pass


@engine.host_kernel(name="exploder")
def exploder(a, out, fail):
    if fail:
        raise Boom(f"kernel asked to fail on {a[0]}")
    out[...] = a * 2


@engine.program
def prog(run, x: In((4,)), y: Out((4,)), fail: Scalar(int)):
    h = run.scratch((4,))
    run.submit(k_copy, x, out=h)
    run.submit(exploder, h, out=y, fail=fail)


def test_kernel_error_is_a_runtime_error_and_picklable():
    assert issubclass(engine.KernelError, RuntimeError)
    e = engine.KernelError(3, 1, "exploder", "bad")
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.run_id, e2.task_index, e2.kernel, e2.message) == (3, 1, "exploder", "bad")
    assert str(e2) == str(e)


def test_failing_kernel_raises_kernel_error_naming_task_and_kernel(prepared):
    rt = prepared(prog)
    x = np.arange(4, dtype=np.float32)
    with pytest.raises(engine.KernelError) as ei:
        rt(x, fail=1)
    err = ei.value
    assert err.task_index == 1  # the second task of the run
    assert "exploder" in err.kernel
    msg = str(err)
    assert "exploder" in msg and "task 1" in msg
    assert "asked to fail" in msg
    assert rt.memory_stats()["free_slots"] == rt.depth
    np.testing.assert_array_equal(rt(x, fail=0), 2 * x)


def test_only_the_failing_run_fails_among_pipelined_runs(prepared):
    rt = prepared(prog, depth=3, workers=2)
    xs = [np.full(4, i, np.float32) for i in range(12)]
    failing = {3, 7, 8}
    handles = [rt.submit(x, fail=int(i in failing)) for i, x in enumerate(xs)]
    for i, (x, h) in enumerate(zip(xs, handles)):
        if i in failing:
            err = h.exception(10)
            assert isinstance(err, engine.KernelError)
            assert err.run_id == h.id
            with pytest.raises(engine.KernelError) as ei:
                h.result()
            assert ei.value is err  # the same outcome every time
        else:
            assert h.exception(10) is None
            np.testing.assert_array_equal(h.result(), 2 * x)


def test_every_waiter_sees_the_same_kernel_error(prepared):
    gate = Gate()
    gk = gate.kernel()

    @engine.program
    def gated(run, x: In((4,)), y: Out((4,)), fail: Scalar(int)):
        h = run.scratch((4,))
        run.submit(gk, x, out=h, key=1)
        run.submit(exploder, h, out=y, fail=fail)

    rt = prepared(gated, workers=2)
    h = rt.submit(np.zeros(4, np.float32), fail=1)
    seen, barrier = [], threading.Barrier(5)

    def waiter():
        barrier.wait()
        try:
            h.result(20)
        except engine.KernelError as e:
            seen.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for t in threads:
        t.start()
    barrier.wait()
    gate.open_all()
    for t in threads:
        t.join(20)
    assert len(seen) == 4 and all(e is seen[0] for e in seen)
    assert h.exception() is seen[0]


def test_writing_a_read_only_input_fails_the_kernel(prepared):
    @engine.host_kernel(name="vandal")
    def vandal(a, out):
        a[...] = 0  # inputs are read-only views

    @engine.program
    def p(run, x: In((4,)), y: Out((4,))):
        run.submit(vandal, x, out=y)

    rt = prepared(p)
    with pytest.raises(engine.KernelError, match="vandal"):
        rt(np.ones(4, np.float32))


def test_failing_host_callback_names_the_callback(prepared):
    def broken(a):
        raise Boom("callback broke")

    @engine.program(callbacks={"broken": 1})
    def p(run, x: In((4,)), y: Out((4,))):
        run.submit(k_copy, x, out=y)
        run.host("broken", y)

    rt = prepared(p, callbacks={"broken": broken})
    with pytest.raises(engine.KernelError) as ei:
        rt(np.ones(4, np.float32))
    assert "broken" in ei.value.kernel
    assert "callback broke" in str(ei.value)
    assert ei.value.task_index == 1


def test_orchestration_error_propagates_from_submit_and_does_not_disturb_runs_in_flight(prepared):
    gate = Gate()
    gk = gate.kernel()

    @engine.program
    def p(run, x: In((4,)), y: Out((4,)), mode: Scalar(int)):
        if mode < 0:
            run.submit(k_copy, x, out=y)
            raise Boom("orchestration failed after a submit")
        run.submit(gk, x, out=y, key=mode)

    rt = prepared(p, depth=2, workers=2)
    x = np.zeros(4, np.float32)
    h1 = rt.submit(x, mode=1)
    with pytest.raises(Boom):
        rt.submit(x, mode=-1)
    assert rt.memory_stats()["free_slots"] == 1  # only h1 holds a slot
    h2 = rt.submit(x, mode=2)
    gate.open_all()
    np.testing.assert_array_equal(h1.result(10), x + 1)
    np.testing.assert_array_equal(h2.result(10), x + 2)
    assert rt.memory_stats()["free_slots"] == 2


def test_failed_runs_do_not_leak_device_memory(prepared):
    rt = prepared(prog, depth=2)
    x = np.ones(4, np.float32)
    rt(x, fail=0)
    s = rt.memory_stats()
    before = (s["total_allocations"], s["bytes_in_use"], s["live_allocations"])
    for i in range(50):
        try:
            rt(x, fail=i % 2)
        except engine.KernelError:
            pass
    s = rt.memory_stats()
    assert (s["total_allocations"], s["bytes_in_use"], s["live_allocations"]) == before
    assert s["free_slots"] == 2


def test_a_failed_run_does_not_stall_later_runs_sharing_its_resident_tensor(prepared):
    @engine.host_kernel(name="accumulate_or_fail")
    def acc(s, x, out, fail):
        if fail:
            raise Boom("step failed")
        out[...] = s + x

    @engine.program
    def step(run, x: In((4,)), s: InOut((4,)), fail: Scalar(int)):
        run.submit(acc, s, x, out=s, fail=fail)

    rt = prepared(step, depth=3, workers=2)
    s = rt.alloc_tensor((4,), "float32", init=np.zeros(4, np.float32))
    handles = [rt.submit(np.ones(4, np.float32), s, fail=int(i == 2)) for i in range(6)]
    outcomes = [h.exception(10) for h in handles]
    assert [type(e) for e in outcomes] == [type(None)] * 2 + [engine.KernelError] + [type(None)] * 3
    assert "accumulate_or_fail" in str(outcomes[2])
    np.testing.assert_array_equal(s.to_numpy(), 5)  # the failed step contributed nothing
