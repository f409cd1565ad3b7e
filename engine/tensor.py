"""Device tensors: strided views over device allocations.

A `DeviceTensor` is what orchestration code handles (slot buffers, scratch,
resident weights) and what users hold as resident tensors. Views share their
allocation; the allocation records who owns it and whether it is still live.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import numpy as np

from engine import _native
from engine.dtypes import DType

__all__ = ["Allocation", "DeviceBuffer", "DeviceTensor", "check_owned_tensor", "contiguous_strides"]




def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


class Allocation:
    """One device allocation and its owner; `freed` flips exactly once.

    worker: the device it lives on, for runtimes with several (a chip
    worker of engine.distributed); 0 on a single device. owner is None for
    the stand-ins of a planning pass, which no data is behind.
    """

    __slots__ = ("owner", "buf", "freed", "kind", "worker", "__weakref__")

    def __init__(self, owner: object | None, buf: "_native.Buffer", kind: str, worker: int = 0) -> None:
        self.owner = owner
        self.buf = buf
        self.freed = False
        self.kind = kind  # "resident", "buffer", "slot", "scratch", "shared", "planning"
        self.worker = worker

    @property
    def id(self) -> int:
        return self.buf.id

    @property
    def addr(self) -> int:
        return self.buf.addr

    @property
    def size(self) -> int:
        return self.buf.size


def check_owned_tensor(t: Any, owner: object, what: str) -> None:
    """t is a live DeviceTensor of `owner`'s memory, or a stand-in of a planning pass."""
    if not isinstance(t, DeviceTensor):
        raise TypeError(f"{what}: expected a device tensor, not {type(t).__name__}")
    alloc = t._alloc
    if alloc.kind == "planning":
        return
    if alloc.owner is not owner:
        raise ValueError(f"{what}: the tensor belongs to another runtime")
    if alloc.freed:
        raise ValueError(f"{what}: the tensor was freed")


class DeviceBuffer:
    """Raw device memory from `malloc(nbytes)`."""

    __slots__ = ("_alloc",)

    def __init__(self, alloc: Allocation) -> None:
        self._alloc = alloc

    @property
    def nbytes(self) -> int:
        return self._alloc.size

    @property
    def freed(self) -> bool:
        return self._alloc.freed

    def __repr__(self) -> str:
        state = "freed" if self._alloc.freed else f"{self.nbytes} bytes"
        return f"<DeviceBuffer {state}>"


