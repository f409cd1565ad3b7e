"""One distributed run's record: what the dispatcher completes, and what completing it does.

RunRecord plays the part of the native run object of a single-device
runtime (id, done, wait, cancel, times, outcome), so that engine.RunHandle,
engine.base_runtime.finish_run and scheduler.AsyncRuntime drive a
distributed run unchanged. Like a native run, it completes in one step
before anyone can see it done: its outputs go from the slot's shared region
into the caller's arrays, its slot is released, its timings are logged.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from engine import _native
    from engine.distributed.dispatch import Dispatcher
    from engine.slots import SlotLease

__all__ = ["RunRecord"]

_COMPLETED, _FAILED, _CANCELLED = 0, 1, 2  # engine._native.RunLog's kinds


class RunRecord:
    """The completion state of one run. The dispatcher writes it under its lock; done flips once."""

    __slots__ = ("id", "notify", "_dispatcher", "_done", "_until_done", "cancelled", "error", "remaining", "waiting",
                 "created_ns", "sealed_ns", "first_start_ns", "last_end_ns", "done_ns", "busy_ns",
                 "_slots", "lease", "copy_outs", "log")

    def __init__(self, run_id: int, notify: bool, dispatcher: "Dispatcher", now_ns: int,
                 slots: "_native.SlotTable", lease: "SlotLease") -> None:
        self.id = run_id
        self.notify = notify  # announce the completion on the runtime's notifier (async runs)
        self._dispatcher = dispatcher
        # Held until the run completes: a waiter acquires it (and passes it on). A plain lock, made per run
        # at C speed; a threading.Event builds a Condition in Python, a measurable share of a small run.
        self._done = False
        self._until_done = threading.Lock()
        self._until_done.acquire()
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
        self._slots = slots
        self.lease = lease  # the slot it holds from admission until it completes
        self.copy_outs: list[tuple[np.ndarray, np.ndarray]] = []  # (caller's contiguous array, its region)
        self.log: tuple[Any, int, int] | None = None  # (RunLog, dispatch_ns, launch_ns) for an AsyncRuntime

    @property
    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> bool:
        if self._done:
            return True
        read = self._dispatcher.read_until(self, timeout)  # a caller that reads its own replies
        if read is not None:
            return read
        if self._until_done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._until_done.release()  # the next waiter's turn
        return self._done

    def cancel(self) -> bool:
        """Skips the submissions not yet sent; False when the run already completed."""
        return self._dispatcher.cancel(self)

    def outcome(self) -> tuple[BaseException | None, bool]:
        """(the run's error or None, cancelled) of a completed run."""
        return self.error, self.cancelled

    def times(self) -> dict[str, int]:
        """Host-clock timestamps (ns) like a single-device run's: first_start / last_end span the workers."""
        return {"created_ns": self.created_ns, "sealed_ns": self.sealed_ns, "first_start_ns": self.first_start_ns,
                "last_end_ns": self.last_end_ns, "done_ns": self.done_ns, "busy_ns": self.busy_ns}

    def complete(self) -> None:
        """Every submission is back (or skipped): outputs out, slot free, timings logged; then done.

        The dispatcher calls it once, outside its lock. The caller then
        announces the run on the notifier if it notifies.
        """
        try:
            if self.error is None and not self.cancelled:
                try:
                    for target, region in self.copy_outs:
                        np.copyto(target, region)
                except Exception as e:  # the run's outputs could not be delivered: its error
                    self.error = e
        finally:
            self.copy_outs = []
            try:
                self._slots.release(*self.lease)
                if self.log is not None:
                    log, dispatch_ns, launch_ns = self.log
                    kind = _CANCELLED if self.cancelled else _FAILED if self.error is not None else _COMPLETED
                    log.record(dispatch_ns, self.created_ns, launch_ns or self.created_ns, self.sealed_ns,
                               self.first_start_ns, self.last_end_ns, self.done_ns, kind)
                    self.log = None
            finally:
                self._done = True
                self._until_done.release()

    def __repr__(self) -> str:
        return f"<RunRecord {self.id} {'done' if self.done else 'pending'}>"
