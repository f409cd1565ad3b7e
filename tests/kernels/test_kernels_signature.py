"""Kernel signatures: bind() order, access and scalar conversion; every
validation error (TypeError for arity, shapes and dtypes; ValueError for bad
scalars and forbidden aliases) raised before anything reaches the device;
user-declared kernels.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import engine.kernels as K
from engine.dtypes import bfloat16, float16, float32, int32, int64
from engine.kernels import READ, READWRITE, WRITE, Kernel, Param
from tests.kernels.harness import HostTensor, empty, run, tensor


def t(shape, dt=float32):
    return tensor(np.zeros(shape), dt) if dt.is_float else HostTensor(np.zeros(shape, dt.numpy), dt)


def raises(exc, *fragments):
    """pytest.raises matching every fragment (literally) in the message."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# -- bind(): order, access, scalars ------------------------------------------------------------------
def test_bind_orders_tensors_and_converts_scalars():
    a, b, out = t((4, 3)), t((3, 5)), t((4, 5))
    call = K.matmul.bind((a, b), out, {"alpha": 2, "transpose_b": False})
    assert call.tensors == [a, b, out] and call.names == ["a", "b", "out"]
    assert call.access == [READ, READ, WRITE]
    assert call.scalars == [0, 2.0, 0.0] and isinstance(call.scalars[1], float)
    assert K.matmul.bind((a, b), out, {"beta": 1}).access == [READ, READ, READWRITE]

    x, m = t((2, 9)), t((9,))
    call = K.softmax.bind((x,), x, {"mask": m, "scale": 0.5})
    assert call.names == ["x", "mask", "out"] and call.scalars == [0.5]
    assert K.softmax.bind((x,), t((2, 9)), {"mask": None}).names == ["x", "out"]
    assert K.gelu.bind((x,), x, {"approximate": "tanh"}).scalars == [1]
    assert K.gelu.bind((x,), x, {}).scalars == [0]

    q, kv = t((1, 2, 3, 4)), t((1, 2, 8, 4))
    call = K.attention.bind((q, kv, kv), t((1, 2, 3, 4)), {"kv_len": 5, "causal": True})
    assert call.scalars == [0.5, 1, 5]
    assert K.spin.bind((), None, {"ns": 10}).scalars == [10]
    assert K.fill.bind((), t((3,), int64), {"value": 7.0}).scalars == [7]
    assert K.fill.bind((), t((3,)), {"value": 7}).scalars == [7]


def test_signature_text():
    assert K.matmul.signature == "matmul(a, b, *, out, transpose_b=False, alpha=1.0, beta=0.0)"
    assert K.attention.signature == "attention(q, k, v, *, out, mask=None, scale=None, causal=False, kv_len=None)"
    assert K.noop.signature == "noop()"
    assert "Kernel softmax(x, *, out, mask=None, scale=1.0)" in repr(K.softmax)


# -- TypeError: arity, arguments ---------------------------------------------------------------------
def test_arity_and_argument_errors():
    a = t((2, 2))
    with raises(TypeError, "matmul: expected 2 input tensor(s) (a, b), got 1"):
        K.matmul.bind((a,), a, {})
    with raises(TypeError, "matmul: missing the out= tensor"):
        K.matmul.bind((a, a), None, {})
    with raises(TypeError, "noop: takes no out tensor"):
        K.noop.bind((), a, {})
    with raises(TypeError, "relu: unexpected keyword argument 'alpha'"):
        K.relu.bind((a,), t((2, 2)), {"alpha": 1.0})
    with raises(TypeError, "scale: missing scalar 'alpha'"):
        K.scale.bind((a,), t((2, 2)), {})
    with raises(TypeError, "add: argument 'b' must be a tensor, got float"):
        K.add.bind((a, 1.0), t((2, 2)), {})
    with raises(TypeError, "relu: argument 'x' must be a tensor, got ndarray"):
        K.relu.bind((np.zeros((2, 2), np.float32),), t((2, 2)), {})


