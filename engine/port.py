"""TaskPort: what an orchestration (engine.Run) reaches of the runtime it submits to.

A Run does not hold its runtime. It holds this narrow port: the native
engine it submits into, the kernels resolved for that engine, the kernel
calls validated once and kept (see engine.run), the check that a tensor is
a live one of the memory's owner, and the host callbacks bound at prepare.
The local Runtime makes one; so does a chip worker of engine.distributed
(its own device and engine); a planning pass uses one without an engine.
"""

from __future__ import annotations

import threading
from typing import Any, Mapping

from engine import _native
from engine.run import HostKernel
from engine.tensor import check_owned_tensor

__all__ = ["TaskPort"]


class TaskPort:
    """The port of one native engine (or of none, for a planning pass).

    owner: whose allocations a run's tensors must be (None: only planning
    stand-ins are accepted). callbacks: name -> (tensor count or None, the
    registered native kernel); None when the programs run here have no host
    callbacks (a chip worker's: they run through the distributed
    orchestration), no_callbacks then says why.
    """

    __slots__ = ("owner", "engine", "workers", "calls", "_kernels", "_callbacks", "_program", "_no_callbacks",
                 "_lock")

    def __init__(self, owner: object | None, engine: Any, workers: int, *,
                 program: str = "", callbacks: Mapping[str, tuple[int | None, "_native.Kernel"]] | None = None,
                 no_callbacks: str = "") -> None:
        self.owner = owner
        self.engine = engine
        self.workers = workers
        # Validated kernel calls, reused by run.submit (engine.run._call_key): key -> (call, native call or
        # None, the distinct allocations of its tensors).
        self.calls: dict[tuple[Any, ...] | int, Any] = {}
        self._kernels: dict[int, tuple[_native.Kernel, Any]] = {}  # id(kernel object) -> (native kernel, object)
        self._callbacks = callbacks
        self._program = program
        self._no_callbacks = no_callbacks
        self._lock = threading.Lock()

    def check_tensor(self, t: Any, what: str) -> None:
        """t is a live tensor of the owner's memory, or a stand-in of a planning pass."""
        check_owned_tensor(t, self.owner, what)

    def native_kernel(self, kernel: Any) -> "_native.Kernel":
        """The engine's kernel for a kernel object: a built-in by name, or a host kernel registered once."""
        entry = self._kernels.get(id(kernel))
        if entry is not None:
            return entry[0]
        engine = self.engine
        assert engine is not None  # a planning pass resolves no kernels
        with self._lock:  # two orchestrations may meet a new host kernel at once
            entry = self._kernels.get(id(kernel))
            if entry is None:
                if isinstance(kernel, HostKernel):
                    nk = engine.register_host_kernel(f"host:{kernel.name}:{id(kernel):x}", kernel.fn)
                else:
                    nk = engine.kernel(kernel.name)
                entry = (nk, kernel)  # keeps the kernel object alive: its id is the key
                self._kernels[id(kernel)] = entry
        return entry[0]

    def callback_kernel(self, name: str, n_tensors: int) -> "_native.Kernel":
        """The kernel of host callback `name`, checked for a call with n_tensors."""
        callbacks = self._callbacks
        if callbacks is None:
            raise ValueError(f"run.host('{name}'): {self._no_callbacks}")
        entry = callbacks.get(name)
        if entry is None:
            raise ValueError(f"run.host: '{name}' is not a callback declared by {self._program} "
                             f"(declared: {sorted(callbacks)})")
        arity, kernel = entry
        if arity is not None and arity != n_tensors:
            raise TypeError(f"run.host: callback '{name}' takes {arity} tensors, got {n_tensors}")
        return kernel

    def recording(self, engine: Any) -> "TaskPort":
        """This port with submissions going to `engine` (a recorder in front of the real one), its
        kernels, kept calls and callbacks shared."""
        port = TaskPort(self.owner, engine, self.workers, program=self._program, callbacks=self._callbacks,
                        no_callbacks=self._no_callbacks)
        port.calls = self.calls
        port._kernels = self._kernels
        port._lock = self._lock
        return port

    def close(self) -> None:
        """Lets go of the engine and of everything kept (kept calls hold tensors, whose allocations hold
        the owner): after its runtime closed, a Run kept beyond its orchestration holds nothing of it."""
        self.engine = None
        self.calls.clear()
        self._kernels.clear()
        self._callbacks = {} if self._callbacks is not None else None
