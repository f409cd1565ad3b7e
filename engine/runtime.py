"""Runtime: a prepared program on one device, with its native engine, worker pool and pipeline slots.

Where each step of a run lives (engine.base_runtime has what every level shares):

    admit        try_admit(): the native engine begins a run holding a free slot of the native
                 slot table, the slot's host-tensor accessor attached to it
    bind         BaseRuntime.bind() -> engine.binding (before admission)
    stage        launch(): the accessor maps each host argument's slot buffer to the caller's
                 array and copies In / InOut data in; a DeviceTensor is used in place
    orchestrate  launch(): the program's function runs with an engine.Run, whose submits enter
                 the native task graph (engine.port.TaskPort) and may start at once
    execute      native: the task graph, its dependency tracker, the worker pool
    complete     native: the last task (an output's copy-back) finishes, the run closes its
                 accessor, releases its slot and announces itself on the notifier;
                 finish_run() then writes back non-contiguous outputs
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from engine import _native
from engine.base_runtime import BaseRuntime, TaskEvent
from engine.binding import BoundCall, bind_call
from engine.call_cache import CachedBinding, CallCache
from engine.capture import Capture
from engine.errors import CaptureError, ClosedError, DeviceMemoryError
from engine.handles import RunHandle
from engine.hostarrays import empty_like_kind
from engine.orchestration import ScratchArena
from engine.port import TaskPort
from engine.program import Program
from engine.run import Run
from engine.slots import Slot, slot_view
from engine.specs import TensorSpec
from engine.tensor import Allocation, DeviceTensor, contiguous_strides
from engine.validation import check_optional, check_positive_int

__all__ = ["Runtime", "RunHandle"]

_PLANNING_BUFFER_SIZE = 1 << 62


class Runtime(BaseRuntime["_native.Run"]):
    """A prepared program on the embedded `cpu` device. Call it, submit() to it, or wrap it in scheduler.AsyncRuntime."""

    def __init__(self, prog: Program, *, device: str = "cpu", workers: int | None = None, depth: int = 2,
                 bounds: Mapping[str, int] | None = None, callbacks: Mapping[str, Callable[..., Any]] | None = None,
                 memory_limit: int | None = None, scratch_bytes: int | None = None,
                 spin_us: int | None = None, capture: bool = False, capture_limit: int = 256) -> None:
        super().__init__(prog, depth=depth, bounds=bounds, callbacks=callbacks)
        self.program: Program = prog
        if device != "cpu":
            raise ValueError(f"unknown device {device!r}: this build has the embedded 'cpu' device")
        check_optional(positive={"workers": workers, "memory_limit": memory_limit},
                       non_negative={"spin_us": spin_us, "scratch_bytes": scratch_bytes})
        if not isinstance(capture, bool):
            raise TypeError(f"capture must be True or False, not {type(capture).__name__}")
        check_positive_int("capture_limit", capture_limit)
        self._device: _native.Device | None = None
        self._engine: _native.Engine | None = None
        self._trace: _native.TraceRecorder | None = None  # task events: attached while tracing, kept until drained
        self._slots: list[Slot] = []
        self._calls: CallCache | None = None  # the hit path of calls shaped like an earlier one
        try:
            self._device = _native.Device(memory_limit or 0)
            self._engine = (_native.Engine(self._device, workers or 0) if spin_us is None
                            else _native.Engine(self._device, workers or 0, spin_us))
            bound = {name: (prog.callback_arity(name), self._engine.register_host_kernel(f"callback:{name}", fn))
                     for name, fn in self._callback_fns.items()}
            self._port = TaskPort(self, self._engine, self._engine.workers, program=prog.name, callbacks=bound)
            if scratch_bytes is None:
                scratch_bytes = self._plan_scratch()
            self._slots = [self._make_slot(i, scratch_bytes) for i in range(self.depth)]
            # The lease state lives natively: a run takes its slot when it begins and frees it when it completes.
            self._slot_table = _native.SlotTable([slot.accessor for slot in self._slots])
            self.scratch_bytes: int = scratch_bytes
            if capture:
                self._capture = Capture(prog, capture_limit)
            self._calls = CallCache(prog, capture_limit, self.depth)
        except BaseException:
            self._teardown()
            raise

    # -- setup --------------------------------------------------------------------------------------
    @property
    def workers(self) -> int:
        return self._engine.workers if self._engine is not None else 0

    def _planning_alloc(self) -> Allocation:
        """A stand-in allocation for the planning pass: nothing behind it is ever touched."""
        return Allocation(self, _native.Buffer(0, 0, 0, _PLANNING_BUFFER_SIZE), "planning")

    def _plan_scratch(self) -> int:
        """Runs the orchestration once at the bounds, without the device, to size scratch."""
        prog = self.program
        dims = dict(self.bounds)
        args: list[Any] = []
        for p in prog.params:  # each parameter its own allocation, as in a real run
            if isinstance(p.spec, TensorSpec):
                shape = tuple(d if isinstance(d, int) else dims[d] for d in p.spec.shape)
                args.append(DeviceTensor(self._planning_alloc(), 0, shape, contiguous_strides(shape), p.spec.dtype))
            else:
                args.append(p.spec.type())
        run = Run(self._port, None, {s: dims[s] for s in prog.symbols}, ScratchArena(self._planning_alloc()))
        try:
            prog.invoke(run, args)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{prog.name}: the planning pass at the bounds {self.bounds} failed: {e} "
                          "(pass scratch_bytes= to skip planning)") from e
        return run.scratch_used

    def _make_slot(self, index: int, scratch_bytes: int) -> Slot:
        assert self._device is not None
        buffers: dict[str, Allocation] = {}
        for p in self.program.params:
            if isinstance(p.spec, TensorSpec):
                n = p.spec.dtype.itemsize
                for d in p.spec.shape:
                    n *= d if isinstance(d, int) else self.bounds[d]
                buffers[p.name] = self._new_alloc(n, "slot", 0, None)
        scratch = self._new_alloc(scratch_bytes, "scratch", 0, None) if scratch_bytes > 0 else None
        return Slot(index, buffers, scratch, _native.HostAccessor(self._device))

    # -- the backend protocol -----------------------------------------------------------------------
    def completions(self) -> "_native.Engine":
        """The native engine: its notifier's fd, drain_completed() and clock."""
        assert self._engine is not None, "the runtime is closed"
        return self._engine

    def now_ns(self) -> int:
        """The engine's clock (the one task timestamps use)."""
        assert self._engine is not None
        return self._engine.now_ns()

    def try_admit(self, notify: bool) -> "tuple[_native.Run, int, int] | None":
        """(native run, its id, its slot) of a begun run holding a free slot, or None when none is free."""
        if self._closing or self._closed:
            raise ClosedError("the runtime is closed")
        assert self._engine is not None and self._slot_table is not None
        # Raises ClosedError once close() stopped admitting (it may have, since the check above).
        return self._engine.begin_run_leased(notify, self._slot_table)

    def abandon(self, lease: "tuple[_native.Run, int, int]") -> None:
        """The empty run completes at once and frees its slot."""
        native = lease[0]
        native.cancel()
        engine = self._engine
        if engine is not None:  # after close the engine sealed it already
            engine.seal(native)

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BoundCall | CachedBinding:
        """Checks one call's arguments against the signature (TypeError / ValueError before anything runs).

        A call shaped like one launched before binds from the call cache (engine.call_cache).
        """
        self.check_open()
        calls = self._calls
        assert calls is not None  # open
        got = calls.bind(args, kwargs)
        if type(got) is CachedBinding:
            return got
        call = super().bind(args, kwargs)
        assert isinstance(call, BoundCall)
        if got is not None:
            call.signature = (got, len(args), tuple(kwargs))
        return call

    def launch(self, call: BoundCall | CachedBinding, lease: "tuple[_native.Run, int, int]", dispatch_ns: int,
               log: "_native.RunLog | None", launch_ns: int = 0) -> "tuple[_native.Run, int, Any]":
        """Stages inputs through the slot, orchestrates and seals; the slot frees when the run completes.

        On an error the run is cancelled and sealed (so its slot frees) before it raises.
        """
        if type(call) is CachedBinding:
            if self._capture is None:
                return self._launch_plain(call, lease, dispatch_ns, log, launch_ns)
            launched = self._launch_cached(call, lease, dispatch_ns, log, launch_ns)
            if launched is not None:
                return launched
            try:  # the key is no longer recorded: the full path binds again, then records it
                call = bind_call(self._check_argument, self.program, call.args, call.kwargs, self.bounds)
            except BaseException:
                self._abort(lease[0])
                raise
        assert isinstance(call, BoundCall)
        native, run_id, slot_index = lease
        engine = self._engine
        assert engine is not None  # an admitted run keeps the runtime open until it is sealed
        slot = self._slots[slot_index]
        spans = self._host_spans
        t_admitted = engine.now_ns() if spans is not None else 0
        acc = slot.accessor  # attached to the run at admission: closed when it completes
        capture = self._capture
        outputs: list[Any] = []
        try:
            fn_args: list[Any] = []
            copy_backs: list[tuple[int, DeviceTensor, int]] = []  # (parameter index, slot view, buffer address)
            # (parameter index, tensor): checked live by the call cache's hit path; part of the capture key
            device_args: list[tuple[int, DeviceTensor]] = []
            for a in call.args:
                spec = a.param.spec
                if not isinstance(spec, TensorSpec):
                    fn_args.append(a.value)
                    continue
                value = a.value
                if isinstance(value, DeviceTensor):
                    device_args.append((len(fn_args), value))
                    fn_args.append(value)
                    if spec.writes:
                        outputs.append(value)
                    continue
                if value is None:  # omitted Out: allocate one of the callers' kind
                    user, a.host = empty_like_kind(call.torch_kind, a.shape, spec.dtype)
                    outputs.append(user)
                elif spec.writes:
                    outputs.append(value)
                view, addr = slot_view(slot, a.param.name, a.shape, spec.dtype)
                host = a.host
                assert host is not None
                acc.map(addr, host.nbytes, host, spec.reads)  # host: the contiguous array of exactly the view's bytes
                if spec.writes:
                    copy_backs.append((len(fn_args), view, addr))
                fn_args.append(view)
            t_staged = engine.now_ns() if spans is not None else 0
            base_key = None
            if capture is None:
                self._orchestrate(native, slot, call.dims, fn_args,
                                  [(view._native_arg(), addr) for _, view, addr in copy_backs])
            else:  # replayed natively (its copy backs with it), or orchestrated and recorded
                base_key = capture.orchestrate(self._port, native, slot, call, fn_args, device_args,
                                               [(i, addr) for i, _, addr in copy_backs])
                if base_key is None:
                    for _, view, addr in copy_backs:
                        engine.submit_copy_back(native, view._native_arg(), addr)
            self._seal(lease, log, dispatch_ns, launch_ns, t_admitted, t_staged)
        except BaseException:
            self._abort(native)
            raise
        if call.signature is not None and self._calls is not None and (capture is None or base_key is not None):
            sig, n_args, kw_names = call.signature  # learnt once launched (captured: once replayed)
            self._calls.learn(sig, call, n_args, kw_names, device_args, base_key)
        return native, run_id, (call, outputs)

    def _launch_plain(self, call: CachedBinding, lease: "tuple[_native.Run, int, int]", dispatch_ns: int,
                      log: "_native.RunLog | None", launch_ns: int) -> "tuple[_native.Run, int, Any]":
        """launch() of a cached binding, uncaptured: stage into the slot views the signature derived,
        orchestrate, copy back, seal."""
        native, run_id, slot_index = lease
        engine = self._engine
        assert engine is not None
        spans = self._host_spans
        t_admitted = engine.now_ns() if spans is not None else 0
        entry = call.entry
        slot = self._slots[slot_index]
        values = call.values
        try:
            fn_args = list(values)
            hosts = entry.host_arrays(values)
            stage = slot.accessor.map
            for (i, addr, nbytes, reads, view), host in zip(entry.staging(slot), hosts):
                stage(addr, nbytes, host, reads)
                fn_args[i] = view
            t_staged = engine.now_ns() if spans is not None else 0
            self._orchestrate(native, slot, entry.dims, fn_args, entry.copy_back_args(slot))
            self._seal(lease, log, dispatch_ns, launch_ns, t_admitted, t_staged)
        except BaseException:
            self._abort(native)
            raise
        return native, run_id, (call, entry.outputs_of(hosts))  # the call keeps the arrays alive; nothing to write back

    def _orchestrate(self, native: "_native.Run", slot: Slot, dims: dict[str, int], fn_args: list[Any],
                     copy_backs: "list[tuple[_native.TensorArg, int]]") -> None:
        """Runs the orchestration function over the slot's scratch, then copies back each (native argument of
        a slot view, buffer address) written."""
        engine = self._engine
        assert engine is not None
        arena = slot.arena
        arena.used = 0  # the slot's scratch, empty for this run
        self.program.invoke(Run(self._port, native, dims, arena), fn_args)
        for arg, addr in copy_backs:
            engine.submit_copy_back(native, arg, addr)

    def _seal(self, lease: "tuple[_native.Run, int, int]", log: "_native.RunLog | None", dispatch_ns: int,
              launch_ns: int, t_admitted: int, t_staged: int) -> None:
        """Seals a launched run (logged); records its host spans while tracing."""
        native, run_id, slot_index = lease
        engine = self._engine
        assert engine is not None
        engine.seal_logged(native, log, dispatch_ns, launch_ns)
        spans = self._host_spans
        if spans is not None:
            self._record_spans(spans, run_id, slot_index, dispatch_ns, t_admitted, t_staged, engine.now_ns())

    def _launch_cached(self, call: CachedBinding, lease: "tuple[_native.Run, int, int]", dispatch_ns: int,
                       log: "_native.RunLog | None", launch_ns: int) -> "tuple[_native.Run, int, Any] | None":
        """launch() of a cached binding: stage, replay, seal. None, with nothing done, when its key is no
        longer recorded."""
        native, run_id, slot_index = lease
        engine, capture = self._engine, self._capture
        assert engine is not None and capture is not None
        spans = self._host_spans  # tracing: the same spans as the full path's, staging the host arrays' part
        t_admitted = engine.now_ns() if spans is not None else 0
        entry = call.entry
        slot = self._slots[slot_index]
        values = call.values
        try:
            key = entry.replay_key(slot_index, values)
            hit = entry.replayed(key)
            if hit is not None and capture.rehit(hit[0]):
                plan = hit[1]
                patches: list[tuple[int, list[Any]]] = []
            else:
                assert entry.base_key is not None  # learnt by a captured runtime's replay
                found = capture.lookup(entry.base_key, values)
                if found is None:
                    return None
                recorded, patches = found
                plan = capture.plan(recorded, slot, entry.device_args)
                if not recorded.sites:  # nothing patched per run: the plan is all a replay needs
                    entry.remember(key, recorded, plan)
            hosts = entry.host_arrays(values)
            staged = [(addr, nbytes, host, reads)
                      for (_, addr, nbytes, reads, _), host in zip(entry.staging(slot), hosts)]
            outputs = entry.outputs_of(hosts)
            t_staged = engine.now_ns() if spans is not None else 0
            engine.launch_replay(native, staged, plan, patches, entry.copy_backs(slot, capture.tensor_base), log,
                                 dispatch_ns, launch_ns)
            if spans is not None:
                self._record_spans(spans, run_id, slot_index, dispatch_ns, t_admitted, t_staged, engine.now_ns())
        except BaseException:
            self._abort(native)
            raise
        return native, run_id, (call, outputs)  # the call keeps the arrays alive; nothing to write back

    def _abort(self, native: "_native.Run") -> None:
        """A launch failed: the run is cancelled and sealed, so its slot frees once started tasks are done."""
        engine = self._engine
        assert engine is not None
        native.cancel()
        engine.seal(native)
        # The caller's arrays stay mapped until tasks already started are done: wait for
        # them, even if Ctrl-C interrupts the wait (the KeyboardInterrupt is raised after).
        interrupted = _wait_through_interrupts(native)
        if interrupted is not None:
            raise interrupted

    # -- closing --------------------------------------------------------------------------------------
    def _drain_device(self) -> None:
        assert self._engine is not None
        self._engine.stop_admitting()  # a thread past the check in try_admit now gets ClosedError
        self._engine.wait_idle(None)  # launches under way seal their runs; every run completes

    def _teardown(self) -> None:
        if self._engine is not None:
            self._engine.close(True)
            if self._trace is not None:
                self._engine.remove_observer(self._trace)
                self._trace = None
        if self._device is not None:
            with self._memory_lock:
                owned = list(self._owned.values())
                self._owned.clear()
            for alloc in owned:
                alloc.freed = True
                self._device.free(alloc.buf)
        port = getattr(self, "_port", None)
        if port is not None:
            port.close()
        if self._capture is not None:
            self._capture.clear()  # recordings hold tensors, whose allocations hold this runtime
        if self._calls is not None:
            self._calls.clear()  # and so do cached calls
        self._engine = None
        self._device = None

    # -- tracing -----------------------------------------------------------------------------------------
    def _trace_tasks(self, on: bool) -> None:
        """Attaches one TraceRecorder (an engine observer) while tracing; what it recorded stays for draining."""
        assert self._engine is not None
        if on:
            if self._trace is None:
                self._trace = _native.TraceRecorder()
            self._engine.add_observer(self._trace)  # False when attached already
        elif self._trace is not None:
            self._engine.remove_observer(self._trace)

    def _drain_task_events(self) -> list[TaskEvent]:
        return self._trace.drain() if self._trace is not None else []

    # -- device memory -----------------------------------------------------------------------------------
    def _device_alloc(self, nbytes: int, kind: str, worker: int, init: np.ndarray | None) -> Allocation:
        assert self._device is not None
        if nbytes >= 1 << 63:  # beyond what the native allocator can even be asked for
            raise DeviceMemoryError(f"device memory exhausted: requested {nbytes} bytes")
        alloc = Allocation(self, self._device.alloc(nbytes), kind)
        if init is not None:
            self._device.copy_h2d(alloc.buf, 0, init)
        return alloc

    def _device_free(self, alloc: Allocation) -> None:
        assert self._engine is not None and self._device is not None
        self._engine.forget_allocation(alloc.id)
        self._device.free(alloc.buf)

    def _device_write(self, alloc: Allocation, offset: int, data: np.ndarray) -> None:
        assert self._device is not None
        self._device.copy_h2d(alloc.buf, offset, data)

    def _device_read(self, alloc: Allocation, offset: int, out: np.ndarray) -> None:
        assert self._device is not None
        if self._capture is not None and getattr(self._capture.recording, "active", False):
            raise CaptureError("a captured program cannot read device data in its orchestration: a replay would "
                               "not read it again (prepare without capture=True)")
        self._device.copy_d2h(out, alloc.buf, offset)

    def _quiesce(self, alloc: Allocation) -> None:
        assert self._engine is not None
        self._engine.quiesce(alloc.id)

    def _device_stats(self, worker: int | None) -> dict[str, int]:
        assert self._device is not None and self._slot_table is not None
        stats = dict(self._device.stats())
        stats["free_slots"] = self._slot_table.free_count
        stats["depth"] = self.depth
        return stats

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"depth={self.depth} workers={self.workers}"
        return f"<Runtime {self.program.name} {state}>"


def _wait_through_interrupts(native: "_native.Run") -> KeyboardInterrupt | None:
    """Waits until the run is done; a KeyboardInterrupt meanwhile is returned, not raised."""
    interrupted = None
    while True:
        try:
            native.wait()
            return interrupted
        except KeyboardInterrupt as e:
            interrupted = e


