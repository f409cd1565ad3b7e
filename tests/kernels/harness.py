"""Drives built-in kernels on host memory: Kernel.bind() validates the call,
engine._native.call_kernel runs the C++ kernel (engine.kernels.host.call),
numpy/torch give references.

bfloat16 data is held as uint16 bit patterns (engine.dtypes' host storage).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine.dtypes import DType, bfloat16, float16, float32
from engine.kernels import Call, Kernel, host
from engine.kernels.host import HostArray

FLOAT_DTYPES = [float32, float16, bfloat16]

# Unit roundoff of each storage type: one rounding of a result costs at most this, relatively.
EPS = {float32: 2.0**-24, float16: 2.0**-11, bfloat16: 2.0**-8}


class HostTensor(HostArray):
    """engine.kernels.host.HostArray plus its values as float64, for references."""

    __slots__ = ()

    def f64(self) -> np.ndarray:
        return to_f64(self.array, self.dtype)


def wrap(x: Any) -> Any:
    return HostTensor(x) if isinstance(x, np.ndarray) else x


def run(kernel: Kernel, *inputs: Any, out: Any = None, **kw: Any) -> Call:
    """Binds the call through the kernel's signature, then runs the native kernel on this thread."""
    return host.call(kernel, *(wrap(x) for x in inputs), out=wrap(out), **{k: wrap(v) for k, v in kw.items()})


# -- dtype conversion ---------------------------------------------------------------------------------
def to_storage(x: np.ndarray, dt: DType) -> np.ndarray:
    """float values rounded (to nearest even) into dt's host storage."""
    if dt == bfloat16:
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16)
        return t.view(torch.int16).numpy().view(np.uint16)
    with np.errstate(over="ignore"):  # values beyond float16 become inf, as a store does
        return np.asarray(x).astype(dt.numpy)


def to_f64(a: np.ndarray, dt: DType) -> np.ndarray:
    """Storage values as float64 (exact)."""
    if dt == bfloat16:
        return (np.asarray(a).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(a).astype(np.float64)


def tensor(values: np.ndarray, dt: DType, layout: str = "contiguous") -> HostTensor:
    """A tensor of dtype dt holding `values` (rounded), laid out as `layout`."""
    return HostTensor(as_layout(to_storage(values, dt), layout), dt)


def empty(shape: tuple[int, ...], dt: DType, layout: str = "contiguous", fill: float = np.nan) -> HostTensor:
    """An out tensor pre-filled with `fill` (NaN by default, so unwritten elements show)."""
    return tensor(np.full(shape, fill, np.float32), dt, layout) if dt.is_float else HostTensor(
        as_layout(np.zeros(shape, dt.numpy), layout), dt
    )


# -- layouts --------------------------------------------------------------------------------------------
LAYOUTS = ["contiguous", "strided", "transposed", "reversed"]


def as_layout(x: np.ndarray, layout: str) -> np.ndarray:
    """A view holding x's values with a given memory layout.

    strided: every other element of the last axis, rows padded;
    transposed: the last two axes stored swapped (column-major matrices);
    reversed: negative strides on the last axis.
    """
    if layout == "contiguous":
        return np.array(x, order="C", copy=True)  # ascontiguousarray would make 0-d arrays 1-d
    if layout == "strided":
        buf = np.zeros(x.shape[:-1] + (2 * x.shape[-1] + 3,), x.dtype) if x.ndim else np.zeros(3, x.dtype)
        v = buf[..., 1 : 1 + 2 * x.shape[-1] : 2] if x.ndim else buf[1:2].reshape(())
        v[...] = x
        return v
    if layout == "transposed":
        if x.ndim < 2:
            return as_layout(x, "strided")
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -1, -2)), -1, -2)
    if layout == "reversed":
        if x.ndim == 0:
            return x.copy()
        return np.ascontiguousarray(x[..., ::-1])[..., ::-1]
    raise ValueError(layout)


def rounded(expected: np.ndarray, dt: DType) -> np.ndarray:
    """A float64 reference rounded to dt's storage (so overflow to inf matches), as float64."""
    return to_f64(to_storage(np.asarray(expected, np.float64).astype(np.float32), dt), dt)


def assert_close(actual: HostTensor, expected: np.ndarray, *, rtol: float, atol: float) -> None:
    """actual within rtol/atol of the float64 reference rounded to actual's storage type."""
    np.testing.assert_allclose(actual.f64(), rounded(expected, actual.dtype), rtol=rtol, atol=atol)
