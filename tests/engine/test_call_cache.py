"""The call cache's hit path (engine.call_cache): calls shaped like an earlier one skip binding logic, and
still see every check, every value and (captured) every recording change the full path would."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar
from engine import kernels as K
from engine.binding import BoundCall
from engine.call_cache import CachedBinding
from scheduler import AsyncRuntime
from tests.engine.test_capture import f32, mlp, mlp_ref  # mlp passes its float Scalar straight through

@engine.program
def steps(run: engine.Run, x: In((8,)), y: Out((8,)), k: Scalar(int)):
    h = run.scratch((8,))
    run.submit(K.copy, x, out=h)
    for _ in range(k):  # read: each k has its own recording
        run.submit(K.scale, h, out=h, alpha=2.0)
    run.submit(K.copy, h, out=y)


@engine.program
def two_outs(run: engine.Run, x: In((4,)), a: Out((4,)), b: Out((4,))):
    run.submit(K.copy, x, out=a)
    run.submit(K.scale, x, out=b, alpha=3.0)


def test_a_call_shaped_like_a_replayed_one_binds_from_the_cache_and_sees_each_call_s_values(prepared):
    rt = prepared(mlp, bounds={"B": 16}, capture=True)
    w = f32(8, 8)
    wd = rt.alloc_tensor((8, 8), init=w)
    x = f32(4, 8)
    assert isinstance(rt.bind((x, wd), {"alpha": 1.0}), BoundCall)  # nothing replayed yet
    rt(x, wd, alpha=1.0)  # recorded
    rt(x, wd, alpha=1.0)  # replayed through the full path: learnt
    assert isinstance(rt.bind((x, wd), {"alpha": 1.0}), CachedBinding)
    outs = []
    for alpha in (0.5, -2.0, 3.0):
        x = f32(4, 8)
        y = rt(x, wd, alpha=alpha)
        np.testing.assert_allclose(y, mlp_ref(x, w, alpha), rtol=1e-5, atol=1e-5)
        outs.append(y)
    assert len({id(y) for y in outs}) == 3  # an omitted output is a new array per call
    given = np.zeros((4, 8), np.float32)
    x = f32(4, 8)
    rt(x, wd, given, alpha=1.5)  # a given output is filled in place
    rt(x, wd, given, alpha=1.5)
    assert isinstance(rt.bind((x, wd, given), {"alpha": 1.5}), CachedBinding)
    assert rt(x, wd, given, alpha=1.5) is given
    np.testing.assert_allclose(given, mlp_ref(x, w, 1.5), rtol=1e-5, atol=1e-5)
    # another batch size is another signature, bound and recorded by the full path
    x = f32(9, 8)
    assert isinstance(rt.bind((x, wd), {"alpha": 1.0}), BoundCall)
    np.testing.assert_allclose(rt(x, wd, alpha=1.0), mlp_ref(x, w, 1.0), rtol=1e-5, atol=1e-5)
    assert rt.capture_stats()["misses"] == 2


def test_the_cached_path_raises_binding_s_errors_and_leaves_the_runtime_usable(prepared):
    rt = prepared(mlp, bounds={"B": 8}, capture=True)
    w = f32(8, 8)
    wd = rt.alloc_tensor((8, 8), init=w)
    x = f32(4, 8)
    for _ in range(3):
        rt(x, wd, alpha=1)  # an int for a float: converted, as binding does
    assert isinstance(rt.bind((x, wd), {"alpha": 2}), CachedBinding)
    with pytest.raises(ValueError, match="parameter 'alpha': int value is too large for a float"):
        rt(x, wd, alpha=10 ** 400)  # the cached path checks each value
    with pytest.raises(TypeError, match="parameter 'alpha': expected a float, got str"):
        rt(x, wd, alpha="1.0")
    big = f32(12, 8)
    with pytest.raises(ValueError, match="exceeds its bound"):
        rt(big, wd, alpha=1.0)
    rt.free_tensor(wd)
    with pytest.raises(ValueError, match="parameter 'w': the tensor was freed"):
        rt(x, wd, alpha=1.0)
    wd2 = rt.alloc_tensor((8, 8), init=w)
    np.testing.assert_allclose(rt(x, wd2, alpha=2.0), mlp_ref(x, w, 2.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rt(x, wd2, alpha=3), mlp_ref(x, w, 3.0), rtol=1e-5, atol=1e-5)
    assert rt.memory_stats()["free_slots"] == rt.depth


def test_arrays_the_cache_does_not_take_go_through_the_full_path(prepared):
    rt = prepared(mlp, bounds={"B": 8}, capture=True)
    w = f32(8, 8)
    strided = f32(4, 16)[:, ::2]  # not contiguous: staged through a copy
    readonly = f32(4, 8)
    readonly.flags.writeable = False
    out_strided = np.zeros((4, 16), np.float32)[:, ::2]  # written back after the run
    for _ in range(3):
        assert isinstance(rt.bind((strided, w), {"alpha": 1.0}), BoundCall)
        np.testing.assert_allclose(rt(strided, w, alpha=1.0), mlp_ref(strided, w, 1.0), rtol=1e-5, atol=1e-5)
        assert isinstance(rt.bind((readonly, w), {"alpha": 1.0}), BoundCall)
        np.testing.assert_allclose(rt(readonly, w, alpha=1.0), mlp_ref(readonly, w, 1.0), rtol=1e-5, atol=1e-5)
        assert isinstance(rt.bind((readonly, w, out_strided), {"alpha": 1.0}), BoundCall)
        rt(readonly, w, out_strided, alpha=1.0)
        np.testing.assert_allclose(out_strided, mlp_ref(readonly, w, 1.0), rtol=1e-5, atol=1e-5)
    assert rt.capture_stats()["hits"] >= 6


def test_calls_with_two_given_outputs_are_checked_for_overlap_every_time(prepared):
    rt = prepared(two_outs, capture=True, scratch_bytes=0)
    x = f32(4)
    a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
    for _ in range(3):
        rt(x, a, b)
        assert isinstance(rt.bind((x, a, b), {}), BoundCall)
    np.testing.assert_allclose(a, x)
    np.testing.assert_allclose(b, x * 3)
    shared = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="outputs sharing memory"):
        rt(x, shared, shared)
    outs = rt(x)  # both omitted: cached after a replay
    outs = rt(x)
    assert isinstance(rt.bind((x,), {}), CachedBinding)
    a2, b2 = rt(x)
    np.testing.assert_allclose(a2, x)
    np.testing.assert_allclose(b2, x * 3)
    assert outs[0] is not a2


def test_read_scalars_find_their_own_recording_on_the_cached_path(prepared):
    rt = prepared(steps, capture=True, capture_limit=3)
    x = f32(8)
    for rnd in range(4):
        for k in (0, 1, 2, 3, 1, 4):  # more ks than recordings kept: evicted ones are recorded again
            np.testing.assert_allclose(rt(x, k=k), x * 2.0 ** k, rtol=1e-6)
    stats = rt.capture_stats()
    assert stats["entries"] == 3 and stats["evictions"] > 0
    assert stats["hits"] + stats["misses"] == 24


def test_a_signature_remembers_a_replay_per_read_value_and_slot_up_to_what_the_capture_table_holds(prepared):
    # A decoder step reads its position: one signature, one recording per position, replayed on each slot.
    # Every (slot, value) is remembered, up to capture_limit x depth, so none is looked up again. One slot,
    # so that which (slot, value) pairs occur does not depend on timing.
    rt = prepared(steps, depth=1, capture=True, capture_limit=80)
    x = f32(8)
    ks = list(range(70))

    def run_all() -> None:
        for k in ks:
            np.testing.assert_allclose(rt(x, k=k), x * 2.0 ** k, rtol=1e-6)

    for _ in range(3):  # record, learn the signature, remember each (slot, k)
        run_all()
    entry = next(iter(rt._calls._entries.values()))
    assert len(entry._replays) == len(ks)  # more than the 64 it used to keep
    lookups = []
    lookup = rt._capture.lookup
    rt._capture.lookup = lambda *a: lookups.append(a) or lookup(*a)
    run_all()
    assert not lookups


def test_an_evicted_or_replaced_recording_is_never_replayed_from_the_cache(prepared):
    rt = prepared(mlp, bounds={"B": 16}, capture=True, capture_limit=1)
    w = f32(8, 8)
    for B in (4, 4, 4, 5, 5, 4, 4, 5, 4):
        x = f32(B, 8)
        np.testing.assert_allclose(rt(x, w, alpha=2.0), mlp_ref(x, w, 2.0), rtol=1e-5, atol=1e-5)
    stats = rt.capture_stats()
    # every return of a size after the other evicted its recording: recorded again, never replayed
    assert stats["entries"] == 1 and stats["misses"] == 5 and stats["evictions"] == 4 and stats["hits"] == 4


def test_tracing_records_the_host_spans_of_cached_calls_on_the_cached_path(prepared, monkeypatch):
    rt = prepared(mlp, bounds={"B": 8}, capture=True)
    w, x = f32(8, 8), f32(4, 8)
    for _ in range(3):
        rt(x, w, alpha=1.0)
    rt.set_tracing(True)
    rt.drain_trace()

    def full_path(*args, **kwargs):  # tracing must measure the path an untraced call takes
        raise AssertionError("a traced cached call took the full path")

    monkeypatch.setattr(rt._capture, "orchestrate", full_path)
    handles = [rt.submit(x, w, alpha=1.0) for _ in range(3)]
    for h in handles:
        h.result()
    spans, events = rt.drain_trace()
    runs = {h.id for h in handles}
    for name in ("staging", "orchestration"):
        assert {(r, n) for r, _, n, _, _ in spans if n == name} == {(r, name) for r in runs}
    assert all(start <= end for _, _, _, start, end in spans)
    assert {e[0] for e in events} == runs


def test_the_signature_table_keeps_as_many_signatures_as_recordings(prepared):
    limit = 12
    rt = prepared(steps, capture=True, capture_limit=limit)
    xs = rt.alloc_tensor((limit + 8, 8), init=np.ones((limit + 8, 8), np.float32))
    views = [xs[i] for i in range(limit + 8)]  # a signature per view (one recording: only its plans differ)
    for v in views:
        rt(v, k=1)
        rt(v, k=1)
        assert isinstance(rt.bind((v,), {"k": 1}), CachedBinding)
    assert len(rt._calls._entries) == limit
    for v in views:
        np.testing.assert_allclose(rt(v, k=2), 4.0)


async def _dispatch_all(rt: engine.Runtime, w: engine.DeviceTensor, xs: list[np.ndarray]) -> list[np.ndarray]:
    async with AsyncRuntime(rt) as art:
        futs = [await art.dispatch(x, w, alpha=float(i)) for i, x in enumerate(xs)]
        return [await f for f in futs]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_async_surface_dispatches_cached_calls(prepared, backend):
    rt = prepared(mlp, bounds={"B": 8}, depth=2, capture=True)
    wn = f32(8, 8)
    w = rt.alloc_tensor((8, 8), init=wn)
    xs = [f32(8, 8) for _ in range(8)]
    ys = anyio.run(_dispatch_all, rt, w, xs, backend=backend)
    for i, (x, y) in enumerate(zip(xs, ys)):
        np.testing.assert_allclose(y, mlp_ref(x, wn, float(i)), rtol=1e-5, atol=1e-5)
    assert rt.capture_stats()["hits"] == 7


def test_close_forgets_the_cached_calls(prepared):
    rt = prepared(mlp, bounds={"B": 8}, capture=True)
    w = rt.alloc_tensor((8, 8), init=f32(8, 8))
    for _ in range(3):
        rt(f32(4, 8), w, alpha=1.0)
    assert rt._calls._entries
    rt.close()
    assert not rt._calls._entries
    with pytest.raises(engine.ClosedError):
        rt(f32(4, 8), w, alpha=1.0)


# -- uncaptured runtimes: the same hit path, then the orchestration function runs as always -------------------
@engine.program
def accumulate(run: engine.Run, x: In(("B", 8)), acc: InOut(("B", 8)), y: Out(("B", 8)), k: Scalar(float),
               *, n: Scalar(int)):
    h = run.scratch(("B", 8))
    run.submit(K.scale, x, out=h, alpha=k)
    for _ in range(n):  # read by the orchestration: fine uncaptured, it runs every call
        run.submit(K.add, acc, h, out=acc)
    run.submit(K.copy, acc, out=y)


def test_an_uncaptured_runtime_binds_repeated_calls_from_the_cache_and_runs_its_orchestration_each_time(prepared):
    rt = prepared(accumulate, bounds={"B": 8})
    x = f32(4, 8)
    acc = np.zeros((4, 8), np.float32)
    assert isinstance(rt.bind((x, acc), {"k": 1.0, "n": 1}), BoundCall)  # nothing launched yet
    rt(x, acc, k=1.0, n=1)  # launched through the full path: learnt
    assert isinstance(rt.bind((x, acc), {"k": 1.0, "n": 1}), CachedBinding)
    expect = x.copy()
    outs = []
    for k, n in ((2.0, 1), (0.5, 3), (-1.0, 0), (1, 2)):  # an int for the float Scalar: its own signature
        a, y = rt(x, acc, k=k, n=n)
        expect = expect + n * (np.float32(k) * x)
        assert a is acc
        np.testing.assert_allclose(acc, expect, rtol=1e-5)  # the InOut array is updated in place
        np.testing.assert_allclose(y, expect, rtol=1e-5)
        outs.append(y)
    assert len({id(y) for y in outs}) == 4 and not np.shares_memory(outs[0], outs[1])
    with pytest.raises(TypeError, match="expected a int"):
        rt(x, acc, k=1.0, n=1.5)  # the value checks run on the hit path
    with pytest.raises(ValueError, match="too large for a float"):
        rt(x, acc, k=10**400, n=1)
    np.testing.assert_allclose(rt(x, acc, k=0.0, n=1)[1], expect, rtol=1e-5)  # still usable


def test_an_uncaptured_hit_whose_orchestration_raises_frees_its_slot(prepared):
    @engine.program
    def picky(run: engine.Run, x: In((4,)), y: Out((4,)), k: Scalar(int)):
        if k < 0:
            raise ValueError("k must not be negative")
        run.submit(K.scale, x, out=y, alpha=float(k))

    rt = prepared(picky, depth=2)
    x = f32(4)
    for _ in range(2):
        rt(x, k=1)
    assert isinstance(rt.bind((x,), {"k": 1}), CachedBinding)
    for _ in range(3):  # more failures than slots: each one gave its slot back
        with pytest.raises(ValueError, match="must not be negative"):
            rt(x, k=-1)
    np.testing.assert_allclose(rt(x, k=3), 3 * x)
    assert rt.memory_stats()["free_slots"] == 2


def test_an_uncaptured_hit_with_a_freed_resident_tensor_takes_the_full_path_and_its_error(prepared):
    rt = prepared(mlp, bounds={"B": 8})
    w = f32(8, 8)
    wd = rt.alloc_tensor((8, 8), init=w)
    x = f32(4, 8)
    for _ in range(2):
        np.testing.assert_allclose(rt(x, wd, alpha=2.0), mlp_ref(x, w, 2.0), rtol=1e-5, atol=1e-5)
    assert isinstance(rt.bind((x, wd), {"alpha": 2.0}), CachedBinding)
    rt.free_tensor(wd)
    with pytest.raises(ValueError, match="freed"):
        rt(x, wd, alpha=2.0)


def test_an_uncaptured_hit_is_traced_with_its_host_spans(prepared):
    rt = prepared(mlp, bounds={"B": 8})
    w, x = f32(8, 8), f32(4, 8)
    rt(x, w, alpha=1.0)
    rt.set_tracing(True)
    rt.drain_trace()
    assert isinstance(rt.bind((x, w), {"alpha": 1.0}), CachedBinding)
    handles = [rt.submit(x, w, alpha=1.0) for _ in range(3)]
    for h in handles:
        np.testing.assert_allclose(h.result(), mlp_ref(x, w, 1.0), rtol=1e-5, atol=1e-5)
    spans, events = rt.drain_trace()
    runs = {h.id for h in handles}
    for name in ("staging", "orchestration"):
        assert {(r, n) for r, _, n, _, _ in spans if n == name} == {(r, name) for r in runs}
    assert {e[0] for e in events} == runs
