"""Shape and dtype rules of the built-in kernels, one small function each."""

from __future__ import annotations

import math

from engine.dtypes import DTYPES, bfloat16, float16, float32, int32, int64, uint8
from engine.kernels.signature import READWRITE, Binding, broadcast_shapes

FLOATS = (float32, float16, bfloat16)
IDS = (int32, int64)
ALL = tuple(DTYPES.values())


def shape(b: Binding, name: str) -> tuple[int, ...]:
    return tuple(b[name].shape)


def matmul(b: Binding) -> None:
    b.expect_dtype("a", FLOATS)
    b.expect_same_dtype("b", "a")
    b.expect_same_dtype("out", "a")
    b.expect_ndim("a", 2)
    b.expect_ndim("b", 2)
    a, w = shape(b, "a"), shape(b, "b")
    tb = b["transpose_b"]
    k_b, n = (w[-1], w[-2]) if tb else (w[-2], w[-1])
    if a[-1] != k_b:
        which = "last" if tb else "second-to-last"
        raise b.type_error(
            f"argument 'b' has shape {w}, incompatible with argument 'a' of shape {a}: "
            f"a's last dim {a[-1]} != b's {which} dim {k_b}"
        )
    batch = broadcast_shapes(a[:-2], w[:-2])
    if batch is None:
        raise b.type_error(f"batch dims of argument 'a' {a} and argument 'b' {w} do not broadcast")
    b.expect_shape("out", batch + (a[-2], n), why=lambda: f"a {a} @ b {w}{'^T' if tb else ''}")
    if b["beta"] != 0.0:
        b.out_access = READWRITE


PANEL = 16  # columns per panel of a packed operand (engine.kernels.packing)


