"""engine.Run inside orchestration: submit, scratch, views and split for tiling, host callbacks, host kernels."""

import threading
import time

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar
from engine import kernels as K

from .conftest import k_add, k_copy, k_matmul, k_relu, k_scale


def gelu_np(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


@engine.host_kernel
def k_gelu(a, out):
    out[...] = gelu_np(a)


# -- host kernels ------------------------------------------------------------------------------
def test_host_kernel_decorator_forms():
    def f(a, out):
        out[...] = a

    k = engine.host_kernel(f)
    assert isinstance(k, engine.HostKernel) and k.name == "test_host_kernel_decorator_forms.<locals>.f"
    k2 = engine.host_kernel(name="custom")(f)
    assert isinstance(k2, engine.HostKernel) and k2.name == "custom"
    with pytest.raises(TypeError):
        engine.host_kernel(3)


def test_host_kernel_receives_inputs_out_and_scalars_in_order(prepared):
    seen = []

    @engine.host_kernel
    def probe(a, b, out, first, second):
        seen.append((a.shape, b.shape, out.shape, first, second, a.flags.writeable, out.flags.writeable))
        out[...] = a * first + b * second

    @engine.program
    def prog(run, a: In((2, 3)), b: In((2, 3)), y: Out((2, 3))):
        run.submit(probe, a, b, out=y, first=2, second=0.5)

    rt = prepared(prog)
    a, b = np.ones((2, 3), np.float32), np.full((2, 3), 4, np.float32)
    np.testing.assert_array_equal(rt(a, b), 2 * a + 0.5 * b)
    assert seen == [((2, 3), (2, 3), (2, 3), 2, 0.5, False, True)]  # inputs are read-only views


def test_in_place_kernel_reads_and_writes_the_same_view(prepared):
    @engine.program
    def prog(run, x: InOut((5,))):
        run.submit(k_add, x, x, out=x)
        run.submit(k_scale, x, out=x, factor=3.0)

    rt = prepared(prog)
    x = np.arange(5, dtype=np.float32)
    assert rt(x.copy()) is not None
    y = x.copy()
    rt(y)
    np.testing.assert_array_equal(y, 6 * x)


def test_submit_rejects_non_kernels_and_non_tensor_arguments(prepared):
    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), mode: Scalar(int)):
        if mode == 1:
            run.submit(lambda a, out: None, x, out=y)
        elif mode == 2:
            run.submit(k_copy, x, out=np.zeros(4, np.float32))
        else:
            run.submit(k_copy, x, out=y)

    rt = prepared(prog)
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="kernel"):
        rt(x, mode=1)
    with pytest.raises(TypeError):
        rt(x, mode=2)
    np.testing.assert_array_equal(rt(x, mode=0), x)


def test_run_properties(prepared):
    seen = []

    @engine.program
    def prog(run, x: In(("B", "N")), y: Out(("B", "N"))):
        seen.append((run.planning, dict(run.dims), run.workers, run.id))
        run.submit(k_copy, x, out=y)

    rt = prepared(prog, bounds={"B": 4, "N": 8}, workers=2)
    rt(np.zeros((2, 3), np.float32))
    rt(np.zeros((4, 8), np.float32))
    assert seen[0][:3] == (True, {"B": 4, "N": 8}, 2)
    assert seen[1][:3] == (False, {"B": 2, "N": 3}, 2)
    assert seen[2][:3] == (False, {"B": 4, "N": 8}, 2)
    assert seen[1][3] != seen[2][3]  # distinct run ids


# -- scratch ------------------------------------------------------------------------------------
def test_scratch_tensors_are_disjoint_and_resolve_symbols(prepared):
    info = []

    @engine.program
    def prog(run, x: In(("B", 3)), y: Out(("B", 3))):
        a = run.scratch(("B", 3))
        b = run.scratch(("B", 3), "float32")
        c = run.scratch((2, "B"), engine.int32)
        info.append((a.shape, b.shape, c.shape, c.dtype, a.overlaps(b), b.overlaps(c), a.overlaps(a)))
        run.submit(k_scale, x, out=a, factor=2.0)
        run.submit(k_scale, x, out=b, factor=3.0)
        run.submit(k_add, a, b, out=y)

    rt = prepared(prog, bounds={"B": 5})
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(rt(x), 5 * x)
    assert info[-1] == ((2, 3), (2, 3), (2, 2), engine.int32, False, False, True)


