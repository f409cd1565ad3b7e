"""attention against a float64 reference (and torch's scaled_dot_product_attention
where the semantics coincide): masks broadcast to [..., Sq, Skv], causal
(bottom-right aligned for KV caches), kv_len over a pre-allocated cache whose
tail holds NaN, strided q/k/v from a fused projection, query blocking, odd
sizes. Tolerance: 1e-5 relative + 1e-5 absolute (float32).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import engine.kernels as K
from engine.dtypes import bfloat16, float16, float32
from tests.kernels.harness import HostTensor, empty, run, tensor

TOL = {"rtol": 1e-5, "atol": 1e-5}


def attn_ref(q, k, v, *, scale=None, causal=False, mask=None, kv_len=None):
    length = k.shape[-2] if kv_len is None else kv_len
    k, v = k[..., :length, :], v[..., :length, :]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ np.swapaxes(k, -1, -2)
    if mask is not None:
        s = s + mask[..., :length]
    if causal:
        sq = q.shape[-2]
        i = np.arange(sq)[:, None]
        j = np.arange(length)[None, :]
        s = np.where(j > length - sq + i, -np.inf, s)
    dead = np.isneginf(s).all(-1, keepdims=True)
    s = np.where(dead, 0.0, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = np.where(dead, 0.0, p / p.sum(-1, keepdims=True))
    return p @ v


def qkv(rng, b, h, sq, skv, d, dv=None, layout="contiguous"):
    dv = d if dv is None else dv
    return (tensor(rng.standard_normal((b, h, sq, d)), float32, layout),
            tensor(rng.standard_normal((b, h, skv, d)), float32, layout),
            tensor(rng.standard_normal((b, h, skv, dv)), float32, layout))


@pytest.mark.parametrize("layout", ["contiguous", "strided", "transposed", "reversed"])
@pytest.mark.parametrize("dims", [(2, 3, 13, 17, 8), (1, 2, 1, 29, 5), (1, 1, 33, 33, 31)], ids=str)
def test_plain_matches_torch_sdpa(rng, layout, dims):
    q, k, v = qkv(rng, *dims, layout=layout)
    out = empty(q.shape, float32, "strided")
    run(K.attention, q, k, v, out=out)
    t = [torch.from_numpy(np.ascontiguousarray(x.f64())) for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*t).numpy()
    np.testing.assert_allclose(out.array, ref, **TOL)


def test_causal_square_matches_torch_sdpa(rng):
    q, k, v = qkv(rng, 2, 3, 19, 19, 16)
    out = empty(q.shape, float32)
    run(K.attention, q, k, v, out=out, causal=True)
    t = [torch.from_numpy(x.f64()) for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True).numpy()
    np.testing.assert_allclose(out.array, ref, **TOL)


@pytest.mark.parametrize("mshape", [(2, 1, 1, 23), (11, 23), (2, 3, 11, 23), (1, 3, 11, 1)], ids=str)
def test_additive_mask_broadcast(rng, mshape):
    q, k, v = qkv(rng, 2, 3, 11, 23, 8)
    mv = np.where(rng.random(mshape) < 0.25, -np.inf, rng.standard_normal(mshape))
    if mshape[-1] == 23:
        mv[..., 0] = 0.0  # keep one key visible in every row
    mask = tensor(mv, float32, "strided")
    out = empty(q.shape, float32)
    call = run(K.attention, q, k, v, out=out, mask=mask, scale=0.3)
    assert call.names == ["q", "k", "v", "mask", "out"]
    np.testing.assert_allclose(out.array, attn_ref(q.f64(), k.f64(), v.f64(), scale=0.3, mask=mask.f64()), **TOL)


def test_padding_mask_matches_torch_sdpa(rng):
    q, k, v = qkv(rng, 2, 4, 9, 9, 8)
    lengths = [9, 5]
    mv = np.zeros((2, 1, 1, 9))
    for i, n in enumerate(lengths):
        mv[i, ..., n:] = -np.inf
    out = empty(q.shape, float32)
    run(K.attention, q, k, v, out=out, mask=tensor(mv, float32))
    t = [torch.from_numpy(x.f64()) for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=torch.from_numpy(mv)).numpy()
    np.testing.assert_allclose(out.array, ref, **TOL)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,kv_len", [(1, 1), (1, 37), (4, 37), (37, 37)], ids=str)
def test_kv_cache_prefix_ignores_the_tail(rng, causal, sq, kv_len):
    cap = 64
    q = tensor(rng.standard_normal((1, 2, sq, 12)), float32)
    kc = rng.standard_normal((1, 2, cap, 12))
    vc = rng.standard_normal((1, 2, cap, 12))
    kc[..., kv_len:, :] = np.nan  # stale cache positions must never be read
    vc[..., kv_len:, :] = np.nan
    k, v = tensor(kc, float32), tensor(vc, float32)
    out = empty(q.shape, float32)
    run(K.attention, q, k, v, out=out, kv_len=kv_len, causal=causal)
    ref = attn_ref(q.f64(), k.f64(), v.f64(), causal=causal, kv_len=kv_len)
    np.testing.assert_allclose(out.array, ref, **TOL)


@pytest.mark.parametrize("mdt", [float32, float16, bfloat16], ids=str)
@pytest.mark.parametrize("causal,kv_len", [(True, None), (False, 29), (True, 29)], ids=str)
def test_mask_with_causal_and_kv_len(rng, mdt, causal, kv_len):
    cap, sq = 40, 7
    q, k, v = qkv(rng, 2, 3, sq, cap, 8)
    if kv_len is not None:  # the cache's stale tail must not be read
        k.array[..., kv_len:, :] = np.nan
        v.array[..., kv_len:, :] = np.nan
    mv = np.where(rng.random((2, 1, sq, cap)) < 0.3, -np.inf, rng.standard_normal((2, 1, sq, cap)))
    mv[..., 0] = 0.0  # keep one key visible in every row
    mask = tensor(mv, mdt, "strided")
    out = empty(q.shape, float32)
    run(K.attention, q, k, v, out=out, mask=mask, causal=causal, kv_len=kv_len)
    ref = attn_ref(q.f64(), k.f64(), v.f64(), mask=mask.f64(), causal=causal, kv_len=kv_len)
    np.testing.assert_allclose(out.array, ref, **TOL)


@pytest.mark.parametrize("causal", [False, True])
def test_query_blocks_long_context(rng, causal):
    # L = 1031 keys: the score tile holds 31 query rows, so 67 queries take three blocks.
    q, k, v = qkv(rng, 1, 2, 67, 1031, 8, dv=5)
    out = empty(q.shape[:-1] + (5,), float32, "transposed")
    run(K.attention, q, k, v, out=out, causal=causal)
    np.testing.assert_allclose(out.array, attn_ref(q.f64(), k.f64(), v.f64(), causal=causal), **TOL)


def test_fused_qkv_views(rng):
    # [B, S, 3, H, D] projections viewed as [B, H, S, D] q, k, v without copies.
    b, s, h, d = 2, 15, 3, 8
    fused = rng.standard_normal((b, s, 3, h, d)).astype(np.float32)
    q, k, v = (HostTensor(np.transpose(fused[:, :, i], (0, 2, 1, 3))) for i in range(3))
    out_buf = np.full((b, s, h, d), np.nan, np.float32)  # written through a [B, H, S, D] view
    out = HostTensor(np.transpose(out_buf, (0, 2, 1, 3)))
    run(K.attention, q, k, v, out=out, causal=True)
    np.testing.assert_allclose(out.array, attn_ref(q.f64(), k.f64(), v.f64(), causal=True), **TOL)


@pytest.mark.parametrize("shape", [(13, 8), (3, 13, 8)], ids=str)
def test_lower_rank(rng, shape):
    q = tensor(rng.standard_normal(shape), float32)
    k = tensor(rng.standard_normal(shape[:-2] + (21, 8)), float32)
    v = tensor(rng.standard_normal(shape[:-2] + (21, 8)), float32)
    out = empty(shape, float32)
    run(K.attention, q, k, v, out=out)
    np.testing.assert_allclose(out.array, attn_ref(q.f64(), k.f64(), v.f64()), **TOL)


def test_fully_masked_row_gives_zeros(rng):
    q, k, v = qkv(rng, 1, 1, 3, 5, 4)
    mv = np.zeros((3, 5))
    mv[1] = -np.inf
    out = empty(q.shape, float32)
    run(K.attention, q, k, v, out=out, mask=tensor(mv, float32))
    np.testing.assert_array_equal(out.array[0, 0, 1], np.zeros(4))
    np.testing.assert_allclose(out.array, attn_ref(q.f64(), k.f64(), v.f64(), mask=mv), **TOL)


def test_default_scale_is_inverse_sqrt_d(rng):
    q, k, v = qkv(rng, 1, 1, 4, 6, 9)
    call = K.attention.bind((q, k, v), empty(q.shape, float32), {})
    assert call.scalars == [1 / 3, 0, -1]


# The fused pass (native/kernels/fused_attention.cpp) takes blocks of 8 query rows, k^T in 16-key panels and v in
# 16-column panels, on CPUs with AVX-512 and value heads of 16, 32, 48 or 64 columns: these shapes reach it there
# (and the sgemm path elsewhere, checked against the same reference). Row counts with and without a partial block,
# key counts on and off a panel edge and past a 3-panel register block, heads of 1 to 3 value panel groups.
@pytest.mark.parametrize("sq,skv", [(8, 8), (13, 47), (16, 48), (67, 130), (9, 1)], ids=str)
@pytest.mark.parametrize("d,dv", [(32, 32), (37, 16), (1, 48), (64, 64)], ids=str)
def test_fused_head_sizes_match_the_reference(rng, sq, skv, d, dv):
    q, k, v = qkv(rng, 2, 3, sq, skv, d, dv=dv)
    out = empty(q.shape[:-1] + (dv,), float32)
    run(K.attention, q, k, v, out=out, scale=0.2)
    np.testing.assert_allclose(out.array, attn_ref(q.f64(), k.f64(), v.f64(), scale=0.2), **TOL)


@pytest.mark.parametrize("mshape", [(2, 1, 1, 40), (2, 3, 20, 40), (20, 40)], ids=str)
@pytest.mark.parametrize("causal,kv_len", [(False, None), (True, None), (False, 37), (True, 37)], ids=str)
def test_fused_masks_causal_and_cache_prefix(rng, mshape, causal, kv_len):
    cap, sq = 40, 20
    q, k, v = qkv(rng, 2, 3, sq, cap, 32)
    length = cap if kv_len is None else kv_len
    k.array[..., length:, :] = np.nan  # a cache's stale tail: never read
    v.array[..., length:, :] = np.nan
    mv = np.where(rng.random(mshape) < 0.3, -np.inf, rng.standard_normal(mshape))
    mv[..., 0] = 0.0  # one key visible in every row
    if len(mshape) == 4 and mshape[2] > 1:
        mv[0, 1, 5] = -np.inf  # and one row that sees nothing: zeros
    mask = tensor(mv, float32)  # contiguous float32: read along its keys in place
    out = empty(q.shape, float32)
    run(K.attention, q, k, v, out=out, mask=mask, causal=causal, kv_len=kv_len)
    ref = attn_ref(q.f64(), k.f64(), v.f64(), mask=mv, causal=causal, kv_len=kv_len)
    np.testing.assert_allclose(out.array, ref, **TOL)
    if len(mshape) == 4 and mshape[2] > 1:
        np.testing.assert_array_equal(out.array[0, 1, 5], np.zeros(32))


def test_fused_over_a_minilm_projection(rng):
    # The encoder's layout: q, k, v are column ranges of one [B, S, 3 * hidden] projection, out a column range of
    # [B, S, hidden], the mask [B, 1, S] a padding bias; every view strided by rows, unit stride along a row.
    b, s, heads, dh = 3, 21, 4, 32
    hidden = heads * dh
    proj = rng.standard_normal((b, s, 3 * hidden)).astype(np.float32)
    ctx = np.full((b, s, hidden), np.nan, np.float32)
    bias = np.zeros((b, 1, s), np.float32)
    bias[1, :, 15:] = -1e4
    for h in range(heads):
        c = h * dh
        q, k, v = (HostTensor(proj[:, :, o + c:o + c + dh]) for o in (0, hidden, 2 * hidden))
        run(K.attention, q, k, v, out=HostTensor(ctx[:, :, c:c + dh]), mask=HostTensor(bias), scale=dh ** -0.5)
        ref = attn_ref(q.f64(), k.f64(), v.f64(), scale=dh ** -0.5, mask=bias.astype(np.float64))
        np.testing.assert_allclose(ctx[:, :, c:c + dh], ref, **TOL)


@pytest.mark.parametrize("skv", [14000, 20000], ids=str)  # k^T within the fused pass's workspace, then past it
def test_long_context_either_side_of_the_fused_workspace(rng, skv):
    q, k, v = qkv(rng, 1, 1, 9, skv, 64, dv=16)
    out = empty(q.shape[:-1] + (16,), float32)
    run(K.attention, q, k, v, out=out, causal=True)
    np.testing.assert_allclose(out.array, attn_ref(q.f64(), k.f64(), v.f64(), causal=True), **TOL)
