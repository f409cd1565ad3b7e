"""Runs submitted by threads: their in-flight record and the RunHandle users hold."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.backend import RunState
    from engine.base_runtime import BaseRuntime

__all__ = ["InFlight", "RunHandle"]


class InFlight:
    """A run submitted by a thread: its state, and what finishing it takes (the arguments it keeps alive).

    Registered with its runtime, which finishes it when a thread waits for a
    slot or when closing; it may be finished from several threads, so
    finishing takes a lock.
    """

    __slots__ = ("rt", "run", "id", "payload", "_lock", "_finished", "_result", "_error")

    def __init__(self, rt: "BaseRuntime[Any]", run: "RunState", run_id: int, payload: Any) -> None:
        self.rt = rt
        self.run = run
        self.id = run_id
        self.payload: Any = payload
        self._lock = threading.Lock()
        self._finished = False
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self) -> None:
        """After the run completed: outcome, write-backs, the slot's release. Exactly once."""
        with self._lock:
            if self._finished:
                return
            payload = self.payload
            assert payload is not None
            try:
                self._result, self._error = self.rt.finish(self.run, self.id, payload)
            except Exception as e:  # a write-back into the caller's array failed: the run's error
                self._error = e
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
        if not self._inflight.run.done:
            return False
        self._inflight.finish()  # write-backs and slot release, once
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the run completed (True) or the timeout passed (False)."""
        if not self._inflight.run.wait(timeout):
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
        return self._inflight.run.cancel()

    def times(self) -> dict[str, int]:
        """Timestamps (ns, on the runtime's clock): created, sealed (host work done), first_start,
        last_end (device work), done; busy_ns is the summed task time."""
        return self._inflight.run.times()

    def __repr__(self) -> str:
        return f"<RunHandle {self.id} {'done' if self.done else 'pending'}>"