@pytest.mark.parametrize("shape,exc", [
    (("M", 3), ValueError),  # unknown symbol
    ((0, 3), ValueError),
    ((), ValueError),
    ((2.5,), TypeError),
    ((True,), TypeError),
])
def test_scratch_argument_errors(shape, exc):
    @engine.program
    def prog(run, x: In(("B", 3))):
        run.scratch(shape)

    with pytest.raises(exc):
        prog.prepare(bounds={"B": 2})


def test_scratch_unknown_dtype_is_a_type_error():
    @engine.program
    def prog(run, x: In((3,))):
        run.scratch((3,), "float64")

    with pytest.raises(TypeError):
        prog.prepare()


def test_data_dependent_scratch_beyond_the_plan_fails_that_run_only(prepared):
    @engine.program
    def prog(run, x: In((16,)), y: Out((16,)), extra: Scalar(int)):
        for _ in range(extra):
            run.scratch((1024,))
        run.submit(k_copy, x, out=y)

    rt = prepared(prog, depth=1)  # the planning pass ran with extra=0
    x = np.arange(16, dtype=np.float32)
    with pytest.raises(ValueError, match="scratch"):
        rt(x, extra=3)
    assert rt.memory_stats()["free_slots"] == 1
    np.testing.assert_array_equal(rt(x, extra=0), x)


# -- views and split for tiling ------------------------------------------------------------------
def test_row_tiles_by_slicing(prepared):
    @engine.program
    def prog(run, x: In(("B", 8)), w: In((8, 4)), y: Out(("B", 4))):
        b = run.dims["B"]
        step = 3
        for i in range(0, b, step):
            run.submit(k_matmul, x[i:i + step], w, out=y[i:i + step])

    rt = prepared(prog, bounds={"B": 32}, workers=2)
    rng = np.random.default_rng(3)
    for b in (1, 7, 32):
        x = rng.standard_normal((b, 8)).astype(np.float32)
        w = rng.standard_normal((8, 4)).astype(np.float32)
        np.testing.assert_allclose(rt(x, w), x @ w, rtol=1e-5, atol=1e-5)


def test_column_tiles_are_strided_views(prepared):
    @engine.program
    def prog(run, x: In((6, 10)), y: Out((6, 10))):
        for j in range(0, 10, 4):
            run.submit(k_scale, x[:, j:j + 4], out=y[:, j:j + 4], factor=float(j + 1))

    rt = prepared(prog, workers=2)
    x = np.arange(60, dtype=np.float32).reshape(6, 10)
    expect = x.copy()
    for j in range(0, 10, 4):
        expect[:, j:j + 4] *= j + 1
    np.testing.assert_array_equal(rt(x), expect)


def test_reshape_views_in_orchestration(prepared):
    @engine.program
    def prog(run, x: In(("B", 2, 3)), y: Out(("B", 6))):
        flat = run.scratch(("B", 2, 3))
        run.submit(k_relu, x, out=flat)
        run.submit(k_copy, flat.reshape(run.dims["B"], 6), out=y)

    rt = prepared(prog, bounds={"B": 4})
    x = np.arange(-12, 12, dtype=np.float32).reshape(4, 2, 3)
    np.testing.assert_array_equal(rt(x), np.maximum(x, 0).reshape(4, 6))
    x3 = x[:3].copy()
    np.testing.assert_array_equal(rt(x3), np.maximum(x3, 0).reshape(3, 6))


def test_reshape_of_a_non_contiguous_view_is_refused_in_orchestration(prepared):
    @engine.program
    def prog(run, x: In((4, 6)), y: Out((12,))):
        run.submit(k_copy, x[:, ::2].reshape(12), out=y)

    with pytest.raises(ValueError, match="contiguous"):
        prog.prepare()


