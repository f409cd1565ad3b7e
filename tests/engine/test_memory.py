"""The device memory handle: malloc/free/copies, resident tensors, counters, steady state."""

import threading

import numpy as np
import pytest

import engine
from engine import In, InOut, Out, Scalar

from .conftest import Gate, k_add, k_copy

STAT_KEYS = {"bytes_in_use", "peak_bytes", "live_allocations", "h2d_bytes", "d2h_bytes"}


@engine.program
def add_prog(run, x: In(("B", 8)), w: In(("B", 8)), y: Out(("B", 8))):
    h = run.scratch(("B", 8))
    run.submit(k_add, x, w, out=h)
    run.submit(k_add, h, w, out=y)


@pytest.fixture
def rt(prepared):
    return prepared(add_prog, bounds={"B": 16})


def alloc_counters(rt):
    s = rt.memory_stats()
    return s["bytes_in_use"], s["live_allocations"], s["total_allocations"]


# -- the abstract surface -------------------------------------------------------------------
def test_runtime_is_a_device_memory_handle(rt):
    assert isinstance(rt, engine.DeviceMemoryHandle)
    assert issubclass(engine.Runtime, engine.DeviceMemoryHandle)


def test_device_memory_handle_is_one_implementation_over_device_hooks():
    """The surface is implemented once (validation, ownership, init staging); a runtime supplies the device."""
    with pytest.raises(TypeError):
        engine.DeviceMemoryHandle()
    surface = {"malloc", "free", "copy_to", "copy_from", "alloc_tensor", "free_tensor", "memory_stats"}
    hooks = {"_check_ready", "_device_alloc", "_device_free", "_device_write", "_device_read", "_quiesce",
             "_device_stats"}
    assert engine.DeviceMemoryHandle.__abstractmethods__ == hooks
    assert not surface & engine.DeviceMemoryHandle.__abstractmethods__
    for name in surface:  # neither level re-implements the surface
        assert getattr(engine.Runtime, name) is getattr(engine.DeviceMemoryHandle, name)

    class Partial(engine.DeviceMemoryHandle):
        def _device_alloc(self, nbytes, kind, worker, init):
            return None

    with pytest.raises(TypeError):
        Partial()


def test_memory_stats_keys(rt):
    s = rt.memory_stats()
    assert STAT_KEYS <= set(s)
    assert all(isinstance(s[k], int) for k in STAT_KEYS)
    assert s["live_allocations"] > 0 and s["bytes_in_use"] > 0  # slots and scratch
    assert s["peak_bytes"] >= s["bytes_in_use"]


# -- malloc / free / copies ------------------------------------------------------------------
def test_malloc_copy_round_trip_and_counters(rt):
    s0 = rt.memory_stats()
    buf = rt.malloc(64)
    assert isinstance(buf, engine.DeviceBuffer)
    assert buf.nbytes == 64 and not buf.freed
    s1 = rt.memory_stats()
    assert s1["live_allocations"] == s0["live_allocations"] + 1
    assert s1["bytes_in_use"] >= s0["bytes_in_use"] + 64
    src = np.arange(16, dtype=np.float32)
    rt.copy_to(buf, src)
    dst = np.zeros(16, np.float32)
    rt.copy_from(dst, buf)
    np.testing.assert_array_equal(dst, src)
    s2 = rt.memory_stats()
    assert s2["h2d_bytes"] - s1["h2d_bytes"] == 64
    assert s2["d2h_bytes"] - s1["d2h_bytes"] == 64
    part = np.zeros(4, np.float32)  # a prefix of the buffer
    rt.copy_from(part, buf)
    np.testing.assert_array_equal(part, src[:4])
    rt.free(buf)
    assert buf.freed
    s3 = rt.memory_stats()
    assert (s3["live_allocations"], s3["bytes_in_use"]) == (s0["live_allocations"], s0["bytes_in_use"])


def test_copy_to_from_a_non_contiguous_source(rt):
    buf = rt.malloc(4 * 8)
    src = np.arange(16, dtype=np.float32)[::2]
    rt.copy_to(buf, src)
    out = np.empty(8, np.float32)
    rt.copy_from(out, buf)
    np.testing.assert_array_equal(out, src)


