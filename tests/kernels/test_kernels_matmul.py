"""matmul against float64 numpy: 2-D and batched, broadcast batch dims,
transpose_b, alpha/beta, strided / transposed / reversed operands and outputs,
every float dtype, odd sizes.

Tolerance: |out - ref| <= rtol * |ref| + 1e-5 * sqrt(K) with rtol = 1e-5 for
float32 and two storage roundings (2^-10 float16, 2^-7 bfloat16) otherwise;
ref is computed in float64 from the same (rounded) inputs, so the bound covers
float32 accumulation and the final rounding to storage.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import engine.kernels as K
from engine.dtypes import float32
from tests.kernels.harness import EPS, FLOAT_DTYPES, LAYOUTS, assert_close, empty, run, tensor


def check(out, ref, k: int) -> None:
    assert_close(out, ref, rtol=2 * EPS[out.dtype] + 1e-5, atol=1e-5 * math.sqrt(max(k, 1)))


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("la", LAYOUTS)
@pytest.mark.parametrize("lb", LAYOUTS)
def test_layouts(rng, dt, la, lb):
    m, k, n = 33, 65, 17
    a = tensor(rng.standard_normal((m, k)), dt, la)
    b = tensor(rng.standard_normal((k, n)), dt, lb)
    out = empty((m, n), dt, ["contiguous", "strided", "transposed", "reversed"][(len(la) + len(lb)) % 4])
    run(K.matmul, a, b, out=out)
    check(out, a.f64() @ b.f64(), k)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("mkn", [(1, 1, 1), (1, 37, 1), (7, 13, 5), (1, 129, 65), (65, 3, 1), (129, 31, 257)], ids=str)
def test_sizes(rng, dt, mkn):
    m, k, n = mkn
    a, b = tensor(rng.standard_normal((m, k)), dt), tensor(rng.standard_normal((k, n)), dt)
    out = empty((m, n), dt)
    run(K.matmul, a, b, out=out)
    check(out, a.f64() @ b.f64(), k)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("lb", ["contiguous", "transposed", "strided"])
def test_transpose_b(rng, dt, lb):
    m, k, n = 19, 45, 23
    a = tensor(rng.standard_normal((m, k)), dt)
    b = tensor(rng.standard_normal((n, k)), dt, lb)
    out = empty((m, n), dt)
    run(K.matmul, a, b, out=out, transpose_b=True)
    check(out, a.f64() @ b.f64().T, k)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("lo", ["contiguous", "strided", "transposed"])
def test_alpha_beta_accumulate(rng, dt, lo):
    m, k, n = 21, 35, 11
    a, b = tensor(rng.standard_normal((m, k)), dt), tensor(rng.standard_normal((k, n)), dt)
    out = tensor(rng.standard_normal((m, n)), dt, lo)
    before = out.f64().copy()
    call = run(K.matmul, a, b, out=out, alpha=0.5, beta=-2.0)
    assert call.access == [1, 1, 3]  # beta != 0: out is read as well
    check(out, 0.5 * (a.f64() @ b.f64()) - 2.0 * before, k)


def test_beta_zero_ignores_garbage_in_out(rng):
    a, b = tensor(rng.standard_normal((9, 7)), float32), tensor(rng.standard_normal((7, 5)), float32)
    out = empty((9, 5), float32, fill=np.nan)
    call = run(K.matmul, a, b, out=out, alpha=3.0)
    assert call.access == [1, 1, 2]
    check(out, 3.0 * (a.f64() @ b.f64()), 7)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize(
    "ashape,bshape",
    [
        ((2, 3, 9, 13), (2, 3, 13, 7)),  # same batch
        ((4, 17, 13), (13, 7)),  # shared 2-D b: folded into one product
        ((2, 1, 9, 13), (1, 3, 13, 7)),  # broadcast both ways
        ((9, 13), (3, 13, 7)),  # 2-D a, batched b
        ((3, 1, 13), (3, 13, 7)),  # M = 1
    ],
    ids=str,
)
def test_batched(rng, dt, ashape, bshape):
    a, b = tensor(rng.standard_normal(ashape), dt), tensor(rng.standard_normal(bshape), dt, "transposed")
    ref = a.f64() @ b.f64()
    out = empty(ref.shape, dt, "strided")
    run(K.matmul, a, b, out=out)
    check(out, ref, ashape[-1])


@pytest.mark.parametrize("la", ["strided", "transposed", "reversed"])
def test_batched_strided_rows_not_folded(rng, la):
    # A strided batch of a shared-b product cannot fold into one M: one product per batch.
    buf = tensor(rng.standard_normal((5, 24, 13)), float32, la)
    a = type(buf)(buf.array[:, 1:20:2, :])  # [5, 10, 13], batch stride != 10 * row stride
    b = tensor(rng.standard_normal((13, 9)), float32)
    out = empty((5, 10, 9), float32)
    run(K.matmul, a, b, out=out)
    check(out, a.f64() @ b.f64(), 13)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("kshape", [(2, 4, 13, 8), (13, 8)], ids=["batched k", "shared k"])
def test_batched_transpose_b_attention_scores(rng, dt, kshape):
    q = tensor(rng.standard_normal((2, 4, 11, 8)), dt)
    k = tensor(rng.standard_normal(kshape), dt, "strided")
    out = empty((2, 4, 11, 13), dt)
    run(K.matmul, q, k, out=out, transpose_b=True, alpha=0.125)
    check(out, 0.125 * q.f64() @ np.swapaxes(k.f64(), -1, -2), 8)


@pytest.mark.parametrize("dt", FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("bshape", [(2, 3, 13, 7), (13, 7)], ids=["batched b", "shared b"])
def test_batched_alpha_beta_accumulate(rng, dt, bshape):
    a, b = tensor(rng.standard_normal((2, 3, 9, 13)), dt), tensor(rng.standard_normal(bshape), dt)
    out = tensor(rng.standard_normal((2, 3, 9, 7)), dt, "strided")
    before = out.f64().copy()
    run(K.matmul, a, b, out=out, alpha=-1.5, beta=0.25)
    check(out, -1.5 * (a.f64() @ b.f64()) + 0.25 * before, 13)


def test_empty_inner_dim_scales_out(rng):
    a, b = tensor(np.zeros((4, 0)), float32), tensor(np.zeros((0, 3)), float32)
    out = tensor(rng.standard_normal((4, 3)), float32)
    before = out.array.copy()
    run(K.matmul, a, b, out=out, beta=0.5)
    np.testing.assert_array_equal(out.array, 0.5 * before)
    run(K.matmul, a, b, out=out)
    np.testing.assert_array_equal(out.array, np.zeros((4, 3), np.float32))


def test_matches_numpy_sgemm_bitwise_close(rng):
    """Same BLAS family as numpy: float32 results agree with numpy's to float32 rounding."""
    a = rng.standard_normal((64, 96)).astype(np.float32)
    b = rng.standard_normal((96, 48)).astype(np.float32)
    out = empty((64, 48), float32)
    run(K.matmul, tensor(a, float32), tensor(b, float32), out=out)
    np.testing.assert_allclose(out.array, a @ b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("la", LAYOUTS)
@pytest.mark.parametrize("lb", LAYOUTS)
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("alpha_beta", [(1.0, 0.0), (2.0, 0.5), (1.0, 1.0)], ids=str)
def test_one_row_goes_through_sgemv_with_sgemm_s_results(rng, la, lb, transpose_b, alpha_beta):
    """A single row (a decode step's product) takes sgemv: every layout, op(b), alpha and beta as sgemm does."""
    alpha, beta = alpha_beta
    k, n = 67, 41
    a = tensor(rng.standard_normal((1, k)), float32, la)
    b = tensor(rng.standard_normal((n, k) if transpose_b else (k, n)), float32, lb)
    old = rng.standard_normal((1, n))
    out = empty((1, n), float32) if beta == 0.0 else tensor(old, float32)  # beta == 0: NaN contents ignored
    run(K.matmul, a, b, out=out, transpose_b=transpose_b, alpha=alpha, beta=beta)
    bb = b.f64().T if transpose_b else b.f64()
    check(out, alpha * (a.f64() @ bb) + (beta * old if beta else 0.0), k)