def test_split_views(prepared):
    shapes = []

    @engine.program
    def prog(run, x: In((10, 6)), y: Out((10, 6))):
        rows = run.split(x, 3)
        cols = run.split(x, 4, axis=1)
        shapes.append(([r.shape for r in rows], [c.shape for c in cols], len(run.split(x)),
                       len(run.split(x, 50))))
        for xi, yi in zip(run.split(x, 3), run.split(y, 3)):
            run.submit(k_scale, xi, out=yi, factor=2.0)

    rt = prepared(prog, workers=2)
    x = np.arange(60, dtype=np.float32).reshape(10, 6)
    np.testing.assert_array_equal(rt(x), 2 * x)
    rows, cols, default_parts, clamped = shapes[-1]
    assert rows == [(4, 6), (3, 6), (3, 6)]
    assert cols == [(10, 2), (10, 2), (10, 1), (10, 1)]
    assert default_parts == 2  # one per worker
    assert clamped == 10  # never more parts than rows


def test_split_matmul_across_workers_matches_numpy(prepared):
    @engine.program
    def prog(run, x: In(("B", 16)), w: In((16, 12)), y: Out(("B", 12))):
        for xi, yi in zip(run.split(x), run.split(y)):
            run.submit(k_matmul, xi, w, out=yi)

    rt = prepared(prog, bounds={"B": 64}, workers=2)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((37, 16)).astype(np.float32)
    w = rng.standard_normal((16, 12)).astype(np.float32)
    np.testing.assert_allclose(rt(x, w), x @ w, rtol=1e-4, atol=1e-5)


# -- multi-kernel programs against numpy -----------------------------------------------------------
@engine.program
def mlp(run, x: In(("B", 32)), w1: In((32, 64)), b1: In((64,)), w2: In((64, 32)), y: Out(("B", 32))):
    h = run.scratch(("B", 64))
    for xi, hi in zip(run.split(x), run.split(h)):
        run.submit(k_matmul, xi, w1, out=hi)
    run.submit(k_add, h, b1, out=h)
    run.submit(k_gelu, h, out=h)
    for hi, yi in zip(run.split(h), run.split(y)):
        run.submit(k_matmul, hi, w2, out=yi)
    run.submit(k_add, y, x, out=y)  # residual


def mlp_ref(x, w1, b1, w2):
    return gelu_np(x @ w1 + b1) @ w2 + x


def test_multi_kernel_program_matches_numpy(prepared):
    rt = prepared(mlp, bounds={"B": 16}, workers=2, depth=2)
    rng = np.random.default_rng(11)
    w1 = (rng.standard_normal((32, 64)) / 6).astype(np.float32)
    b1 = rng.standard_normal(64).astype(np.float32)
    w2 = (rng.standard_normal((64, 32)) / 8).astype(np.float32)
    w1_d, b1_d, w2_d = (rt.alloc_tensor(a.shape, "float32", init=a) for a in (w1, b1, w2))
    xs = [rng.standard_normal((b, 32)).astype(np.float32) for b in (16, 5, 1, 9)]
    handles = [rt.submit(x, w1_d, b1_d, w2_d) for x in xs]
    for x, h in zip(xs, handles):
        np.testing.assert_allclose(h.result(10), mlp_ref(x, w1, b1, w2), rtol=1e-4, atol=1e-4)


# -- host callbacks -------------------------------------------------------------------------------
@engine.host_kernel
def slow_scale(a, out, factor):
    v = a * factor
    time.sleep(0.01)
    out[...] = v


def test_host_callback_sees_kernel_results_and_kernels_see_its_writes(prepared):
    log = []

    def normalize(h, out):
        log.append((h.flags.writeable, out.flags.writeable))
        out[...] = h / h.sum()

    @engine.program(callbacks={"normalize": 2})
    def prog(run, x: In((6,)), y: Out((6,))):
        h = run.scratch((6,))
        n = run.scratch((6,))
        run.submit(slow_scale, x, out=h, factor=2.0)  # slow: the callback must wait for it
        run.host("normalize", h, n, reads=[h], writes=[n])
        run.submit(k_scale, n, out=y, factor=10.0)

    rt = prepared(prog, callbacks={"normalize": normalize}, workers=2)
    x = np.arange(1, 7, dtype=np.float32)
    for _ in range(3):
        np.testing.assert_allclose(rt(x), 10 * x / x.sum(), rtol=1e-6)
    assert log == [(False, True)] * 3  # reads-only arguments are read-only arrays


