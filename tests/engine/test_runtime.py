"""Runtime calls: outputs, host array kinds, resident tensors as arguments, RunHandle."""

import gc
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar
from engine import kernels as K

from .conftest import Gate, k_add, k_copy, k_scale


@engine.program
def affine(run, x: In(("B", 4)), w: In((4, 4)), b: In((4,)), y: Out(("B", 4))):
    h = run.scratch(("B", 4))

    @engine.host_kernel
    def bias(h_, b_, out):
        np.add(h_, b_, out=out)

    run.submit(mm, x, w, out=h)
    run.submit(bias, h, b, out=y)


@engine.host_kernel
def mm(a, b, out):
    np.matmul(a, b, out=out)


@engine.program
def three_outputs(run, x: In(("B", 3)), first: Out(("B", 3)), acc: InOut(("B", 3)), last: Out(("B", 3)),
                  k: Scalar(float)):
    run.submit(k_scale, x, out=first, factor=k)
    run.submit(k_add, acc, x, out=acc)
    run.submit(k_scale, x, out=last, factor=-k)


@engine.program
def no_outputs(run, x: In((3,))):
    h = run.scratch((3,))
    run.submit(k_copy, x, out=h)


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_single_output_is_returned_as_one_value(prepared, rng):
    rt = prepared(affine, bounds={"B": 16})
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in [(5, 4), (4, 4), (4,)])
    y = rt(x, w, b)
    assert isinstance(y, np.ndarray)
    assert y.shape == (5, 4) and y.dtype == np.float32
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-6)


def test_several_outputs_come_back_as_a_tuple_in_declaration_order(prepared, rng):
    rt = prepared(three_outputs, bounds={"B": 4})
    x = rng.standard_normal((2, 3)).astype(np.float32)
    acc = np.ones((2, 3), np.float32)
    acc0 = acc.copy()
    out = rt(x, acc=acc, k=2.0)
    assert isinstance(out, tuple) and len(out) == 3
    first, acc_out, last = out
    np.testing.assert_allclose(first, 2 * x)
    np.testing.assert_allclose(last, -2 * x)
    assert acc_out is acc, "an InOut host array is filled in place and returned"
    np.testing.assert_allclose(acc, acc0 + x)


def test_program_without_outputs_returns_none(prepared):
    rt = prepared(no_outputs)
    assert rt(np.ones(3, np.float32)) is None
    assert rt.submit(np.ones(3, np.float32)).result() is None


def test_passed_out_is_filled_in_place_and_returned(prepared, rng):
    rt = prepared(affine, bounds={"B": 8})
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in [(3, 4), (4, 4), (4,)])
    y = np.full((3, 4), np.nan, np.float32)
    got = rt(x, w, b, y)
    assert got is y
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-6)
    y2 = np.zeros((3, 4), np.float32)
    assert rt(x, w, b=b, y=y2) is y2  # by keyword too
    np.testing.assert_array_equal(y2, y)


def test_outputs_of_successive_calls_are_distinct_arrays(prepared):
    rt = prepared(affine, bounds={"B": 2})
    w, b = np.eye(4, dtype=np.float32), np.zeros(4, np.float32)
    y1 = rt(np.ones((2, 4), np.float32), w, b)
    y2 = rt(np.full((2, 4), 3, np.float32), w, b)
    assert not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(y1, 1)
    np.testing.assert_array_equal(y2, 3)


def test_arguments_by_keyword_in_any_order(prepared, rng):
    rt = prepared(three_outputs, bounds={"B": 4})
    x = rng.standard_normal((1, 3)).astype(np.float32)
    acc = np.zeros((1, 3), np.float32)
    first, _, last = rt(k=1.5, acc=acc, x=x)
    np.testing.assert_allclose(first, 1.5 * x)
    np.testing.assert_allclose(acc, x)


def test_scalar_int_passed_for_float_is_accepted(prepared):
    rt = prepared(three_outputs, bounds={"B": 4})
    x = np.ones((1, 3), np.float32)
    first, _, _ = rt(x, acc=np.zeros((1, 3), np.float32), k=3)
    np.testing.assert_array_equal(first, 3)


