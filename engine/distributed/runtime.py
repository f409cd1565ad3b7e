"""DistributedRuntime: a prepared distributed program with its chip workers, slots and shared memory.

    drt = tp.prepare(workers=2, depth=2, bounds={"B": 64}, callbacks={"gather": gather})
    w = [drt.alloc_tensor((64, 32), init=w_np[:, 32 * i:32 * (i + 1)], worker_id=i) for i in range(2)]
    y = drt(x, w)                        # blocking
    h = drt.submit(x, w)                 # engine.RunHandle
    async with AsyncRuntime(drt) as art: # unchanged: pipelined dispatch
        y = await art.call(x, w)

A run flows as on one device: admit (lease one of `depth` slots), bind
(check the arguments), stage (copy host inputs into the slot's shared
region), orchestrate (the function records its submissions), seal (the
submissions enter the dependency graph and the ready ones go to their
workers), complete (every submission is back), finish (copy outputs out of
the region, release the slot). While the workers execute run N, the host
orchestrates run N+1 on another slot.
"""

from __future__ import annotations

import inspect
import itertools
import os
import threading
import weakref
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from engine import _native
from engine.binding import BoundCall, bind_call
from engine.distributed.dispatch import Dispatcher
from engine.distributed.memory import SharedAllocation, WorkerAllocation, host_view
from engine.distributed.notifier import CompletionEngine
from engine.distributed.orchestrator import Orchestrator, Registry
from engine.distributed.planning import plan
from engine.distributed.program import DistributedProgram, PerWorker, tensor_spec
from engine.distributed.protocol import RegionSpec, Setup
from engine.distributed.runs import DistInFlight, RunRecord
from engine.distributed.slots import Layout, SharedSlot
from engine.distributed.transport import ProcessTransport, Transport
from engine.distributed.worker import program_spec
from engine.errors import ClosedError
from engine.hostarrays import as_numpy_view, empty_like_kind, is_host_array
from engine.memory import DeviceMemoryHandle, check_tensor_request
from engine.program import Param
from engine.runtime import RunHandle, Runtime, _check_bounds, _check_positive_int
from engine.slots import SlotLease
from engine.specs import Scalar
from engine.tensor import DeviceBuffer, DeviceTensor, contiguous_strides

__all__ = ["DistributedRuntime"]