def test_malloc_and_copy_validation(rt, prepared):
    for bad, exc in [(0, ValueError), (-8, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(exc):
            rt.malloc(bad)
    buf = rt.malloc(16)
    with pytest.raises(ValueError):
        rt.copy_to(buf, np.zeros(5, np.float32))  # 20 bytes into 16
    with pytest.raises(ValueError):
        rt.copy_from(np.zeros(5, np.float32), buf)
    with pytest.raises(ValueError):
        rt.copy_from(np.zeros(8, np.float32)[::2], buf)  # non-contiguous destination
    with pytest.raises(TypeError):
        rt.copy_to(buf, [1.0, 2.0])
    with pytest.raises(TypeError):
        rt.copy_to("not a buffer", np.zeros(2, np.float32))
    with pytest.raises(TypeError):
        rt.free(rt.alloc_tensor((2,), "float32"))


def test_double_free_and_foreign_free_are_value_errors(rt, prepared):
    other = prepared(add_prog, bounds={"B": 2})
    buf = rt.malloc(32)
    rt.free(buf)
    with pytest.raises(ValueError, match="freed"):
        rt.free(buf)
    with pytest.raises(ValueError, match="freed"):
        rt.copy_to(buf, np.zeros(2, np.float32))
    foreign = other.malloc(32)
    before = alloc_counters(rt), alloc_counters(other)
    with pytest.raises(ValueError, match="another runtime"):
        rt.free(foreign)
    with pytest.raises(ValueError, match="another runtime"):
        rt.copy_to(foreign, np.zeros(2, np.float32))
    assert (alloc_counters(rt), alloc_counters(other)) == before
    assert not foreign.freed


# -- alloc_tensor ----------------------------------------------------------------------------------
def test_alloc_tensor_properties_and_round_trip(rt):
    init = np.arange(24, dtype=np.float32).reshape(4, 6)
    s0 = rt.memory_stats()
    t = rt.alloc_tensor((4, 6), "float32", init=init)
    s1 = rt.memory_stats()
    assert isinstance(t, engine.DeviceTensor)
    assert t.shape == (4, 6) and t.dtype == engine.float32 and t.nbytes == 96
    assert s1["h2d_bytes"] - s0["h2d_bytes"] == 96
    assert s1["live_allocations"] == s0["live_allocations"] + 1
    got = t.to_numpy()
    assert isinstance(got, np.ndarray) and got.dtype == np.float32
    np.testing.assert_array_equal(got, init)
    got[...] = 0  # a copy: the device tensor is unchanged
    np.testing.assert_array_equal(t.to_numpy(), init)
    init[...] = -1  # and init was copied too
    np.testing.assert_array_equal(t.to_numpy(), np.arange(24).reshape(4, 6))


def test_alloc_tensor_without_init_and_list_shape(rt):
    t = rt.alloc_tensor([3, 5], engine.int32)
    assert t.shape == (3, 5) and t.dtype == engine.int32 and t.nbytes == 60
    t2 = rt.alloc_tensor((np.int64(2), 3), np.float16)
    assert t2.shape == (2, 3) and t2.dtype == engine.float16


def test_alloc_tensor_from_torch_and_to_torch(rt):
    torch = pytest.importorskip("torch")
    init = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    t = rt.alloc_tensor((3, 4), torch.float32, init=init)
    back = t.to_torch()
    assert isinstance(back, torch.Tensor) and back.dtype == torch.float32
    torch.testing.assert_close(back, init)
    torch.testing.assert_close(t[1:, 2:].to_torch(), init[1:, 2:])
    bf = torch.randn(2, 3).to(torch.bfloat16)
    tb = rt.alloc_tensor((2, 3), "bfloat16", init=bf)
    assert tb.to_torch().dtype == torch.bfloat16
    assert torch.equal(tb.to_torch(), bf)


def test_alloc_tensor_with_non_contiguous_init(rt):
    init = np.arange(12, dtype=np.float32).reshape(3, 4).T  # (4, 3) Fortran-ordered
    t = rt.alloc_tensor((4, 3), "float32", init=init)
    np.testing.assert_array_equal(t.to_numpy(), init)


@pytest.mark.parametrize("shape,dtype,init_fn,exc", [
    ((2, True), "float32", None, TypeError),
    ((2, 2.0), "float32", None, TypeError),
    ((2, "B"), "float32", None, TypeError),
    ((), "float32", None, ValueError),
    ((4, 0), "float32", None, ValueError),
    ((-1,), "float32", None, ValueError),
    ((4,), "float64", None, TypeError),
    ((4,), "complex", None, TypeError),
    ((4,), "float32", lambda: np.zeros(5, np.float32), ValueError),
    ((4,), "float32", lambda: np.zeros((4, 1), np.float32), ValueError),
    ((4,), "float32", lambda: np.zeros(4, np.float64), ValueError),
    ((4,), "float32", lambda: np.zeros(4, np.int32), ValueError),
])
def test_alloc_tensor_validates_before_allocating(rt, shape, dtype, init_fn, exc):
    before = rt.memory_stats()
    with pytest.raises(exc):
        rt.alloc_tensor(shape, dtype, init=None if init_fn is None else init_fn())
    after = rt.memory_stats()
    for k in ("bytes_in_use", "live_allocations", "total_allocations", "h2d_bytes"):
        assert after[k] == before[k], k


def test_alloc_tensor_beyond_the_memory_limit_raises_and_the_runtime_stays_usable(prepared):
    rt = prepared(add_prog, bounds={"B": 2}, memory_limit=4096)
    before = rt.memory_stats()
    with pytest.raises(engine.DeviceMemoryError) as ei:
        rt.alloc_tensor((1 << 20,), "float32")
    assert isinstance(ei.value, MemoryError)
    after = rt.memory_stats()
    assert (after["live_allocations"], after["bytes_in_use"]) == (before["live_allocations"], before["bytes_in_use"])
    x = np.ones((2, 8), np.float32)
    np.testing.assert_array_equal(rt(x, x), 3 * x)


# -- views ----------------------------------------------------------------------------------------
def test_views_by_slicing(rt):
    a = np.arange(60, dtype=np.float32).reshape(5, 12)
    t = rt.alloc_tensor((5, 12), "float32", init=a)
    for key in [np.s_[1:3], np.s_[:, 2:7], np.s_[::2], np.s_[1:4, ::3], np.s_[2], np.s_[-1], np.s_[:, -2],
                np.s_[4:, 11:], np.s_[1:100], np.s_[np.int64(3)], np.s_[1:, np.int32(-3)], np.s_[0:5:2, 1:12:5],
                np.s_[-3:, 5:100:4]]:
        v = t[key]
        assert isinstance(v, engine.DeviceTensor)
        expect = a[key]
        assert v.shape == expect.shape, key
        np.testing.assert_array_equal(v.to_numpy(), expect)
    v = t[1:4][1:, 2:5]  # views of views
    np.testing.assert_array_equal(v.to_numpy(), a[1:4][1:, 2:5])
    with pytest.raises(IndexError):
        t[5]
    with pytest.raises(IndexError):
        t[0, 0, 0]
    with pytest.raises(ValueError):
        t[::-1]
    with pytest.raises(ValueError):
        t[3:3]  # empty
    with pytest.raises(TypeError):
        t["a"]
    with pytest.raises(TypeError):
        t[True]  # a bool is not an index here (numpy would read it as a mask)
    with pytest.raises(TypeError):
        t[1.0]


def test_reshape_of_contiguous_tensors(rt):
    a = np.arange(24, dtype=np.float32)
    t = rt.alloc_tensor((24,), "float32", init=a)
    r = t.reshape(4, 6)
    assert r.shape == (4, 6)
    np.testing.assert_array_equal(r.to_numpy(), a.reshape(4, 6))
    np.testing.assert_array_equal(t.reshape((2, -1, 3)).to_numpy(), a.reshape(2, 4, 3))
    np.testing.assert_array_equal(r[1:3].reshape(12).to_numpy(), a.reshape(4, 6)[1:3].reshape(12))
    with pytest.raises(ValueError):
        t.reshape(5, 5)
    with pytest.raises(ValueError):
        r[:, ::2].reshape(12)  # not contiguous
    with pytest.raises(ValueError):
        t.reshape(-1, -1)


def test_views_share_memory_with_their_tensor(prepared):
    @engine.program
    def write_rows(run, src: In((2, 4)), dst: InOut((6, 4))):
        run.submit(k_copy, src, out=dst[2:4])

    rt = prepared(write_rows)
    dst = rt.alloc_tensor((6, 4), "float32", init=np.zeros((6, 4), np.float32))
    rt(np.ones((2, 4), np.float32), dst)
    expect = np.zeros((6, 4), np.float32)
    expect[2:4] = 1
    np.testing.assert_array_equal(dst.to_numpy(), expect)
    np.testing.assert_array_equal(dst[2:4].to_numpy(), 1)


# -- freeing -----------------------------------------------------------------------------------------
def test_free_tensor_twice_is_a_value_error(rt):
    t = rt.alloc_tensor((4,), "float32")
    before = alloc_counters(rt)
    rt.free_tensor(t)
    assert t.freed
    after = alloc_counters(rt)
    assert after[1] == before[1] - 1
    with pytest.raises(ValueError, match="freed"):
        rt.free_tensor(t)
    assert alloc_counters(rt) == after
    with pytest.raises(ValueError, match="freed"):
        t.to_numpy()
    with pytest.raises(TypeError):
        rt.free_tensor(np.zeros(4, np.float32))


def test_free_tensor_of_another_runtime_is_a_value_error(rt, prepared):
    other = prepared(add_prog, bounds={"B": 2})
    t = other.alloc_tensor((4,), "float32")
    with pytest.raises(ValueError, match="another runtime"):
        rt.free_tensor(t)
    assert not t.freed
    other.free_tensor(t)


def test_freeing_runtime_owned_scratch_is_refused(prepared):
    leaked = []

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,))):
        h = run.scratch((4,))
        leaked.append(h)
        run.submit(k_copy, x, out=h)
        run.submit(k_copy, h, out=y)

    rt = prepared(prog)
    rt(np.ones(4, np.float32))
    with pytest.raises(ValueError):
        rt.free_tensor(leaked[-1])
    np.testing.assert_array_equal(rt(np.full(4, 2, np.float32)), 2)