# -- torch -------------------------------------------------------------------------------
def test_import_engine_does_not_import_torch():
    code = ("import sys, engine, engine.runtime, engine.binding, engine.hostarrays\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_a_numpy_only_run_does_not_import_torch():
    code = ("import sys, numpy as np, engine\n"
            "from engine import In, Out\n"
            "@engine.host_kernel\n"
            "def cp(a, out): out[...] = a\n"
            "@engine.program\n"
            "def p(run, x: In((3,)), y: Out((3,))): run.submit(cp, x, out=y)\n"
            "with p.prepare() as rt:\n"
            "    assert (rt(np.ones(3, np.float32)) == 1).all()\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_torch_inputs_give_torch_outputs(prepared):
    torch = pytest.importorskip("torch")
    rt = prepared(affine, bounds={"B": 8})
    x, w, b = torch.randn(3, 4), torch.randn(4, 4), torch.randn(4)
    y = rt(x, w, b)
    assert isinstance(y, torch.Tensor)
    assert y.dtype == torch.float32 and tuple(y.shape) == (3, 4) and y.device.type == "cpu"
    torch.testing.assert_close(y, x @ w + b, rtol=1e-5, atol=1e-5)


def test_torch_passed_out_is_filled_in_place(prepared):
    torch = pytest.importorskip("torch")
    rt = prepared(three_outputs, bounds={"B": 4})
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    first = torch.zeros(2, 3)
    acc = torch.ones(2, 3)
    f, a, l = rt(x, first, acc, k=2.0)
    assert f is first and a is acc
    assert isinstance(l, torch.Tensor)
    torch.testing.assert_close(first, 2 * x)
    torch.testing.assert_close(acc, 1 + x)
    torch.testing.assert_close(l, -2 * x)


def test_torch_tensor_requiring_grad_is_accepted_as_input(prepared):
    torch = pytest.importorskip("torch")
    rt = prepared(affine, bounds={"B": 8})
    x = torch.randn(2, 4, requires_grad=True)
    w, b = torch.eye(4), torch.zeros(4)
    y = rt(x, w, b)
    torch.testing.assert_close(y, x.detach())


@pytest.mark.parametrize("dtype", ["float16", "int32", "int64", "uint8"])
def test_other_dtypes_round_trip_numpy_and_torch(prepared, dtype):
    torch = pytest.importorskip("torch")

    @engine.program
    def prog(run, x: In(("N",), dtype), y: Out(("N",), dtype)):
        run.submit(k_add, x, x, out=y)

    rt = prepared(prog, bounds={"N": 16})
    x = np.arange(10).astype(dtype)
    y = rt(x)
    assert y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(y, x + x)
    xt = torch.from_numpy(x.copy())
    yt = rt(xt)
    assert isinstance(yt, torch.Tensor) and yt.dtype == xt.dtype
    np.testing.assert_array_equal(yt.numpy(), x + x)


# -- resident tensors as arguments --------------------------------------------------------------
def test_device_tensor_arguments_are_not_copied_in_or_out(prepared, rng):
    rt = prepared(affine, bounds={"B": 8})
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in [(4, 4), (4, 4), (4,)])
    w_dev = rt.alloc_tensor((4, 4), "float32", init=w)
    b_dev = rt.alloc_tensor((4,), "float32", init=b)
    x_dev = rt.alloc_tensor((4, 4), "float32", init=x)
    y_dev = rt.alloc_tensor((4, 4), "float32")
    s0 = rt.memory_stats()
    got = rt(x_dev, w_dev, b_dev, y_dev)
    s1 = rt.memory_stats()
    assert got is y_dev, "a DeviceTensor Out is returned as itself"
    assert s1["h2d_bytes"] == s0["h2d_bytes"]
    assert s1["d2h_bytes"] == s0["d2h_bytes"]
    np.testing.assert_allclose(y_dev.to_numpy(), x @ w + b, rtol=1e-5, atol=1e-6)


def test_mixed_host_and_device_arguments_copy_only_the_host_ones(prepared, rng):
    rt = prepared(affine, bounds={"B": 8})
    w, b = rng.standard_normal((4, 4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    w_dev, b_dev = rt.alloc_tensor((4, 4), init=w), rt.alloc_tensor((4,), init=b)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    s0 = rt.memory_stats()
    y = rt(x, w_dev, b_dev)
    s1 = rt.memory_stats()
    assert s1["h2d_bytes"] - s0["h2d_bytes"] == x.nbytes
    assert s1["d2h_bytes"] - s0["d2h_bytes"] == y.nbytes
    np.testing.assert_allclose(y, x @ w + b, rtol=1e-5, atol=1e-6)


def test_device_tensor_inout_is_updated_without_copies(prepared):
    rt = prepared(three_outputs, bounds={"B": 4})
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    acc = rt.alloc_tensor((2, 3), "float32", init=np.zeros((2, 3), np.float32))
    s0 = rt.memory_stats()
    _, got, _ = rt(x, acc=acc, k=1.0)
    _, got2, _ = rt(x, acc=acc, k=1.0)
    s1 = rt.memory_stats()
    assert got is acc and got2 is acc
    assert s1["h2d_bytes"] - s0["h2d_bytes"] == 2 * x.nbytes
    assert s1["d2h_bytes"] - s0["d2h_bytes"] == 2 * 2 * x.nbytes  # first and last only
    np.testing.assert_array_equal(acc.to_numpy(), 2 * x)


def test_a_view_of_a_resident_tensor_can_stand_for_an_argument(prepared):
    rt = prepared(affine, bounds={"B": 8})
    big = np.arange(32, dtype=np.float32).reshape(8, 4)
    big_dev = rt.alloc_tensor((8, 4), init=big)
    w_dev = rt.alloc_tensor((4, 4), init=np.eye(4, dtype=np.float32))
    b_dev = rt.alloc_tensor((4,), init=np.zeros(4, np.float32))
    y = rt(big_dev[2:5], w_dev, b_dev)
    np.testing.assert_allclose(y, big[2:5])
    y = rt(big_dev[::2], w_dev, b_dev)  # strided rows
    np.testing.assert_allclose(y, big[::2])


# -- RunHandle ---------------------------------------------------------------------------------
@pytest.fixture
def gated(prepared):
    gate = Gate()
    kern = gate.kernel()

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), key: Scalar(int)):
        run.submit(kern, x, out=y, key=key)

    rt = prepared(prog, workers=2, depth=3)
    yield rt, gate
    gate.open_all()


def test_run_handle_lifecycle(gated):
    rt, gate = gated
    x = np.arange(4, dtype=np.float32)
    h = rt.submit(x, key=1)
    assert isinstance(h, engine.RunHandle)
    assert gate.wait_started(1)
    assert not h.done
    assert h.wait(0.05) is False
    with pytest.raises(TimeoutError):
        h.result(timeout=0.05)
    with pytest.raises(TimeoutError):
        h.exception(timeout=0.05)
    gate.open(1)
    assert h.wait(10) is True
    assert h.done
    assert h.exception() is None
    np.testing.assert_array_equal(h.result(), x + 1)
    np.testing.assert_array_equal(h.result(0), x + 1)


def test_result_is_cached_and_every_waiter_sees_the_same_outcome(gated):
    rt, gate = gated
    x = np.arange(4, dtype=np.float32)
    h = rt.submit(x, key=5)
    assert gate.wait_started(5)
    results, barrier = [], threading.Barrier(6)

    def waiter():
        barrier.wait()
        results.append(h.result(timeout=20))

    threads = [threading.Thread(target=waiter) for _ in range(5)]
    for t in threads:
        t.start()
    barrier.wait()
    gate.open(5)
    for t in threads:
        t.join(20)
    assert len(results) == 5
    assert all(r is results[0] for r in results)
    assert h.result() is results[0]
    np.testing.assert_array_equal(results[0], x + 5)


def test_handle_keeps_its_arguments_alive_until_the_run_is_released(gated):
    rt, gate = gated

    class Arr(np.ndarray):  # weak-referenceable array
        pass

    x = np.arange(4, dtype=np.float32).view(Arr)
    ref = weakref.ref(x)
    h = rt.submit(x, key=9)
    del x
    gc.collect()
    assert gate.wait_started(9)
    assert ref() is not None, "the input was dropped while its run is in flight"
    gate.open(9)
    np.testing.assert_array_equal(h.result(10), np.arange(4) + 9)
    gc.collect()
    assert ref() is None, "the input is still referenced after the run was released"


def test_run_times_are_ordered_on_one_engine_clock(prepared):
    @engine.program
    def spin_then_copy(run, x: In((4,)), y: Out((4,)), ns: Scalar(int)):
        run.submit(K.spin, ns=ns)
        run.submit(k_copy, x, out=y)

    rt = prepared(spin_then_copy, workers=1, depth=2)
    x = np.arange(4, dtype=np.float32)
    first = rt.submit(x, ns=1_000_000)
    while not first.done:  # polled: a waiting thread would run the copy beside the spin
        time.sleep(0.001)
    np.testing.assert_array_equal(first.result(10), x)
    t = first.times()
    assert set(t) == {"created_ns", "sealed_ns", "first_start_ns", "last_end_ns", "done_ns", "busy_ns"}
    assert 0 <= t["created_ns"] <= t["sealed_ns"] <= t["done_ns"]
    assert t["created_ns"] <= t["first_start_ns"] <= t["last_end_ns"] <= t["done_ns"]
    # The one worker ran the tasks one after the other: their summed time, at least the spin's,
    # fits within the span from the first start to the last end.
    assert 1_000_000 <= t["busy_ns"] <= t["last_end_ns"] - t["first_start_ns"]
    assert first.times() == t  # fixed once the run is done
    # The same clock for every run: a run submitted after another completed was created after it.
    second = rt.submit(x, ns=0)
    second.result(10)
    assert second.times()["created_ns"] >= t["done_ns"]


@pytest.fixture
def blocked_worker(prepared):
    """(runtime, gate, calls): one pool worker; each run's first task waits at gate key
    `key`, then a dependent and an independent host task record their calls."""
    gate = Gate()
    gk = gate.kernel()
    calls = []

    @engine.host_kernel
    def record(a, out):
        calls.append(a.copy())
        out[...] = a + 1

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), z: Out((4,)), key: Scalar(int)):
        h = run.scratch((4,))
        run.submit(gk, x, out=h, key=key)
        run.submit(record, h, out=y)  # waits for the gate's output
        run.submit(record, x, out=z)  # depends on nothing, but the only worker is at the gate

    rt = prepared(prog, workers=1, depth=2)
    yield rt, gate, calls
    gate.open_all()


