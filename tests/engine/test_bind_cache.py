"""Binding's hit path (engine.binding.BindCache): a call shaped like an earlier one binds from what that
derived, and every check that depends on the values still runs per call."""

from __future__ import annotations

import numpy as np
import pytest

import engine
import engine.binding
from engine import In, Out, Scalar
from engine import kernels as K


@engine.program
def scaled(run, x: In(("N",)), y: Out(("N",)), k: Scalar(float)):
    run.submit(K.scale, x, out=y, alpha=k)


@engine.program
def two_outputs(run, x: In((4,)), y: Out((4,)), z: Out((4,))):
    run.submit(K.copy, x, out=y)
    run.submit(K.copy, x, out=z)


@pytest.fixture
def full_binds(monkeypatch):
    """The calls that took binding's full path."""
    calls: list[int] = []
    real = engine.binding.bind_call

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.binding, "bind_call", counting)
    return calls


def test_a_call_shaped_like_an_earlier_one_binds_from_the_cache(prepared, full_binds):
    rt = prepared(scaled, bounds={"N": 8}, depth=1)
    x = np.arange(4, dtype=np.float32)
    for k in (2.0, 3.0, 2):  # scalar values and an int for the float (its own signature) vary freely
        np.testing.assert_array_equal(rt(x, k=k), x * k)
    assert len(full_binds) == 2  # the float call and the int call; the second float call hit
    y1, y2 = rt(x, k=1.0), rt(x, k=1.0)  # omitted outputs: a new array every call, never shared
    assert y1 is not y2 and not np.shares_memory(y1, y2)
    np.testing.assert_array_equal(rt(np.arange(6, dtype=np.float32), k=1.0), np.arange(6, dtype=np.float32))
    assert len(full_binds) == 3  # another shape: another signature


def test_the_value_checks_still_run_on_the_hit_path(prepared, full_binds):
    rt = prepared(scaled, bounds={"N": 8}, depth=1)
    x = np.arange(4, dtype=np.float32)
    rt(x, k=2)
    with pytest.raises(ValueError, match="too large for a float"):
        rt(x, k=10**400)  # an int like the cached call's, whose value does not fit the Scalar
    t = rt.alloc_tensor((4,), "float32", init=x)
    out = np.zeros(4, np.float32)
    np.testing.assert_array_equal(rt(t, out, k=2.0), x * 2)
    rt.free_tensor(t)
    with pytest.raises(ValueError, match="freed"):
        rt(t, out, k=2.0)  # the same signature (the same tensor object): the tensor is checked per call
    np.testing.assert_array_equal(rt(x, k=2.0), x * 2)  # and the runtime is still usable


def test_calls_the_cache_does_not_take_still_bind_and_check(prepared, full_binds):
    rt = prepared(scaled, bounds={"N": 8}, depth=1)
    x = np.arange(8, dtype=np.float32)
    strided = x[::2]
    for _ in range(2):  # a non-contiguous input: staged through a copy, bound in full every time
        np.testing.assert_array_equal(rt(strided, k=2.0), strided * 2)
    out = np.zeros(8, np.float32)
    for _ in range(2):  # a non-contiguous output: written back after the run
        rt(x[:4], out[::2], k=3.0)
        np.testing.assert_array_equal(out[::2], x[:4] * 3)
    assert len(full_binds) == 4
    with pytest.raises(ValueError, match="exceeds its bound"):
        rt(np.zeros(9, np.float32), k=1.0)

    rt2 = prepared(two_outputs, depth=1)
    a = np.arange(4, dtype=np.float32)
    y, z = np.zeros(4, np.float32), np.zeros(4, np.float32)
    rt2(a, y, z)
    rt2(a, y, z)
    np.testing.assert_array_equal(z, a)
    with pytest.raises(ValueError, match="sharing memory"):
        rt2(a, y, y)  # two host outputs: whether they overlap is checked on every call
