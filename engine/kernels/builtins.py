"""Signatures of the built-in kernels of the ``cpu`` device (native/kernels/).

Conventions: input tensors positional, the written tensor as ``out=``, scalars
(and the optional ``mask``) as keywords. Reductions and normalisations work
over the last axis; every kernel accepts strided views (negative strides too)
and leading batch dims. Dtypes: float32 everywhere; float16 and bfloat16
storage (float32 math) for matmul, the elementwise kernels, softmax, the norms,
the reductions and mean_pool; cast converts between all six dtypes; copy,
fill, transpose and embedding's table take any dtype; int32/int64 ids and
argmax indices. Elementwise kernels and the row kernels may write in place
(``out`` the same view as their input); nothing else may write into memory it
reads.
"""

from __future__ import annotations

from engine.kernels import _checks as c
from engine.kernels.signature import Kernel, Param

__all__ = [
    "matmul", "matmul_packed", "add", "sub", "mul", "div", "scale", "relu", "gelu", "silu", "tanh", "exp",
    "softmax", "layernorm", "rmsnorm", "l2_normalize", "sum", "mean", "max", "argmax", "mean_pool",
    "embedding", "attention", "cast", "transpose", "copy", "fill", "noop", "spin", "BUILTINS",
]  # fmt: skip

_ELEMENTWISE = ("x",)

matmul = Kernel(
    "matmul", ["a", "b"],
    scalars={"transpose_b": Param(bool, False), "alpha": Param(float, 1.0), "beta": Param(float, 0.0)},
    check=c.matmul,
    doc="out = alpha * a @ b + beta * out (b^T with transpose_b). a [..., M, K], b [..., K, N] or [K, N]; "
    "batch dims broadcast. out is read as well when beta != 0 and may not overlap a or b.",
)  # fmt: skip


matmul_packed = Kernel(
    "matmul_packed", ["a", "bp"], optional=["bias"],
    scalars={"alpha": Param(float, 1.0), "beta": Param(float, 0.0), "activation": Param(("none", "gelu"), "none")},
    check=c.matmul_packed,
    doc="out = act(alpha * a @ B + beta * out + bias), with B [K, N] panel-packed once by "
    "engine.kernels.pack_panels(B): "
    "bp [ceil(N / 16), K, 16]. For few rows (a batch-1 forward, a decode step), where it reads each weight once "
    "instead of packing it on every call. a [..., M, K] and out [..., M, N] float32 with unit column strides; "
    "bp[p0:p1] with out[..., 16 p0:16 p1] (and bias[16 p0:16 p1]) is a column slice. bias: a contiguous [N] "
    "vector; activation 'gelu' is the exact (erf) GELU, as K.gelu.",
)  # fmt: skip


def _binary(name: str, op: str) -> Kernel:
    return Kernel(
        name, ["a", "b"], inplace=("a", "b"), check=c.binary,
        doc=f"out = a {op} b; b broadcasts to a's shape (same shape, a vector over the last axis, one element, ...).",
    )  # fmt: skip


add = _binary("add", "+")
sub = _binary("sub", "-")
mul = _binary("mul", "*")
div = _binary("div", "/")


def _unary(name: str, doc: str, **scalars: Param) -> Kernel:
    return Kernel(name, ["x"], scalars=scalars, inplace=_ELEMENTWISE, check=c.unary, doc=doc)


scale = _unary("scale", "out = alpha * x.", alpha=Param(float))
relu = _unary("relu", "out = max(x, 0).")
gelu = _unary(
    "gelu",
    "GELU: exact 0.5 x (1 + erf(x / sqrt 2)) by default (as torch computes it), or the tanh approximation.",
    approximate=Param(("none", "tanh"), "none"),
)
silu = _unary("silu", "out = x * sigmoid(x).")
tanh = _unary("tanh", "out = tanh(x).")
exp = _unary("exp", "out = exp(x).")

