"""The completion pump: the one way completed runs reach the event loop.

The native notifier queues the id of every completed run and makes its
eventfd readable once per batch. The pump waits for that fd on the loop and
calls on_ready(), which drains every run completed since the last wake-up.
No thread per run, no polling.

Under asyncio the fd is registered once with loop.add_reader(), so a wake-up
is a plain loop callback: no task switch, and no epoll re-registration per
wake-up (anyio.wait_readable() adds and removes the reader on every call,
which costs about as much as the whole round trip of a small run). Other
backends (trio) run a task looping on anyio.wait_readable().
"""

from __future__ import annotations

import asyncio
from typing import Callable

import anyio
from anyio.abc import TaskGroup, TaskStatus

__all__ = ["CompletionPump"]


class CompletionPump:
    """Calls on_ready() on the loop thread each time the fd becomes readable, until stop()."""

    def __init__(self, fd: int, on_ready: Callable[[], None]) -> None:
        self._fd = fd
        self._on_ready = on_ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scope: anyio.CancelScope | None = None

    async def start(self, tg: TaskGroup) -> None:
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # not asyncio (an anyio backend such as trio)
            loop = None
        if loop is not None:
            try:
                loop.add_reader(self._fd, self._on_ready)
            except NotImplementedError:  # a loop without add_reader (Windows' proactor): the task below serves
                pass
            else:
                self._loop = loop
                return
        await tg.start(self._run)

    async def _run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # Shielded: the pump must outlive a cancellation of the code around
        # `async with AsyncRuntime(...)`, because closing drains through it.
        # Only stop() ends it.
        with anyio.CancelScope(shield=True) as scope:
            self._scope = scope
            task_status.started()
            fd, on_ready = self._fd, self._on_ready
            while True:
                await anyio.wait_readable(fd)
                on_ready()

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
            self._loop = None
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None
