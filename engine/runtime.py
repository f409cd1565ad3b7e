"""Runtime: a prepared program with its device, worker pool and pipeline slots."""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable, Mapping, Sequence, TypeAlias

import numpy as np

from engine import _native
from engine.binding import BoundCall, bind_call
from engine.errors import ClosedError, DeviceMemoryError, KernelError, RunCancelledError
from engine.hostarrays import as_numpy_view, empty_like_kind, is_host_array
from engine.memory import DeviceMemoryHandle, check_tensor_request
from engine.program import Program
from engine.run import HostKernel, Run
from engine.slots import Slot
from engine.specs import TensorSpec
from engine.tensor import Allocation, DeviceBuffer, DeviceTensor, contiguous_strides

__all__ = ["Runtime", "RunHandle"]

_PLANNING_BUFFER_SIZE = 1 << 62

# What admission hands out: a begun native run holding a slot, with its id and slot index.
Admitted: TypeAlias = "tuple[Any, int, int]"  # (engine._native.Run, run id, slot index)

# What launching a run for an AsyncRuntime gives: the native run, its id, and what
# finishing it takes (Runtime._finish_async). A tuple rather than a record object:
# the scheduler's future is the one per-run object on that path.
Launched: TypeAlias = "tuple[Any, int, Any]"  # (engine._native.Run, run id, payload)


def finish_run(native: "_native.Run", run_id: int, payload: tuple[BoundCall, list[Any]]) -> tuple[Any, BaseException | None]:
    """A completed native run's (result, error), with its outputs written back into the caller's arrays.

    payload: (the bound call, the run's outputs) as launching gave them. Raises
    when a write-back fails (the caller's array is not writable any more, say):
    the run's error.
    """
    call, outputs = payload
    failure, cancelled = native.outcome()
    if failure is not None:
        return None, KernelError(run_id, *failure)
    if cancelled:
        return None, RunCancelledError(f"run {run_id} was cancelled")
    for i in call.outputs:
        a = call.args[i]
        if a.writeback is not None and a.host is not None:
            a.writeback[...] = a.host
    return (None if not outputs else outputs[0] if len(outputs) == 1 else tuple(outputs)), None


class InFlight:
    """A run submitted by a thread: its native run (which holds the slot) and the arguments it keeps alive.

    Registered with its runtime, which finishes it when reaping or closing;
    it may be finished from several threads, so finishing takes a lock.
    """

    __slots__ = ("rt", "native", "id", "payload", "_lock", "_finished", "_result", "_error")

    def __init__(self, rt: "Runtime", native: "_native.Run", run_id: int,
                 payload: tuple[BoundCall, list[Any]]) -> None:
        self.rt = rt
        self.native = native
        self.id = run_id
        self.payload: tuple[BoundCall, list[Any]] | None = payload  # (call, outputs): the arguments it keeps alive
        self._lock = threading.Lock()
        self._finished = False
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self) -> None:
        """After the native run completed (its slot is free again): outcome and write-backs. Exactly once."""
        with self._lock:
            if self._finished:
                return
            payload = self.payload
            assert payload is not None
            try:
                self._result, self._error = finish_run(self.native, self.id, payload)
            finally:
                self._finished = True
                self.payload = None  # drop the arguments: the run no longer needs them
                self.rt._forget(self)

    def outcome(self) -> Any:
        assert self._finished
        if self._error is not None:
            raise self._error
        return self._result

    def error(self) -> BaseException | None:
        return self._error


class RunHandle:
    """The handle of one submitted run: wait for it, get its outputs or its error."""

    __slots__ = ("_inflight",)

    def __init__(self, inflight: InFlight) -> None:
        self._inflight = inflight

    @property
    def id(self) -> int:
        return self._inflight.id

    @property
    def done(self) -> bool:
        """True once the run completed and its outputs are in place."""
        if not self._inflight.native.done:
            return False
        self._inflight.finish()  # write-backs and slot release, once
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the run completed (True) or the timeout passed (False)."""
        if not self._inflight.native.wait(timeout):
            return False
        self._inflight.finish()
        return True

    def result(self, timeout: float | None = None) -> Any:
        """The outputs (one value, a tuple, or None), or the run's error raised."""
        if not self.wait(timeout):
            raise TimeoutError(f"run {self.id} did not complete within {timeout} s")
        return self._inflight.outcome()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise TimeoutError(f"run {self.id} did not complete within {timeout} s")
        return self._inflight.error()

    def cancel(self) -> bool:
        """Skips the run's tasks that have not started; the result is discarded."""
        return self._inflight.native.cancel()

    def times(self) -> dict[str, int]:
        """Engine-clock timestamps (ns): created, sealed (host work done), first_start,
        last_end (device work), done; busy_ns is the summed task time."""
        return self._inflight.native.times()

    def __repr__(self) -> str:
        return f"<RunHandle {self.id} {'done' if self.done else 'pending'}>"


