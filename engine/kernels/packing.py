"""Weights laid out once for the kernels that stream them: the panel packing of matmul_packed."""

from __future__ import annotations

import numpy as np

from engine import _native
from engine.kernels._checks import PANEL

__all__ = ["PANEL", "pack_panels", "packed_max_rows", "packed_shape"]

# Rows per call up to which the AVX2 block (6 rows x one panel in 8-lane halves) is ahead of sgemm, whose
# per-call packing of the whole weight matrix is what few rows cannot amortise.
_HALVES_MAX_ROWS = 128


def packed_max_rows() -> int | None:
    """Rows per call up to which matmul_packed outruns sgemm (`matmul`) on this CPU; None: at any count.

    With AVX-512 its register block (8 rows x three 16-column panels of whole vectors) beats the
    sgemm of scipy-openblas32 at every row count measured, and its epilogue adds the bias and the
    GELU that would otherwise be tasks of their own (benchmarks/README.md); elsewhere it is the
    kernel for few rows (a batch-1 forward, a decode step).
    """
    return None if _native.packed_matmul_whole_vectors() else _HALVES_MAX_ROWS


def packed_shape(k: int, n: int) -> tuple[int, int, int]:
    """The shape of a K x N operand packed by pack_panels: (ceil(N / 16), K, 16)."""
    return (-(-n // PANEL), k, PANEL)


def pack_panels(b: np.ndarray) -> np.ndarray:
    """B [K, N] float32 as matmul_packed reads it: panels of 16 columns, each K rows of 16 contiguous floats.

    out[p, k, j] = B[k, 16 p + j], zero past N. Done once for a resident weight
    (at load or prepare time); the packed array is what goes to the device.
    """
    b = np.asarray(b)
    if b.ndim != 2:
        raise ValueError(f"pack_panels: expected a 2-d [K, N] matrix, got shape {b.shape}")
    if b.dtype != np.float32:
        raise TypeError(f"pack_panels: expected float32, got {b.dtype}")
    k, n = b.shape
    panels = -(-n // PANEL)
    padded = np.zeros((k, panels * PANEL), np.float32)
    padded[:, :n] = b
    return np.ascontiguousarray(padded.reshape(k, panels, PANEL).transpose(1, 0, 2))