def test_freed_or_foreign_tensor_passed_to_a_run_is_rejected_before_the_device(rt, prepared):
    other = prepared(add_prog, bounds={"B": 16})
    w = rt.alloc_tensor((2, 8), "float32", init=np.ones((2, 8), np.float32))
    foreign = other.alloc_tensor((2, 8), "float32")
    x = np.ones((2, 8), np.float32)
    rt.free_tensor(w)
    before = rt.memory_stats()
    with pytest.raises(ValueError, match="freed") as ei:
        rt(x, w)
    assert "'w'" in str(ei.value)
    with pytest.raises(ValueError, match="another runtime") as ei:
        rt(x, foreign)
    assert "'w'" in str(ei.value)
    assert rt.memory_stats() == before
    np.testing.assert_array_equal(rt(x, x), 3 * x)  # still usable


def test_freeing_a_tensor_used_by_a_run_in_flight_waits_for_it(prepared):
    gate = Gate()
    kern = gate.kernel()

    @engine.program
    def prog(run, w: In((4,)), y: Out((4,)), key: Scalar(int)):
        run.submit(kern, w, out=y, key=key)

    rt = prepared(prog, workers=2)
    w = rt.alloc_tensor((4,), "float32", init=np.arange(4, dtype=np.float32))
    h = rt.submit(w, key=1)
    try:
        assert gate.wait_started(1)
        freer = threading.Thread(target=lambda: (rt.free_tensor(w), gate.record("freed", 0)))
        freer.start()
        freer.join(0.1)
        gate.open(1)
        freer.join(10)
        assert not freer.is_alive()
    finally:
        gate.open_all()
    np.testing.assert_array_equal(h.result(10), np.arange(4) + 1)
    assert gate.events.index(("end", 1)) < gate.events.index(("freed", 0))
    assert w.freed


