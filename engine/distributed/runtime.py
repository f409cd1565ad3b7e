"""DistributedRuntime: a prepared distributed program with its chip workers, slots and shared memory.

    drt = tp.prepare(workers=2, depth=2, bounds={"B": 64}, callbacks={"gather": gather})
    w = [drt.alloc_tensor((64, 32), init=w_np[:, 32 * i:32 * (i + 1)], worker_id=i) for i in range(2)]
    y = drt(x, w)                        # blocking
    h = drt.submit(x, w)                 # engine.RunHandle
    async with AsyncRuntime(drt) as art: # unchanged: pipelined dispatch
        y = await art.call(x, w)

Everything a runtime shares with the single-device one is engine.base_runtime's.
What is this level's (the hooks):

    admit        try_admit(): a lease of the native slot table and the run's RunRecord
    stage        launch(): host inputs are copied into the slot's shared region
    orchestrate  launch(): the function records its submissions (engine.distributed.orchestrator);
                 sealing hands them to the dispatcher, which sends the ready ones to their workers
    execute      each chip worker runs its sub-programs on its own device and pool
    complete     the dispatcher: when every submission is back, the run's outputs go from the
                 region to the caller's arrays, its slot is released, then it is done
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

from engine import _native
from engine.base_runtime import BaseRuntime, TaskEvent
from engine.binding import BoundCall
from engine.distributed.capture import DistributedCapture
from engine.distributed.dispatch import Dispatcher
from engine.distributed.memory import SharedAllocation, host_view
from engine.distributed.notifier import CompletionEngine
from engine.distributed.orchestrator import Orchestrator, Registry
from engine.distributed.planning import plan
from engine.distributed.program import DistributedProgram, PerWorker, tensor_spec
from engine.distributed.protocol import RegionSpec, Setup
from engine.distributed.runs import RunRecord
from engine.distributed.slots import Layout, SharedSlot
from engine.distributed.transport import ProcessTransport, Transport
from engine.distributed.worker import program_spec
from engine.hostarrays import empty_like_kind
from engine.orchestration import ScratchArena
from engine.program import Param
from engine.specs import Scalar
from engine.tensor import Allocation, DeviceBuffer, DeviceTensor
from engine.validation import check_optional, check_positive_int

if TYPE_CHECKING:
    from engine.call_cache import CachedBinding

__all__ = ["DistributedRuntime"]

Lease = tuple[RunRecord, int, int]  # (the run's record, its id, its slot)


@dataclass(frozen=True)
class _Signature:
    """What binding sees of the program: its parameters with PerWorker unwrapped."""

    name: str
    params: tuple[Param, ...]
    param_names: frozenset[str]


_REPLICAS_KEPT = 64  # replica lists whose checks are remembered (a program passes the same few every run)


class DistributedRuntime(BaseRuntime[RunRecord]):
    """A prepared distributed program. Call it, submit() to it, or wrap it in scheduler.AsyncRuntime.

    Its memory calls take worker_id= (default 0): resident tensors and
    buffers live on one chip worker each.
    """

    def __init__(self, prog: DistributedProgram, *, workers: int, depth: int = 2,
                 bounds: Mapping[str, int] | None = None, callbacks: Mapping[str, Callable[..., Any]] | None = None,
                 worker_threads: int | None = None, memory_limit: int | None = None,
                 scratch_bytes: int | None = None, start_method: str = "spawn", startup_timeout: float = 60.0,
                 transport: Transport | None = None, capture: bool = False, capture_limit: int = 256) -> None:
        if not isinstance(prog, DistributedProgram):
            raise TypeError(f"DistributedRuntime needs a distributed program, not {type(prog).__name__}")
        self._workers = check_positive_int("workers", workers)
        super().__init__(prog, depth=depth, bounds=bounds, callbacks=callbacks)
        self.program: DistributedProgram = prog
        # Replica lists checked before, by parameter and the tensors' identities: the same tensors pass the
        # same checks again, but for having been freed (re-checked per call).
        self._replicas_checked: dict[tuple[Any, ...], tuple[DeviceTensor, ...]] = {}
        check_optional(positive={"worker_threads": worker_threads, "memory_limit": memory_limit},
                       non_negative={"scratch_bytes": scratch_bytes})
        if isinstance(startup_timeout, bool) or not isinstance(startup_timeout, (int, float)) or startup_timeout <= 0:
            raise ValueError(f"startup_timeout must be a positive number of seconds, got {startup_timeout!r}")
        if not isinstance(capture, bool):
            raise TypeError(f"capture must be True or False, not {type(capture).__name__}")
        check_positive_int("capture_limit", capture_limit)
        # Recordings of orchestrations, when prepared with capture=True (engine.distributed.capture)
        self._recordings = DistributedCapture(capture_limit, prog.params) if capture else None
        threads = worker_threads or max(1, (os.cpu_count() or 1) // workers)
        # Everything that can fail without a process runs first.
        self._plan = plan(prog, workers, self.bounds, threads)
        specs = tuple(program_spec(p, b, s) for p, b, s in zip(self._plan.programs, self._plan.bounds,
                                                               self._plan.scratch))
        self._layout = Layout.of(prog, self.bounds,
                                 self._plan.shared_scratch if scratch_bytes is None else scratch_bytes)
        self.scratch_bytes: int = self._layout.scratch_size
        self._registry = Registry({id(p): (i, p, b) for i, (p, b) in enumerate(zip(self._plan.programs,
                                                                                   self._plan.bounds))})
        self._callbacks = {name: (tags, self._callback_fns[name]) for name, tags in prog.callbacks.items()}
        params = tuple(Param(p.name, tensor_spec(p), p.keyword_only) if isinstance(p.spec, PerWorker) else p
                       for p in prog.params)
        self._sig = _Signature(prog.name, params, frozenset(p.name for p in params))
        self._per_worker = [i for i, p in enumerate(prog.params) if isinstance(p.spec, PerWorker)]

        self._state_cv = threading.Condition(self._state_lock)
        self._launching = 0  # leases not yet launched or abandoned: close() waits for them
        self._run_ids = itertools.count(1)
        self._completion = CompletionEngine()  # the notifier, drain and clock of this level
        self._slot_list: list[SharedSlot] = []  # the regions; the lease state is the native slot table's
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
            self._slot_table = _native.SlotTable(self.depth)
            self._dispatcher = Dispatcher(self._transport, workers, self._completion.post, self._completion.now_ns)
            region_specs = tuple(RegionSpec(r.index, r.name, r.size) for r in regions)
            setups = [Setup(i, threads, memory_limit or 0, specs, region_specs) for i in range(workers)]
            readies = self._transport.start(setups, self._dispatcher.on_message, self._dispatcher.on_exit,
                                            float(startup_timeout))
            self._dispatcher.workers_started()
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

    def transfer_stats(self) -> dict[str, int]:
        """Region bytes and views copied to and from the workers so far (all zero with shared memory:
        a ProcessTransport's workers map the regions; resident tensors never cross)."""
        return self._transport.transfer_stats()

    @property
    def shared_memory_names(self) -> list[str]:
        """The names of this runtime's shared-memory regions (under /dev/shm on Linux)."""
        prefix = getattr(self._transport, "prefix", None)
        return [f"{prefix}_{s.index}" for s in self._slot_list] if prefix else []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs once and returns the outputs, reading the run's replies on this thread (see
        ProcessTransport): no other thread has to wake this one when the run completes.

        The run is this call's alone, so it gets no RunHandle and is not registered as in flight: a
        thread waiting for a slot waits for it to complete (it releases its slot then), and close()
        waits for every sealed run. Interrupted, the call leaves the run to complete on its own.
        """
        with self._transport.caller_reads():
            run, run_id, payload = self._launch_blocking(args, kwargs)
            run.wait()
        result, error = self.finish(run, run_id, payload)
        if error is not None:
            raise error
        return result

    # -- the backend protocol -----------------------------------------------------------------------
    def check_open(self) -> None:
        super().check_open()
        if self._dispatcher is not None and self._dispatcher.broken is not None:
            raise self._dispatcher.broken

    def completions(self) -> CompletionEngine:
        return self._completion

    def now_ns(self) -> int:
        return self._completion.now_ns()

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> BoundCall:
        """Checks the arguments against the signature (TypeError / ValueError before anything runs)."""
        self.check_open()
        if not self._per_worker:
            return self._binds.bind(self._check_argument, self._sig, args, kwargs, self.bounds)
        params = self.program.params
        args_l, kwargs_d = list(args), dict(kwargs)
        replicas: dict[int, tuple[DeviceTensor, ...]] = {}
        for i in self._per_worker:  # binding checks the first replica against the spec, we check the rest
            p = params[i]
            if i < len(args_l):
                replicas[i] = self._check_replicas(p, args_l[i])
                args_l[i] = replicas[i][0]
            elif kwargs_d.get(p.name) is not None:
                replicas[i] = self._check_replicas(p, kwargs_d[p.name])
                kwargs_d[p.name] = replicas[i][0]
        # Each replica list binds as its first tensor: calls shaped alike bind from the cache too.
        call = self._binds.bind(self._check_argument, self._sig, tuple(args_l), kwargs_d, self.bounds)
        for i, value in replicas.items():
            call.args[i].value = value
        return call

    def _check_replicas(self, p: Param, value: Any) -> tuple[DeviceTensor, ...]:
        key = (p.name, *map(id, value)) if type(value) in (list, tuple) else None
        if key is not None:
            hit = self._replicas_checked.get(key)
            if hit is not None and not any(t._alloc.freed for t in hit):
                return hit
        replicas = self._check_replicas_fully(p, value)
        checked = self._replicas_checked
        if len(checked) >= _REPLICAS_KEPT:
            checked.clear()
        if key is not None:
            checked[key] = replicas  # holds the tensors: their ids stay theirs
        return replicas

    def _check_replicas_fully(self, p: Param, value: Any) -> tuple[DeviceTensor, ...]:
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

    def try_admit(self, notify: bool) -> Lease | None:
        """A free slot and the run's record, or None when every slot is held."""
        with self._state_lock:
            self.check_open()
            assert self._slot_table is not None and self._dispatcher is not None
            lease = self._slot_table.try_lease()
            if lease is None:
                return None
            self._launching += 1
        run = RunRecord(next(self._run_ids), notify, self._dispatcher, self._completion.now_ns(),
                        self._slot_table, lease)
        return run, run.id, lease[0]

    def abandon(self, lease: Lease) -> None:
        try:
            assert self._slot_table is not None
            self._slot_table.release(*lease[0].lease)
        finally:
            self._launched()

    def _launched(self) -> None:
        with self._state_cv:
            self._launching -= 1
            if self._closing:  # only close() waits for launches, and it sets _closing before it takes this lock
                self._state_cv.notify_all()

    def launch(self, call: "BoundCall | CachedBinding", lease: Lease, dispatch_ns: int,
               log: "_native.RunLog | None", launch_ns: int = 0) -> tuple[RunRecord, int, Any]:
        """Stages, orchestrates and seals one run. Releases the slot when the orchestration raises."""
        assert isinstance(call, BoundCall)  # bind() here never gives a cached binding
        try:
            return self._launch(call, lease, dispatch_ns, log, launch_ns)
        finally:
            self._launched()

    def _launch(self, call: BoundCall, lease: Lease, dispatch_ns: int, log: "_native.RunLog | None",
                launch_ns: int) -> tuple[RunRecord, int, Any]:
        run, run_id, slot_index = lease
        assert self._slot_table is not None and self._dispatcher is not None
        slot = self._slot_list[slot_index]
        now = self._completion.now_ns
        spans = self._host_spans
        t_admitted = now() if spans is not None else 0
        orch: Orchestrator | None = None
        outputs: list[Any] = []
        recordings = self._recordings
        base_key: tuple[Any, ...] = ()  # the capture key's part that binding fixes, when this runtime captures
        values: list[Any] = []  # the parameters' values, when it captures
        replay = None
        try:
            if recordings is not None:
                base_key = recordings.base_key(call, slot_index)
                values = recordings.values(call)
                replay = recordings.lookup(base_key, values)
            fn_args: list[Any] = []
            copy_outs: list[tuple[np.ndarray, np.ndarray]] = []
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
                assert a.host is not None
                region = slot.array(a.param.name, a.shape, spec.dtype)
                if spec.reads:
                    np.copyto(region, a.host)
                if spec.writes:
                    copy_outs.append((a.host, region))
                if replay is None:
                    fn_args.append(slot.tensor(a.param.name, a.shape, spec.dtype))
            t_staged = now() if spans is not None else 0
            if replay is not None:
                subs = replay.replay(run, values)
            else:
                arena = ScratchArena(slot.alloc, self._layout.scratch_offset, self._layout.scratch_size,
                                     "shared scratch")
                orch = Orchestrator(self, self._workers, self._callbacks, self._registry, run, slot.alloc, arena,
                                    call.dims, recording=recordings is not None)
                reads = recordings.stand_ins(fn_args) if recordings is not None else None
                try:
                    self.program.invoke(orch, fn_args)
                finally:
                    if reads is not None:
                        reads.closed = True  # a stand-in kept beyond the orchestration raises when used
                subs = orch.seal()
                if recordings is not None:
                    assert reads is not None
                    recordings.record(base_key, reads, values, call, subs, orch.passed)
        except BaseException:
            if orch is not None:
                orch.seal()  # a kept `orch` can submit no more
            self._slot_table.release(*run.lease)
            raise
        run.copy_outs = copy_outs
        if log is not None:
            log.launched()
            run.log = (log, dispatch_ns, launch_ns)
        self._dispatcher.seal(run, subs)
        if spans is not None:
            self._record_spans(spans, run_id, slot_index, dispatch_ns, t_admitted, t_staged, now())
        return run, run_id, (call, outputs)

    def _recording_stats(self) -> dict[str, int] | None:
        return None if self._recordings is None else self._recordings.stats()

    # -- closing ------------------------------------------------------------------------------------------
    def _drain_device(self) -> None:
        with self._state_cv:
            self._state_cv.wait_for(lambda: self._launching == 0)
        if self._dispatcher is not None:
            self._dispatcher.wait_idle()  # every sealed run completes (or fails, if a worker died)

    def _teardown(self) -> None:
        self._replicas_checked.clear()  # its tensors' allocations hold this runtime
        if self._recordings is not None:
            self._recordings.clear()  # so do the recordings' (and they hold views of the regions)
        if self._dispatcher is not None:
            self._dispatcher.close()  # the callback thread is done with the regions from here
        self._drop_views()
        with self._memory_lock:
            for alloc in self._owned.values():
                alloc.freed = True
            self._owned.clear()
        self._transport.stop()

    def _drop_views(self) -> None:
        """Lets go of the host's views of the regions, so that stopping the transport can unmap them."""
        for slot in self._slot_list:
            slot.drop_views()

    # -- tracing ----------------------------------------------------------------------------------------
    def _trace_tasks(self, on: bool) -> None:
        assert self._dispatcher is not None
        if not on:
            self._dispatcher.events = None
        elif self._dispatcher.events is None:
            self._dispatcher.events = []

    def _drain_task_events(self) -> list[TaskEvent]:
        """Submission events: (run_id, submission index, worker, start_ns, end_ns, name, ok), worker -1 for
        host callbacks."""
        assert self._dispatcher is not None
        return self._dispatcher.take_events()

    # -- device memory: each call takes the chip worker it is about ----------------------------------------
    def malloc(self, nbytes: int, worker_id: int = 0) -> DeviceBuffer:
        """Raw device memory on chip worker `worker_id`."""
        self.check_open()
        return self._malloc(nbytes, self._check_worker_id(worker_id))

    def alloc_tensor(self, shape: Sequence[int], dtype: Any = "float32", init: Any = None,
                     worker_id: int = 0) -> DeviceTensor:
        """A resident tensor on chip worker `worker_id`: it outlives runs and is pinned to that worker."""
        self.check_open()
        return self._alloc_tensor(shape, dtype, init, self._check_worker_id(worker_id))

    def memory_stats(self, worker_id: int | None = None) -> dict[str, int]:
        """Device counters of one worker, or summed over all workers; plus free_slots, depth, workers."""
        self.check_open()
        return self._device_stats(None if worker_id is None else self._check_worker_id(worker_id))

    def _check_worker_id(self, worker_id: Any) -> int:
        if isinstance(worker_id, bool) or not isinstance(worker_id, int):
            raise TypeError(f"worker_id must be an int, not {type(worker_id).__name__}")
        if not 0 <= worker_id < self._workers:
            raise ValueError(f"worker_id {worker_id} does not exist (workers: 0..{self._workers - 1})")
        return worker_id

    def _check_tensor(self, t: Any, what: str) -> None:
        """A resident tensor of this runtime (a run's shared tensors live inside that run only)."""
        if isinstance(t, DeviceTensor) and isinstance(t._alloc, SharedAllocation) and t._alloc.owner is self:
            raise ValueError(f"{what}: a tensor of a run's orchestration cannot be passed to another run")
        super()._check_tensor(t, what)

    def _read_tensor(self, t: DeviceTensor) -> np.ndarray:
        alloc = t._alloc
        if isinstance(alloc, SharedAllocation) and alloc.owner is self and alloc.base is not None:
            self.check_open()  # a run's shared tensor (read from a callback, say): the host has its bytes
            return np.array(host_view(t, False), copy=True)
        return super()._read_tensor(t)

    def _rpc(self, worker: int, op: str, *args: Any) -> Any:
        assert self._dispatcher is not None
        return self._dispatcher.rpc(worker, op, *args)

    def _device_alloc(self, nbytes: int, kind: str, worker: int, init: np.ndarray | None) -> Allocation:
        remote_id = self._rpc(worker, "alloc", nbytes, kind, init)
        return Allocation(self, _native.Buffer(0, remote_id, 0, nbytes), kind, worker)

    def _device_free(self, alloc: Allocation) -> None:
        self._rpc(alloc.worker, "free", alloc.id)

    def _device_write(self, alloc: Allocation, offset: int, data: np.ndarray) -> None:
        self._rpc(alloc.worker, "write", alloc.id, offset, data.reshape(-1).view(np.uint8))

    def _device_read(self, alloc: Allocation, offset: int, out: np.ndarray) -> None:
        out.reshape(-1).view(np.uint8)[...] = self._rpc(alloc.worker, "read", alloc.id, offset, out.nbytes)

    def _quiesce(self, alloc: Allocation) -> None:
        assert self._dispatcher is not None
        self._dispatcher.quiesce(alloc)

    def _device_stats(self, worker: int | None) -> dict[str, int]:
        ids = range(self._workers) if worker is None else [worker]
        stats: dict[str, int] = {}
        for w in ids:
            for k, v in self._rpc(w, "stats").items():
                stats[k] = stats.get(k, 0) + int(v)
        assert self._slot_table is not None
        stats["free_slots"] = self._slot_table.free_count
        stats["depth"] = self.depth
        stats["workers"] = self._workers
        stats["shared_bytes"] = self._layout.nbytes * self.depth
        return stats

    def __repr__(self) -> str:
        if self._closed:
            state = "closed"
        elif self.broken:
            state = "broken"
        else:
            state = f"workers={self._workers} depth={self.depth}"
        return f"<DistributedRuntime {self.program.name} {state}>"


def _last_resort(ref: "weakref.ref[DistributedRuntime]", transport: Transport) -> None:
    """A runtime never closed, at exit or when collected: stop its workers and remove its shared memory."""
    rt = ref()
    if rt is not None:
        rt._drop_views()
    transport.stop()
