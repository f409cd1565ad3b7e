"""RunFuture: the awaitable outcome of one dispatched run."""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Any, Callable, Generator

from engine.errors import RunCancelledError
from scheduler._signal import Signal

if TYPE_CHECKING:
    import asyncio

__all__ = ["RunFuture", "InvalidStateError"]

_PENDING, _DONE, _CANCELLED = 0, 1, 2


class InvalidStateError(RuntimeError):
    """result() or exception() was asked of a RunFuture that is not done yet."""


class RunFuture:
    """The outcome of one run: await it (any number of times, from several tasks) for its outputs.

    done(), cancelled(), cancel(), result() and exception() follow
    concurrent.futures: result() returns the outputs or raises the run's error
    (engine.KernelError for a failing kernel); a cancelled future raises
    engine.RunCancelledError from await, result() and exception().

    The future belongs to the event loop that dispatched it; from another
    thread reach it through anyio.from_thread.

    Cancelling the run is explicit (cancel()): a task that is cancelled while
    awaiting the future stops waiting, and the run goes on for the other
    awaiters. AsyncRuntime.call() and stream() cancel the runs they own.
    """

    __slots__ = ("_native", "_payload", "_loop", "_state", "_result", "_error", "_signal", "_callbacks", "run_id",
                 "_complete_early", "__weakref__")

    def __init__(self, native: Any, run_id: int, payload: Any, loop: "asyncio.AbstractEventLoop | None",
                 complete_early: "Callable[[RunFuture], None]") -> None:
        # The engine's run (done, cancel()) and what finishing it takes, until the run is finished.
        self._native: Any = native
        self._payload: Any = payload
        self._loop = loop  # None under a backend other than asyncio
        self._state = _PENDING
        self._result: Any = None
        self._error: BaseException | None = None
        self._signal: Signal | None = None  # made by the first awaiter that has to wait
        self._callbacks: list[Callable[[RunFuture], None]] | None = None
        self.run_id = run_id
        # Set by the AsyncRuntime: finishes this run on the spot when an awaiter finds the device already done.
        self._complete_early = complete_early

    # -- the concurrent.futures surface ----------------------------------------------
    def done(self) -> bool:
        return self._state != _PENDING

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def cancel(self) -> bool:
        """Cancels the run: device work not yet started is skipped, work in progress finishes.

        Returns False when the future is already done or the run already
        completed on the device (its outcome is then delivered as usual). The
        run keeps its slot until the device has let go of it; the completion
        pump releases it then.
        """
        if self._state != _PENDING:
            return False
        native = self._native
        assert native is not None
        if not native.cancel():
            return False
        self._settle(_CANCELLED, None, RunCancelledError(f"run {self.run_id} was cancelled"))
        return True

    def result(self) -> Any:
        """The run's outputs (one value, a tuple, or None); raises its error."""
        if self._state == _PENDING:
            raise InvalidStateError(f"run {self.run_id} is not done yet")
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self) -> BaseException | None:
        """The run's error, or None when it succeeded. A cancelled future raises RunCancelledError."""
        if self._state == _PENDING:
            raise InvalidStateError(f"run {self.run_id} is not done yet")
        if self._state == _CANCELLED:
            assert self._error is not None
            raise self._error
        return self._error

    def __await__(self) -> Generator[Any, None, Any]:
        # One generator delegating straight to the signal: no coroutine frames on every await of a small run.
        if self._state == _PENDING:
            self._finish_if_done()
            if self._state == _PENDING:
                yield from self._wait_signal()
        return self.result()

    async def wait_done(self) -> None:
        """Waits until the future is done, without taking its outcome."""
        if self._state == _PENDING:
            self._finish_if_done()
            if self._state == _PENDING:
                await self._wait_signal()

    def _finish_if_done(self) -> None:
        """When the device is already done with the run, finishes it now.

        The completion pump would do the same at the loop's next turn; doing
        it here spares the awaiter that turn (a wake-up and a task switch),
        which is most of a small run's round trip. The pump then finds the run
        gone and skips it.
        """
        native = self._native
        if native is not None and native.done:
            self._complete_early(self)

    @types.coroutine
    def _wait_signal(self) -> Generator[Any, None, None]:
        signal = self._signal
        if signal is None:
            signal = self._signal = Signal(self._loop)
        yield from signal.__await__()

    def __repr__(self) -> str:
        state = ("pending", "done", "cancelled")[self._state]
        return f"<RunFuture run={self.run_id} {state}>"

    # -- for the scheduler -----------------------------------------------------------------
    @property
    def native(self) -> Any:
        """The engine's run (engine._native.Run, or a distributed run's record) until it is finished."""
        return self._native

    def add_done_callback(self, fn: Callable[["RunFuture"], None]) -> None:
        """Calls fn(self) on the loop thread once the future is done (at once when it is)."""
        if self._state != _PENDING:
            fn(self)
            return
        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append(fn)

    def _settle_outcome(self, result: Any, error: BaseException | None) -> None:
        """The finished run's outcome (ignored when the future was cancelled: the result is discarded)."""
        if self._state == _PENDING:
            self._settle(_DONE, result, error)
        else:
            self._native = self._payload = None

    def _settle(self, state: int, result: Any, error: BaseException | None) -> None:
        self._state = state
        self._result = result
        self._error = error
        if state == _DONE:
            self._native = self._payload = None  # the run is over: let its native record go
        if self._signal is not None:
            self._signal.set()
        callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            fn(self)