# -- TypeError: dtypes --------------------------------------------------------------------------------
DTYPE_ERRORS = [
    (K.matmul, [t((2, 3)), t((3, 4), float16)], t((2, 4)), {}, ["matmul", "'b'", "float16", "float32"]),
    (K.matmul, [t((2, 3), int32), t((3, 4), int32)], t((2, 4), int32), {}, ["matmul", "'a'", "int32", "float32, float16, bfloat16"]),
    (K.matmul, [t((2, 3)), t((3, 4))], t((2, 4), bfloat16), {}, ["matmul", "'out'", "bfloat16", "float32"]),
    (K.add, [t((5,)), t((5,), bfloat16)], t((5,)), {}, ["add", "'b'", "bfloat16", "float32"]),
    (K.gelu, [t((5,), float16)], t((5,)), {}, ["gelu", "'out'", "float32", "float16"]),
    (K.exp, [t((5,), int64)], t((5,), int64), {}, ["exp", "'x'", "int64"]),
    (K.softmax, [t((2, 5), float16)], t((2, 5), float16), {"mask": t((5,), bfloat16)}, ["softmax", "'mask'", "bfloat16", "float16"]),
    (K.layernorm, [t((2, 5)), t((5,), float16), t((5,))], t((2, 5)), {}, ["layernorm", "'gamma'", "float16", "float32"]),
    (K.rmsnorm, [t((2, 5), bfloat16), t((5,), float16)], t((2, 5), bfloat16), {}, ["rmsnorm", "'gamma'", "float16", "bfloat16"]),
    (K.l2_normalize, [t((2, 5))], t((2, 5), float16), {}, ["l2_normalize", "'out'", "float16", "float32"]),
    (K.sum, [t((2, 5))], t((2,), float16), {}, ["sum", "'out'", "float16", "float32"]),
    (K.argmax, [t((2, 5))], t((2,)), {}, ["argmax", "'out'", "float32", "int32, int64"]),
    (K.mean_pool, [t((2, 5, 3)), t((2, 5), float16)], t((2, 3)), {}, ["mean_pool", "'mask'", "float16", "float32"]),
    (K.embedding, [t((3,)), t((7, 4))], t((3, 4)), {}, ["embedding", "'ids'", "float32", "int32, int64"]),
    (K.embedding, [t((3,), int64), t((7, 4))], t((3, 4), float16), {}, ["embedding", "'out'", "float16", "float32"]),
    (K.attention, [t((1, 3, 4), float16), t((1, 5, 4)), t((1, 5, 4))], t((1, 3, 4)), {}, ["attention", "'q'", "float16", "float32"]),
    (K.attention, [t((1, 3, 4)), t((1, 5, 4)), t((1, 5, 4))], t((1, 3, 4)), {"mask": t((3, 5), int32)}, ["attention", "'mask'", "int32"]),
    (K.copy, [t((3,))], t((3,), float16), {}, ["copy", "'out'", "float16", "float32"]),
    (K.add, [t((5,), int32), t((5,), int32)], t((5,), int32), {}, ["add", "'a'", "int32", "float32, float16, bfloat16"]),
    (K.add, [t((5,)), t((5,))], t((5,), float16), {}, ["add", "'out'", "float16", "float32"]),
    (K.layernorm, [t((2, 5)), t((5,)), t((5,), float16)], t((2, 5)), {}, ["layernorm", "'beta'", "float16", "float32"]),
    (K.softmax, [t((2, 5))], t((2, 5)), {"mask": t((5,), float16)}, ["softmax", "'mask'", "float16", "float32"]),
    (K.transpose, [t((3, 2), int32)], t((2, 3), int64), {}, ["transpose", "'out'", "int64", "int32"]),
]


@pytest.mark.parametrize("kernel,inputs,out,kw,fragments", DTYPE_ERRORS, ids=[f"{c[0].name}-{i}" for i, c in enumerate(DTYPE_ERRORS)])
def test_dtype_errors(kernel, inputs, out, kw, fragments):
    with raises(TypeError, *fragments):
        kernel.bind(tuple(inputs), out, kw)


