"""What kernel signatures need to know about a tensor argument.

engine.kernels validates calls against this protocol only, so it works for the
engine's device tensors and views, and for stand-ins in tests.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.dtypes import DType


@runtime_checkable
class TensorLike(Protocol):
    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> DType: ...

    @property
    def strides(self) -> tuple[int, ...]:
        """Strides in elements, one per dim."""
        ...

    def overlaps(self, other: "TensorLike") -> bool:
        """True when both views touch at least one common byte of one allocation."""
        ...

    def same_view(self, other: "TensorLike") -> bool:
        """True when both are the same view: same allocation, offset, shape and strides."""
        ...
