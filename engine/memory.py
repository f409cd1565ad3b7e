"""The device-memory surface every runtime offers (single device or several workers)."""

from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np

from engine.tensor import DeviceBuffer, DeviceTensor

__all__ = ["DeviceMemoryHandle"]


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