def test_cancel_skips_the_tasks_that_have_not_started(blocked_worker):
    rt, gate, calls = blocked_worker
    x = np.arange(4, dtype=np.float32)
    y, z = np.full(4, -7, np.float32), np.full(4, -7, np.float32)
    h = rt.submit(x, y, z, key=1)
    assert gate.wait_started(1)
    assert h.cancel() is True
    assert not h.done
    gate.open(1)
    with pytest.raises(engine.RunCancelledError):
        h.result(10)
    assert isinstance(h.exception(), engine.RunCancelledError)
    assert calls == [], "a task that had not started when the run was cancelled ran"
    assert (y == -7).all() and (z == -7).all(), "a cancelled run wrote its outputs back"
    assert h.cancel() is False  # done: nothing left to cancel
    assert rt.memory_stats()["free_slots"] == rt.depth
    # The runtime carries on: the next run executes every task.
    gate.open(2)
    y2, z2 = rt(x, key=2)
    np.testing.assert_array_equal(y2, x + 3)
    np.testing.assert_array_equal(z2, x + 1)
    assert len(calls) == 2


def test_a_run_cancelled_before_any_task_started_has_no_device_times(blocked_worker):
    rt, gate, calls = blocked_worker
    x = np.arange(4, dtype=np.float32)
    running = rt.submit(x, key=1)
    assert gate.wait_started(1)
    queued = rt.submit(x, key=2)  # admitted (depth 2), its tasks queued behind the gate
    assert queued.times()["done_ns"] == -1
    assert queued.cancel() is True
    gate.open(1)
    y, z = running.result(10)
    np.testing.assert_array_equal(y, x + 2)
    with pytest.raises(engine.RunCancelledError):
        queued.result(10)
    assert not gate.has_started(2)
    assert len(calls) == 2  # the running run's two records, none of the cancelled one's
    t = queued.times()
    assert (t["first_start_ns"], t["last_end_ns"], t["busy_ns"]) == (-1, -1, 0)
    assert t["created_ns"] <= t["sealed_ns"] <= t["done_ns"]
    assert rt.memory_stats()["free_slots"] == rt.depth


