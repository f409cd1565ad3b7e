"""FIFO admission to the runtime's pipeline slots.

The runtime's slot pool only offers a non-blocking lease. Waiting is done here,
on the event loop: a dispatch that finds no free slot (or finds others already
waiting) queues up, and every time slots free up they are handed to the
waiters in arrival order. Handing the lease over (instead of waking waiters to
race for it) is what makes the order strict: a newcomer can never take a slot
that a waiter was woken for.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Generic, TypeVar

from engine.errors import ClosedError

__all__ = ["Admission"]

W = TypeVar("W")
# What the runtime's lease source hands out (an engine.backend.Lease).
L = TypeVar("L")


class Admission(Generic[W, L]):
    """A FIFO of waiters over a non-blocking lease source.

    on_grant(waiter, lease) is called (on the loop thread, synchronously) when
    a waiter reaches the front and a slot is free; on_fail(waiter, error) when
    no slot will ever come (the runtime was closed).
    """

    def __init__(self, try_lease: Callable[[], L | None], on_grant: Callable[[W, L], None],
                 on_fail: Callable[[W, BaseException], None]) -> None:
        self._try_lease = try_lease
        self._on_grant = on_grant
        self._on_fail = on_fail
        self._waiters: deque[W] = deque()
        self._refilling = False

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self) -> L | None:
        """A lease at once, unless there is none free or somebody is already waiting (no barging)."""
        if self._waiters:
            return None
        return self._try_lease()

    def enqueue(self, waiter: W) -> None:
        self._waiters.append(waiter)

    def remove(self, waiter: W) -> bool:
        """Takes a waiter out of the queue (it gave up). False when it was not waiting."""
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return False
        return True

    def refill(self) -> None:
        """Hands every free slot to the waiters at the front. Call it whenever a slot may have freed."""
        if self._refilling:  # a grant that failed and released its lease re-enters: the loop below goes on
            return
        self._refilling = True
        try:
            while self._waiters:
                try:
                    lease = self._try_lease()
                except ClosedError as e:
                    self.fail_all(e)
                    return
                if lease is None:
                    return
                self._on_grant(self._waiters.popleft(), lease)
        finally:
            self._refilling = False

    def fail_all(self, error: BaseException) -> None:
        """Every waiter gets `error` (for close: they were never admitted)."""
        waiters, self._waiters = self._waiters, deque()
        for w in waiters:
            self._on_fail(w, error)
