"""Running a built-in kernel directly on numpy arrays, on the calling thread.

For tests, benchmarks and debugging: no runtime, no device memory. The call
goes through the kernel's signature (``bind``) exactly as ``run.submit`` does,
then through ``engine._native.call_kernel``, which releases the GIL while the
kernel runs. bfloat16 arrays are uint16 bit patterns: wrap them as
``HostArray(bits, engine.dtypes.bfloat16)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine import _native
from engine.dtypes import DType, as_dtype
from engine.kernels.signature import Call, Kernel

__all__ = ["HostArray", "call", "native_args"]


class HostArray:
    """A numpy array (any strides) as a TensorLike."""

    __slots__ = ("array", "_dtype")

    def __init__(self, array: np.ndarray, dtype: DType | None = None) -> None:
        self.array = array
        self._dtype = dtype if dtype is not None else as_dtype(array.dtype)
        if array.dtype != self._dtype.numpy:
            raise TypeError(f"{self._dtype} is stored as {self._dtype.numpy}, not {array.dtype}")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def strides(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def overlaps(self, other: Any) -> bool:
        return isinstance(other, HostArray) and bool(np.shares_memory(self.array, other.array))

    def same_view(self, other: Any) -> bool:
        if not isinstance(other, HostArray):
            return False
        a, b = self.array, other.array
        return (
            a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.shape == b.shape
            and a.strides == b.strides
            and self.dtype == other.dtype
        )

    def __repr__(self) -> str:
        return f"HostArray({self.shape}, {self.dtype})"


def _wrap(x: Any) -> Any:
    return HostArray(x) if isinstance(x, np.ndarray) else x


def native_args(call: Call) -> list[tuple[np.ndarray, int, int]]:
    """The (buffer, dtype code, access) list call_kernel takes, for a call over HostArrays."""
    args = []
    for name, t, a in zip(call.names, call.tensors, call.access):
        if not isinstance(t, HostArray):
            raise TypeError(f"{call.kernel.name}: argument '{name}' is a {type(t).__name__}, not host memory")
        args.append((t.array, t.dtype.code, a))
    return args


def call(kernel: Kernel, *inputs: Any, out: Any = None, **scalars: Any) -> Call:
    """Validate like run.submit, then run the built-in kernel on this thread.

    numpy arrays are wrapped as HostArray; a kernel failure raises RuntimeError
    with the kernel's message.
    """
    bound = kernel.bind(tuple(_wrap(x) for x in inputs), _wrap(out), {k: _wrap(v) for k, v in scalars.items()})
    _native.call_kernel(kernel.name, native_args(bound), bound.scalars)
    return bound