def test_runs_submitted_from_several_threads(prepared):
    rt = prepared(affine, bounds={"B": 4}, workers=2, depth=2)
    w = np.eye(4, dtype=np.float32) * 2
    b = np.ones(4, np.float32)
    errors = []

    def worker(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(30):
                x = r.standard_normal((3, 4)).astype(np.float32)
                np.testing.assert_allclose(rt(x, w, b), 2 * x + 1, rtol=1e-5, atol=1e-6)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]


def test_when_done_is_true_a_passed_non_contiguous_output_is_filled(prepared):
    """done means the run completed: its outputs are in place without a further wait()/result()."""
    gate = Gate()
    kern = gate.kernel()

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), key: Scalar(int)):
        run.submit(kern, x, out=y, key=key)

    rt = prepared(prog, workers=2)
    parent = np.zeros(8, np.float32)
    x = np.arange(4, dtype=np.float32)
    h = rt.submit(x, parent[::2], key=1)
    gate.open(1)
    for _ in range(10_000):
        if h.done:
            break
        threading.Event().wait(0.001)
    assert h.done
    np.testing.assert_array_equal(parent[::2], x + 1)
    np.testing.assert_array_equal(parent[1::2], 0)


def test_program_with_only_scalars_and_callbacks(prepared):
    calls = []

    @engine.program(callbacks={"cb": 0})
    def prog(run, n: Scalar(int)):
        for _ in range(n):
            run.host("cb")

    rt = prepared(prog, callbacks={"cb": lambda: calls.append(1)})
    assert rt(n=3) is None
    assert rt(2) is None
    assert len(calls) == 5
