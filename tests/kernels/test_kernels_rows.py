"""Row kernels over the last axis against float64 references: softmax (scale,
broadcast additive masks), layernorm, rmsnorm, l2_normalize, sum, mean, max,
argmax and mean_pool. Every float dtype, odd sizes, strided views, leading
batch dims, in place.

Tolerances: float32 results within 2e-6 relative (+1e-6 absolute; sums 1e-6
relative to the sum of magnitudes); float16/bfloat16 within two roundings of
the storage type of the float64 result on the same rounded inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine.kernels as K
from engine.dtypes import bfloat16, float16, float32, int32, int64, uint8
from tests.kernels.harness import EPS, FLOAT_DTYPES, LAYOUTS, HostTensor, assert_close, empty, run, tensor

SHAPES = [(13,), (7, 33), (3, 5, 129), (2, 3, 4, 1031)]


def tol(dt) -> dict:
    return {"rtol": 2 * EPS[dt] + 2e-6, "atol": 1e-6}


def softmax_ref(z: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; rows that are -inf throughout give zeros (the kernel's contract)."""
    dead = np.isneginf(z).all(-1, keepdims=True)
    z = np.where(dead, 0.0, z)
    e = np.exp(z - z.max(-1, keepdims=True))
    return np.where(dead, 0.0, e / e.sum(-1, keepdims=True))


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_softmax(rng, dt, shape, layout):
    x = tensor(rng.standard_normal(shape) * 3, dt, layout)
    out = empty(shape, dt, "strided" if layout == "contiguous" else "contiguous")
    run(K.softmax, x, out=out, scale=0.7)
    assert_close(out, softmax_ref(0.7 * x.f64()), **tol(dt))


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mshape", [(129,), (5, 129), (3, 1, 129), (1, 5, 1), (3, 5, 129)], ids=str)
def test_softmax_mask_broadcast(rng, dt, mshape):
    shape = (3, 5, 129)
    x = tensor(rng.standard_normal(shape), dt)
    mv = np.where(rng.random(mshape) < 0.3, -np.inf, rng.standard_normal(mshape))
    mask = tensor(mv, float32, "strided")
    out = empty(shape, dt)
    call = run(K.softmax, x, out=out, mask=mask)
    assert call.names == ["x", "mask", "out"]
    assert_close(out, softmax_ref(x.f64() + mask.f64()), **tol(dt))


@pytest.mark.parametrize("dt", [float16, bfloat16], ids=str)
def test_softmax_mask_in_x_dtype_and_fully_masked_row(rng, dt):
    x = tensor(rng.standard_normal((4, 9)), dt)
    mv = np.where(rng.random((4, 9)) < 0.2, -np.inf, rng.standard_normal((4, 9)))
    mv[2, :] = -np.inf
    mv[1, 3:] = -np.inf
    mask = tensor(mv, dt)
    out = empty((4, 9), dt)
    run(K.softmax, x, out=out, mask=mask)
    got = out.f64()
    np.testing.assert_array_equal(got[2], np.zeros(9))
    np.testing.assert_array_equal(got[1, 3:], np.zeros(6))
    assert_close(out, softmax_ref(x.f64() + mask.f64()), **tol(dt))


def test_softmax_in_place_and_large_values(rng):
    x = tensor(rng.standard_normal((6, 257)) * 50 + 1000, float32, "strided")
    expected = softmax_ref(x.f64())
    run(K.softmax, x, out=x)
    assert_close(x, expected, **tol(float32))
    np.testing.assert_allclose(x.array.sum(-1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layernorm(rng, dt, shape):
    layout = LAYOUTS[len(shape) - 1]
    n = shape[-1]
    x = tensor(rng.standard_normal(shape) * 2 + 0.5, dt, layout)
    g = tensor(rng.standard_normal(n), dt, "strided")
    b = tensor(rng.standard_normal(n), float32)  # float32 affine params with half activations
    out = empty(shape, dt)
    run(K.layernorm, x, g, b, out=out, eps=1e-3)
    ref = torch.nn.functional.layer_norm(torch.from_numpy(np.ascontiguousarray(x.f64())), (n,), torch.from_numpy(g.f64()),
                                         torch.from_numpy(b.f64()), eps=1e-3).numpy()
    assert_close(out, ref, rtol=2 * EPS[dt] + 1e-5, atol=1e-5)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("gdt", ["x's", float32], ids=str)
def test_rmsnorm(rng, dt, shape, gdt):
    n = shape[-1]
    x = tensor(rng.standard_normal(shape) * 3, dt, LAYOUTS[-len(shape)])
    g = tensor(rng.standard_normal(n), dt if gdt == "x's" else gdt)  # float32 gamma with half activations too
    out = empty(shape, dt, "strided")
    run(K.rmsnorm, x, g, out=out)
    xf = x.f64()
    ref = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-6) * g.f64()
    assert_close(out, ref, rtol=2 * EPS[dt] + 1e-5, atol=1e-5)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_l2_normalize(rng, dt, shape):
    x = tensor(rng.standard_normal(shape), dt, LAYOUTS[len(shape) % 4])
    out = empty(shape, dt)
    run(K.l2_normalize, x, out=out)
    ref = torch.nn.functional.normalize(torch.from_numpy(np.ascontiguousarray(x.f64())), dim=-1).numpy()
    assert_close(out, ref, **tol(dt))


def test_l2_normalize_zero_row_and_eps():
    x = tensor(np.array([[0.0, 0.0, 0.0], [3.0, 4.0, 0.0], [1e-9, 0.0, 0.0]]), float32)
    out = empty((3, 3), float32)
    run(K.l2_normalize, x, out=out, eps=1e-6)
    np.testing.assert_allclose(out.array, [[0, 0, 0], [0.6, 0.8, 0], [1e-3, 0, 0]], rtol=1e-6)


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "l2_normalize"])
def test_norms_in_place(rng, name):
    x = tensor(rng.standard_normal((5, 77)), float32, "strided")
    g, b = tensor(rng.standard_normal(77), float32), tensor(rng.standard_normal(77), float32)
    ref_out = empty((5, 77), float32)
    args = {"layernorm": (g, b), "rmsnorm": (g,), "l2_normalize": ()}[name]
    run(getattr(K, name), x, *args, out=ref_out)
    run(getattr(K, name), x, *args, out=x)
    np.testing.assert_array_equal(x.array, ref_out.array)


REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max}


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(REDUCE))
@pytest.mark.parametrize("shape", SHAPES + [(3, 100_003)], ids=str)
def test_reductions(rng, dt, name, shape):
    x = tensor(rng.standard_normal(shape) + 0.25, dt, LAYOUTS[len(shape) - 1])
    out = empty(shape[:-1], dt)
    run(getattr(K, name), x, out=out)
    xf = x.f64()
    ref = REDUCE[name](xf, axis=-1)
    atol = 1e-6 * np.abs(xf).sum(-1) if name == "sum" else 1e-6 * np.abs(xf).mean(-1) if name == "mean" else 0.0
    np.testing.assert_allclose(out.f64(), ref, rtol=2 * EPS[dt], atol=np.max(atol) + 1e-12)


@pytest.mark.parametrize("name", ["sum", "mean", "max", "argmax"])
def test_reductions_keepdims_out(rng, name):
    x = tensor(rng.standard_normal((4, 6, 19)), float32, "transposed")
    out = empty((4, 6, 1), int64 if name == "argmax" else float32)
    run(getattr(K, name), x, out=out)
    ref = {"sum": np.sum, "mean": np.mean, "max": np.max, "argmax": np.argmax}[name](x.array, axis=-1)
    np.testing.assert_allclose(out.array[..., 0], ref, rtol=1e-6)


def test_max_nan_propagates_and_argmax_first_occurrence():
    xv = np.array([[1.0, 5.0, 5.0, -2.0], [np.nan, 1.0, 2.0, np.nan], [-np.inf, -np.inf, -np.inf, -np.inf]], np.float32)
    out = empty((3,), float32)
    run(K.max, tensor(xv, float32), out=out)
    np.testing.assert_array_equal(out.array, np.max(xv, axis=-1))
    idx = empty((3,), int32)
    run(K.argmax, tensor(xv, float32), out=idx)
    np.testing.assert_array_equal(idx.array, np.argmax(xv, axis=-1))


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("idt", [int32, int64], ids=str)
@pytest.mark.parametrize("shape", [(37,), (5, 129), (2, 3, 1031)], ids=str)
def test_argmax(rng, dt, idt, shape):
    x = tensor(rng.permuted(np.arange(np.prod(shape)).reshape(shape), axis=-1).astype(np.float64), dt, "reversed")
    out = empty(shape[:-1], idt, "strided" if len(shape) > 1 else "contiguous")
    run(K.argmax, x, out=out)
    np.testing.assert_array_equal(out.array, np.argmax(x.f64(), axis=-1))


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mdt", ["x's", float32, int64, int32, uint8], ids=str)
@pytest.mark.parametrize("xlayout", ["contiguous", "transposed"])
def test_mean_pool(rng, dt, mdt, xlayout):
    mdt = dt if mdt == "x's" else mdt
    b, s, d = 3, 11, 37
    x = tensor(rng.standard_normal((b, s, d)), dt, xlayout)
    lengths = [11, 4, 0]
    mv = np.zeros((b, s))
    for i, n in enumerate(lengths):
        mv[i, :n] = 1
    mask = tensor(mv * 0.5, mdt, "strided") if mdt.is_float else HostTensor(mv.astype(mdt.numpy), mdt)
    out = empty((b, d), dt)
    run(K.mean_pool, x, mask, out=out)
    m = mask.f64()
    ref = (x.f64() * m[..., None]).sum(1) / np.maximum(m.sum(1), 1e-9)[:, None]
    assert_close(out, ref, rtol=2 * EPS[dt] + 1e-6, atol=1e-6)
    np.testing.assert_array_equal(out.f64()[2], np.zeros(d))  # an all-padding row pools to zeros


def test_mean_pool_leading_batch_dims(rng):
    x = tensor(rng.standard_normal((2, 3, 7, 5)), float32)
    mv = (rng.random((2, 3, 7)) < 0.6).astype(np.float32)
    out = empty((2, 3, 5), float32)
    run(K.mean_pool, x, tensor(mv, float32), out=out)
    ref = (x.f64() * mv[..., None]).sum(-2) / np.maximum(mv.sum(-1), 1e-9)[..., None]
    np.testing.assert_allclose(out.array, ref, rtol=2e-6, atol=1e-6)
