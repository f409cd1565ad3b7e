"""engine.kernels: the kernels a program submits, each with its signature.

``run.submit(K.matmul, a, b, out=c, beta=1.0)`` binds the call through
``K.matmul.bind(...)``, which validates it before anything reaches the device.
Built-in kernels live in native/kernels/; user kernels declare a
:class:`Kernel` with their own signature.
"""

from engine.kernels.builtins import (
    BUILTINS,
    add,
    argmax,
    attention,
    cast,
    copy,
    div,
    embedding,
    exp,
    fill,
    gelu,
    l2_normalize,
    layernorm,
    matmul,
    matmul_packed,
    max,
    mean,
    mean_pool,
    mul,
    noop,
    relu,
    rmsnorm,
    scale,
    silu,
    softmax,
    spin,
    sub,
    sum,
    tanh,
    transpose,
)
from engine.kernels import host
from engine.kernels.packing import pack_panels, packed_max_rows, packed_shape
from engine.kernels.signature import READ, READWRITE, REQUIRED, WRITE, Binding, Call, Kernel, Param

__all__ = [
    "Kernel", "Param", "Binding", "Call", "READ", "WRITE", "READWRITE", "REQUIRED", "BUILTINS", "host",
    "matmul", "matmul_packed", "pack_panels", "packed_max_rows", "packed_shape", "add", "sub", "mul", "div", "scale", "relu", "gelu", "silu", "tanh", "exp",
    "softmax", "layernorm", "rmsnorm", "l2_normalize", "sum", "mean", "max", "argmax", "mean_pool",
    "embedding", "attention", "cast", "transpose", "copy", "fill", "noop", "spin",
]  # fmt: skip
