"""Program.prepare(): options, host-callback binding, exception safety, the context manager."""

import os
import weakref

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar

from .conftest import fd_count, k_add, k_copy, pool_threads, pool_threads_within, settle


@engine.program
def copy_prog(run, x: In(("B", 8)), y: Out(("B", 8))):
    run.submit(k_copy, x, out=y)


@engine.program
def big_prog(run, x: In((1024,)), y: Out((1024,))):
    run.submit(k_copy, x, out=y)


def test_defaults(prepared):
    rt = prepared(copy_prog, bounds={"B": 4})
    assert rt.depth == 2
    assert rt.workers == (os.cpu_count() or 1)  # every core computes; the waiting host thread helps
    assert rt.bounds == {"B": 4}
    assert not rt.closed
    x = np.ones((3, 8), np.float32)
    np.testing.assert_array_equal(rt(x), x)


def test_explicit_workers_and_depth(prepared):
    rt = prepared(copy_prog, workers=3, depth=5, bounds={"B": 2})
    assert rt.workers == 3
    assert rt.depth == 5
    assert rt.memory_stats()["depth"] == 5


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"device": "cuda"}, ValueError, "cuda"),
    ({"depth": 0}, ValueError, "depth"),
    ({"depth": -2}, ValueError, "depth"),
    ({"depth": 1.5}, TypeError, "depth"),
    ({"depth": True}, TypeError, "depth"),
    ({"workers": 0}, ValueError, "workers"),
    ({"workers": "2"}, TypeError, "workers"),
    ({"memory_limit": 0}, ValueError, "memory_limit"),
    ({"bounds": {}}, ValueError, "B"),
    ({"bounds": None}, ValueError, "B"),
    ({"bounds": {"B": 0}}, ValueError, "B"),
    ({"bounds": {"B": 2.0}}, TypeError, "B"),
])
def test_invalid_prepare_options(kwargs, exc, match):
    kwargs = {"bounds": {"B": 4}, **kwargs}
    threads = pool_threads()
    with pytest.raises(exc, match=match):
        copy_prog.prepare(**kwargs)
    assert pool_threads_within(threads), "a failed prepare left pool threads running"


def test_scratch_is_sized_at_the_bounds_and_symbols_resolve_per_run(prepared):
    seen = []

    @engine.program
    def prog(run, x: In(("B", "N")), y: Out(("B", "N"))):
        h = run.scratch(("B", "N"), "float32")
        seen.append((run.planning, h.shape))
        run.submit(k_add, x, x, out=h)
        run.submit(k_add, h, x, out=y)

    rt = prepared(prog, bounds={"B": 8, "N": 16})
    assert seen == [(True, (8, 16))]  # the planning pass ran at the bounds
    assert rt.scratch_bytes >= 8 * 16 * 4
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(rt(x), 3 * x)
    assert seen[-1] == (False, (3, 4))


def test_explicit_scratch_bytes_skips_planning(prepared):
    calls = []

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,))):
        calls.append(run.planning)
        h = run.scratch((4,))
        run.submit(k_copy, x, out=h)
        run.submit(k_copy, h, out=y)

    rt = prepared(prog, scratch_bytes=64)
    assert calls == []
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(rt(x), x)


def test_scratch_beyond_explicit_scratch_bytes_fails_that_run_only(prepared):
    @engine.program
    def prog(run, x: In((64,)), y: Out((64,))):
        h = run.scratch((64,))
        run.submit(k_copy, x, out=h)
        run.submit(k_copy, h, out=y)

    rt = prepared(prog, scratch_bytes=16)
    x = np.arange(64, dtype=np.float32)
    with pytest.raises(ValueError, match="scratch"):
        rt(x)
    assert rt.memory_stats()["free_slots"] == rt.depth  # the failed launch gave its slot back


# -- host callbacks bound at prepare --------------------------------------------------------
@engine.program(callbacks={"accumulate": 2})
def cb_prog(run, x: In((4,)), y: Out((4,))):
    run.submit(k_copy, x, out=y)
    run.host("accumulate", x, y, reads=[x], writes=[y])


def test_callback_binding_runs_the_bound_function(prepared):
    calls = []

    def accumulate(a, b):
        calls.append(a.copy())
        b += a

    rt = prepared(cb_prog, callbacks={"accumulate": accumulate})
    x = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(rt(x), 2 * x)
    assert len(calls) == 1
    np.testing.assert_array_equal(calls[0], x)


def test_unknown_callback_name_is_a_value_error_at_prepare():
    with pytest.raises(ValueError, match="bogus"):
        cb_prog.prepare(callbacks={"accumulate": lambda a, b: None, "bogus": lambda: None})


def test_missing_callback_is_a_value_error_at_prepare():
    with pytest.raises(ValueError, match="accumulate"):
        cb_prog.prepare()
    with pytest.raises(ValueError, match="accumulate"):
        cb_prog.prepare(callbacks={})


@pytest.mark.parametrize("fn", [lambda a: None, lambda a, b, c: None, lambda: None])
def test_wrong_callback_arity_is_a_type_error_at_prepare(fn):
    with pytest.raises(TypeError, match="accumulate"):
        cb_prog.prepare(callbacks={"accumulate": fn})


