"""AsyncRuntime.stream(): a depth-bounded pipeline over an iterable of argument tuples.

The consumer's own task dispatches: each __anext__ tops the window up to
`depth` runs, waits for the next output, and dispatches the next item before
handing the output over, so `depth` runs stay in flight while the loop body
works on the output. No helper task is involved, which keeps cancellation
simple: whatever interrupts the consumer (an exception, a cancel scope,
leaving the loop) ends the stream and cancels its runs.

Leaving an `async for` early drops the iterator; CPython finalises it at once
and that cancels the runs still in flight (device work not started is
skipped). For deterministic cleanup independent of garbage collection use
`async with art.stream(src) as s: async for y in s: ...` or `await s.aclose()`.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, AsyncIterable, AsyncIterator, Iterable, Iterator, Union

import anyio

from engine.errors import ClosedError, RunCancelledError
from scheduler._futures import RunFuture

if TYPE_CHECKING:
    from scheduler.runtime import AsyncRuntime

__all__ = ["RunStream", "StreamItemError"]

Source = Union[Iterable[Any], AsyncIterable[Any]]


class StreamItemError(Exception):
    """Item `index` of a stream failed; the original error is `error` (and __cause__).

    Raised for the item's argument errors (TypeError, ValueError), its run's
    errors (engine.KernelError) and errors of the source while producing it.
    engine.ClosedError and engine.RunCancelledError are not the item's fault
    and propagate unwrapped.
    """

    def __init__(self, index: int, error: BaseException) -> None:
        self.index = index
        self.error = error
        super().__init__(f"stream item {index} failed: {type(error).__name__}: {error}")

    def __reduce__(self) -> Any:
        return (type(self), (self.index, self.error))


class _Entry:
    __slots__ = ("index", "future", "error")

    def __init__(self, index: int, future: RunFuture | None, error: BaseException | None) -> None:
        self.index = index
        self.future = future
        self.error = error


def _as_args(item: Any) -> tuple[Any, ...]:
    return item if isinstance(item, tuple) else (item,)


class RunStream(AsyncIterator[Any]):
    """Outputs of one run per source item: in input order, or (index, output) as they complete."""

    def __init__(self, art: "AsyncRuntime", source: Source, *, ordered: bool = True, depth: int | None = None,
                 priority: int = 0) -> None:
        if depth is None:
            depth = art.depth
        if isinstance(depth, bool) or not isinstance(depth, int):
            raise TypeError(f"stream depth must be an int, not {type(depth).__name__}")
        if depth <= 0:
            raise ValueError(f"stream depth must be positive, got {depth}")
        self._priority = priority
        self._iter: Iterator[Any] | None = None
        self._aiter: AsyncIterator[Any] | None = None
        if hasattr(source, "__aiter__"):
            self._aiter = source.__aiter__()
        elif hasattr(source, "__iter__"):
            self._iter = iter(source)
        else:
            raise TypeError(f"stream() needs an iterable or an async iterable, not {type(source).__name__}")
        self._art = art
        self._ordered = bool(ordered)
        self._depth = depth
        self._window: deque[_Entry] = deque()  # dispatched and not yet handed out, in input order
        self._ready: deque[_Entry] = deque()  # unordered: done, in completion order
        self._ready_event: anyio.Event | None = None
        self._next_index = 0
        self._exhausted = False  # no more items will be dispatched
        self._finished = False

    # -- iteration -----------------------------------------------------------------------
    def __aiter__(self) -> "RunStream":
        return self

    async def __anext__(self) -> Any:
        if self._finished:
            raise StopAsyncIteration
        try:
            if not self._window:
                await self._fill()
            if not self._window:
                self._finished = True
                raise StopAsyncIteration
            entry = await (self._next_in_order() if self._ordered else self._next_completed())
            value = self._take(entry)
            await self._fill()  # the output's slot is free: keep `depth` runs going while the consumer works
            return value
        except StopAsyncIteration:
            raise
        except BaseException:
            self._cancel_rest()
            raise

    async def _next_in_order(self) -> _Entry:
        entry = self._window[0]
        if entry.future is not None:
            await entry.future.wait_done()
        self._window.popleft()
        return entry

    async def _next_completed(self) -> _Entry:
        while not self._ready:
            self._ready_event = anyio.Event()
            await self._ready_event.wait()
        entry = self._ready.popleft()
        self._window.remove(entry)
        return entry

    def _take(self, entry: _Entry) -> Any:
        error = entry.error
        if error is None:
            fut = entry.future
            assert fut is not None
            if fut.cancelled():
                fut.result()  # raises RunCancelledError
            error = fut.exception()
            if error is None:
                out = fut.result()
                return out if self._ordered else (entry.index, out)
        if isinstance(error, (ClosedError, RunCancelledError)):
            raise error
        raise StreamItemError(entry.index, error) from error

    # -- feeding ------------------------------------------------------------------------------
    async def _fill(self) -> None:
        while not self._exhausted and len(self._window) < self._depth:
            index = self._next_index
            try:
                if self._aiter is not None:
                    item = await self._aiter.__anext__()
                else:
                    assert self._iter is not None
                    item = next(self._iter)
            except (StopIteration, StopAsyncIteration):
                self._exhausted = True
                return
            except Exception as e:  # the source failed to produce item `index`
                self._failed(index, e)
                return
            self._next_index += 1
            try:
                fut = await self._art.dispatch(*_as_args(item), priority=self._priority)
            except Exception as e:  # bad arguments, a failing orchestration, a closed runtime
                self._failed(index, e)
                return
            entry = _Entry(index, fut, None)
            self._window.append(entry)
            if not self._ordered:
                fut.add_done_callback(partial(self._run_done, entry))

    def _failed(self, index: int, error: BaseException) -> None:
        """Item `index` could not be dispatched: it surfaces in its turn and nothing later is dispatched."""
        self._exhausted = True
        entry = _Entry(index, None, error)
        self._window.append(entry)
        if not self._ordered:
            self._mark_ready(entry)

    def _run_done(self, entry: _Entry, _future: RunFuture) -> None:
        """The done callback of an unordered stream's run."""
        self._mark_ready(entry)

    def _mark_ready(self, entry: _Entry) -> None:
        if self._finished:
            return
        self._ready.append(entry)
        if self._ready_event is not None:
            self._ready_event.set()

    # -- ending ---------------------------------------------------------------------------------
    def _cancel_rest(self) -> None:
        """Ends the stream: its runs still in flight are cancelled (their slots free up as they finish)."""
        self._finished = True
        self._exhausted = True
        window, self._window = self._window, deque()
        self._ready.clear()
        for entry in window:
            if entry.future is not None:
                entry.future.cancel()

    async def aclose(self) -> None:
        """Ends the stream now, cancelling the runs still in flight."""
        self._cancel_rest()
        await anyio.lowlevel.checkpoint()

    async def __aenter__(self) -> "RunStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._cancel_rest()

    def __del__(self) -> None:
        if not getattr(self, "_finished", True):  # getattr: __init__ may have raised half-way
            self._cancel_rest()