def test_host_callback_without_reads_and_writes_reads_and_writes_everything(prepared):
    @engine.program(callbacks={"bump": 1})
    def prog(run, x: InOut((3,))):
        run.host("bump", x)
        run.submit(k_scale, x, out=x, factor=2.0)

    def bump(a):
        assert a.flags.writeable
        a += 1

    rt = prepared(prog, callbacks={"bump": bump})
    x = np.zeros(3, np.float32)
    rt(x)
    np.testing.assert_array_equal(x, 2)


def test_host_callback_reads_writes_errors():
    @engine.program(callbacks={"cb": 2})
    def neither(run, a: In((3,)), b: Out((3,))):
        run.host("cb", a, b, reads=[a])

    with pytest.raises(ValueError, match="cb"):
        neither.prepare(callbacks={"cb": lambda a, b: None})

    @engine.program(callbacks={"cb": 1})
    def stranger(run, a: In((3,)), b: Out((3,))):
        run.host("cb", b, writes=[b], reads=[a])

    with pytest.raises(ValueError, match="cb"):
        stranger.prepare(callbacks={"cb": lambda b: None})


def test_host_callback_with_no_tensors(prepared):
    ticks = []

    @engine.program(callbacks={"tick": 0})
    def prog(run, x: In((2,)), y: Out((2,))):
        run.submit(k_copy, x, out=y)
        run.host("tick")

    rt = prepared(prog, callbacks={"tick": lambda: ticks.append(threading.get_ident())})
    for _ in range(2):
        h = rt.submit(np.zeros(2, np.float32))
        while not h.done:  # polled, not waited for: a waiting thread would help run the tasks
            time.sleep(0.001)
    assert len(ticks) == 2
    assert threading.get_ident() not in ticks  # runs as a task on a pool worker


def test_a_thread_waiting_for_a_run_runs_its_tasks(prepared):
    """The waiter helps: with the only pool worker held by another run, waiting still completes a run."""
    held, release = threading.Event(), threading.Event()
    ran_on = []

    def hold() -> None:
        if not held.is_set():  # the first run's callback keeps the worker busy
            held.set()
            release.wait(10)
        else:
            ran_on.append(threading.get_ident())

    @engine.program(callbacks={"hold": 0})
    def prog(run, x: In((2,)), y: Out((2,))):
        run.submit(k_copy, x, out=y)
        run.host("hold")

    rt = prepared(prog, workers=1, depth=2, callbacks={"hold": hold})
    first = rt.submit(np.zeros(2, np.float32))
    assert held.wait(10)
    try:
        second = rt.submit(np.ones(2, np.float32))
        assert second.wait(5)  # the waiting thread ran the second run's tasks
        np.testing.assert_array_equal(second.result(), np.ones(2, np.float32))
        assert ran_on == [threading.get_ident()]
        assert not first.done
    finally:
        release.set()
    np.testing.assert_array_equal(first.result(), np.zeros(2, np.float32))


# -- validated calls kept by the runtime ---------------------------------------------------------
@engine.program
def scaled_copy(run, x: In((4,)), y: Out((4,)), k: Scalar(float)):
    run.submit(K.scale, x, out=y, alpha=k)


def test_a_repeated_call_over_the_same_tensors_is_validated_once(prepared, monkeypatch):
    rt = prepared(scaled_copy, depth=1)
    x = np.arange(4, dtype=np.float32)
    rt(x, k=2.0)  # the planning pass and the first run validate
    binds = []
    real = type(K.scale).bind

    def counting(self, *args):
        binds.append(self.name)
        return real(self, *args)

    monkeypatch.setattr(type(K.scale), "bind", counting)
    for k in (2.0, 2.0, 3.0, 3.0):
        np.testing.assert_array_equal(rt(x, k=k), x * k)
    assert binds == ["scale"]  # 2.0 was kept from the first run, 3.0 validated once


@engine.program
def sliced_scale(run, x: In((8,)), y: Out((8,)), half: Scalar(int)):
    # New view objects every run (and within it): slices of the slot buffers and of scratch.
    tmp = run.scratch((8,))
    lo, hi = slice(0, 4), slice(4, 8)
    run.submit(K.scale, x[lo], out=tmp[lo], alpha=2.0)
    run.submit(K.scale, x[hi], out=tmp[hi], alpha=2.0)
    run.submit(K.copy, tmp[lo] if half == 0 else tmp[hi], out=y[lo])
    run.submit(K.copy, tmp[hi] if half == 0 else tmp[lo], out=y[hi])