def test_to_numpy_waits_for_a_run_writing_the_tensor(prepared):
    gate = Gate()
    kern = gate.kernel()

    @engine.program
    def prog(run, x: In((4,)), y: Out((4,)), key: Scalar(int)):
        run.submit(kern, x, out=y, key=key)

    rt = prepared(prog, workers=2)
    y = rt.alloc_tensor((4,), "float32", init=np.zeros(4, np.float32))
    x = np.arange(4, dtype=np.float32)
    h = rt.submit(x, y, key=3)
    got = {}
    try:
        assert gate.wait_started(3)
        reader = threading.Thread(target=lambda: got.setdefault("v", y.to_numpy()))
        reader.start()
        reader.join(0.1)
        assert "v" not in got, "to_numpy() read a tensor a run in flight is still writing"
        gate.open(3)
        reader.join(10)
    finally:
        gate.open_all()
    np.testing.assert_array_equal(got["v"], x + 3)
    assert h.result(10) is y


# -- steady state ----------------------------------------------------------------------------------
def _device_counters(rt):
    s = rt.memory_stats()
    return {k: s[k] for k in ("total_allocations", "bytes_in_use", "live_allocations", "peak_bytes")}


def test_steady_state_allocates_nothing(prepared):
    rt = prepared(add_prog, bounds={"B": 16}, depth=2)
    w = rt.alloc_tensor((4, 8), "float32", init=np.ones((4, 8), np.float32))
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    y = rt(x, w)
    after_one = _device_counters(rt)
    for _ in range(999):
        y = rt(x, w)
    assert _device_counters(rt) == after_one
    np.testing.assert_array_equal(y, x + 2)


def test_steady_state_pipelined_with_varying_shapes_allocates_nothing(prepared):
    rt = prepared(add_prog, bounds={"B": 16}, depth=3)
    xs = [np.full((b, 8), b, np.float32) for b in (1, 16, 7, 3)]
    rt(xs[0], xs[0])
    after_one = _device_counters(rt)
    handles = []
    for i in range(1000):
        x = xs[i % len(xs)]
        handles.append((x, rt.submit(x, x)))
        if len(handles) > 8:
            x0, h0 = handles.pop(0)
            np.testing.assert_array_equal(h0.result(), 3 * x0)
    for x0, h0 in handles:
        np.testing.assert_array_equal(h0.result(), 3 * x0)
    assert _device_counters(rt) == after_one
