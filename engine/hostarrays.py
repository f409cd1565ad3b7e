"""Host arguments: numpy arrays and CPU torch tensors, seen as numpy arrays.

torch is imported only when a torch tensor is actually passed, so
`import engine` never imports it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from engine.dtypes import DType, as_dtype

__all__ = ["is_host_array", "is_torch", "host_dtype", "as_numpy_view", "empty_like_kind"]


def is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_host_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_torch(x)


def host_dtype(x: Any) -> DType:
    return as_dtype(x.dtype)


def as_numpy_view(x: Any) -> np.ndarray:
    """A numpy array sharing memory with x (bfloat16 as uint16 bits)."""
    if isinstance(x, np.ndarray):
        return x
    if x.device.type != "cpu":
        raise TypeError(f"torch tensors must be on the CPU, not {x.device}")
    if x.requires_grad:
        x = x.detach()
    import torch

    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def empty_like_kind(kind_torch: bool, shape: tuple[int, ...], dtype: DType) -> tuple[Any, np.ndarray]:
    """A new host array of the given kind, and a numpy view of its memory."""
    if kind_torch:
        import torch

        t = torch.empty(shape, dtype=getattr(torch, dtype.name))
        return t, as_numpy_view(t)
    arr = np.empty(shape, dtype=dtype.numpy)  # bfloat16: uint16 bits
    return arr, arr