class DistributedRuntime(DeviceMemoryHandle):
    """A prepared distributed program. Call it, submit() to it, or wrap it in scheduler.AsyncRuntime.

    Its memory calls take worker_id= (default 0): resident tensors and
    buffers live on one chip worker each.
    """

    def __init__(self, prog: DistributedProgram, *, workers: int, depth: int = 2,
                 bounds: Mapping[str, int] | None = None, callbacks: Mapping[str, Callable[..., Any]] | None = None,
                 worker_threads: int | None = None, memory_limit: int | None = None,
                 scratch_bytes: int | None = None, start_method: str = "spawn", startup_timeout: float = 60.0,
                 transport: Transport | None = None) -> None:
        if not isinstance(prog, DistributedProgram):
            raise TypeError(f"DistributedRuntime needs a distributed program, not {type(prog).__name__}")
        self.program = prog
        self._workers = _check_positive_int("workers", workers)
        self.depth = _check_positive_int("depth", depth)
        if worker_threads is not None:
            _check_positive_int("worker_threads", worker_threads)
        if memory_limit is not None:
            _check_positive_int("memory_limit", memory_limit)
        if scratch_bytes is not None and (isinstance(scratch_bytes, bool) or not isinstance(scratch_bytes, int)
                                          or scratch_bytes < 0):
            raise ValueError("scratch_bytes must be a non-negative int")
        if isinstance(startup_timeout, bool) or not isinstance(startup_timeout, (int, float)) or startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be a positive number of seconds, got {startup_timeout!r}")
        self.bounds = _check_bounds(prog, bounds)  # type: ignore[arg-type]
        fns = dict(callbacks or {})
        _check_callbacks(prog, fns)
        threads = worker_threads or max(1, (os.cpu_count() or 1) // workers)
        # Everything that can fail without a process runs first.
        self._plan = plan(prog, workers, self.bounds, threads)
        specs = tuple(program_spec(p, b, s) for p, b, s in zip(self._plan.programs, self._plan.bounds,
                                                               self._plan.scratch))
        self._layout = Layout.of(prog, self.bounds,
                                 self._plan.shared_scratch if scratch_bytes is None else scratch_bytes)
        self.scratch_bytes = self._layout.scratch_size
        self._registry = Registry({id(p): (i, p, b) for i, (p, b) in enumerate(zip(self._plan.programs,
                                                                                   self._plan.bounds))})
        self._callbacks = {name: (tags, fns[name]) for name, tags in prog.callbacks.items()}
        params = tuple(Param(p.name, tensor_spec(p), p.keyword_only) if isinstance(p.spec, PerWorker) else p
                       for p in prog.params)
        # What bind_call sees: the program's signature with PerWorker unwrapped.
        self._sig = SimpleNamespace(name=prog.name, params=params, param_names=frozenset(p.name for p in params))
        self._per_worker = [i for i, p in enumerate(prog.params) if isinstance(p.spec, PerWorker)]

        self._state_lock = threading.RLock()
        self._state_cv = threading.Condition(self._state_lock)
        self._launching = 0
        self._admit_lock = threading.Lock()
        self._close_lock = threading.Lock()
        self._closed = False
        self._closing = False
        self._inflight: dict[int, DistInFlight] = {}
        self._run_ids = itertools.count(1)
        self._host_spans: list[tuple[int, int, str, int, int]] | None = None
        self._owned: dict[int, WorkerAllocation] = {}  # live resident tensors and buffers, by id()
        self._engine = CompletionEngine()  # what scheduler.AsyncRuntime reads: notifier_fd, drain, clock
        self._slots: _native.SlotTable | None = None  # the lease state; the regions are _slot_list's
        self._slot_list: list[SharedSlot] = []
        self._dispatcher: Dispatcher | None = None
        self._transport = transport if transport is not None else ProcessTransport(workers, start_method)
        # Workers and shared memory go with the runtime even if close() is never called (GC or exit).
        # The finalizer holds the runtime weakly: it must not keep it alive.
        self._finalizer = weakref.finalize(self, _last_resort, weakref.ref(self), self._transport)
        self.pids: list[int] = []
        try:
            regions = [self._transport.create_region(self._layout.nbytes) for _ in range(self.depth)]
            self._slot_list = [SharedSlot(i, SharedAllocation(self, r.size, "shared", r.index,
                                                              np.frombuffer(r.buf, np.uint8)), self._layout)
                               for i, r in enumerate(regions)]
            self._slots = _native.SlotTable(self.depth)
            self._dispatcher = Dispatcher(self._transport, workers, self._engine.post, self._engine.now_ns)
            region_specs = tuple(RegionSpec(r.index, r.name, r.size) for r in regions)
            setups = [Setup(i, threads, memory_limit or 0, specs, region_specs) for i in range(workers)]
            readies = self._transport.start(setups, self._dispatcher.on_message, self._dispatcher.on_exit,
                                            float(startup_timeout))
            self.worker_threads = readies[0].threads
            self.pids = [r.pid for r in readies]
        except BaseException:
            self._teardown()
            self._closed = True
            raise

    # -- introspection ------------------------------------------------------------------------------
    @property
    def workers(self) -> int:
        """The number of chip workers."""
        return self._workers

    @property
    def programs(self) -> tuple[Any, ...]:
        """The single-device programs registered on every worker."""
        return self._plan.programs

    @property
    def broken(self) -> bool:
        """True once a chip worker died: every call raises WorkerDiedError; close() still cleans up."""
        return self._dispatcher is not None and self._dispatcher.broken is not None

    def health(self) -> list[bool]:
        """Whether each chip worker process is alive."""
        return [self._transport.alive(i) for i in range(self._workers)]

    @property
    def shared_memory_names(self) -> list[str]:
        """The names of this runtime's shared-memory regions (under /dev/shm on Linux)."""
        prefix = getattr(self._transport, "prefix", None)
        return [f"{prefix}_{s.index}" for s in self._slot_list] if prefix else []

    # -- running ------------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs once and returns the outputs (one value, a tuple in declaration order, or None)."""
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> RunHandle:
        """Starts a run and returns its handle; blocks while `depth` runs are in flight."""
        call = self._bind(args, kwargs)
        t0 = self._engine.now_ns() if self._host_spans is not None else 0
        lease = self._admit_blocking()
        return RunHandle(self._launch(call, lease, notify=False, admit_start_ns=t0))  # type: ignore[arg-type]

    def _bind(self, args: tuple, kwargs: Mapping[str, Any]) -> BoundCall:
        """Checks the arguments against the signature (TypeError / ValueError before anything runs)."""
        self._check_open()
        if not self._per_worker:
            return bind_call(self, self._sig, args, kwargs, self.bounds)  # type: ignore[arg-type]
        params = self.program.params
        args_l, kwargs_d = list(args), dict(kwargs)
        replicas: dict[int, tuple[DeviceTensor, ...]] = {}
        for i in self._per_worker:  # bind_call checks the first replica against the spec, we check the rest
            p = params[i]
            if i < len(args_l):
                replicas[i] = self._check_replicas(p, args_l[i])
                args_l[i] = replicas[i][0]
            elif kwargs_d.get(p.name) is not None:
                replicas[i] = self._check_replicas(p, kwargs_d[p.name])
                kwargs_d[p.name] = replicas[i][0]
        call = bind_call(self, self._sig, tuple(args_l), kwargs_d, self.bounds)  # type: ignore[arg-type]
        for i, value in replicas.items():
            call.args[i].value = value
        return call

    def _check_replicas(self, p: Param, value: Any) -> tuple[DeviceTensor, ...]:
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"parameter '{p.name}': expected one resident tensor per worker (a list of "
                            f"{self._workers}), not {type(value).__name__}")
        if len(value) != self._workers:
            raise TypeError(f"parameter '{p.name}': expected {self._workers} tensors (one per worker), "
                            f"got {len(value)}")
        for i, t in enumerate(value):
            self._check_tensor(t, f"parameter '{p.name}'[{i}]")
            if t._alloc.worker != i:
                raise ValueError(f"parameter '{p.name}'[{i}]: the tensor is resident on worker {t._alloc.worker}, "
                                 f"not on worker {i}")
            if t.shape != value[0].shape or t.dtype != value[0].dtype:
                raise TypeError(f"parameter '{p.name}'[{i}]: shape {t.shape} {t.dtype.name} differs from "
                                f"[0]: {value[0].shape} {value[0].dtype.name}")
        return tuple(value)

    def _admit_blocking(self) -> SlotLease:
        """FIFO admission for threads: reaps the oldest run in flight when no slot is free."""
        with self._admit_lock:
            while True:
                lease = self._try_admit()
                if lease is not None:
                    return lease
                with self._state_lock:
                    oldest = next(iter(self._inflight.values()), None)
                if oldest is not None:
                    oldest.native.wait()
                    oldest.finish()
                else:  # a slot is held by a launch still under way in another thread
                    assert self._slots is not None
                    self._slots.wait_free(0.0005)  # bounded: the launch may register its run instead

    def _try_admit(self, notify: bool = False) -> SlotLease | None:
        """A slot lease if one is free. The caller must pass it to _launch() or _abandon().

        notify is for the local Runtime's signature (its runs are admitted as notifying or not);
        here _launch() takes it.
        """
        with self._state_lock:
            self._check_open()
            assert self._slots is not None
            lease = self._slots.try_lease()
            if lease is not None:
                self._launching += 1
            return lease

    def _abandon(self, lease: SlotLease) -> None:
        """Gives back a lease that will not be launched."""
        try:
            assert self._slots is not None
            self._slots.release(*lease)
        finally:
            self._launched()

    def _launched(self) -> None:
        with self._state_cv:
            self._launching -= 1
            self._state_cv.notify_all()

    def _launch(self, call: BoundCall, lease: SlotLease, notify: bool, admit_start_ns: int = 0) -> DistInFlight:
        """Stages, orchestrates and seals one run. Releases the lease when the orchestration raises."""
        try:
            return self._launch_leased(call, lease, notify, admit_start_ns)
        finally:
            self._launched()

    def _launch_async(self, call: BoundCall, lease: SlotLease, dispatch_ns: int, log: "_native.RunLog | None",
                      launch_ns: int = 0) -> tuple[RunRecord, int, DistInFlight]:
        """As Runtime._launch_async: (run record, run id, what _finish_async takes); it records its timings in log."""
        inflight = self._launch(call, lease, True, dispatch_ns)
        if log is not None:
            inflight.log_to(log, dispatch_ns, launch_ns)
        return inflight.native, inflight.id, inflight

    @staticmethod
    def _finish_async(native: RunRecord, run_id: int, inflight: DistInFlight) -> tuple[Any, BaseException | None]:
        """(result, error) of a completed run from _launch_async; raises when a copy back fails."""
        inflight.finish()
        return inflight.result_and_error()

    def _launch_leased(self, call: BoundCall, lease: SlotLease, notify: bool, admit_start_ns: int) -> DistInFlight:
        assert self._slots is not None and self._dispatcher is not None
        slot = self._slot_list[lease[0]]
        now = self._engine.now_ns
        spans = self._host_spans
        t_admitted = now() if spans is not None else 0
        run = RunRecord(next(self._run_ids), notify, self._dispatcher, now())
        orch: Orchestrator | None = None
        try:
            fn_args: list[Any] = []
            outputs: list[Any] = []
            copy_outs: list[tuple[Any, np.ndarray]] = []
            for a in call.args:
                spec = a.param.spec
                if isinstance(spec, Scalar):
                    fn_args.append(a.value)
                    continue
                if isinstance(a.value, (DeviceTensor, tuple)):  # resident: used in place
                    fn_args.append(a.value)
                    if spec.writes:
                        outputs.append(a.value)
                    continue
                if a.value is None:  # omitted Out: allocate one of the caller's kind
                    user, a.host = empty_like_kind(call.torch_kind, a.shape, spec.dtype)
                    outputs.append(user)
                elif spec.writes:
                    outputs.append(a.value)
                region = slot.array(a.param.name, a.shape, spec.dtype)
                if spec.reads:
                    np.copyto(region, a.host)
                if spec.writes:
                    copy_outs.append((a, region))
                fn_args.append(slot.tensor(a.param.name, a.shape, spec.dtype))
            t_staged = now() if spans is not None else 0
            orch = Orchestrator(self, self._workers, self._callbacks, self._registry, run, slot.alloc,
                                self._layout.scratch_offset, self._layout.scratch_size, call.dims)
            self.program.invoke(orch, fn_args)
            subs = orch.seal()
        except BaseException:
            if orch is not None:
                orch.seal()  # a kept `orch` can submit no more
            self._slots.release(*lease)
            raise
        inflight = DistInFlight(self, run, lease, call, outputs, copy_outs)
        with self._state_lock:
            self._inflight[run.id] = inflight
        self._dispatcher.seal(run, subs)
        if spans is not None:
            t_sealed = now()
            if admit_start_ns:
                spans.append((run.id, slot.index, "admission", admit_start_ns, t_admitted))
            spans.append((run.id, slot.index, "staging", t_admitted, t_staged))
            spans.append((run.id, slot.index, "orchestration", t_staged, t_sealed))
        return inflight

    def _release(self, inflight: DistInFlight) -> None:
        """Called once per run by DistInFlight.finish()."""
        with self._state_lock:
            self._inflight.pop(inflight.id, None)
        assert self._slots is not None
        self._slots.release(*inflight.lease)

    # -- tracing ----------------------------------------------------------------------------------------
    def set_tracing(self, on: bool) -> None:
        """Starts (or stops) recording host spans and submission timings for export_trace()."""
        self._check_open()
        assert self._dispatcher is not None
        if on:
            if self._host_spans is None:
                self._host_spans = []
            if self._dispatcher.events is None:
                self._dispatcher.events = []
        else:
            self._host_spans = None
            self._dispatcher.events = None

    def drain_trace(self) -> tuple[list[tuple[int, int, str, int, int]], list[tuple]]:
        """Takes the recorded (host spans, submission events) so far.

        A submission event is (run_id, submission index, worker, start_ns,
        end_ns, name, ok) with worker -1 for host callbacks.
        """
        self._check_open()
        assert self._dispatcher is not None
        spans = self._host_spans or []
        if self._host_spans is not None:
            self._host_spans = []
        return spans, self._dispatcher.take_events()

    def export_trace(self, path: Any) -> None:
        """Writes the recorded trace as Chrome trace JSON: a device track per chip worker, "caller" for callbacks."""
        from engine.trace import export_chrome_trace

        spans, events = self.drain_trace()
        export_chrome_trace(path, spans, events, workers=self._workers, depth=self.depth)

    # -- checks -------------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or self._closing:
            raise ClosedError("the runtime is closed")
        if self._dispatcher is not None and self._dispatcher.broken is not None:
            raise self._dispatcher.broken

    def _check_tensor(self, t: Any, what: str) -> None:
        """A run argument: a resident tensor of this runtime (shared tensors live inside one run only)."""
        if not isinstance(t, DeviceTensor):
            raise TypeError(f"{what}: expected a device tensor, not {type(t).__name__}")
        alloc = t._alloc
        if isinstance(alloc, SharedAllocation) and alloc.owner is self:
            raise ValueError(f"{what}: a tensor of a run's orchestration cannot be passed to another run")
        if not isinstance(alloc, WorkerAllocation) or alloc.owner is not self:
            raise ValueError(f"{what}: the tensor belongs to another runtime")
        if alloc.freed:
            raise ValueError(f"{what}: the tensor was freed")

    def _check_worker_id(self, worker_id: Any) -> int:
        if isinstance(worker_id, bool) or not isinstance(worker_id, int):
            raise TypeError(f"worker_id must be an int, not {type(worker_id).__name__}")
        if not 0 <= worker_id < self._workers:
            raise ValueError(f"worker_id {worker_id} does not exist (workers: 0..{self._workers - 1})")
        return worker_id

    # -- device memory handle -------------------------------------------------------------------------------
    def _rpc(self, worker: int, op: str, *args: Any) -> Any:
        assert self._dispatcher is not None
        return self._dispatcher.rpc(worker, op, *args)

    def malloc(self, nbytes: int, worker_id: int = 0) -> DeviceBuffer:
        """Raw device memory on chip worker `worker_id`."""
        self._check_open()
        _check_positive_int("nbytes", nbytes)
        w = self._check_worker_id(worker_id)
        return DeviceBuffer(self._new_alloc(w, nbytes, "buffer", None))

    def _new_alloc(self, worker: int, nbytes: int, kind: str, init: np.ndarray | None) -> WorkerAllocation:
        remote_id = self._rpc(worker, "alloc", nbytes, kind, init)
        alloc = WorkerAllocation(self, _native.Buffer(0, remote_id, 0, nbytes), kind, worker)
        with self._state_lock:
            self._owned[id(alloc)] = alloc
        return alloc

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
        self._quiesce(alloc)
        self._rpc(alloc.worker, "write", alloc.id, 0, host.reshape(-1).view(np.uint8))

    def copy_from(self, dst: Any, src: DeviceBuffer) -> None:
        self._check_open()
        alloc = self._buffer_alloc(src, "copy_from")
        host = _host_array(dst, "copy_from destination")
        if not host.flags.c_contiguous or not host.flags.writeable:
            raise ValueError("copy_from: the destination must be a writable contiguous array")
        if host.nbytes > alloc.size:
            raise ValueError(f"copy_from: a {alloc.size}-byte buffer cannot fill {host.nbytes} bytes")
        self._quiesce(alloc)
        data = self._rpc(alloc.worker, "read", alloc.id, 0, host.nbytes)
        host.reshape(-1).view(np.uint8)[...] = data

    def alloc_tensor(self, shape: Sequence[int], dtype: Any = "float32", init: Any = None,
                     worker_id: int = 0) -> DeviceTensor:
        """A resident tensor on chip worker `worker_id`: it outlives runs and is pinned to that worker."""
        self._check_open()
        w = self._check_worker_id(worker_id)
        dims, dt, host, nbytes = check_tensor_request(shape, dtype, init)
        alloc = self._new_alloc(w, nbytes, "resident", host)
        return DeviceTensor(alloc, 0, dims, contiguous_strides(dims), dt)

    def free_tensor(self, t: DeviceTensor) -> None:
        self._check_open()
        if not isinstance(t, DeviceTensor):
            raise TypeError(f"free_tensor() takes a DeviceTensor, not {type(t).__name__}")
        self._free_alloc(t._alloc, "resident")

    def memory_stats(self, worker_id: int | None = None) -> dict[str, int]:
        """Device counters of one worker, or summed over all workers; plus free_slots, depth, workers."""
        self._check_open()
        ids = range(self._workers) if worker_id is None else [self._check_worker_id(worker_id)]
        stats: dict[str, int] = {}
        for w in ids:
            for k, v in self._rpc(w, "stats").items():
                stats[k] = stats.get(k, 0) + int(v)
        assert self._slots is not None
        stats["free_slots"] = self._slots.free_count
        stats["depth"] = self.depth
        stats["workers"] = self._workers
        stats["shared_bytes"] = self._layout.nbytes * self.depth
        return stats

    def _read_tensor(self, t: DeviceTensor) -> np.ndarray:
        self._check_open()
        alloc = t._alloc
        if isinstance(alloc, SharedAllocation) and alloc.owner is self and alloc.base is not None:
            return np.array(host_view(t, False), copy=True)
        self._check_tensor(t, "to_numpy")
        assert isinstance(alloc, WorkerAllocation)
        self._quiesce(alloc)
        begin, end = t._byte_range()
        raw = np.asarray(self._rpc(alloc.worker, "read", alloc.id, begin, end - begin)).view(t.dtype.numpy)
        item = t.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(raw, shape=t.shape, strides=tuple(s * item for s in t.strides))
        return np.array(view, copy=True)

    def _quiesce(self, alloc: WorkerAllocation) -> None:
        assert self._dispatcher is not None
        self._dispatcher.quiesce(alloc)

    def _buffer_alloc(self, buf: Any, what: str) -> WorkerAllocation:
        if not isinstance(buf, DeviceBuffer):
            raise TypeError(f"{what}: expected a DeviceBuffer, not {type(buf).__name__}")
        alloc = buf._alloc
        if not isinstance(alloc, WorkerAllocation) or alloc.owner is not self:
            raise ValueError(f"{what}: the buffer belongs to another runtime")
        if alloc.freed:
            raise ValueError(f"{what}: the buffer was freed")
        return alloc

    def _free_alloc(self, alloc: Any, kind: str) -> None:
        noun = "tensor" if kind == "resident" else "buffer"
        if not isinstance(alloc, WorkerAllocation) or alloc.owner is not self:
            raise ValueError(f"free: the {noun} belongs to another runtime")
        with self._state_lock:
            if alloc.freed:
                raise ValueError(f"free: the {noun} was already freed")
            if alloc.kind != kind:
                right = "free_tensor" if alloc.kind == "resident" else "free"
                raise ValueError(f"free: {alloc.kind} memory is freed with {right}()")
            alloc.freed = True
        self._quiesce(alloc)  # runs in flight may still use it
        self._rpc(alloc.worker, "free", alloc.id)
        with self._state_lock:
            self._owned.pop(id(alloc), None)

    # -- closing ----------------------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Drains runs in flight, stops and reaps every worker, removes the shared memory. Idempotent.

        After a worker died the runs in flight have failed already; close()
        stops the survivors all the same.
        """
        with self._close_lock:
            if self._closed:
                return
            with self._state_cv:
                self._closing = True
                self._state_cv.wait_for(lambda: self._launching == 0)
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
        if self._dispatcher is not None:
            self._dispatcher.close()  # the callback thread is done with the regions from here
        self._drop_views()
        for alloc in self._owned.values():
            alloc.freed = True
        self._owned.clear()
        self._transport.stop()

    def _drop_views(self) -> None:
        """Lets go of the host's views of the regions, so that stopping the transport can unmap them."""
        for slot in self._slot_list:
            slot.drop_views()

    def __enter__(self) -> "DistributedRuntime":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed and hasattr(self, "_transport"):
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif self.broken:
            state = "broken"
        else:
            state = f"workers={self._workers} depth={self.depth}"
        return f"<DistributedRuntime {self.program.name} {state}>"


