"""engine.Run: what an orchestration function receives for one run."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

from engine import _native
from engine.orchestration import OrchestrationContext, ScratchArena
from engine.tensor import DeviceTensor

if TYPE_CHECKING:
    from engine.port import TaskPort

__all__ = ["Run", "HostKernel", "host_kernel"]

READ, WRITE, READWRITE = 1, 2, 3


class HostKernel:
    """A Python function usable as a kernel: fn(*inputs, out, *scalar values).

    It runs on a pool worker with the GIL held, over numpy views of device
    memory (read-only for inputs). Prefer built-in kernels on hot paths.
    Define host kernels once (at module level): each HostKernel object is
    registered with the runtime the first time a run submits it.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"host_kernel needs a callable, not {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", "host_kernel")

    def bind(self, inputs: tuple, out: Any, scalars: dict[str, Any]) -> "_HostCall":
        for i, t in enumerate(inputs):
            if not isinstance(t, DeviceTensor):
                raise TypeError(f"host kernel '{self.name}': input {i} must be a device tensor, not {type(t).__name__}")
        if out is not None and not isinstance(out, DeviceTensor):
            raise TypeError(f"host kernel '{self.name}': out must be a device tensor, not {type(out).__name__}")
        for k, v in scalars.items():
            if not isinstance(v, (int, float)):
                raise ValueError(f"host kernel '{self.name}': scalar '{k}' must be a number, not {type(v).__name__}")
        tensors = list(inputs) + ([out] if out is not None else [])
        access = [READ] * len(inputs) + ([WRITE] if out is not None else [])
        if out is not None and any(out.same_view(t) for t in inputs):
            access = [READWRITE if t.same_view(out) else a for t, a in zip(tensors, access)]
        return _HostCall(self, tensors, access, [int(v) if isinstance(v, bool) else v for v in scalars.values()])

    def __repr__(self) -> str:
        return f"<HostKernel {self.name}>"


class _HostCall:
    # It holds its kernel, as engine.kernels' Call does: a kept call keyed by id(kernel)
    # (engine.run._call_key) keeps that id its kernel's.
    __slots__ = ("kernel", "tensors", "access", "scalars")

    def __init__(self, kernel: HostKernel, tensors: list, access: list[int], scalars: list) -> None:
        self.kernel, self.tensors, self.access, self.scalars = kernel, tensors, access, scalars