# -- TypeError: shapes ---------------------------------------------------------------------------------
SHAPE_ERRORS = [
    (K.matmul, [t((2, 3)), t((4, 5))], t((2, 5)), {}, ["matmul", "'b'", "(4, 5)", "'a'", "(2, 3)"]),
    (K.matmul, [t((2, 3)), t((5, 4))], t((2, 5)), {"transpose_b": True}, ["matmul", "'b'", "(5, 4)", "(2, 3)"]),
    (K.matmul, [t((2, 3)), t((3, 4))], t((2, 5)), {}, ["matmul", "'out'", "(2, 5)", "(2, 4)"]),
    (K.matmul, [t((2, 2, 3)), t((3, 3, 4))], t((2, 2, 4)), {}, ["matmul", "(2, 2, 3)", "(3, 3, 4)", "broadcast"]),
    (K.matmul, [t((3,)), t((3, 4))], t((4,)), {}, ["matmul", "'a'", "(3,)", "at least 2 dims"]),
    (K.add, [t((4, 5)), t((4,))], t((4, 5)), {}, ["add", "'b'", "(4,)", "(4, 5)"]),
    (K.mul, [t((4, 5)), t((5,))], t((5, 4)), {}, ["mul", "'out'", "(5, 4)", "(4, 5)"]),
    (K.relu, [t((4, 5))], t((4, 6)), {}, ["relu", "'out'", "(4, 6)", "(4, 5)"]),
    (K.softmax, [t((4, 5))], t((4, 5)), {"mask": t((4, 4))}, ["softmax", "'mask'", "(4, 4)", "(4, 5)"]),
    (K.softmax, [t(())], t(()), {}, ["softmax", "'x'", "()", "at least 1 dims"]),
    (K.layernorm, [t((4, 5)), t((4,)), t((5,))], t((4, 5)), {}, ["layernorm", "'gamma'", "(4,)", "(5,)"]),
    (K.rmsnorm, [t((4, 5)), t((5, 1))], t((4, 5)), {}, ["rmsnorm", "'gamma'", "(5, 1)", "(5,)"]),
    (K.mean, [t((4, 5))], t((5,)), {}, ["mean", "'out'", "(5,)", "(4,)"]),
    (K.argmax, [t((4, 5))], t((4, 5), int64), {}, ["argmax", "'out'", "(4, 5)", "(4,)"]),
    (K.mean_pool, [t((2, 5, 3)), t((2, 4))], t((2, 3)), {}, ["mean_pool", "'mask'", "(2, 4)", "(2, 5)"]),
    (K.mean_pool, [t((2, 5, 3)), t((2, 5))], t((2, 5)), {}, ["mean_pool", "'out'", "(2, 5)", "(2, 3)"]),
    (K.embedding, [t((3,), int32), t((7, 4))], t((4, 3)), {}, ["embedding", "'out'", "(4, 3)", "(3, 4)"]),
    (K.embedding, [t((3,), int32), t((7,))], t((3,)), {}, ["embedding", "'table'", "(7,)", "2 dims"]),
    (K.attention, [t((1, 3, 4)), t((1, 5, 6)), t((1, 5, 4))], t((1, 3, 4)), {}, ["attention", "'k'", "(1, 5, 6)", "(1, 3, 4)"]),
    (K.attention, [t((1, 3, 4)), t((1, 5, 4)), t((1, 6, 4))], t((1, 3, 4)), {}, ["attention", "'v'", "(1, 6, 4)", "(1, 5, 4)"]),
    (K.attention, [t((1, 3, 4)), t((1, 5, 4)), t((1, 5, 2))], t((1, 3, 4)), {}, ["attention", "'out'", "(1, 3, 4)", "(1, 3, 2)"]),
    (K.attention, [t((2, 3, 4)), t((2, 5, 4)), t((2, 5, 4))], t((2, 3, 4)), {"mask": t((3, 3, 5))}, ["attention", "'mask'", "(3, 3, 5)", "(2, 3, 5)"]),
    (K.transpose, [t((3, 2))], t((3, 2)), {}, ["transpose", "'out'", "(3, 2)", "(2, 3)"]),
    (K.cast, [t((3, 2))], t((2, 3), int32), {}, ["cast", "'out'", "(2, 3)", "(3, 2)"]),
    (K.copy, [t((3, 2))], t((6,)), {}, ["copy", "'out'", "(6,)", "(3, 2)"]),
    (K.matmul, [t((2, 3)), t((3,))], t((2,)), {}, ["matmul", "'b'", "(3,)", "at least 2 dims"]),
    (K.mean_pool, [t((3,)), t((3,))], t(()), {}, ["mean_pool", "'x'", "(3,)", "at least 2 dims"]),
    (K.embedding, [t((1,) * 8, int32), t((7, 4))], t((1,) * 7 + (4,)), {}, ["embedding", "'ids'", "(1, 1, 1, 1, 1, 1, 1, 1)", "7"]),
]


