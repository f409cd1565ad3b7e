"""BaseRuntime: the one implementation of what every runtime does.

A runtime is a prepared program with its device(s), `depth` pipeline slots
and everything a run needs. Whatever the level (one device here, several
chip workers in engine.distributed), these are the same and live here once:

- settings: depth, bounds, the host callbacks bound at prepare (checked before anything is set up);
- the device-memory handle (engine.memory.DeviceMemoryHandle): validation, ownership, init staging;
- runs from threads: submit() / __call__, FIFO admission that waits for a slot, RunHandle;
- the backend protocol (engine.backend.Backend) that scheduler.AsyncRuntime drives: bind, try_admit,
  abandon, launch, finish, completions;
- finishing a run: its outcome, write-backs into the caller's arrays, its result;
- tracing: host spans recorded here, task events from the level's executor, Chrome trace export;
- the lifecycle: the open check, close() that stops admission and drains, idempotent, context manager.

A level implements only what differs, behind these hooks:

    try_admit(notify) -> Lease | None    lease a free slot and begin the run's state
    abandon(lease)                       give back a lease never launched
    launch(call, lease, ...) -> Launched stage inputs into the slot, orchestrate, seal
    completions() / now_ns()             where notifying runs announce completion; the runs' clock
    workers                              the executors (pool workers; chip workers)
    _drain_device()                      close: stop admitting natively, wait until launches under way
                                         are sealed and every run completed
    _teardown()                          free everything (idempotent; also after a failed prepare)
    _trace_tasks(on) / _drain_task_events()   task tracing of the executor
    and the device-memory hooks of DeviceMemoryHandle.

A run's contract, whatever the level: it holds its slot from admission
until it completes, and it releases the slot and puts its outputs in the
caller's arrays (contiguous ones; others are written back by finish())
before anyone can see it done.
"""

from __future__ import annotations

import abc
import threading
from typing import TYPE_CHECKING, Any, Generic, Mapping, TypeVar

from engine import _native
from engine.backend import CompletionSource, Launched, Lease, RunState, RunT
from engine.binding import BindCache, BoundCall
from engine.errors import ClosedError, KernelError, RunCancelledError
from engine.handles import RunHandle
from engine.memory import DeviceMemoryHandle
from engine.validation import check_bounds, check_callbacks, check_positive_int

if TYPE_CHECKING:
    from engine.call_cache import CachedBinding
    from engine.capture import Capture
    from engine.program import ProgramBase

__all__ = ["BaseRuntime", "finish_run", "HostSpan", "TaskEvent"]

_R = TypeVar("_R", bound="BaseRuntime[Any]")

# (run_id, slot, name, start_ns, end_ns): name in admission / staging / orchestration
HostSpan = tuple[int, int, str, int, int]
# (run_id, task_index, worker, start_ns, end_ns, kernel name, ok)
TaskEvent = tuple[int, int, int, int, int, str, bool]


def finish_run(run: RunState, run_id: int, payload: "tuple[BoundCall | CachedBinding, list[Any]]"
               ) -> tuple[Any, BaseException | None]:
    """A completed run's (result, error), its non-contiguous outputs written back into the caller's arrays.

    payload: (the bound call, the run's outputs) as launch() gave them. The
    run's state reports its outcome as (failure, cancelled): failure is None,
    an exception, or a native failure (task index, kernel, message). Raises
    when a write-back fails (the caller's array is not writable any more).
    """
    call, outputs = payload
    failure, cancelled = run.outcome()
    if failure is not None:
        return None, failure if isinstance(failure, BaseException) else KernelError(run_id, *failure)
    if cancelled:
        return None, RunCancelledError(f"run {run_id} was cancelled")
    for i in call.outputs:
        a = call.args[i]
        if a.writeback is not None and a.host is not None:
            a.writeback[...] = a.host
    return (None if not outputs else outputs[0] if len(outputs) == 1 else tuple(outputs)), None