def test_flexible_callback_signatures_are_accepted(prepared):
    calls = []

    def star(*arrays):
        calls.append(("star", len(arrays)))
        arrays[1][...] = 5

    def defaulted(a, b, c=None):
        calls.append(("defaulted", c))
        b[...] = a + 1

    x = np.arange(4, dtype=np.float32)
    rt = prepared(cb_prog, callbacks={"accumulate": star})
    np.testing.assert_array_equal(rt(x), [5] * 4)
    rt2 = prepared(cb_prog, callbacks={"accumulate": defaulted})
    np.testing.assert_array_equal(rt2(x), x + 1)
    # Each ran once per run, with the two declared arrays and no extra argument.
    assert calls == [("star", 2), ("defaulted", None)]


def test_non_callable_callback_is_a_type_error():
    with pytest.raises(TypeError, match="accumulate"):
        cb_prog.prepare(callbacks={"accumulate": 42})


def test_callback_declared_as_names_has_no_arity_check(prepared):
    @engine.program(callbacks=["note"])
    def prog(run, x: In((2,)), y: Out((2,))):
        run.submit(k_copy, x, out=y)
        run.host("note", y, writes=[y])

    def note(y):
        y[...] = 7

    rt = prepared(prog, callbacks={"note": note})
    np.testing.assert_array_equal(rt(np.zeros(2, np.float32)), [7, 7])


def test_program_calling_an_undeclared_callback_fails_at_prepare():
    @engine.program(callbacks={"a": 1})
    def prog(run, x: In((2,))):
        run.host("b", x)

    with pytest.raises(ValueError, match="'b'"):
        prog.prepare(callbacks={"a": lambda t: None})


def test_program_calling_a_callback_with_the_wrong_count_fails_at_prepare():
    @engine.program(callbacks={"a": 1})
    def prog(run, x: In((2,)), y: In((2,))):
        run.host("a", x, y)

    with pytest.raises(TypeError, match="'a'"):
        prog.prepare(callbacks={"a": lambda t: None})


# -- exception safety ----------------------------------------------------------------------
class Callback:
    def __call__(self, a, b):
        pass


def _assert_released(device_spy, threads, fds):
    assert device_spy, "prepare created no device"
    for dev in device_spy:
        stats = dev.stats()
        assert stats["live_allocations"] == 0, stats
        assert stats["bytes_in_use"] == 0, stats
    settle()
    assert pool_threads_within(threads), "worker threads were not joined"
    assert fd_count() <= fds, "file descriptors leaked"


def test_memory_limit_too_small_for_the_slots_raises_and_releases_everything(device_spy):
    cb = Callback()
    ref = weakref.ref(cb)
    settle()
    threads, fds = pool_threads(), fd_count()
    with pytest.raises(engine.DeviceMemoryError) as ei:
        cb_prog.prepare(memory_limit=8, callbacks={"accumulate": cb})
    assert isinstance(ei.value, MemoryError)
    del cb, ei
    _assert_released(device_spy, threads, fds)
    assert ref() is None, "the callback registered before the failure is still referenced"


def test_failure_after_some_slots_were_allocated_frees_them(device_spy):
    settle()
    threads, fds = pool_threads(), fd_count()
    one_slot = 2 * 1024 * 4
    with pytest.raises(engine.DeviceMemoryError):
        big_prog.prepare(depth=3, memory_limit=one_slot + one_slot // 2)
    assert device_spy[0].stats()["total_allocations"] >= 2, "expected the first slot to have been allocated"
    _assert_released(device_spy, threads, fds)


def test_memory_limit_large_enough_works(prepared):
    rt = prepared(big_prog, depth=2, memory_limit=1 << 20)
    x = np.arange(1024, dtype=np.float32)
    np.testing.assert_array_equal(rt(x), x)
    assert rt.memory_stats()["capacity"] == 1 << 20


def test_failing_planning_pass_re_raises_the_original_error_and_releases(device_spy):
    boom = RuntimeError("orchestration exploded")

    @engine.program
    def prog(run, x: In((4,))):
        raise boom

    settle()
    threads, fds = pool_threads(), fd_count()
    with pytest.raises(RuntimeError) as ei:
        prog.prepare()
    assert ei.value is boom
    del ei
    _assert_released(device_spy, threads, fds)


def test_planning_pass_type_error_keeps_its_type_and_cause(device_spy):
    @engine.program
    def prog(run, x: In((4,)), y: Out((4,))):
        run.submit(k_copy, x, x, out=y)  # k_copy takes one input: the kernel itself raises at run time,
        run.submit("not a kernel", x, out=y)  # but this fails during orchestration

    settle()
    threads, fds = pool_threads(), fd_count()
    with pytest.raises(TypeError) as ei:
        prog.prepare()
    assert "kernel" in str(ei.value)
    del ei
    _assert_released(device_spy, threads, fds)


# -- context manager -----------------------------------------------------------------------
def test_context_manager_closes_on_exit(device_spy):
    with copy_prog.prepare(bounds={"B": 2}) as rt:
        assert isinstance(rt, engine.Runtime)
        x = np.ones((2, 8), np.float32)
        np.testing.assert_array_equal(rt(x), x)
    assert rt.closed
    with pytest.raises(engine.ClosedError):
        rt(x)
    assert device_spy[0].stats()["live_allocations"] == 0


def test_context_manager_closes_when_the_body_raises():
    with pytest.raises(KeyError):
        with copy_prog.prepare(bounds={"B": 2}) as rt:
            raise KeyError("body")
    assert rt.closed