@pytest.mark.parametrize("kernel,inputs,out,kw,fragments", SHAPE_ERRORS, ids=[f"{c[0].name}-{i}" for i, c in enumerate(SHAPE_ERRORS)])
def test_shape_errors(kernel, inputs, out, kw, fragments):
    with raises(TypeError, *fragments):
        kernel.bind(tuple(inputs), out, kw)


# -- ValueError: scalars ---------------------------------------------------------------------------------
SCALAR_ERRORS = [
    (K.matmul, {"alpha": "2"}, ["matmul", "'alpha'", "'2'"]),
    (K.matmul, {"beta": True}, ["matmul", "'beta'", "True"]),
    (K.matmul, {"alpha": float("nan")}, ["matmul", "'alpha'", "finite"]),
    (K.matmul, {"transpose_b": 2}, ["matmul", "'transpose_b'", "bool"]),
    (K.gelu, {"approximate": "fast"}, ["gelu", "'approximate'", "'none', 'tanh'", "'fast'"]),
    (K.layernorm, {"eps": 0.0}, ["layernorm", "'eps'", "> 0.0"]),
    (K.rmsnorm, {"eps": -1e-6}, ["rmsnorm", "'eps'", "> 0.0"]),
    (K.l2_normalize, {"eps": float("inf")}, ["l2_normalize", "'eps'", "finite"]),
    (K.scale, {"alpha": None}, ["scale", "'alpha'", "float"]),
    (K.softmax, {"scale": [1.0]}, ["softmax", "'scale'"]),
    (K.spin, {"ns": -1}, ["spin", "'ns'", ">= 0", "-1"]),
    (K.spin, {"ns": 1.5}, ["spin", "'ns'", "int", "1.5"]),
    (K.attention, {"kv_len": 0}, ["attention", "'kv_len'", ">= 1"]),
    (K.attention, {"kv_len": 9}, ["attention", "kv_len 9", "8 key positions"]),
    (K.attention, {"kv_len": 2, "causal": True}, ["attention", "causal", "Sq=3", "2"]),
    (K.attention, {"scale": float("inf")}, ["attention", "'scale'", "finite"]),
    (K.fill, {"value": 2.5}, ["fill", "'value'", "integer", "int32"]),
    (K.fill, {"value": 2**31}, ["fill", "'value'", "outside the range of int32"]),
    (K.fill, {"value": "1"}, ["fill", "'value'", "number"]),
]


def _args_for(kernel):
    x = t((3, 8))
    return {
        "matmul": ((t((3, 4)), t((4, 8))), x), "gelu": ((x,), x), "layernorm": ((x, t((8,)), t((8,))), x),
        "rmsnorm": ((x, t((8,))), x), "l2_normalize": ((x,), x), "scale": ((x,), x), "softmax": ((x,), x),
        "spin": ((), None), "fill": ((), t((3,), int32)),
        "attention": ((t((1, 3, 4)), t((1, 8, 4)), t((1, 8, 4))), t((1, 3, 4))),
    }[kernel.name]


@pytest.mark.parametrize("kernel,kw,fragments", SCALAR_ERRORS, ids=[f"{c[0].name}-{i}" for i, c in enumerate(SCALAR_ERRORS)])
def test_scalar_errors(kernel, kw, fragments):
    inputs, out = _args_for(kernel)
    with raises(ValueError, *fragments):
        kernel.bind(inputs, out, kw)