def host_kernel(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator: makes a Python function usable as a kernel in run.submit()."""
    if fn is None:
        return lambda f: HostKernel(f, name)
    return HostKernel(fn, name)


# Validated calls a runtime keeps (see _call_key): a few thousand covers the distinct calls of many runs of a
# model at several shapes; a program whose calls vary more (scalar values that never repeat) only churns them.
_CALLS_KEPT = 4096
_SCALAR_TYPES = (int, float, bool, str, type(None))


def _call_key(kernel: Any, inputs: tuple, out: Any, scalars: dict[str, Any]) -> tuple | int | None:
    """What makes a kernel call over DeviceTensors validate the same, or None when it cannot be kept.

    Steady-state orchestration repeats its calls run after run: the same
    views of the same slot buffers, scratch and resident tensors, the same
    scalar values. A DeviceTensor is an immutable view, so two calls over
    views equal in value (allocation, offset, shape, strides, dtype) with
    the same scalar values validate to the same Call, and the runtime hands
    the kept one out again: a program that slices new view objects every run
    hits as well as one that keeps its views. The kept Call holds its kernel
    and tensors, so the ids in the key (the kernel's, the allocations') stay
    theirs while it is kept. Whether each tensor is still alive and this
    runtime's is checked on every call regardless.
    """
    if not inputs and out is None and not scalars:  # noop-like calls: the kernel alone (an int, unlike other keys)
        return id(kernel)
    key: list[Any] = [id(kernel)]
    for t in inputs:
        if type(t) is not DeviceTensor:
            return None
        key.append(t._key if t._key is not None else t._make_key())
    if out is not None:
        if type(out) is not DeviceTensor:
            return None
        key.append("out")
        key.append(out._key if out._key is not None else out._make_key())
    for k, v in scalars.items():
        vt = type(v)
        if vt is DeviceTensor:  # an optional tensor given by keyword: by value, like the others
            key.append((k, vt, v._key if v._key is not None else v._make_key()))
        elif vt in _SCALAR_TYPES:  # by type too: 1, 1.0 and True compare equal but validate differently
            if vt is float:
                if v != v:  # NaN never equals itself: never kept (the kernel's check rejects it)
                    return None
                if v == 0.0:  # 0.0 and -0.0 compare equal but are different scalars: the sign is in the key
                    key.append((k, vt, v, math.copysign(1.0, v)))
                    continue
            key.append((k, vt, v))
        else:
            return None
    return tuple(key)


def _check_tensors(port: "TaskPort", tensors: Sequence[Any], kernel: Any) -> None:
    """Each of a call's tensors is a live DeviceTensor of the port's owner (the checker names what is not)."""
    owner = port.owner
    for t in tensors:
        alloc = getattr(t, "_alloc", None)  # the common case inline; the checker says what is wrong
        if alloc is None or alloc.owner is not owner or alloc.freed or type(t) is not DeviceTensor:
            port.check_tensor(t, f"kernel '{kernel.name}' argument")


def _keep(calls: dict[tuple | int, Any], key: tuple | int, entry: Any) -> None:
    if len(calls) >= _CALLS_KEPT and key not in calls:
        calls.clear()
    calls[key] = entry


class Run(OrchestrationContext):
    """One run's orchestration context: submit tasks, carve scratch, call host callbacks.

    Tasks start as soon as their inputs are ready, possibly while this
    function is still submitting. A Run reaches its runtime only through a
    TaskPort (engine.port): the engine it submits into, kernels, kept calls.
    """

    def __init__(self, port: "TaskPort", native: "_native.Run | None", dims: dict[str, int],
                 arena: ScratchArena) -> None:
        # OrchestrationContext's two fields set here: a Run is made per dispatch, and the call costs.
        self.dims = dims
        self._arena = arena
        self._port = port
        self._native = native  # None while planning at prepare()

    @property
    def id(self) -> int:
        return self._native.id if self._native is not None else 0

    @property
    def workers(self) -> int:
        """Pool workers: how many ways to tile work."""
        return self._port.workers

    @property
    def planning(self) -> bool:
        """True during prepare()'s planning pass (no device work happens)."""
        return self._native is None

    def submit(self, kernel: Any, *inputs: DeviceTensor, out: DeviceTensor | None = None, **scalars: Any) -> None:
        """Enters one kernel call into the task graph (validated first)."""
        port = self._port
        calls = port.calls
        key = _call_key(kernel, inputs, out, scalars)
        kept = calls.get(key) if key is not None else None
        if kept is not None:
            call, native_args, allocs = kept
            # Validated when kept: its tensors are this runtime's, and equal keys mean the same allocations
            # (their ids are in the key, and the kept call holds them). Only a free since then is news.
            for alloc in allocs:
                if alloc.freed:
                    _check_tensors(port, call.tensors, kernel)
        else:
            try:
                bind = kernel.bind
            except AttributeError:
                raise TypeError(f"run.submit needs a kernel (engine.kernels.* or a host_kernel), not {kernel!r}") from None
            call = bind(inputs, out, scalars)
            native_args = None
            _check_tensors(port, call.tensors, kernel)
            allocs = tuple({id(t._alloc): t._alloc for t in call.tensors}.values())
        native = self._native
        if native is None:
            if kept is None and key is not None:
                _keep(calls, key, (call, None, allocs))
            return
        engine = port.engine
        assert engine is not None  # a run in flight keeps its runtime open
        if native_args is None:
            # The native call, checked and converted once per kept call: its tensors are immutable
            # views, and a freed one is refused by the check above before this is used again.
            native_args = engine.prepare_call(port.native_kernel(kernel), [t._native_arg() for t in call.tensors],
                                              call.access, call.scalars)
            if key is not None:
                _keep(calls, key, (call, native_args, allocs))
        engine.submit_prepared(native, native_args)

    def host(self, name: str, *tensors: DeviceTensor, reads: Sequence[DeviceTensor] | None = None,
             writes: Sequence[DeviceTensor] | None = None) -> None:
        """Runs the host callback bound at prepare() as a task: fn(*arrays).

        Like any task it runs on a pool worker, or on a thread that is waiting
        for a run meanwhile (waiters help), never inside the orchestration.
        reads / writes say which of `tensors` it reads and writes (by identity);
        with neither given every tensor is read and written.
        """
        port = self._port
        native_kernel = port.callback_kernel(name, len(tensors))
        access = []
        for i, t in enumerate(tensors):
            port.check_tensor(t, f"callback '{name}' argument {i}")
            if reads is None and writes is None:
                access.append(READWRITE)
            else:
                r = any(t is x for x in (reads or ()))
                w = any(t is x for x in (writes or ()))
                if not (r or w):
                    raise ValueError(f"callback '{name}': tensor {i} is in neither reads nor writes")
                access.append((READ if r else 0) | (WRITE if w else 0))
        for group, label in ((reads, "reads"), (writes, "writes")):
            for x in group or ():
                if not any(x is t for t in tensors):
                    raise ValueError(f"callback '{name}': a tensor in {label} is not among its arguments")
        if self._native is None:
            return
        engine = port.engine
        assert engine is not None  # a run in flight keeps its runtime open
        engine.submit(self._native, native_kernel, [t._native_arg() for t in tensors], access, [])
