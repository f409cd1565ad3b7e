"""Pipeline slots of a distributed runtime: one shared-memory region each.

A slot's region holds a buffer for every tensor parameter (sized from the
bounds) followed by the slot's shared scratch (orch.scratch()). The run that
leases the slot stages its host inputs there, the workers read and write
those bytes in place, and its outputs are copied back from there. The region
is created once at prepare and reused by every run on the slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from engine.distributed.memory import SharedAllocation
from engine.distributed.program import DistributedProgram
from engine.dtypes import DType
from engine.specs import TensorSpec
from engine.tensor import DeviceTensor, contiguous_strides

__all__ = ["Layout", "SharedSlot", "ALIGN"]

ALIGN = 64


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    """Where each host tensor parameter and the scratch live in a slot's region."""

    offsets: dict[str, int]
    scratch_offset: int
    scratch_size: int

    @property
    def nbytes(self) -> int:
        return max(ALIGN, self.scratch_offset + self.scratch_size)

    @staticmethod
    def of(prog: DistributedProgram, bounds: dict[str, int], scratch_bytes: int) -> "Layout":
        offsets: dict[str, int] = {}
        end = 0
        for p in prog.params:
            if not isinstance(p.spec, TensorSpec):  # scalars; PerWorker tensors are resident
                continue
            n = p.spec.dtype.itemsize
            for d in p.spec.shape:
                n *= d if isinstance(d, int) else bounds[d]
            offsets[p.name] = end
            end = _align(end + n)
        return Layout(offsets, end, scratch_bytes)


@dataclass(eq=False)
class SharedSlot:
    """One slot: its region (as a SharedAllocation) and cached views of its parameter buffers."""

    index: int
    alloc: SharedAllocation
    layout: Layout
    _tensors: dict[tuple[str, tuple[int, ...]], DeviceTensor] = field(default_factory=dict)
    _arrays: dict[tuple[str, tuple[int, ...]], np.ndarray] = field(default_factory=dict)

    def tensor(self, name: str, shape: tuple[int, ...], dtype: DType) -> DeviceTensor:
        """The parameter's buffer as a tensor of this run's shape (cached: shapes repeat)."""
        key = (name, shape)
        t = self._tensors.get(key)
        if t is None:
            if len(self._tensors) > 64:
                self._tensors.clear()
            t = self._tensors[key] = DeviceTensor(self.alloc, self.layout.offsets[name], shape,
                                                  contiguous_strides(shape), dtype)
        return t

    def array(self, name: str, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
        """The parameter's buffer as a contiguous numpy array of this run's shape (cached)."""
        key = (name, shape)
        a = self._arrays.get(key)
        if a is None:
            if len(self._arrays) > 64:
                self._arrays.clear()
            assert self.alloc.base is not None
            a = self._arrays[key] = np.ndarray(shape, dtype.numpy, buffer=self.alloc.base,
                                               offset=self.layout.offsets[name])
        return a

    def drop_views(self) -> None:
        """Lets go of every numpy view of the region (the region cannot be unmapped while one lives)."""
        self._arrays.clear()
        self._tensors.clear()
        self.alloc.base = None
        self.alloc.freed = True

    def __repr__(self) -> str:
        return f"<SharedSlot {self.index} {self.layout.nbytes} bytes>"
