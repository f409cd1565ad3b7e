"""The device-memory handle every runtime is: one implementation, device operations behind hooks.

DeviceMemoryHandle validates every request before anything is allocated or
copied, checks that buffers and tensors are this handle's and still live,
keeps the table of what it owns, and waits for runs still using memory
before it is freed or read. A runtime supplies only the device operations:

    _check_ready()                          the handle may be used (open; not broken)
    _device_alloc(nbytes, kind, worker, init) -> Allocation
                                            allocate, staging `init` (contiguous host bytes) if given
    _device_free(alloc)                     give the memory back (nothing uses it any more)
    _device_write(alloc, offset, data)      host bytes -> device
    _device_read(alloc, offset, out)        device -> the contiguous host array `out` (its nbytes)
    _quiesce(alloc)                         wait until no unfinished work touches alloc
    _device_stats(worker)                   the device counters (worker None: summed over all)

Memory lives on one of the handle's devices: `worker` 0 on a single
device, a chip worker's index on engine.distributed's runtime (whose
memory calls take worker_id=).
"""

from __future__ import annotations

import abc
import threading
from typing import Any, Sequence

import numpy as np

from engine.dtypes import DType, as_dtype
from engine.hostarrays import as_numpy_view, is_host_array
from engine.tensor import Allocation, DeviceBuffer, DeviceTensor, check_owned_tensor, contiguous_strides
from engine.validation import check_positive_int

__all__ = ["DeviceMemoryHandle", "check_tensor_request", "host_array"]

# Allocations the user frees, and what frees them.
_FREED_WITH = {"resident": "free_tensor", "buffer": "free"}


def check_tensor_request(shape: Any, dtype: Any, init: Any) -> tuple[tuple[int, ...], DType, np.ndarray | None, int]:
    """Validates alloc_tensor's arguments before anything is allocated.

    Returns (dims, dtype, contiguous host copy of init or None, nbytes).
    A bool or non-int dim, or an unknown dtype -> TypeError; an empty shape, a
    dim <= 0, or an init of the wrong shape or dtype -> ValueError.
    """
    if not isinstance(shape, (tuple, list)):
        raise TypeError(f"alloc_tensor: shape must be a tuple of ints, not {type(shape).__name__}")
    dims = tuple(shape)
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            raise TypeError(f"alloc_tensor: dim {d!r} must be an int")
    if not dims:
        raise ValueError("alloc_tensor: shape must have at least one dim")
    if any(d <= 0 for d in dims):
        raise ValueError(f"alloc_tensor: dims must be positive, got {dims}")
    dims = tuple(int(d) for d in dims)
    dt = as_dtype(dtype)
    host = None
    if init is not None:
        if not is_host_array(init):
            raise ValueError(f"alloc_tensor: init must be a numpy array or a CPU torch tensor, "
                             f"not {type(init).__name__}")
        if tuple(init.shape) != dims:
            raise ValueError(f"alloc_tensor: init has shape {tuple(init.shape)}, expected {dims}")
        try:
            init_dt = as_dtype(init.dtype)
        except TypeError:
            init_dt = None
        if init_dt != dt:
            raise ValueError(f"alloc_tensor: init has dtype {init.dtype}, expected {dt.name}")
        host = np.ascontiguousarray(as_numpy_view(init))
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    return dims, dt, host, nbytes


def host_array(x: Any, what: str) -> np.ndarray:
    """A numpy view of a host array argument (a numpy array or a CPU torch tensor)."""
    if not is_host_array(x):
        raise TypeError(f"{what}: expected a numpy array or a CPU torch tensor, not {type(x).__name__}")
    return as_numpy_view(x)