def test_calls_over_views_equal_in_value_are_validated_once(prepared, monkeypatch):
    rt = prepared(sliced_scale, depth=1)
    x = np.arange(8, dtype=np.float32)
    rt(x, half=0)
    binds: list[str] = []
    assert type(K.scale) is type(K.copy)
    real = type(K.scale).bind

    def counting(self, *args):
        binds.append(self.name)
        return real(self, *args)

    monkeypatch.setattr(type(K.scale), "bind", counting)
    for _ in range(3):  # fresh slices of the same bytes: every call is a kept one
        np.testing.assert_array_equal(rt(x, half=0), x * 2)
    assert binds == []
    # Views that differ in value (here: which half is copied where) are other calls, validated once each.
    np.testing.assert_array_equal(rt(x, half=1), np.concatenate([x[4:], x[:4]]) * 2)
    np.testing.assert_array_equal(rt(x, half=1), np.concatenate([x[4:], x[:4]]) * 2)
    assert sorted(binds) == ["copy", "copy"]


_alpha = [1.0]


@engine.program
def scaled_by_box(run, x: In((4,)), y: Out((4,))):
    run.submit(K.scale, x, out=y, alpha=_alpha[0])


def test_a_kept_call_still_meets_every_check(prepared):
    rt = prepared(scaled_copy, depth=1)
    t = rt.alloc_tensor((4,), "float32", init=np.ones(4, np.float32))
    out = rt.alloc_tensor((4,), "float32")

    @engine.program
    def resident(run, k: Scalar(float)):
        run.submit(K.scale, t, out=out, alpha=k)

    with pytest.raises(ValueError, match="another runtime"):
        prepared(resident, depth=1)  # its planning pass meets rt's tensors

    # A scalar equal in value to a kept one but of another type is validated on its own:
    # 1.0 == True, and True is no float alpha.
    rt2 = prepared(scaled_by_box, depth=1)
    x = np.arange(4, dtype=np.float32)
    _alpha[0] = 1.0
    try:
        np.testing.assert_array_equal(rt2(x), x)
        _alpha[0] = True
        with pytest.raises(ValueError, match="alpha"):
            rt2(x)
    finally:
        _alpha[0] = 1.0
    np.testing.assert_array_equal(rt2(x), x)  # the runtime is still usable

    # A tensor freed after its call was kept is still refused.
    box: list = [None]

    @engine.program
    def from_box(run, y: Out((4,))):
        if box[0] is not None:  # empty during the planning pass
            run.submit(K.scale, box[0], out=y, alpha=2.0)

    rt3 = prepared(from_box, depth=1)
    box[0] = rt3.alloc_tensor((4,), "float32", init=np.ones(4, np.float32))
    np.testing.assert_array_equal(rt3(), np.full(4, 2.0, np.float32))
    rt3.free_tensor(box[0])
    with pytest.raises(ValueError, match="freed"):
        rt3()


def test_a_kept_call_tells_signed_zeros_apart(prepared):
    """0.0 == -0.0, but a call with alpha=-0.0 is not the one kept for alpha=0.0 (the sign of a zero product)."""

    @engine.program
    def scaled(run, x: In((4,)), y: Out((4,)), a: Scalar(float)):
        run.submit(K.scale, x, out=y, alpha=a)

    rt = prepared(scaled, depth=1)
    x = np.ones(4, np.float32)
    for a in (0.0, 0.0, -0.0, -0.0, 0.0):
        y = rt(x, a=a)
        assert (np.signbit(y) == np.signbit(a)).all(), a


def test_a_runtime_dropped_without_close_is_collected_with_its_kept_calls():
    import gc
    import weakref

    def make() -> "weakref.ref[engine.Runtime]":
        rt = scaled_copy.prepare(depth=1, workers=1)
        rt(np.ones(4, np.float32), k=2.0)
        assert rt._port.calls  # it did keep the call, whose tensors hold allocations that hold rt
        return weakref.ref(rt)

    threads = threading.active_count()
    ref = make()
    gc.collect()
    assert ref() is None  # collected (and closed by __del__): nothing global holds it
    assert threading.active_count() == threads