def test_empty_axis_reductions_are_value_errors():
    with raises(ValueError, "max", "empty"):
        K.max.bind((t((3, 0)),), t((3,)), {})
    with raises(ValueError, "argmax", "empty"):
        K.argmax.bind((t((3, 0)),), t((3,), int32), {})
    with raises(ValueError, "attention", "at least one key position", "(1, 0, 4)"):
        K.attention.bind((t((1, 3, 4)), t((1, 0, 4)), t((1, 0, 4))), t((1, 3, 4)), {})


def _zeros(*shape, dt=np.float32):
    return np.zeros(shape, dt)  # numpy gives empty arrays zero strides


EMPTY_CALLS = [
    (K.relu, [_zeros(0, 5)], _zeros(0, 5), {}, None),
    (K.add, [_zeros(0, 5), _zeros(5)], _zeros(0, 5), {}, None),
    (K.softmax, [_zeros(3, 0)], _zeros(3, 0), {}, None),
    (K.layernorm, [_zeros(3, 0), _zeros(0), _zeros(0)], _zeros(3, 0), {}, None),
    (K.matmul, [_zeros(0, 3), _zeros(3, 4)], _zeros(0, 4), {}, None),
    (K.attention, [_zeros(1, 0, 4), _zeros(1, 3, 4), _zeros(1, 3, 4)], _zeros(1, 0, 4), {}, None),
    (K.embedding, [_zeros(0, dt=np.int64), _zeros(5, 4)], _zeros(0, 4), {}, None),
    (K.transpose, [_zeros(0, 3)], _zeros(3, 0), {}, None),
    (K.fill, [], _zeros(0, 3), {"value": 1.0}, None),
    # Empty reductions give numpy's answers; an empty inner dim leaves beta * out.
    (K.sum, [_zeros(3, 0)], np.full(3, 7, np.float32), {}, np.zeros(3)),
    (K.mean, [_zeros(3, 0)], np.full(3, 7, np.float32), {}, np.full(3, np.nan)),
    (K.matmul, [_zeros(2, 0), _zeros(0, 3)], np.full((2, 3), 4, np.float32), {"beta": 0.5}, np.full((2, 3), 2.0)),
]


@pytest.mark.parametrize("kernel,inputs,out,kw,expected", EMPTY_CALLS, ids=[f"{c[0].name}-{i}" for i, c in enumerate(EMPTY_CALLS)])
def test_empty_tensors_are_accepted(kernel, inputs, out, kw, expected):
    # A zero-size out has no elements to overlap, whatever strides numpy gives it.
    assert 0 in out.shape or 0 in inputs[0].shape
    run(kernel, *[HostTensor(x) for x in inputs], out=HostTensor(out), **kw)
    if expected is not None:
        np.testing.assert_array_equal(out, expected)


# -- ValueError: aliases ---------------------------------------------------------------------------------
def test_forbidden_aliases():
    buf = np.zeros((8, 8), np.float32)
    whole = HostTensor(buf)
    with raises(ValueError, "matmul", "'out' overlaps input 'a'"):
        K.matmul.bind((whole, HostTensor(np.zeros((8, 8), np.float32))), whole, {})
    with raises(ValueError, "matmul", "'out' overlaps input 'b'"):
        K.matmul.bind((HostTensor(np.zeros((2, 8), np.float32)), whole), HostTensor(buf[:2]), {})
    with raises(ValueError, "matmul", "'out' overlaps input 'a'"):
        K.matmul.bind((whole, HostTensor(np.zeros((8, 8), np.float32))), whole, {"beta": 1.0})
    q = HostTensor(np.zeros((1, 3, 8), np.float32))
    kv = HostTensor(np.zeros((1, 5, 8), np.float32))
    with raises(ValueError, "attention", "'out' overlaps input 'q'"):
        K.attention.bind((q, kv, kv), q, {})
    with raises(ValueError, "transpose", "'out' overlaps input 'x'"):
        K.transpose.bind((whole,), HostTensor(buf.T), {})
    with raises(ValueError, "softmax", "'out' overlaps input 'mask'"):
        K.softmax.bind((HostTensor(np.zeros((3, 8), np.float32)),), HostTensor(buf[:3]), {"mask": HostTensor(buf[2])})
    with raises(ValueError, "embedding", "'out' overlaps input 'table'"):
        K.embedding.bind((HostTensor(np.zeros(2, np.int64)), whole), HostTensor(buf[:2]), {})
    # Elementwise kernels accept the exact same view but not a shifted one.
    K.add.bind((whole, whole), whole, {})
    with raises(ValueError, "add", "partially overlaps input 'a'", "exact same view"):
        K.add.bind((HostTensor(buf[:4]), HostTensor(np.zeros((4, 8), np.float32))), HostTensor(buf[1:5]), {})
    with raises(ValueError, "layernorm", "partially overlaps input 'x'"):
        K.layernorm.bind((HostTensor(buf[:, :4]), t((4,)), t((4,))), HostTensor(buf[:, 2:6]), {})
    with raises(ValueError, "relu", "'out' has a zero stride"):
        K.relu.bind((t((4, 8)),), HostTensor(np.broadcast_to(np.zeros(8, np.float32), (4, 8))), {})


