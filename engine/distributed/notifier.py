"""The completion notifier of a distributed runtime, shaped like the native engine's.

scheduler.AsyncRuntime reads three members of `runtime._engine`: notifier_fd
(readable once completions are queued), drain_completed() (the ids of the
runs completed since the last drain) and now_ns() (the clock of run
timestamps). CompletionEngine offers exactly those, over an eventfd (a pipe
where eventfd does not exist).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import deque

__all__ = ["CompletionEngine"]


class CompletionEngine:
    """Queues completed run ids and makes one fd readable per batch.

    The fd stays open as long as this object lives (an AsyncRuntime holds it
    while its pump watches the fd, even after the runtime closed).
    """

    def __init__(self) -> None:
        self._ids: deque[int] = deque()
        self._lock = threading.Lock()
        self._pending = False  # a wake-up was written and not drained yet: batches wake the loop once
        fds: tuple[int, ...]  # what the finalizer closes: one eventfd, or both ends of a pipe
        if hasattr(os, "eventfd"):
            self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._wfd = self._fd
            fds = (self._fd,)
        else:  # not Linux: a self-pipe
            self._fd, self._wfd = os.pipe()
            os.set_blocking(self._fd, False)
            fds = (self._fd, self._wfd)
        self._finalizer = weakref.finalize(self, _close_fds, fds)

    @property
    def notifier_fd(self) -> int:
        return self._fd

    @staticmethod
    def now_ns() -> int:
        """The host clock every distributed run timestamp is on (workers convert theirs to it)."""
        return time.monotonic_ns()

    def post(self, run_id: int) -> None:
        """A run completed: queue its id and wake the reader unless a wake-up is already pending."""
        with self._lock:
            self._ids.append(run_id)
            if self._pending:
                return
            self._pending = True
        os.write(self._wfd, (1).to_bytes(8, "little"))

    def drain_completed(self) -> list[int]:
        """The ids of the runs completed since the last drain (possibly none)."""
        with self._lock:
            self._pending = False
            try:
                os.read(self._fd, 8 if self._fd == self._wfd else 4096)
            except BlockingIOError:
                pass
            ids = list(self._ids)
            self._ids.clear()
        return ids

    def close(self) -> None:
        self._finalizer()


def _close_fds(fds: tuple[int, ...]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
