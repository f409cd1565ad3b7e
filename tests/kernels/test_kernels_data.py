"""Data-movement kernels: cast (every dtype pair), copy, fill, transpose,
embedding (with its out-of-range failure), noop and spin. Results are exact:
compared bit for bit with numpy / torch conversions.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import engine.kernels as K
from engine import _native
from engine.dtypes import DTYPES, bfloat16, float16, float32, int32, int64, uint8
from tests.kernels.harness import LAYOUTS, HostTensor, as_layout, empty, run, tensor, to_f64, to_storage

ALL = list(DTYPES.values())


def values_for(dt, rng, shape):
    """Values every dtype represents exactly (small integers, halves) so casts are comparable."""
    v = rng.integers(0 if dt == uint8 else -100, 100, shape).astype(np.float64)
    return v + (0.5 if dt.is_float else 0.0)


def host(values, dt, layout="contiguous"):
    if dt.is_float:
        return tensor(values, dt, layout)
    return HostTensor(as_layout(values.astype(dt.numpy), layout), dt)


def as_f64(t):
    return to_f64(t.array, t.dtype) if t.dtype.is_float else t.array.astype(np.float64)


@pytest.mark.parametrize("src", ALL, ids=str)
@pytest.mark.parametrize("dst", ALL, ids=str)
def test_cast_every_pair(rng, src, dst):
    shape = (5, 37)
    vals = values_for(src if src.itemsize <= dst.itemsize else dst, rng, shape)
    if dst == uint8 or src == uint8:
        vals = np.abs(vals)
    x = host(vals, src, "strided")
    out = empty(shape, dst, "transposed")
    run(K.cast, x, out=out)
    expected = np.trunc(as_f64(x)) if not dst.is_float else as_f64(x)
    np.testing.assert_array_equal(as_f64(out), expected)


@pytest.mark.parametrize("dst", [float16, bfloat16], ids=str)
def test_cast_rounds_to_nearest_even_like_numpy_and_torch(rng, dst):
    xs = (rng.standard_normal(4099) * 100).astype(np.float32)
    # Ties to even either way, the largest finite values, inf, -0 and a quiet NaN.
    specials = [65504.0, 70000.0, 1e-8, -3e-5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-11, 1 + 3 * 2**-11,
                3.4028235e38, -np.inf, np.inf, -0.0, np.nan]
    xs[: len(specials)] = specials
    out = empty(xs.shape, dst)
    run(K.cast, HostTensor(xs), out=out)
    expected = to_storage(xs, dst)
    nan = np.isnan(xs)
    assert np.all(np.isnan(to_f64(out.array[nan], dst)))  # NaN stays NaN (payloads differ between libraries)
    np.testing.assert_array_equal(out.array[~nan], expected[~nan])
    back = empty(xs.shape, float32, "reversed")
    run(K.cast, out, out=back)
    np.testing.assert_array_equal(back.array, to_f64(out.array, dst).astype(np.float32))  # NaN == NaN here


def test_cast_float_to_int_truncates_toward_zero():
    xs = np.array([1.7, -1.7, 2.5, -0.4, 100.99], np.float32)
    out = empty(xs.shape, int32)
    run(K.cast, HostTensor(xs), out=out)
    np.testing.assert_array_equal(out.array, xs.astype(np.int32))


@pytest.mark.parametrize("dt", ALL, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_copy(rng, dt, layout):
    x = host(values_for(dt, rng, (3, 4, 29)), dt, layout)
    out = empty((3, 4, 29), dt, "strided" if layout != "strided" else "transposed")
    run(K.copy, x, out=out)
    np.testing.assert_array_equal(as_f64(out), as_f64(x))


def test_copy_same_view_is_allowed(rng):
    x = tensor(rng.standard_normal((4, 5)), float32, "strided")
    before = x.array.copy()
    run(K.copy, x, out=x)
    np.testing.assert_array_equal(x.array, before)


@pytest.mark.parametrize("dt", ALL, ids=str)
def test_fill(dt):
    out = empty((3, 7, 5), dt, "strided")
    gaps = out.array.base.copy()
    value = 3 if not dt.is_float else -2.5
    run(K.fill, out=out, value=value)
    np.testing.assert_array_equal(as_f64(out), np.full((3, 7, 5), value, np.float64))
    # Elements between the view's strides are untouched.
    base = out.array.base
    untouched = np.ones(base.shape, bool)
    untouched[..., 1:1 + 2 * 5:2] = False
    np.testing.assert_array_equal(base[untouched], gaps[untouched])


def test_fill_special_values():
    out = empty((4,), float32)
    run(K.fill, out=out, value=-np.inf)
    assert np.all(np.isneginf(out.array))
    out64 = empty((3,), int64)
    run(K.fill, out=out64, value=2**62 + 1)
    assert np.all(out64.array == 2**62 + 1)
    out8 = empty((3,), uint8)
    run(K.fill, out=out8, value=255.0)
    assert np.all(out8.array == 255)


@pytest.mark.parametrize("dt", ALL, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (5, 3), (37, 65), (2, 3, 33, 17)], ids=str)
def test_transpose(rng, dt, shape):
    x = host(values_for(dt, rng, shape), dt, LAYOUTS[len(shape) % 4])
    out = empty(shape[:-2] + (shape[-1], shape[-2]), dt, "strided")
    run(K.transpose, x, out=out)
    np.testing.assert_array_equal(as_f64(out), np.swapaxes(as_f64(x), -1, -2))


@pytest.mark.parametrize("idt", [int32, int64], ids=str)
@pytest.mark.parametrize("dt", [float32, float16, bfloat16, int64], ids=str)
@pytest.mark.parametrize("ishape", [(), (7,), (3, 5)], ids=str)
def test_embedding(rng, idt, dt, ishape):
    vocab, d = 101, 13
    table = host(values_for(dt, rng, (vocab, d)), dt, "transposed")
    ids = HostTensor(rng.integers(0, vocab, ishape).astype(idt.numpy))
    out = empty(ishape + (d,), dt, "strided")
    run(K.embedding, ids, table, out=out)
    np.testing.assert_array_equal(as_f64(out), as_f64(table)[ids.array])


@pytest.mark.parametrize("idt,bad", [(int64, 101), (int64, -1), (int64, 2**40), (int32, 101), (int32, -1), (int32, -(2**31))],
                         ids=str)
def test_embedding_out_of_range_fails_cleanly(rng, idt, bad):
    table = tensor(rng.standard_normal((101, 4)), float32)
    ids = HostTensor(np.array([[1, 2], [bad, 3]], idt.numpy))
    out = empty((2, 2, 4), float32, fill=7.0)
    with pytest.raises(RuntimeError, match=rf"embedding: id {bad} at position 2 is out of range for a table of 101 rows"):
        run(K.embedding, ids, table, out=out)
    np.testing.assert_array_equal(out.array, np.full((2, 2, 4), 7.0, np.float32))  # nothing written


def test_noop_and_spin():
    call = run(K.noop)
    assert call.tensors == [] and call.scalars == []
    t0 = time.perf_counter_ns()
    call = run(K.spin, ns=2_000_000)
    elapsed = time.perf_counter_ns() - t0
    assert call.scalars == [2_000_000]
    assert elapsed >= 2_000_000


def test_call_kernel_reports_native_failures():
    with pytest.raises(ValueError, match="unknown built-in kernel 'nope'"):
        _native.call_kernel("nope", [], [])
    x = np.zeros(3, np.float32)
    with pytest.raises(RuntimeError, match="copy: expected 2 tensors"):
        _native.call_kernel("copy", [(x, 0, 1)], [])
    with pytest.raises(TypeError, match="item size"):
        _native.call_kernel("copy", [(x, 4, 1), (x, 4, 2)], [])
    with pytest.raises(RuntimeError, match="spin: ns must be >= 0"):
        _native.call_kernel("spin", [], [-5])
    assert sorted(_native.builtin_kernel_names()) == sorted(K.BUILTINS)