softmax = Kernel(
    "softmax", ["x"], optional=["mask"], scalars={"scale": Param(float, 1.0)}, inplace=_ELEMENTWISE,
    check=c.softmax,
    doc="Softmax over the last axis of x * scale + mask (additive, broadcast to x). A row that is -inf "
    "throughout comes out as zeros.",
)  # fmt: skip
layernorm = Kernel(
    "layernorm", ["x", "gamma", "beta"], scalars={"eps": Param(float, 1e-5, gt=0.0)}, inplace=_ELEMENTWISE,
    check=c.layernorm, doc="(x - mean) / sqrt(var + eps) * gamma + beta over the last axis.",
)  # fmt: skip
rmsnorm = Kernel(
    "rmsnorm", ["x", "gamma"], scalars={"eps": Param(float, 1e-6, gt=0.0)}, inplace=_ELEMENTWISE,
    check=c.rmsnorm, doc="x / sqrt(mean(x^2) + eps) * gamma over the last axis.",
)  # fmt: skip
l2_normalize = Kernel(
    "l2_normalize", ["x"], scalars={"eps": Param(float, 1e-12, gt=0.0)}, inplace=_ELEMENTWISE,
    check=c.l2_normalize, doc="x / max(||x||_2, eps) over the last axis.",
)  # fmt: skip

sum = Kernel("sum", ["x"], check=c.reduction, doc="Sum over the last axis; out is x.shape[:-1] (or with a 1).")
mean = Kernel("mean", ["x"], check=c.reduction, doc="Mean over the last axis; out is x.shape[:-1] (or with a 1).")
max = Kernel("max", ["x"], check=c.max_, doc="Maximum over the last axis (NaN if any element is NaN).")
argmax = Kernel("argmax", ["x"], check=c.argmax, doc="Index of the first maximum over the last axis; int32 or int64 out.")
mean_pool = Kernel(
    "mean_pool", ["x", "mask"], check=c.mean_pool,
    doc="Masked mean over the sequence axis: x [..., S, D], mask [..., S] (weights, e.g. an attention mask), "
    "out [..., D] = sum(mask * x) / max(sum(mask), 1e-9).",
)  # fmt: skip

embedding = Kernel(
    "embedding", ["ids", "table"], check=c.embedding,
    doc="out[..., :] = table[ids[...], :] with int32/int64 ids; an id outside [0, V) fails the task.",
)  # fmt: skip
attention = Kernel(
    "attention", ["q", "k", "v"], optional=["mask"],
    scalars={
        "scale": Param(float, None, none_value=0.0),
        "causal": Param(bool, False),
        "kv_len": Param(int, None, ge=1, none_value=-1),
    },
    check=c.attention,
    doc="softmax(scale * q @ k^T + mask) @ v. q [..., Sq, D], k/v [..., Skv, D]; scale defaults to 1/sqrt(D); "
    "kv_len limits attention to the first positions of a KV cache; causal lets query i see keys "
    "j <= kv_len - Sq + i.",
)  # fmt: skip

cast = Kernel("cast", ["x"], inplace=_ELEMENTWISE, check=c.same_shape_any_dtype, doc="out = x converted to out's dtype.")
transpose = Kernel("transpose", ["x"], check=c.transpose, doc="out = x with its last two axes swapped.")
copy = Kernel("copy", ["x"], inplace=_ELEMENTWISE, check=c.copy, doc="out = x (same shape and dtype, any strides).")
fill = Kernel("fill", [], scalars={"value": Param("number", finite=False)}, check=c.fill, doc="out[...] = value.")
noop = Kernel("noop", [], out=None, doc="Does nothing (overhead measurements).")
spin = Kernel("spin", [], out=None, scalars={"ns": Param(int, ge=0)}, doc="Busy-waits for ns nanoseconds.")

BUILTINS: dict[str, Kernel] = {
    k.name: k
    for k in (
        matmul, matmul_packed, add, sub, mul, div, scale, relu, gelu, silu, tanh, exp, softmax, layernorm,
        rmsnorm, l2_normalize, sum, mean, max, argmax, mean_pool, embedding, attention, cast, transpose, copy, fill,
        noop, spin,
    )
}  # fmt: skip
"""Every built-in kernel by registry name."""