class Runtime(DeviceMemoryHandle):
    """A prepared program. Call it, submit() to it, or wrap it in scheduler.AsyncRuntime."""

    def __init__(self, prog: Program, *, device: str = "cpu", workers: int | None = None, depth: int = 2,
                 bounds: Mapping[str, int] | None = None, callbacks: Mapping[str, Callable[..., Any]] | None = None,
                 memory_limit: int | None = None, scratch_bytes: int | None = None,
                 spin_us: int | None = None) -> None:
        self.program = prog
        self.depth = _check_positive_int("depth", depth)
        if device != "cpu":
            raise ValueError(f"unknown device {device!r}: this build has the embedded 'cpu' device")
        if workers is not None:
            _check_positive_int("workers", workers)
        if memory_limit is not None:
            _check_positive_int("memory_limit", memory_limit)
        if spin_us is not None and (isinstance(spin_us, bool) or not isinstance(spin_us, int) or spin_us < 0):
            raise ValueError("spin_us must be a non-negative int")
        if scratch_bytes is not None and (isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int)
                                          or scratch_bytes < 0):
            raise ValueError("scratch_bytes must be a non-negative int")
        self.bounds = _check_bounds(prog, bounds)
        callbacks = dict(callbacks or {})
        _check_callbacks(prog, callbacks)

        self._state_lock = threading.RLock()
        self._admit_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._closing = False
        self._owned: dict[int, Allocation] = {}  # every live allocation of this runtime, by id
        self._inflight: dict[int, InFlight] = {}  # runs submitted by threads, by native run id, in launch order
        self._kernels: dict[int, tuple[Any, Any]] = {}  # id(kernel object) -> (native kernel, object)
        self._calls: dict[tuple | int, Any] = {}  # validated kernel calls, reused by run.submit (engine.run._call_key)
        self._callbacks: dict[str, Any] = {}
        self._host_spans: list[tuple[int, int, str, int, int]] | None = None  # when tracing
        self._trace: _native.TraceRecorder | None = None  # task events: attached while tracing, kept until drained
        self._device: _native.Device | None = None
        self._engine: _native.Engine | None = None
        try:
            self._device = _native.Device(memory_limit or 0)
            self._engine = (_native.Engine(self._device, workers or 0) if spin_us is None
                            else _native.Engine(self._device, workers or 0, spin_us))
            for name, fn in callbacks.items():
                self._callbacks[name] = self._engine.register_host_kernel(f"callback:{name}", fn)
            if scratch_bytes is None:
                scratch_bytes = self._plan_scratch()
            self._slots = [self._make_slot(i, scratch_bytes) for i in range(self.depth)]
            # The lease state lives natively: a run takes its slot when it begins and frees it when it completes.
            self._slot_table = _native.SlotTable([slot.accessor for slot in self._slots])
            self.scratch_bytes = scratch_bytes
        except BaseException:
            self._teardown()
            raise

    # -- setup --------------------------------------------------------------------
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
        run = Run(self, None, None, {s: dims[s] for s in prog.symbols}, self._planning_alloc())
        try:
            prog.invoke(run, args)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{prog.name}: the planning pass at the bounds {self.bounds} failed: {e} "
                          "(pass scratch_bytes= to skip planning)") from e
        return run._scratch_used

    def _make_slot(self, index: int, scratch_bytes: int) -> Slot:
        buffers: dict[str, Allocation] = {}
        for p in self.program.params:
            if isinstance(p.spec, TensorSpec):
                n = p.spec.dtype.itemsize
                for d in p.spec.shape:
                    n *= d if isinstance(d, int) else self.bounds[d]
                buffers[p.name] = self._alloc(n, "slot")
        scratch = self._alloc(scratch_bytes, "scratch") if scratch_bytes > 0 else None
        return Slot(index, buffers, scratch, _native.HostAccessor(self._device))

    def _alloc(self, nbytes: int, kind: str) -> Allocation:
        assert self._device is not None
        if nbytes >= 1 << 63:  # beyond what the native allocator can even be asked for
            raise DeviceMemoryError(f"device memory exhausted: requested {nbytes} bytes")
        alloc = Allocation(self, self._device.alloc(nbytes), kind)
        self._owned[alloc.id] = alloc
        return alloc

    # -- running -------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs once and returns the outputs (one value, a tuple in declaration order, or None)."""
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> RunHandle:
        """Starts a run and returns its handle; blocks while `depth` runs are in flight."""
        call = self._bind(args, kwargs)
        t0 = self._now_ns() if self._host_spans is not None else 0
        admitted = self._admit_blocking()
        return RunHandle(self._launch(call, admitted, admit_start_ns=t0))

    def _bind(self, args: tuple, kwargs: Mapping[str, Any]) -> BoundCall:
        self._check_open()
        return bind_call(self, self.program, args, kwargs, self.bounds)

    def _admit_blocking(self) -> Admitted:
        """FIFO admission for threads: reaps the oldest run in flight when no slot is free."""
        with self._admit_lock:
            while True:
                admitted = self._try_admit(False)
                if admitted is not None:
                    return admitted
                with self._state_lock:
                    oldest = next(iter(self._inflight.values()), None)
                if oldest is not None:
                    oldest.native.wait()
                    oldest.finish()
                else:  # the slots are held by async runs or by launches under way in other threads
                    self._slot_table.wait_free(None)

    def _try_admit(self, notify: bool = False) -> Admitted | None:
        """(native run, its id, its slot) of a begun run holding a free slot, or None when none is free.

        notify: the run announces its completion on the notifier (the async
        path). The caller must pass the run to _launch() (_launch_async() when notify) or _abandon().
        """
        if self._closing or self._closed:
            raise ClosedError("the runtime is closed")
        assert self._engine is not None
        # Raises ClosedError once close() stopped admitting (it may have, since the check above).
        return self._engine.begin_run_leased(notify, self._slot_table)

    def _abandon(self, admitted: Admitted) -> None:
        """Gives back an admitted run that will not be launched (e.g. its dispatch was cancelled).

        The empty run completes at once and frees its slot.
        """
        native = admitted[0]
        native.cancel()
        engine = self._engine
        if engine is not None:  # after close the engine sealed it already
            engine.seal(native)

    def _launch(self, call: BoundCall, admitted: Admitted, admit_start_ns: int = 0) -> InFlight:
        """Launches a run admitted with notify=False (a thread's): registered, finished by its handle or by close."""
        native, run_id, payload = self._launch_async(call, admitted, admit_start_ns, None, 0)
        inflight = InFlight(self, native, run_id, payload)
        with self._state_lock:
            self._inflight[run_id] = inflight
        return inflight

    def _launch_async(self, call: BoundCall, admitted: Admitted, dispatch_ns: int, log: "_native.RunLog | None",
                      launch_ns: int = 0) -> Launched:
        """Stages inputs through the slot, orchestrates and seals; the slot frees when the run completes.

        For an AsyncRuntime (the run was admitted with notify=True), which
        finishes it with _finish_async; _launch() wraps it for threads.
        dispatch_ns: when the caller asked for the run (for the trace and the
        log); log: where the run records its timings as it completes;
        launch_ns: when its orchestration started, if not at admission. On an
        error the run is cancelled and sealed (so its slot frees) before it raises.
        """
        native, run_id, slot_index = admitted
        engine = self._engine
        assert engine is not None  # an admitted run keeps the runtime open until it is sealed
        slot = self._slots[slot_index]
        spans = self._host_spans
        t_admitted = engine.now_ns() if spans is not None else 0
        acc = slot.accessor  # attached to the run at admission: closed when it completes
        outputs: list[Any] = []
        try:
            fn_args: list[Any] = []
            copy_backs: list[tuple[DeviceTensor, int]] = []  # (slot view, its buffer's device address)
            for a in call.args:
                spec = a.param.spec
                if not isinstance(spec, TensorSpec):
                    fn_args.append(a.value)
                    continue
                value = a.value
                if isinstance(value, DeviceTensor):
                    fn_args.append(value)
                    if spec.writes:
                        outputs.append(value)
                    continue
                if value is None:  # omitted Out: allocate one of the callers' kind
                    user, a.host = empty_like_kind(call.torch_kind, a.shape, spec.dtype)
                    outputs.append(user)
                elif spec.writes:
                    outputs.append(value)
                view, addr = _slot_view(slot, a.param.name, a.shape, spec)
                host = a.host
                assert host is not None
                acc.add(addr, host.nbytes, host)  # host is the contiguous array of exactly the view's bytes
                if spec.reads:
                    acc.stage_in(addr)
                if spec.writes:
                    copy_backs.append((view, addr))
                fn_args.append(view)
            run = Run(self, native, slot, call.dims, slot.scratch)
            t_staged = engine.now_ns() if spans is not None else 0
            self.program.invoke(run, fn_args)
            for view, addr in copy_backs:
                engine.submit_copy_back(native, view._native_arg(), addr)
            engine.seal_logged(native, log, dispatch_ns, launch_ns)
            if spans is not None:
                t_sealed = engine.now_ns()
                if dispatch_ns:
                    spans.append((run_id, slot.index, "admission", dispatch_ns, t_admitted))
                spans.append((run_id, slot.index, "staging", t_admitted, t_staged))
                spans.append((run_id, slot.index, "orchestration", t_staged, t_sealed))
        except BaseException:
            native.cancel()
            engine.seal(native)
            # The caller's arrays stay mapped until tasks already started are done: wait for
            # them, even if Ctrl-C interrupts the wait (the KeyboardInterrupt is raised after).
            interrupted = _wait_through_interrupts(native)
            if interrupted is not None:
                raise interrupted
            raise
        return native, run_id, (call, outputs)

    # (result, error) of a completed run from _launch_async; raises when a write-back fails.
    _finish_async = staticmethod(finish_run)

    def _forget(self, inflight: InFlight) -> None:
        """Called once per registered run by InFlight.finish()."""
        with self._state_lock:
            self._inflight.pop(inflight.id, None)

    # -- tracing --------------------------------------------------------------------
    def _now_ns(self) -> int:
        """The engine's clock (the one task timestamps use)."""
        assert self._engine is not None
        return self._engine.now_ns()

    def set_tracing(self, on: bool) -> None:
        """Starts (or stops) recording host spans and task timings for export_trace()."""
        self._check_open()
        assert self._engine is not None
        if on:
            if self._trace is None:
                self._trace = _native.TraceRecorder()
            self._engine.add_observer(self._trace)  # False when attached already
            if self._host_spans is None:
                self._host_spans = []
        else:
            if self._trace is not None:
                self._engine.remove_observer(self._trace)  # what it recorded stays for drain_trace()
            self._host_spans = None

    def drain_trace(self) -> tuple[list[tuple[int, int, str, int, int]], list[tuple]]:
        """Takes the recorded (host spans, task events) so far.

        host span: (run_id, slot, name, start_ns, end_ns), name in admission /
        staging / orchestration; task event: (run_id, task_index, worker,
        start_ns, end_ns, kernel_name, ok).
        """
        self._check_open()
        assert self._engine is not None
        spans = self._host_spans or []
        if self._host_spans is not None:
            self._host_spans = []
        return spans, self._trace.drain() if self._trace is not None else []

    def export_trace(self, path: Any) -> None:
        """Writes the recorded trace as Chrome trace JSON (opens in Perfetto)."""
        from engine.trace import export_chrome_trace

        spans, events = self.drain_trace()
        export_chrome_trace(path, spans, events, workers=self.workers, depth=self.depth)

    # -- kernels --------------------------------------------------------------------
    def _native_kernel(self, kernel: Any) -> "_native.Kernel":
        entry = self._kernels.get(id(kernel))
        if entry is not None:
            return entry[0]
        with self._state_lock:  # two orchestrations may meet a new host kernel at once
            entry = self._kernels.get(id(kernel))
            if entry is None:
                assert self._engine is not None
                if isinstance(kernel, HostKernel):
                    nk = self._engine.register_host_kernel(f"host:{kernel.name}:{id(kernel):x}", kernel.fn)
                else:
                    nk = self._engine.kernel(kernel.name)
                entry = (nk, kernel)  # keeps the kernel object alive: its id is the key
                self._kernels[id(kernel)] = entry
        return entry[0]

    def _callback_kernel(self, name: str, n_tensors: int) -> "_native.Kernel":
        if name not in self.program.callbacks:
            raise ValueError(f"run.host: '{name}' is not a callback declared by {self.program.name} "
                             f"(declared: {sorted(self.program.callbacks)})")
        arity = self.program.callbacks[name]
        if arity is not None and arity != n_tensors:
            raise TypeError(f"run.host: callback '{name}' takes {arity} tensors, got {n_tensors}")
        return self._callbacks[name]

    # -- checks ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise ClosedError("the runtime is closed")

    def _check_tensor(self, t: Any, what: str) -> None:
        if not isinstance(t, DeviceTensor):
            raise TypeError(f"{what}: expected a device tensor, not {type(t).__name__}")
        alloc = t._alloc
        if alloc.kind == "planning":
            return
        if alloc.owner is not self:
            raise ValueError(f"{what}: the tensor belongs to another runtime")
        if alloc.freed:
            raise ValueError(f"{what}: the tensor was freed")

    # -- device memory handle ----------------------------------------------------------
    def malloc(self, nbytes: int) -> DeviceBuffer:
        self._check_open()
        _check_positive_int("nbytes", nbytes)
        return DeviceBuffer(self._alloc(nbytes, "buffer"))

    def free(self, buf: DeviceBuffer) -> None:
        self._check_open()
        if not isinstance(buf, DeviceBuffer):
            raise TypeError(f"free() takes a DeviceBuffer, not {type(buf).__name__}")
        self._free_alloc(buf._alloc, "buffer")

    def copy_to(self, dst: DeviceBuffer, src: Any) -> None:
        self._check_open()
        alloc = self._buffer_alloc(dst, "copy_to")
        host = np.ascontiguousarray(_host_array(src, "copy_to source"))
        if host.nbytes > alloc.size:
            raise ValueError(f"copy_to: {host.nbytes} bytes do not fit a {alloc.size}-byte buffer")
        assert self._engine is not None and self._device is not None
        self._engine.quiesce(alloc.id)
        self._device.copy_h2d(alloc.buf, 0, host)

    def copy_from(self, dst: Any, src: DeviceBuffer) -> None:
        self._check_open()
        alloc = self._buffer_alloc(src, "copy_from")
        host = _host_array(dst, "copy_from destination")
        if not host.flags.c_contiguous or not host.flags.writeable:
            raise ValueError("copy_from: the destination must be a writable contiguous array")
        if host.nbytes > alloc.size:
            raise ValueError(f"copy_from: a {alloc.size}-byte buffer cannot fill {host.nbytes} bytes")
        assert self._engine is not None and self._device is not None
        self._engine.quiesce(alloc.id)
        self._device.copy_d2h(host, alloc.buf, 0)

    def alloc_tensor(self, shape: Sequence[int], dtype: Any = "float32", init: Any = None) -> DeviceTensor:
        """A resident tensor: device memory that outlives runs (weights, KV caches)."""
        self._check_open()
        dims, dt, host, nbytes = check_tensor_request(shape, dtype, init)
        alloc = self._alloc(nbytes, "resident")
        if host is not None:
            assert self._device is not None
            self._device.copy_h2d(alloc.buf, 0, host)
        return DeviceTensor(alloc, 0, dims, contiguous_strides(dims), dt)

    def free_tensor(self, t: DeviceTensor) -> None:
        self._check_open()
        if not isinstance(t, DeviceTensor):
            raise TypeError(f"free_tensor() takes a DeviceTensor, not {type(t).__name__}")
        self._free_alloc(t._alloc, "resident")

    def memory_stats(self) -> dict[str, int]:
        self._check_open()
        assert self._device is not None
        stats = dict(self._device.stats())
        stats["free_slots"] = self._slot_table.free_count
        stats["depth"] = self.depth
        return stats

    def _read_tensor(self, t: DeviceTensor) -> np.ndarray:
        self._check_open()
        self._check_tensor(t, "to_numpy")
        assert self._engine is not None and self._device is not None
        alloc = t._alloc
        self._engine.quiesce(alloc.id)
        begin, end = t._byte_range()
        raw = np.empty((end - begin) // t.dtype.itemsize, t.dtype.numpy)  # the view's whole span
        self._device.copy_d2h(raw, alloc.buf, begin)
        item = t.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(raw, shape=t.shape, strides=tuple(s * item for s in t.strides))
        return np.array(view, copy=True)

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
        if alloc.owner is not self:
            raise ValueError(f"free: the {'tensor' if kind == 'resident' else 'buffer'} belongs to another runtime")
        with self._state_lock:
            if alloc.freed:
                raise ValueError(f"free: the {'tensor' if kind == 'resident' else 'buffer'} was already freed")
            if alloc.kind != kind:
                raise ValueError(f"free: cannot free {alloc.kind} memory owned by the runtime")
            alloc.freed = True
        assert self._engine is not None and self._device is not None
        self._engine.quiesce(alloc.id)  # runs in flight may still use it
        self._engine.forget_allocation(alloc.id)
        self._device.free(alloc.buf)
        with self._state_lock:
            self._owned.pop(alloc.id, None)

    # -- closing ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drains runs in flight, frees everything the runtime owns, joins the pool. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closing = True  # from here no run is admitted
            assert self._engine is not None
            self._engine.stop_admitting()  # a thread past the check in _try_admit now gets ClosedError
            self._engine.wait_idle(None)  # launches under way seal their runs; every run completes
            with self._admit_lock:
                while True:
                    with self._state_lock:
                        pending = list(self._inflight.values())
                    if not pending:
                        break
                    for inflight in pending:
                        inflight.native.wait()
                        inflight.finish()
            self._teardown()
            self._closed = True

    def _teardown(self) -> None:
        if self._engine is not None:
            self._engine.close(True)
            if self._trace is not None:
                self._engine.remove_observer(self._trace)
                self._trace = None
        if self._device is not None:
            for alloc in list(self._owned.values()):
                alloc.freed = True
                self._device.free(alloc.buf)
            self._owned.clear()
        self._kernels.clear()
        self._calls.clear()  # they hold tensors, whose allocations hold this runtime
        self._callbacks.clear()
        self._engine = None
        self._device = None

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and self._engine is not None:
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"depth={self.depth} workers={self.workers}"
        return f"<Runtime {self.program.name} {state}>"


def _slot_view(slot: Slot, name: str, shape: tuple[int, ...], spec: TensorSpec) -> tuple[DeviceTensor, int]:
    """The slot buffer of `name` viewed at this run's shape, and the buffer's address.

    Cached: shapes repeat run after run.
    """
    cache = slot.views
    key = (name, shape)
    hit = cache.get(key)
    if hit is None:
        buf = slot.buffers[name]
        hit = (DeviceTensor(buf, 0, shape, contiguous_strides(shape), spec.dtype), buf.addr)
        if len(cache) > 64:
            cache.clear()
        cache[key] = hit
    return hit


def _wait_through_interrupts(native: "_native.Run") -> KeyboardInterrupt | None:
    """Waits until the run is done; a KeyboardInterrupt meanwhile is returned, not raised."""
    interrupted = None
    while True:
        try:
            native.wait()
            return interrupted
        except KeyboardInterrupt as e:
            interrupted = e


def _host_array(x: Any, what: str) -> np.ndarray:
    if not is_host_array(x):
        raise TypeError(f"{what}: expected a numpy array or a CPU torch tensor, not {type(x).__name__}")
    return as_numpy_view(x)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_bounds(prog: Program, bounds: Mapping[str, int] | None) -> dict[str, int]:
    bounds = dict(bounds or {})
    for sym, v in bounds.items():
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"bound of '{sym}' must be an int, not {type(v).__name__}")
        if v <= 0:
            raise ValueError(f"bound of '{sym}' must be positive, got {v}")
    missing = [s for s in prog.symbols if s not in bounds]
    if missing:
        raise ValueError(f"{prog.name}: symbols {missing} need bounds: prepare(bounds={{{missing[0]!r}: ...}})")
    return bounds


def _check_callbacks(prog: Program, callbacks: dict[str, Callable[..., Any]]) -> None:
    unknown = sorted(set(callbacks) - set(prog.callbacks))
    if unknown:
        raise ValueError(f"{prog.name}: unknown callbacks {unknown} (the program declares {sorted(prog.callbacks)})")
    missing = sorted(set(prog.callbacks) - set(callbacks))
    if missing:
        raise ValueError(f"{prog.name}: callbacks {missing} are declared but not bound at prepare")
    for name, fn in callbacks.items():
        if not callable(fn):
            raise TypeError(f"callback '{name}' must be callable, not {type(fn).__name__}")
        arity = prog.callbacks[name]
        if arity is None:
            continue
        try:
            inspect.signature(fn).bind(*range(arity))
        except TypeError:
            raise TypeError(f"callback '{name}' must accept {arity} tensor arguments") from None
        except ValueError:  # no signature available (some builtins): accept
            pass