# scheduler.AsyncRuntime accepts an engine.Runtime; a DistributedRuntime offers the same surface
# (_bind, _try_admit, _launch, _abandon, _check_open, _engine, depth, tracing, close), so it is
# registered as a virtual subclass and AsyncRuntime works over it unchanged.
Runtime.register(DistributedRuntime)


def _last_resort(ref: "weakref.ref[DistributedRuntime]", transport: Transport) -> None:
    """A runtime never closed, at exit or when collected: stop its workers and remove its shared memory."""
    rt = ref()
    if rt is not None:
        rt._drop_views()
    transport.stop()


def _host_array(x: Any, what: str) -> np.ndarray:
    if not is_host_array(x):
        raise TypeError(f"{what}: expected a numpy array or a CPU torch tensor, not {type(x).__name__}")
    return as_numpy_view(x)


def _check_callbacks(prog: DistributedProgram, callbacks: dict[str, Callable[..., Any]]) -> None:
    """Unknown or missing callbacks fail here, at prepare, before any process starts."""
    unknown = sorted(set(callbacks) - set(prog.callbacks))
    if unknown:
        raise ValueError(f"{prog.name}: unknown callbacks {unknown} (the program declares {sorted(prog.callbacks)})")
    missing = sorted(set(prog.callbacks) - set(callbacks))
    if missing:
        raise ValueError(f"{prog.name}: callbacks {missing} are declared but not bound at prepare")
    for name, fn in callbacks.items():
        if not callable(fn):
            raise TypeError(f"callback '{name}' must be callable, not {type(fn).__name__}")
        arity = len(prog.callbacks[name])
        try:
            inspect.signature(fn).bind(*range(arity))
        except TypeError:
            raise TypeError(f"callback '{name}' must accept {arity} tensor arguments") from None
        except ValueError:  # no signature available (some builtins): accept
            pass
