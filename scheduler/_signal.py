"""Signal: a one-shot "it happened" that any number of tasks can wait for.

It is anyio.Event in spirit. Under asyncio it is built on bare loop futures,
one per waiter: anyio.Event wraps asyncio.Event, and the two layers (plus the
backend lookup anyio does when an Event is made) are a measurable part of a
small run's round trip. Each waiter has its own future, so a waiter that is
cancelled cancels only its own. Other backends use anyio.Event.
"""

from __future__ import annotations

import asyncio
from typing import Any, Generator

import anyio

__all__ = ["Signal", "running_asyncio_loop"]


def running_asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop, or None under another anyio backend (trio)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Signal:
    """Set once, from the loop thread; wait() returns once it is set."""

    __slots__ = ("_loop", "_set", "_waiters", "_event")

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self._loop = loop
        self._set = False
        self._waiters: list[asyncio.Future[None]] | None = None
        self._event: anyio.Event | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, None
        if waiters:
            for w in waiters:
                if not w.done():
                    w.set_result(None)
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        await self

    def __await__(self) -> Generator[Any, None, None]:
        # A generator rather than a coroutine: an awaiter that delegates with
        # `yield from signal.__await__()` adds no frame of its own.
        if self._set:
            return
        loop = self._loop
        if loop is None:
            if self._event is None:
                self._event = anyio.Event()
            yield from self._event.wait().__await__()
            return
        w = loop.create_future()
        if self._waiters is None:
            self._waiters = [w]
        else:
            self._waiters.append(w)
        try:
            yield from w.__await__()
        finally:
            if not w.done():  # cancelled: forget this waiter only
                w.cancel()
            if self._waiters is not None:
                try:
                    self._waiters.remove(w)
                except ValueError:
                    pass