class BaseRuntime(DeviceMemoryHandle, Generic[RunT]):
    """A prepared program: call it, submit() to it, or wrap it in scheduler.AsyncRuntime.

    RunT: the level's run state (engine.backend.RunState).
    """

    def __init__(self, program: "ProgramBase", *, depth: int, bounds: Mapping[str, int] | None,
                 callbacks: Mapping[str, Any] | None) -> None:
        super().__init__()
        self.program = program
        self.depth: int = check_positive_int("depth", depth)
        self.bounds: dict[str, int] = check_bounds(program, bounds)
        self._callback_fns = check_callbacks(program, callbacks)
        self._state_lock = threading.RLock()
        self._admit_lock = threading.Lock()  # thread admission is FIFO
        self._close_lock = threading.Lock()
        self._closing = False  # close() began: nothing is admitted any more
        self._closed = False
        self._inflight: dict[int, RunHandle] = {}  # runs submitted by threads, by run id, in launch order
        self._host_spans: list[HostSpan] | None = None  # while tracing
        self._slot_table: _native.SlotTable | None = None  # the lease state of the slots (set by the level)
        self._check_argument = self._check_tensor  # what binding checks a DeviceTensor argument with
        self._binds = BindCache()  # calls shaped like an earlier one bind from what it derived
        self._capture: Capture | None = None  # recordings, when prepared with capture=True (engine.capture)

    # -- the level's part ------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def workers(self) -> int:
        """The executors: pool workers on one device, chip workers in engine.distributed."""

    @abc.abstractmethod
    def try_admit(self, notify: bool) -> Lease[RunT] | None: ...

    @abc.abstractmethod
    def abandon(self, lease: Lease[RunT]) -> None: ...

    @abc.abstractmethod
    def launch(self, call: "BoundCall | CachedBinding", lease: Lease[RunT], dispatch_ns: int, log: "_native.RunLog | None",
               launch_ns: int = 0) -> Launched[RunT]: ...

    @abc.abstractmethod
    def completions(self) -> CompletionSource: ...

    @abc.abstractmethod
    def now_ns(self) -> int:
        """The clock of the runs' timestamps and of the trace."""

    @abc.abstractmethod
    def _drain_device(self) -> None: ...

    @abc.abstractmethod
    def _teardown(self) -> None: ...

    @abc.abstractmethod
    def _trace_tasks(self, on: bool) -> None: ...

    @abc.abstractmethod
    def _drain_task_events(self) -> list[TaskEvent]: ...

    # -- the backend protocol: what is the same at every level ----------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closing or self._closed:
            raise ClosedError("the runtime is closed")

    def _check_ready(self) -> None:  # the device-memory handle's ready check
        self.check_open()

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> "BoundCall | CachedBinding":
        """Checks one call's arguments against the signature (TypeError / ValueError before anything runs)."""
        self.check_open()
        return self._binds.bind(self._check_argument, self.program, args, kwargs, self.bounds)

    finish = staticmethod(finish_run)

    # -- runs from threads ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs once and returns the outputs (one value, a tuple in declaration order, or None)."""
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> RunHandle:
        """Starts a run and returns its handle; blocks while `depth` runs are in flight."""
        run, run_id, payload = self._launch_blocking(args, kwargs)
        handle = RunHandle(self, run, run_id, payload)
        with self._state_lock:
            self._inflight[run_id] = handle
        return handle

    def _launch_blocking(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Launched[RunT]:
        """Binds, admits (blocking while `depth` runs are in flight) and launches one run from a thread."""
        call = self.bind(args, kwargs)
        t0 = self.now_ns() if self._host_spans is not None else 0
        lease = self._admit_blocking()
        return self.launch(call, lease, t0, None)

    def _admit_blocking(self) -> Lease[RunT]:
        """FIFO admission for threads: while no slot is free, finishes the oldest run in flight or waits."""
        with self._admit_lock:
            while True:
                lease = self.try_admit(False)
                if lease is not None:
                    return lease
                with self._state_lock:
                    oldest = next(iter(self._inflight.values()), None)
                if oldest is not None:
                    oldest._run.wait()
                    oldest._finish()
                else:  # the slots are held by async runs or by launches under way in other threads
                    assert self._slot_table is not None
                    self._slot_table.wait_free(0.05)  # bounded: re-checks, should a launch fail meanwhile

    def _forget(self, run_id: int) -> None:
        """Called once per registered run by RunHandle._finish()."""
        with self._state_lock:
            self._inflight.pop(run_id, None)

    def capture_stats(self) -> dict[str, int]:
        """Captured runs: hits (replays), misses (runs recorded), entries, evictions, invalidations, limit.

        All zero for a runtime prepared without capture=True.
        """
        stats = self._recording_stats()
        if stats is None:
            return {"hits": 0, "misses": 0, "entries": 0, "evictions": 0, "invalidations": 0, "limit": 0}
        return stats

    def _recording_stats(self) -> dict[str, int] | None:
        """The level's capture counters, None without capture."""
        return None if self._capture is None else self._capture.stats()

    # -- tracing ---------------------------------------------------------------------------------
    def set_tracing(self, on: bool) -> None:
        """Starts (or stops) recording host spans and task timings for export_trace()."""
        self.check_open()
        self._trace_tasks(bool(on))
        if on and self._host_spans is None:
            self._host_spans = []
        elif not on:
            self._host_spans = None

    def drain_trace(self) -> tuple[list[HostSpan], list[TaskEvent]]:
        """Takes the recorded (host spans, task events) so far.

        host span: (run_id, slot, name, start_ns, end_ns), name in admission /
        staging / orchestration; task event: (run_id, task_index, worker,
        start_ns, end_ns, kernel_name, ok).
        """
        self.check_open()
        spans = self._host_spans or []
        if self._host_spans is not None:
            self._host_spans = []
        return spans, self._drain_task_events()

    def export_trace(self, path: Any) -> None:
        """Writes the recorded trace as Chrome trace JSON (opens in Perfetto)."""
        from engine.trace import export_chrome_trace

        spans, events = self.drain_trace()
        export_chrome_trace(path, spans, events, workers=self.workers, depth=self.depth)

    @staticmethod
    def _record_spans(spans: list[HostSpan], run_id: int, slot: int, dispatch_ns: int, admitted_ns: int,
                      staged_ns: int, sealed_ns: int) -> None:
        """A launched run's host spans (while tracing)."""
        if dispatch_ns:
            spans.append((run_id, slot, "admission", dispatch_ns, admitted_ns))
        spans.append((run_id, slot, "staging", admitted_ns, staged_ns))
        spans.append((run_id, slot, "orchestration", staged_ns, sealed_ns))

    # -- closing -------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stops admitting, drains the runs in flight, frees everything the runtime owns. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closing = True  # from here no run is admitted
            self._drain_device()
            with self._admit_lock:
                while True:
                    with self._state_lock:
                        pending = list(self._inflight.values())
                    if not pending:
                        break
                    for handle in pending:
                        handle._run.wait()
                        handle._finish()
            self._teardown()
            self._binds.clear()  # cached calls hold DeviceTensors, whose allocations hold this runtime
            self._closed = True

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self._closed:
                self.close()
        except Exception:
            pass
