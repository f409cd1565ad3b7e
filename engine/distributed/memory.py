"""Host-side records of memory the orchestration names: worker-resident and shared."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np

from engine import _native
from engine.tensor import Allocation, DeviceTensor

if TYPE_CHECKING:
    from engine.memory import DeviceMemoryHandle

__all__ = ["WorkerAllocation", "SharedAllocation", "host_view"]

# Host-side ids of shared regions (and planning stand-ins): only identity matters on the host.
_ids = itertools.count(1)


class WorkerAllocation(Allocation):
    """Device memory of one chip worker. `buf` mirrors the worker's buffer (its id is the worker's)."""

    __slots__ = ("worker",)

    def __init__(self, owner: "DeviceMemoryHandle", buf: "_native.Buffer", kind: str, worker: int) -> None:
        super().__init__(owner, buf, kind)
        self.worker = worker


class SharedAllocation(Allocation):
    """A host shared-memory region (one per pipeline slot) that every worker maps.

    `base` is the host's byte view of it (None for the planning stand-in).
    """

    __slots__ = ("region", "base")

    def __init__(self, owner: "DeviceMemoryHandle", size: int, kind: str, region: int,
                 base: np.ndarray | None) -> None:
        super().__init__(owner, _native.Buffer(0, next(_ids), 0, size), kind)
        self.region = region
        self.base = base


def host_view(t: DeviceTensor, writable: bool) -> np.ndarray:
    """A numpy view of a shared tensor's bytes (no copy)."""
    alloc = t._alloc
    assert isinstance(alloc, SharedAllocation) and alloc.base is not None
    item = t.dtype.itemsize
    arr = np.ndarray(t.shape, t.dtype.numpy, buffer=alloc.base, offset=t._offset,
                     strides=tuple(s * item for s in t.strides))
    if not writable:
        arr.flags.writeable = False
    return arr
