"""Jobs (a dispatch on its way to becoming a run) and the worker-thread launcher.

A Job is what waits in the admission queue: the bound call, and once a slot
is granted, either the run's future or the error that launching raised.

ThreadLauncher is the `orchestrate_in_thread=True` option: staging and the
program's orchestration function run in a worker thread instead of on the
loop. Launches go through one queue, in admission order, one batch per thread
hop: the task graph must receive runs in the order they were admitted (runs
that share memory execute in that order), and orchestration is sequential
host work anyway.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Union

import anyio
from anyio.abc import TaskStatus

from scheduler._futures import RunFuture
from scheduler._signal import Signal

if TYPE_CHECKING:
    import asyncio

    from engine.binding import BoundCall
    from engine.call_cache import CachedBinding
    from engine.backend import Launched as LaunchedRun

__all__ = ["Job", "ThreadLauncher", "Launched"]

# What launching one job gives: the launched run, or the error it raised (the lease is released by then).
Launched = Union["LaunchedRun", BaseException]


class Job:
    """One dispatch: bound, then leased, then launched (a future) or failed (an error)."""

    __slots__ = ("call", "t_dispatch", "lease", "future", "error", "signal", "abandoned")

    def __init__(self, call: "BoundCall | CachedBinding", t_dispatch: int,
                 loop: "asyncio.AbstractEventLoop | None") -> None:
        self.call: BoundCall | CachedBinding | None = call
        self.t_dispatch = t_dispatch
        self.lease: Any = None  # what admission granted (see scheduler._admission)
        self.future: RunFuture | None = None
        self.error: BaseException | None = None
        self.signal = Signal(loop)
        self.abandoned = False  # its dispatch gave up while the worker thread was launching it

    @property
    def settled(self) -> bool:
        return self.signal.is_set()

    async def wait(self) -> None:
        await self.signal.wait()

    def outcome(self) -> RunFuture:
        if self.error is not None:
            raise self.error
        assert self.future is not None
        return self.future

    def settle(self, future: RunFuture | None, error: BaseException | None = None) -> None:
        self.future, self.error = future, error
        self.call = None
        self.signal.set()


class ThreadLauncher:
    """Launches queued jobs in a worker thread, in queue order, and reports each batch back on the loop."""

    def __init__(self, launch: Callable[[Job], Launched],
                 on_launched: Callable[[list[tuple[Job, Launched]]], None]) -> None:
        self._launch = launch
        self._on_launched = on_launched
        self._queue: deque[Job] = deque()
        self._busy = False
        self._wakeup: anyio.Event | None = None
        self._scope: anyio.CancelScope | None = None

    @property
    def idle(self) -> bool:
        return not self._queue and not self._busy

    def submit(self, job: Job) -> None:
        """Queues a job that holds a lease."""
        self._queue.append(job)
        if self._wakeup is not None:
            self._wakeup.set()

    def withdraw(self, job: Job) -> bool:
        """Takes a job back before its launch started (its lease is the caller's to release)."""
        try:
            self._queue.remove(job)
        except ValueError:
            return False
        return True

    def withdraw_all(self) -> list[Job]:
        jobs, self._queue = list(self._queue), deque()
        return jobs

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        # Shielded for the same reason as the completion pump: closing needs
        # it after the surrounding code was cancelled. Only stop() ends it,
        # and only once idle: a batch in the thread is never abandoned.
        with anyio.CancelScope(shield=True) as scope:
            self._scope = scope
            task_status.started()
            while True:
                while not self._queue:
                    self._wakeup = anyio.Event()
                    await self._wakeup.wait()
                    self._wakeup = None
                batch = list(self._queue)
                self._queue.clear()
                self._busy = True
                try:
                    with anyio.CancelScope(shield=True):
                        results = await anyio.to_thread.run_sync(self._launch_batch, batch)
                finally:
                    self._busy = False
                self._on_launched(list(zip(batch, results)))

    def _launch_batch(self, batch: list[Job]) -> list[Any]:
        return [self._launch(job) for job in batch]

    def stop(self) -> None:
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None