class DeviceMemoryHandle(abc.ABC):
    """Allocation, copies and counters of device memory (see the module docstring for the hooks)."""

    def __init__(self) -> None:
        self._memory_lock = threading.RLock()
        self._owned: dict[int, Allocation] = {}  # every live allocation of this handle, by id()

    # -- the device, behind hooks ----------------------------------------------------------------
    @abc.abstractmethod
    def _check_ready(self) -> None:
        """Raises when the handle cannot be used (closed, broken)."""

    @abc.abstractmethod
    def _device_alloc(self, nbytes: int, kind: str, worker: int, init: np.ndarray | None) -> Allocation: ...

    @abc.abstractmethod
    def _device_free(self, alloc: Allocation) -> None: ...

    @abc.abstractmethod
    def _device_write(self, alloc: Allocation, offset: int, data: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _device_read(self, alloc: Allocation, offset: int, out: np.ndarray) -> None: ...

    @abc.abstractmethod
    def _quiesce(self, alloc: Allocation) -> None: ...

    @abc.abstractmethod
    def _device_stats(self, worker: int | None) -> dict[str, int]: ...

    # -- the surface ---------------------------------------------------------------------------------
    def malloc(self, nbytes: int) -> DeviceBuffer:
        """Raw device memory of `nbytes` bytes."""
        return self._malloc(nbytes, 0)

    def free(self, buf: DeviceBuffer) -> None:
        self._check_ready()
        if not isinstance(buf, DeviceBuffer):
            raise TypeError(f"free() takes a DeviceBuffer, not {type(buf).__name__}")
        self._free_alloc(buf._alloc, "buffer")

    def copy_to(self, dst: DeviceBuffer, src: Any) -> None:
        """Host -> device: copies the bytes of `src` (an array) to the start of `dst`."""
        self._check_ready()
        alloc = self._buffer_alloc(dst, "copy_to")
        host = np.ascontiguousarray(host_array(src, "copy_to source"))
        if host.nbytes > alloc.size:
            raise ValueError(f"copy_to: {host.nbytes} bytes do not fit a {alloc.size}-byte buffer")
        self._quiesce(alloc)
        self._device_write(alloc, 0, host.reshape(-1).view(np.uint8))

    def copy_from(self, dst: Any, src: DeviceBuffer) -> None:
        """Device -> host: fills the writable array `dst` from the start of `src`."""
        self._check_ready()
        alloc = self._buffer_alloc(src, "copy_from")
        host = host_array(dst, "copy_from destination")
        if not host.flags.c_contiguous or not host.flags.writeable:
            raise ValueError("copy_from: the destination must be a writable contiguous array")
        if host.nbytes > alloc.size:
            raise ValueError(f"copy_from: a {alloc.size}-byte buffer cannot fill {host.nbytes} bytes")
        self._quiesce(alloc)
        self._device_read(alloc, 0, host)

    def alloc_tensor(self, shape: Sequence[int], dtype: Any = "float32", init: Any = None) -> DeviceTensor:
        """A resident tensor: device memory that outlives runs (weights, KV caches)."""
        return self._alloc_tensor(shape, dtype, init, 0)

    def free_tensor(self, t: DeviceTensor) -> None:
        self._check_ready()
        if not isinstance(t, DeviceTensor):
            raise TypeError(f"free_tensor() takes a DeviceTensor, not {type(t).__name__}")
        self._free_alloc(t._alloc, "resident")

    def memory_stats(self) -> dict[str, int]:
        """The device's counters (bytes_in_use, live_allocations, peak_bytes, h2d_bytes, ...)."""
        self._check_ready()
        return self._device_stats(None)

    def _read_tensor(self, t: DeviceTensor) -> np.ndarray:
        """A host copy of a tensor view (DeviceTensor.to_numpy): waits for runs still writing its bytes."""
        self._check_ready()
        self._check_tensor(t, "to_numpy")
        alloc = t._alloc
        self._quiesce(alloc)
        begin, end = t._byte_range()
        raw = np.empty((end - begin) // t.dtype.itemsize, t.dtype.numpy)  # the view's whole span
        self._device_read(alloc, begin, raw)
        item = t.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(raw, shape=t.shape, strides=tuple(s * item for s in t.strides))
        return np.array(view, copy=True)

    # -- shared by the surface and its per-device variants -------------------------------------------
    def _malloc(self, nbytes: int, worker: int) -> DeviceBuffer:
        self._check_ready()
        check_positive_int("nbytes", nbytes)
        return DeviceBuffer(self._new_alloc(nbytes, "buffer", worker, None))

    def _alloc_tensor(self, shape: Sequence[int], dtype: Any, init: Any, worker: int) -> DeviceTensor:
        self._check_ready()
        dims, dt, host, nbytes = check_tensor_request(shape, dtype, init)
        alloc = self._new_alloc(nbytes, "resident", worker, host)
        return DeviceTensor(alloc, 0, dims, contiguous_strides(dims), dt)

    def _new_alloc(self, nbytes: int, kind: str, worker: int, init: np.ndarray | None) -> Allocation:
        alloc = self._device_alloc(nbytes, kind, worker, init)
        with self._memory_lock:
            self._owned[id(alloc)] = alloc
        return alloc

    def _check_tensor(self, t: Any, what: str) -> None:
        """t is a live tensor of this handle (or a stand-in of a planning pass)."""
        check_owned_tensor(t, self, what)

    def _buffer_alloc(self, buf: Any, what: str) -> Allocation:
        if not isinstance(buf, DeviceBuffer):
            raise TypeError(f"{what}: expected a DeviceBuffer, not {type(buf).__name__}")
        alloc = buf._alloc
        if alloc.owner is not self:
            raise ValueError(f"{what}: the buffer belongs to another runtime")
        if alloc.freed:
            raise ValueError(f"{what}: the buffer was freed")
        return alloc

    def _free_alloc(self, alloc: Allocation, kind: str) -> None:
        noun = "tensor" if kind == "resident" else "buffer"
        if alloc.owner is not self:
            raise ValueError(f"free: the {noun} belongs to another runtime")
        with self._memory_lock:
            if alloc.freed:
                raise ValueError(f"free: the {noun} was already freed")
            if alloc.kind != kind:
                right = _FREED_WITH.get(alloc.kind)
                if right is None:
                    raise ValueError(f"free: cannot free {alloc.kind} memory owned by the runtime")
                raise ValueError(f"free: {alloc.kind} memory is freed with {right}()")
            alloc.freed = True
        self._quiesce(alloc)  # runs in flight may still use it
        self._device_free(alloc)
        with self._memory_lock:
            self._owned.pop(id(alloc), None)
