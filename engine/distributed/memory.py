"""Host-side records of the shared memory the orchestration names (a slot's region).

Memory resident on a chip worker is a plain engine.tensor.Allocation whose
`worker` says which; its `buf` mirrors the worker's buffer (the id is the
worker's).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from engine import _native
from engine.dtypes import as_dtype
from engine.tensor import Allocation, DeviceTensor

__all__ = ["SharedAllocation", "host_view", "strided_view", "descriptor_view", "region_arguments", "none_freed"]

# Host-side ids of shared regions (and planning stand-ins): only identity matters on the host.
_ids = itertools.count(1)


class SharedAllocation(Allocation):
    """A host shared-memory region (one per pipeline slot) that every worker maps.

    `base` is the host's byte view of it (None for the planning stand-in).
    """

    __slots__ = ("region", "base")

    def __init__(self, owner: object | None, size: int, kind: str, region: int, base: np.ndarray | None) -> None:
        super().__init__(owner, _native.Buffer(0, next(_ids), 0, size), kind)
        self.region = region
        self.base = base


def host_view(t: DeviceTensor, writable: bool) -> np.ndarray:
    """A numpy view of a shared tensor's bytes (no copy)."""
    alloc = t._alloc
    assert isinstance(alloc, SharedAllocation) and alloc.base is not None
    return strided_view(alloc.base, t._offset, t.shape, t.strides, t.dtype.numpy, writable)


def descriptor_view(base: np.ndarray, desc: tuple[Any, ...], writable: bool = True) -> np.ndarray:
    """The view of `base` (a region's bytes) that a Call's region descriptor ("s", region, offset, shape,
    strides, dtype) names."""
    _, _, offset, shape, strides, dtype = desc
    return strided_view(base, offset, shape, strides, as_dtype(dtype).numpy, writable)


def region_arguments(args: tuple[tuple[Any, ...], ...], access: tuple[int, ...], bit: int) -> list[int]:
    """The indices of a Call's region arguments ("s" descriptors) whose access has `bit` (READ or WRITE):
    what a transport without shared memory ships to the worker (READ) or back (WRITE)."""
    return [k for k, (d, a) in enumerate(zip(args, access)) if a & bit and d[0] == "s"]


def strided_view(base: np.ndarray, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 dtype: np.dtype, writable: bool = True) -> np.ndarray:
    """A numpy view of `base` (bytes): `offset` in bytes, `strides` in elements."""
    item = dtype.itemsize
    arr = np.ndarray(shape, dtype, buffer=base, offset=offset, strides=tuple(s * item for s in strides))
    if not writable:
        arr.flags.writeable = False
    return arr


def none_freed(allocs: tuple[Allocation, ...]) -> bool:
    """Whether every allocation a kept submission (or recording) names is still alive."""
    for alloc in allocs:
        if alloc.freed:
            return False
    return True