class DeviceTensor:
    """A strided view of device memory. Slicing gives views; nothing is copied."""

    __slots__ = ("_alloc", "_offset", "_shape", "_strides", "_dtype", "_arg", "_key", "__weakref__")

    def __init__(self, alloc: Allocation, offset: int, shape: tuple[int, ...], strides: tuple[int, ...],
                 dtype: DType) -> None:
        self._alloc = alloc
        self._offset = offset  # bytes from the allocation base
        self._shape = shape
        self._strides = strides  # elements
        self._dtype = dtype
        self._arg: _native.TensorArg | None = None
        self._key: tuple[Any, ...] | None = None  # _make_key()'s, once asked for

    # -- the TensorLike protocol ------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def strides(self) -> tuple[int, ...]:
        return self._strides

    def overlaps(self, other: Any) -> bool:
        """Whether the views may share an element (False for column slices of the same rows, as dependency
        tracking sees them)."""
        if not isinstance(other, DeviceTensor) or other._alloc is not self._alloc:
            return False
        return self._native_arg().may_overlap(other._native_arg())

    def same_view(self, other: Any) -> bool:
        return (isinstance(other, DeviceTensor) and other._alloc is self._alloc and other._offset == self._offset
                and other._shape == self._shape and other._strides == self._strides and other._dtype == self._dtype)

    # -- properties ---------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        n = 1
        for d in self._shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.size * self._dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        return all(s == c or d == 1 for d, s, c in zip(self._shape, self._strides, contiguous_strides(self._shape)))

    @property
    def freed(self) -> bool:
        return self._alloc.freed

    def _byte_range(self) -> tuple[int, int]:
        span = sum((d - 1) * s for d, s in zip(self._shape, self._strides))
        return self._offset, self._offset + (span + 1) * self._dtype.itemsize

    def _make_key(self) -> tuple[Any, ...]:
        """What identifies this view in a kept call's key (engine.run._call_key): its allocation by id (a kept
        call holds the allocation, so the id stays its own), offset, shape, strides and dtype. Made once."""
        self._key = (id(self._alloc), self._offset, self._shape, self._strides, self._dtype)
        return self._key

    def _native_arg(self) -> "_native.TensorArg":
        """The native argument for this view (built once: views are immutable)."""
        if self._arg is None:
            begin, end = self._byte_range()
            self._arg = _native.TensorArg(self._alloc.addr + self._offset, self._dtype.code, list(self._shape),
                                          list(self._strides), self._alloc.id, begin, end)
        return self._arg

    # -- views ----------------------------------------------------------------------
    def __getitem__(self, key: Any) -> "DeviceTensor":
        if type(key) is not tuple:
            key = (key,)
        shape, strides = self._shape, self._strides
        if len(key) > len(shape):
            raise IndexError(f"too many indices: {len(key)} for a {len(shape)}-d tensor")
        offset = self._offset
        item = self._dtype.itemsize
        new_shape: list[int] = []
        new_strides: list[int] = []
        # Orchestration slices views by the hundred per run: the common kinds (slices, ints) are
        # tested by exact type first.
        for axis, k in enumerate(key):
            dim, stride = shape[axis], strides[axis]
            kt = type(k)
            if kt is slice:
                start, stop, step = k.indices(dim)
                if step == 1:
                    n = stop - start
                elif step > 0:
                    n = (stop - start + step - 1) // step
                else:
                    raise ValueError("views take positive slice steps only")
                if n <= 0:
                    raise ValueError(f"empty slice on axis {axis}")
                offset += start * stride * item
                new_shape.append(n)
                new_strides.append(stride * step)
                continue
            if kt is not int:
                if kt is bool or not hasattr(kt, "__index__"):  # ints, numpy ints, int-likes
                    raise TypeError(f"views index with ints and slices, not {kt.__name__}")
                k = operator.index(k)
            if not -dim <= k < dim:
                raise IndexError(f"index {k} out of range for axis {axis} of size {dim}")
            offset += (k % dim) * stride * item
        n_key = len(key)
        if n_key < len(shape):
            new_shape.extend(shape[n_key:])
            new_strides.extend(strides[n_key:])
        if not new_shape:  # a single element: keep it a 1-element vector
            return DeviceTensor(self._alloc, offset, (1,), (1,), self._dtype)
        return DeviceTensor(self._alloc, offset, tuple(new_shape), tuple(new_strides), self._dtype)

    def reshape(self, *shape: int | Sequence[int]) -> "DeviceTensor":
        dims: Sequence[Any] = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
        dims = [operator.index(d) if not isinstance(d, (bool, int)) and hasattr(type(d), "__index__") else d
                for d in dims]
        if dims.count(-1) > 1:
            raise ValueError("reshape: at most one -1")
        if -1 in dims:
            known = 1
            for d in dims:
                if d != -1:
                    known *= d
            if known <= 0 or self.size % known:
                raise ValueError(f"reshape: cannot infer -1 for {self._shape} -> {tuple(dims)}")
            dims[dims.index(-1)] = self.size // known
        if any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in dims):
            raise ValueError(f"reshape: dims must be positive ints, got {tuple(dims)}")
        n = 1
        for d in dims:
            n *= d
        if n != self.size:
            raise ValueError(f"reshape: {self._shape} has {self.size} elements, {tuple(dims)} has {n}")
        if not self.is_contiguous:
            raise ValueError("reshape needs a contiguous tensor")
        return DeviceTensor(self._alloc, self._offset, tuple(dims), contiguous_strides(dims), self._dtype)

    # -- host copies ------------------------------------------------------------------
    def to_numpy(self) -> np.ndarray:
        """A host copy (waits for runs still writing these bytes)."""
        read = getattr(self._alloc.owner, "_read_tensor", None)
        if read is None:  # a planning stand-in, or a chip worker's own view
            raise ValueError("this tensor's memory cannot be read from here")
        result: np.ndarray = read(self)
        return result

    def to_torch(self) -> Any:
        import torch

        arr = self.to_numpy()
        if self._dtype.name == "bfloat16":
            return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(arr)

    def __repr__(self) -> str:
        state = ", freed" if self._alloc.freed else ""
        return f"<DeviceTensor shape={self._shape} dtype={self._dtype.name}{state}>"