def test_rejected_calls_never_reach_the_device(rng):
    a = tensor(rng.standard_normal((4, 4)), float32)
    out = empty((4, 5), float32, fill=3.0)
    with pytest.raises(TypeError):
        run(K.matmul, a, a, out=out)
    np.testing.assert_array_equal(out.array, np.full((4, 5), 3.0, np.float32))
    before = a.array.copy()
    with pytest.raises(ValueError):
        run(K.matmul, a, a, out=a)
    np.testing.assert_array_equal(a.array, before)


# -- user kernels ----------------------------------------------------------------------------------------
def test_user_kernel_signature():
    def check(b):
        b.expect_dtype("x", (float32,))
        b.expect_same_dtype("w", "x")
        b.expect_shape("w", b["x"].shape[-1:], why="one weight per feature")
        b.expect_shape("out", b["x"].shape)

    scale_rows = Kernel("user_scale_rows", ["x", "w"], scalars={"alpha": Param(float, 1.0, gt=0)},
                        optional=["bias"], inplace=("x",), check=check)
    x, w = t((3, 4)), t((4,))
    call = scale_rows.bind((x, w), x, {"alpha": 2})
    assert call.names == ["x", "w", "out"] and call.access == [READ, READ, WRITE] and call.scalars == [2.0]
    assert scale_rows.bind((x, w), x, {"bias": t((4,))}).names == ["x", "w", "bias", "out"]
    with raises(TypeError, "user_scale_rows", "'w'", "(5,)", "(4,)"):
        scale_rows.bind((x, t((5,))), x, {})
    with raises(ValueError, "user_scale_rows", "'alpha'", "> 0"):
        scale_rows.bind((x, w), x, {"alpha": -1.0})
    buf = np.zeros((3, 4), np.float32)
    with raises(ValueError, "user_scale_rows", "'out' overlaps input 'w'"):
        scale_rows.bind((x, HostTensor(buf[1])), HostTensor(buf), {})

    bare = Kernel("user_bare", ["x"], scalars={"n": int})  # no check: arity, tensors, scalars only
    assert bare.bind((x,), t((9,)), {"n": 3}).scalars == [3]
    with raises(TypeError, "user_bare", "missing scalar 'n'"):
        bare.bind((x,), t((9,)), {})


def test_kernel_declaration_errors():
    with raises(ValueError, "repeat"):
        Kernel("k", ["x", "x"])
    with raises(ValueError, "at most one optional tensor"):
        Kernel("k", ["x"], optional=["m1", "m2"])
    with raises(ValueError, "inplace names ['y'] are not inputs"):
        Kernel("k", ["x"], inplace=("y",))
    with raises(ValueError, "not an identifier"):
        Kernel("k", ["x-y"])
    with raises(ValueError, "unsupported scalar kind"):
        Param(complex)
    with raises(ValueError, "'default'", "> 0"):
        Param(float, -1.0, gt=0)
