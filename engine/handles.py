"""RunHandle: a run submitted by a thread, as its caller holds it and its runtime tracks it."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.backend import RunState
    from engine.base_runtime import BaseRuntime

__all__ = ["RunHandle"]


class RunHandle:
    """The handle of one submitted run: wait for it, get its outputs or its error.

    The runtime registers the same object as the run in flight (one object
    per run: a small run's host cost is counted in allocations) and finishes
    it when a thread waits for a slot or when closing; it may be finished
    from several threads, so finishing takes a lock.
    """

    __slots__ = ("_rt", "_run", "_id", "_payload", "_lock", "_finished", "_result", "_error")

    def __init__(self, rt: "BaseRuntime[Any]", run: "RunState", run_id: int, payload: Any) -> None:
        self._rt = rt
        self._run = run
        self._id = run_id
        self._payload: Any = payload  # what finishing takes; keeps the run's arguments alive until then
        self._lock = threading.Lock()
        self._finished = False
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def id(self) -> int:
        return self._id

    @property
    def done(self) -> bool:
        """True once the run completed and its outputs are in place."""
        if not self._finished:
            if not self._run.done:
                return False
            self._finish()  # write-backs and slot release, once
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the run completed (True) or the timeout passed (False)."""
        if not self._finished:
            if not self._run.wait(timeout):
                return False
            self._finish()
        return True

    def result(self, timeout: float | None = None) -> Any:
        """The outputs (one value, a tuple, or None), or the run's error raised."""
        if not self.wait(timeout):
            raise TimeoutError(f"run {self._id} did not complete within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise TimeoutError(f"run {self._id} did not complete within {timeout} s")
        return self._error

    def cancel(self) -> bool:
        """Skips the run's tasks that have not started; the result is discarded."""
        return self._run.cancel()

    def times(self) -> dict[str, int]:
        """Timestamps (ns, on the runtime's clock): created, sealed (host work done), first_start,
        last_end (device work), done; busy_ns is the summed task time."""
        return self._run.times()

    # -- the runtime's side ------------------------------------------------------------------------
    def _finish(self) -> None:
        """After the run completed: outcome, write-backs, the runtime's record of it dropped. Exactly once."""
        with self._lock:
            if self._finished:
                return
            try:
                self._result, self._error = self._rt.finish(self._run, self._id, self._payload)
            except Exception as e:  # a write-back into the caller's array failed: the run's error
                self._error = e
            finally:
                self._finished = True
                self._payload = None  # drop the arguments: the run no longer needs them
                self._rt._forget(self._id)

    def __repr__(self) -> str:
        return f"<RunHandle {self._id} {'done' if self.done else 'pending'}>"
