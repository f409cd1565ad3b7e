"""One distributed run: its record (what the dispatcher completes) and its in-flight state.

RunRecord plays the part of the native run object of a single-device
runtime (done, wait, cancel, times), and DistInFlight the part of
engine.runtime.InFlight (finish, outcome, error), so that engine.RunHandle
and scheduler.AsyncRuntime drive a distributed run unchanged.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import RunCancelledError

if TYPE_CHECKING:
    from engine.binding import BoundArg, BoundCall
    from engine.distributed.dispatch import Dispatcher
    from engine.distributed.runtime import DistributedRuntime
    from engine.slots import SlotLease

__all__ = ["RunRecord", "DistInFlight"]


class RunRecord:
    """The completion state of one run. The dispatcher writes it under its lock; done flips once."""

    __slots__ = ("id", "notify", "_dispatcher", "_event", "cancelled", "error", "remaining", "waiting",
                 "created_ns", "sealed_ns", "first_start_ns", "last_end_ns", "done_ns", "busy_ns")

    def __init__(self, run_id: int, notify: bool, dispatcher: "Dispatcher", now_ns: int) -> None:
        self.id = run_id
        self.notify = notify  # announce the completion on the runtime's notifier (async runs)
        self._dispatcher = dispatcher
        self._event = threading.Event()
        self.cancelled = False
        self.error: BaseException | None = None  # the first failure; later ones are dropped
        self.remaining = 0  # submissions not yet complete
        self.waiting: list[Any] = []  # submissions not yet sent (skipped on failure or cancel)
        self.created_ns = now_ns
        self.sealed_ns = -1
        self.first_start_ns = -1
        self.last_end_ns = -1
        self.done_ns = -1
        self.busy_ns = 0

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def cancel(self) -> bool:
        """Skips the submissions not yet sent; False when the run already completed."""
        return self._dispatcher.cancel(self)

    def times(self) -> dict[str, int]:
        """Host-clock timestamps (ns) like a single-device run's: first_start / last_end span the workers."""
        return {"created_ns": self.created_ns, "sealed_ns": self.sealed_ns, "first_start_ns": self.first_start_ns,
                "last_end_ns": self.last_end_ns, "done_ns": self.done_ns, "busy_ns": self.busy_ns}

    def _set_done(self) -> None:
        self._event.set()

    def __repr__(self) -> str:
        return f"<RunRecord {self.id} {'done' if self.done else 'pending'}>"


class DistInFlight:
    """A launched run: its record, its slot lease, the arguments it keeps alive, its outputs."""

    __slots__ = ("rt", "native", "lease", "call", "outputs", "copy_outs", "_lock", "_finished", "_result",
                 "_error", "_log")

    def __init__(self, rt: "DistributedRuntime", native: RunRecord, lease: "SlotLease", call: "BoundCall",
                 outputs: list[Any], copy_outs: list[tuple["BoundArg", np.ndarray]]) -> None:
        self.rt = rt
        self.native = native
        self.lease = lease
        self.call: BoundCall | None = call
        self.outputs = outputs
        self.copy_outs = copy_outs  # (argument, its buffer in the slot's region) for every host Out / InOut
        self._lock = threading.Lock()
        self._finished = False
        self._result: Any = None
        self._error: BaseException | None = None
        self._log: tuple[Any, int, int] | None = None  # (RunLog, dispatch_ns, launch_ns)

    def log_to(self, log: Any, dispatch_ns: int, launch_ns: int) -> None:
        """Records the run's timings in `log` (an engine._native.RunLog) when it is finished."""
        log.launched()
        self._log = (log, dispatch_ns, launch_ns)

    @property
    def id(self) -> int:
        return self.native.id

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self) -> None:
        """After the run completed: outcome, copies back to the caller's arrays, slot release. Exactly once."""
        with self._lock:
            if self._finished:
                return
            run = self.native
            assert run.done
            try:
                if run.error is not None:
                    self._error = run.error
                elif run.cancelled:
                    self._error = RunCancelledError(f"run {run.id} was cancelled")
                else:
                    for a, region in self.copy_outs:
                        target = a.writeback if a.writeback is not None else a.host
                        assert target is not None
                        np.copyto(target, region)
                    outs = tuple(self.outputs)
                    self._result = None if not outs else outs[0] if len(outs) == 1 else outs
            finally:
                self._finished = True
                self.call = None
                self.copy_outs = []
                self.rt._release(self)
                if self._log is not None:
                    log, dispatch_ns, launch_ns = self._log
                    kind = 2 if run.cancelled else 1 if run.error is not None else 0
                    log.record(dispatch_ns, run.created_ns, launch_ns or run.created_ns, run.sealed_ns,
                               run.first_start_ns, run.last_end_ns, run.done_ns, kind)

    def outcome(self) -> Any:
        assert self._finished
        if self._error is not None:
            raise self._error
        return self._result

    def error(self) -> BaseException | None:
        return self._error

    def result_and_error(self) -> tuple[Any, BaseException | None]:
        assert self._finished
        return (self._result if self._error is None else None), self._error
