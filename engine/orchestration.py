"""What every orchestration context shares: this run's dims, its scratch arena, views of tensors.

engine.Run (one device: it submits kernels) and engine.distributed's
Orchestrator (several chip workers: it submits sub-programs) are both an
OrchestrationContext; they differ in what they submit and where it runs.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from typing import Any, Sequence

from engine.dtypes import DType, as_dtype
from engine.tensor import Allocation, DeviceTensor, contiguous_strides

__all__ = ["OrchestrationContext", "ScratchArena", "SCRATCH_ALIGN"]

SCRATCH_ALIGN = 64


class ScratchArena:
    """A run's scratch: tensors carved at increasing, aligned offsets of one allocation.

    base: where the arena starts in the allocation; capacity: its bytes, or
    None during a planning pass, which measures what the orchestration carves
    (`used`) instead of enforcing a size.
    """

    __slots__ = ("alloc", "base", "capacity", "used", "label")

    def __init__(self, alloc: Allocation | None, base: int = 0, capacity: int | None = None,
                 label: str = "scratch arena") -> None:
        self.alloc = alloc
        self.base = base
        self.capacity = capacity
        self.used = 0
        self.label = label

    def carve(self, nbytes: int) -> tuple[Allocation, int]:
        """(allocation, byte offset) of `nbytes` more bytes; ValueError when the arena is exhausted."""
        offset = -(-self.used // SCRATCH_ALIGN) * SCRATCH_ALIGN
        self.used = offset + nbytes
        alloc = self.alloc
        if self.capacity is not None and (alloc is None or self.used > self.capacity):
            have = 0 if alloc is None else self.capacity
            raise ValueError(f"{self.label} exhausted: this run needs at least {self.used} bytes, the slot has "
                             f"{have} (prepare() sizes it from a planning pass at the bounds; pass scratch_bytes= "
                             "for orchestration that needs more)")
        assert alloc is not None  # a planning pass carves from a stand-in
        return alloc, self.base + offset


class OrchestrationContext(ABC):
    """One run's orchestration: its symbols' values (`dims`), scratch tensors, and views.

    Tasks may start as soon as they are submitted, possibly while the
    orchestration function is still running.
    """

    def __init__(self, dims: dict[str, int], arena: ScratchArena) -> None:
        # A subclass made once per run may set these two itself instead of calling this.
        self.dims: dict[str, int] = dims
        self._arena = arena

    @property
    @abstractmethod
    def workers(self) -> int:
        """How many ways to divide work (split()'s default)."""

    @property
    @abstractmethod
    def planning(self) -> bool:
        """True during prepare()'s planning pass at the bounds (nothing runs)."""

    @property
    def scratch_used(self) -> int:
        """Scratch bytes carved so far (what a planning pass measures)."""
        return self._arena.used

    def scratch(self, shape: Sequence[int | str], dtype: Any = "float32") -> DeviceTensor:
        """A tensor from this run's scratch arena (symbols resolve to this run's dims)."""
        dt: DType = as_dtype(dtype)
        dims = []
        for shape_dim in shape:
            d: Any = shape_dim
            if isinstance(d, str):
                if d not in self.dims:
                    raise ValueError(f"scratch: unknown symbol '{d}' (bound symbols: {sorted(self.dims)})")
                d = self.dims[d]
            try:  # an int or an int-like (a numpy int, a captured program's Scalar stand-in)
                d = operator.index(d) if not isinstance(d, bool) else None
            except TypeError:
                d = None
            if d is None:
                raise TypeError(f"scratch: dim {shape_dim!r} must be an int or a symbol name")
            if d <= 0:
                raise ValueError(f"scratch: dim {d} must be positive")
            dims.append(d)
        if not dims:
            raise ValueError("scratch: shape must have at least one dim")
        nbytes = dt.itemsize
        for d in dims:
            nbytes *= d
        alloc, offset = self._arena.carve(nbytes)
        return DeviceTensor(alloc, offset, tuple(dims), contiguous_strides(dims), dt)

    def split(self, t: DeviceTensor, parts: int | None = None, axis: int = 0) -> list[DeviceTensor]:
        """Views of `t` cut into `parts` near-equal pieces along `axis` (default: one per worker)."""
        parts = parts or self.workers
        n = t.shape[axis]
        parts = max(1, min(parts, n))
        out, start = [], 0
        for i in range(parts):
            size = n // parts + (1 if i < n % parts else 0)
            out.append(t[tuple([slice(None)] * axis + [slice(start, start + size)])])
            start += size
        return out
