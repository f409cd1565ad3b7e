"""Admission to the runtime's pipeline slots: by priority, aged so that nobody starves.

The runtime's slot pool only offers a non-blocking lease. Waiting is done here,
on the event loop: a dispatch that finds no free slot (or finds others already
waiting) queues up, and every time slots free up they are handed to the
waiters in rank order. Handing the lease over (instead of waking waiters to
race for it) is what makes the order strict: a newcomer can never take a slot
that a waiter was woken for.

The rank. A waiter that arrived at time t with priority p ranks at
t - p * aging: the smallest rank is admitted first, ties in arrival order. So
a priority step is worth `aging` seconds of waiting: among dispatches waiting
together, a higher priority goes first unless the lower one has waited more
than `aging` seconds per step longer, and a dispatch is overtaken only by
dispatches that arrive within (their priority - its priority) * aging seconds
after it. That bounds how long a low priority can starve, whatever the load of
higher ones. aging=None ranks by priority alone (FIFO within one): strict, and
a steady stream of higher priorities can starve a lower one for ever. The rank
is fixed at arrival, so the queue is an ordinary heap.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Callable, Generic, TypeVar

from engine.errors import ClosedError

__all__ = ["Admission"]

W = TypeVar("W")
# What the runtime's lease source hands out (an engine.backend.Lease).
L = TypeVar("L")


class Admission(Generic[W, L]):
    """A priority queue of waiters over a non-blocking lease source.

    on_grant(waiter, lease) is called (on the loop thread, synchronously) when
    a waiter reaches the front and a slot is free; on_fail(waiter, error) when
    no slot will ever come (the runtime was closed). aging_ns: what a priority
    step is worth in waiting time (None: strict priorities).
    """

    def __init__(self, try_lease: Callable[[], L | None], on_grant: Callable[[W, L], None],
                 on_fail: Callable[[W, BaseException], None], *, aging_ns: int | None = None) -> None:
        self._try_lease = try_lease
        self._on_grant = on_grant
        self._on_fail = on_fail
        self._aging_ns = aging_ns
        # [rank, arrival number, waiter]; a waiter that gave up stays in the heap with waiter None
        # (removing from the middle of a heap is O(n); skipping it when it surfaces is O(log n)).
        self._heap: list[list] = []
        self._entries: dict[int, list] = {}  # id(waiter) -> its heap entry
        self._arrivals = itertools.count()
        self._refilling = False

    @property
    def waiting(self) -> int:
        return len(self._entries)

    def try_acquire(self) -> L | None:
        """A lease at once, unless there is none free or somebody is already waiting (no barging)."""
        if self._entries:
            return None
        return self._try_lease()

    def enqueue(self, waiter: W, now_ns: int = 0, priority: int = 0) -> None:
        rank = -priority if self._aging_ns is None else now_ns - priority * self._aging_ns
        entry = [rank, next(self._arrivals), waiter]
        self._entries[id(waiter)] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, waiter: W) -> bool:
        """Takes a waiter out of the queue (it gave up). False when it was not waiting."""
        entry = self._entries.pop(id(waiter), None)
        if entry is None:
            return False
        entry[2] = None
        if not self._entries:
            self._heap.clear()  # only the given-up are left
        return True

    def _pop(self) -> W:
        while True:
            entry = heapq.heappop(self._heap)
            if entry[2] is not None:
                del self._entries[id(entry[2])]
                return entry[2]

    def refill(self) -> None:
        """Hands every free slot to the waiters at the front. Call it whenever a slot may have freed."""
        if self._refilling:  # a grant that failed and released its lease re-enters: the loop below goes on
            return
        self._refilling = True
        try:
            while self._entries:
                try:
                    lease = self._try_lease()
                except ClosedError as e:
                    self.fail_all(e)
                    return
                if lease is None:
                    return
                self._on_grant(self._pop(), lease)
        finally:
            self._refilling = False

    def fail_all(self, error: BaseException) -> None:
        """Every waiter gets `error` (for close: they were never admitted), in rank order."""
        waiters = [e[2] for e in sorted(self._heap) if e[2] is not None]
        self._heap, self._entries = [], {}
        for w in waiters:
            self._on_fail(w, error)