def matmul_packed(b: Binding) -> None:
    for name in ("a", "bp", "out"):
        b.expect_dtype(name, (float32,))
    b.expect_ndim("a", 2)
    b.expect_ndim("out", 2)
    b.expect_ndim("bp", 3, 3)
    a, bp, o = shape(b, "a"), shape(b, "bp"), shape(b, "out")
    n = o[-1]
    if bp[1:] != (a[-1], PANEL) or bp[0] != -(-n // PANEL):
        raise b.type_error(f"argument 'bp' has shape {bp}, expected ({-(-n // PANEL)}, {a[-1]}, {PANEL}): "
                           f"a K={a[-1]} x N={n} operand packed by engine.kernels.pack_panels")
    b.expect_shape("out", a[:-1] + (n,), why=lambda: f"a {a} @ the packed operand, N={n} taken from out")
    st = tuple(b["bp"].strides)
    if st[2] != 1 or (bp[1] > 1 and st[1] != PANEL) or (bp[0] > 1 and st[0] != bp[1] * PANEL):
        raise b.value_error("argument 'bp' must be contiguous (a packed operand or a slice of its panels)")
    bias = b.get("bias")
    if bias is not None:
        b.expect_dtype("bias", (float32,))
        b.expect_shape("bias", (n,), why=f"one value per output column, N={n}")
        if n > 1 and tuple(bias.strides)[-1] != 1:
            raise b.value_error("argument 'bias' must be contiguous")
    for name in ("a", "out"):
        if not _rows_in_one_stride(b[name]):
            raise b.value_error(f"argument '{name}' needs a unit column stride and its leading axes in one row "
                                "stride (a contiguous view or a slice of rows or columns of one)")
    if b["beta"] != 0.0:
        b.out_access = READWRITE


def _rows_in_one_stride(t: object) -> bool:
    """Whether t's last axis has stride 1 and its other axes collapse into rows of one stride."""
    shp, st = tuple(t.shape), tuple(t.strides)  # type: ignore[attr-defined]
    if shp[-1] > 1 and st[-1] != 1:
        return False
    expect = None
    for d in range(len(shp) - 2, -1, -1):
        if shp[d] == 1:
            continue
        if expect is not None and st[d] != expect:
            return False
        expect = st[d] * shp[d]
    return True


def binary(b: Binding) -> None:
    b.expect_dtype("a", FLOATS)
    b.expect_same_dtype("b", "a")
    b.expect_same_dtype("out", "a")
    b.expect_broadcast("b", shape(b, "a"), target_desc="the shape of 'a'")
    b.expect_shape("out", shape(b, "a"), why="the shape of 'a'")


def unary(b: Binding) -> None:
    b.expect_dtype("x", FLOATS)
    b.expect_same_dtype("out", "x")
    b.expect_shape("out", shape(b, "x"), why="the shape of 'x'")


def softmax(b: Binding) -> None:
    unary(b)
    b.expect_ndim("x", 1)
    if b.get("mask") is not None:
        b.expect_same_dtype("mask", "x", also=(float32,))
        b.expect_broadcast("mask", shape(b, "x"), target_desc="the shape of 'x'")


def _feature(b: Binding, name: str) -> None:
    b.expect_same_dtype(name, "x", also=(float32,))
    b.expect_shape(name, (shape(b, "x")[-1],), why="one value per feature of 'x'")


def layernorm(b: Binding) -> None:
    unary(b)
    b.expect_ndim("x", 1)
    _feature(b, "gamma")
    _feature(b, "beta")


def rmsnorm(b: Binding) -> None:
    unary(b)
    b.expect_ndim("x", 1)
    _feature(b, "gamma")


def l2_normalize(b: Binding) -> None:
    unary(b)
    b.expect_ndim("x", 1)


def _reduced(b: Binding) -> None:
    b.expect_ndim("x", 1)
    x = shape(b, "x")
    b.expect_shape("out", [x[:-1], x[:-1] + (1,)], why="one value per row of 'x'")


def reduction(b: Binding) -> None:
    b.expect_dtype("x", FLOATS)
    b.expect_same_dtype("out", "x")
    _reduced(b)


def max_(b: Binding) -> None:
    reduction(b)
    if shape(b, "x")[-1] == 0:
        raise b.value_error(f"cannot take the maximum of an empty last axis (x has shape {shape(b, 'x')})")


def argmax(b: Binding) -> None:
    b.expect_dtype("x", FLOATS)
    b.expect_dtype("out", IDS)
    _reduced(b)
    if shape(b, "x")[-1] == 0:
        raise b.value_error(f"cannot take the argmax of an empty last axis (x has shape {shape(b, 'x')})")


def mean_pool(b: Binding) -> None:
    b.expect_dtype("x", FLOATS)
    b.expect_same_dtype("out", "x")
    b.expect_same_dtype("mask", "x", also=(float32, int32, int64, uint8))
    b.expect_ndim("x", 2)
    x = shape(b, "x")
    b.expect_shape("mask", x[:-1], why="x [..., S, D] takes mask [..., S]")
    b.expect_shape("out", x[:-2] + x[-1:], why="x [..., S, D] pools to out [..., D]")


def embedding(b: Binding) -> None:
    b.expect_dtype("ids", IDS)
    b.expect_ndim("ids", 0, 7)
    b.expect_ndim("table", 2, 2)
    b.expect_same_dtype("out", "table")
    b.expect_shape("out", shape(b, "ids") + shape(b, "table")[-1:], why="ids.shape + (D,)")


def attention(b: Binding) -> None:
    for name in ("q", "k", "v", "out"):
        b.expect_dtype(name, (float32,))
    nd = b.expect_ndim("q", 2)
    q, k, v = shape(b, "q"), shape(b, "k"), shape(b, "v")
    lead, sq, d = q[:-2], q[-2], q[-1]
    b.expect_ndim("k", nd, nd)
    if k[:-2] != lead or k[-1] != d:
        raise b.type_error(f"argument 'k' has shape {k}, expected {lead + ('Skv', d)} to match 'q' {q}")
    b.expect_ndim("v", nd, nd)
    skv = k[-2]
    if v[:-2] != lead or v[-2] != skv:
        raise b.type_error(f"argument 'v' has shape {v}, expected {lead + (skv, 'Dv')} to match 'k' {k}")
    b.expect_shape("out", q[:-1] + v[-1:], why=lambda: f"q {q} attends over v {v}")
    if b.get("mask") is not None:
        b.expect_dtype("mask", FLOATS)
        b.expect_broadcast("mask", lead + (sq, skv), target_desc="[..., Sq, Skv]")
    kv_len = b["kv_len"]
    length = skv if kv_len is None else kv_len
    if kv_len is not None and kv_len > skv:
        raise b.value_error(f"kv_len {kv_len} exceeds the {skv} key positions of 'k' {k}")
    if sq > 0 and length < 1:
        raise b.value_error(f"attention needs at least one key position, k has shape {k}")
    if b["causal"] and length < sq:
        raise b.value_error(f"causal attention needs at least Sq={sq} key positions, got {length}")
    if b["scale"] is None:
        b.scalars["scale"] = 1.0 / math.sqrt(d) if d > 0 else 1.0


def same_shape_any_dtype(b: Binding) -> None:
    b.expect_shape("out", shape(b, "x"), why="the shape of 'x'")


def copy(b: Binding) -> None:
    b.expect_same_dtype("out", "x")
    same_shape_any_dtype(b)


def transpose(b: Binding) -> None:
    b.expect_ndim("x", 2)
    b.expect_same_dtype("out", "x")
    x = shape(b, "x")
    b.expect_shape("out", x[:-2] + (x[-1], x[-2]), why="x with its last two dims swapped")


_INT_RANGE = {int32: (-(2**31), 2**31 - 1), int64: (-(2**63), 2**63 - 1), uint8: (0, 255)}


def fill(b: Binding) -> None:
    dt = b["out"].dtype
    value = b["value"]
    if dt in _INT_RANGE:
        if isinstance(value, float):
            if not value.is_integer():
                raise b.value_error(f"scalar 'value' must be an integer to fill a {dt} tensor, got {value!r}")
            value = b.scalars["value"] = int(value)
        lo, hi = _INT_RANGE[dt]
        if not lo <= value <= hi:
            raise b.value_error(f"scalar 'value' {value} is outside the range of {dt}")
