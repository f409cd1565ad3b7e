"""Tandem: an asynchronous pipelined execution engine with a native worker pool."""

from engine import _blas  # noqa: F401  (must precede _native: loads OpenBLAS)
from engine import _native

__all__ = ["_native"]
