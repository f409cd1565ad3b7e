"""matmul_packed (B panel-packed once by pack_panels) against float64 numpy.

Every register-block remainder of both shapes (AVX-512: rows 1..7 past
multiples of 8, panels in groups of three with one or two left; elsewhere rows
1..5 past multiples of 6), partial last panels, K of 1 and odd K, batch axes folded into rows, row-strided a and out,
column slices along panels (how a model splits a matmul across workers),
alpha / beta, beta == 0 ignoring NaN in out, and the errors a bad call gets
before anything runs. Tolerance as test_kernels_matmul's float32.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import engine.kernels as K
from engine.dtypes import float16, float32
from tests.kernels.harness import EPS, HostTensor, assert_close, empty, run, tensor


def check(out, ref, k: int) -> None:
    assert_close(out, ref, rtol=2 * EPS[float32] + 1e-5, atol=1e-5 * math.sqrt(max(k, 1)))


def packed(b: np.ndarray) -> HostTensor:
    return HostTensor(K.pack_panels(b.astype(np.float32)), float32)


def test_pack_panels_lays_out_sixteen_column_panels():
    b = np.arange(3 * 20, dtype=np.float32).reshape(3, 20)
    bp = K.pack_panels(b)
    assert bp.shape == K.packed_shape(3, 20) == (2, 3, 16) and bp.flags.c_contiguous
    np.testing.assert_array_equal(bp[0], b[:, :16])
    np.testing.assert_array_equal(bp[1, :, :4], b[:, 16:])
    assert not bp[1, :, 4:].any()  # zero past N
    with pytest.raises(TypeError, match="float32"):
        K.pack_panels(b.astype(np.float64))
    with pytest.raises(ValueError, match="2-d"):
        K.pack_panels(b[0])


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14, 15, 16, 17, 23, 64])
@pytest.mark.parametrize("kn", [(1, 1), (7, 16), (33, 17), (384, 40), (130, 100), (20, 64), (9, 80)], ids=str)
def test_sizes(rng, m, kn):
    k, n = kn
    a = tensor(rng.standard_normal((m, k)), float32)
    b = rng.standard_normal((k, n))
    out = empty((m, n), float32)
    run(K.matmul_packed, a, packed(b), out=out)
    check(out, a.f64() @ b.astype(np.float32).astype(np.float64), k)


def test_alpha_beta_and_beta_zero_ignores_nan_in_out(rng):
    m, k, n = 9, 21, 35
    a = tensor(rng.standard_normal((m, k)), float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c0 = rng.standard_normal((m, n))
    out = tensor(c0, float32)
    run(K.matmul_packed, a, packed(b), out=out, alpha=-0.5, beta=2.0)
    check(out, -0.5 * (a.f64() @ b.astype(np.float64)) + 2.0 * c0.astype(np.float32), k)
    nan_out = empty((m, n), float32)  # NaN-filled
    run(K.matmul_packed, a, packed(b), out=nan_out, alpha=3.0)
    check(nan_out, 3.0 * (a.f64() @ b.astype(np.float64)), k)


def test_batch_axes_fold_into_rows_and_row_strides_are_honoured(rng):
    k, n = 24, 50
    b = rng.standard_normal((k, n)).astype(np.float32)
    a_full = rng.standard_normal((2, 5, k + 3)).astype(np.float32)
    a = HostTensor(np.ascontiguousarray(a_full.reshape(10, k + 3))[:, :k].reshape(2, 5, k), float32)
    assert not a.array.flags.c_contiguous  # rows padded by 3 elements: one row stride all the same
    out_buf = np.full((10, n + 7), np.nan, np.float32)
    out = HostTensor(out_buf[:, 2:2 + n].reshape(2, 5, n), float32)
    run(K.matmul_packed, a, packed(b), out=out)
    check(out, a.f64() @ b.astype(np.float64), k)
    assert np.isnan(out_buf[:, :2]).all() and np.isnan(out_buf[:, 2 + n:]).all()  # nothing written outside


def test_a_slice_of_panels_computes_its_columns(rng):
    m, k, n = 7, 40, 70  # panels: 16, 16, 16, 16, 6 columns
    a = tensor(rng.standard_normal((m, k)), float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bp = K.pack_panels(b)
    out = np.full((m, n), np.nan, np.float32)
    for p0, p1 in [(0, 2), (2, 3), (3, 5)]:
        c0, c1 = 16 * p0, min(n, 16 * p1)
        run(K.matmul_packed, a, HostTensor(bp[p0:p1], float32), out=HostTensor(out[:, c0:c1], float32))
    check(HostTensor(out, float32), a.f64() @ b.astype(np.float64), k)


def test_bad_calls_are_refused_before_anything_runs(rng):
    a = tensor(rng.standard_normal((4, 8)), float32)
    b = rng.standard_normal((8, 20)).astype(np.float32)
    out = empty((4, 20), float32)
    with pytest.raises(TypeError, match="'bp' has shape"):
        run(K.matmul_packed, a, packed(b[:7]), out=out)  # K differs
    with pytest.raises(TypeError, match="'bp' has shape"):
        run(K.matmul_packed, a, packed(b), out=empty((4, 40), float32))  # out's N needs 3 panels
    with pytest.raises(TypeError, match="'bp' has shape"):
        run(K.matmul_packed, a, HostTensor(b, float32), out=out)  # not packed
    with pytest.raises(TypeError, match="'out' has shape"):
        run(K.matmul_packed, a, packed(b), out=empty((5, 20), float32))
    with pytest.raises(ValueError, match="'a' needs a unit column stride"):
        run(K.matmul_packed, tensor(rng.standard_normal((4, 8)), float32, "transposed"), packed(b), out=out)
    with pytest.raises(ValueError, match="'bp' must be contiguous"):
        run(K.matmul_packed, a, HostTensor(K.pack_panels(b)[::-1], float32), out=out)  # panels reversed
    with pytest.raises(TypeError, match="dtype"):
        run(K.matmul_packed, tensor(rng.standard_normal((4, 8)), float16), packed(b), out=out)
    assert np.isnan(out.array).all()  # none of them ran


def _gelu(x: np.ndarray) -> np.ndarray:
    from math import erf

    return 0.5 * x * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))


@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_bias_and_gelu_epilogue(rng, activation, beta):
    m, k, n = 13, 30, 37
    a = tensor(rng.standard_normal((m, k)), float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    c0 = rng.standard_normal((m, n)).astype(np.float32)
    out = tensor(c0, float32)
    run(K.matmul_packed, a, packed(b), bias=HostTensor(bias, float32), out=out, beta=beta, activation=activation)
    ref = a.f64() @ b.astype(np.float64) + beta * c0 + bias
    check(out, _gelu(ref) if activation == "gelu" else ref, k)


def test_a_bias_slice_goes_with_its_panels(rng):
    m, k, n = 5, 12, 40
    a = tensor(rng.standard_normal((m, k)), float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    bp = K.pack_panels(b)
    out = np.full((m, n), np.nan, np.float32)
    for p0, p1 in [(0, 1), (1, 3)]:
        c0, c1 = 16 * p0, min(n, 16 * p1)
        run(K.matmul_packed, a, HostTensor(bp[p0:p1], float32), bias=HostTensor(bias[c0:c1], float32),
            out=HostTensor(out[:, c0:c1], float32), activation="gelu")
    check(HostTensor(out, float32), _gelu(a.f64() @ b.astype(np.float64) + bias), k)


def test_a_bad_bias_is_refused(rng):
    a = tensor(rng.standard_normal((4, 8)), float32)
    b = rng.standard_normal((8, 20)).astype(np.float32)
    out = empty((4, 20), float32)
    with pytest.raises(TypeError, match="'bias' has shape"):
        run(K.matmul_packed, a, packed(b), bias=HostTensor(np.zeros(16, np.float32), float32), out=out)
    with pytest.raises(ValueError, match="'bias' must be contiguous"):
        run(K.matmul_packed, a, packed(b), bias=HostTensor(np.zeros(40, np.float32)[::2], float32), out=out)
    with pytest.raises(ValueError, match="activation"):
        run(K.matmul_packed, a, packed(b), out=out, activation="relu")
    assert np.isnan(out.array).all()
