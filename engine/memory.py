"""The device-memory surface every runtime offers (single device or several workers)."""

from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np

from engine.dtypes import DType, as_dtype
from engine.hostarrays import as_numpy_view, is_host_array
from engine.tensor import DeviceBuffer, DeviceTensor

__all__ = ["DeviceMemoryHandle", "check_tensor_request"]


def check_tensor_request(shape: Any, dtype: Any, init: Any) -> tuple[tuple[int, ...], DType, np.ndarray | None, int]:
    """Validates alloc_tensor's arguments before anything is allocated.

    Returns (dims, dtype, contiguous host copy of init or None, nbytes).
    A bool or non-int dim, or an unknown dtype -> TypeError; an empty shape, a
    dim <= 0, or an init of the wrong shape or dtype -> ValueError.
    """
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"alloc_tensor: shape must be a tuple of ints, not {type(shape).__name__}")
    dims = tuple(shape)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"alloc_tensor: dim {d!r} must be an int")
    if not dims:
        raise ValueError("alloc_tensor: shape must have at least one dim")
    if any(d <= 0 for d in dims):
        raise ValueError(f"alloc_tensor: dims must be positive, got {dims}")
    dims = tuple(int(d) for d in dims)
    dt = as_dtype(dtype)
    host = None
    if init is not None:
        if not is_host_array(init):
            raise ValueError(f"alloc_tensor: init must be a numpy array or a CPU torch tensor, "
                             f"not {type(init).__name__}")
        if tuple(init.shape) != dims:
            raise ValueError(f"alloc_tensor: init has shape {tuple(init.shape)}, expected {dims}")
        try:
            init_dt = as_dtype(init.dtype)
        except TypeError:
            init_dt = None
        if init_dt != dt:
            raise ValueError(f"alloc_tensor: init has dtype {init.dtype}, expected {dt.name}")
        host = np.ascontiguousarray(as_numpy_view(init))
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    return dims, dt, host, nbytes


class DeviceMemoryHandle(abc.ABC):
    """Allocation, copies and counters of device memory."""

    @abc.abstractmethod
    def malloc(self, nbytes: int) -> DeviceBuffer: ...

    @abc.abstractmethod
    def free(self, buf: DeviceBuffer) -> None: ...

    @abc.abstractmethod
    def copy_to(self, dst: DeviceBuffer, src: Any) -> None:
        """Host -> device: copies the bytes of `src` (an array) to the start of `dst`."""

    @abc.abstractmethod
    def copy_from(self, dst: Any, src: DeviceBuffer) -> None:
        """Device -> host: fills the writable array `dst` from the start of `src`."""

    @abc.abstractmethod
    def alloc_tensor(self, shape: Sequence[int], dtype: Any, init: Any = None) -> DeviceTensor: ...

    @abc.abstractmethod
    def free_tensor(self, t: DeviceTensor) -> None: ...

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, int]: ...

    @abc.abstractmethod
    def _read_tensor(self, t: DeviceTensor) -> np.ndarray:
        """A host copy of a tensor view (used by DeviceTensor.to_numpy)."""
