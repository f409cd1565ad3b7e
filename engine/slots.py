"""Pipeline slots: `depth` buffer sets, each leased to exactly one run at a time.

A lease carries the slot's generation. Releasing advances the generation, so
a stale lease (released already, or from an earlier run) is rejected and a
slot can never be released twice.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine import _native
    from engine.tensor import Allocation

__all__ = ["Slot", "Lease", "SlotPool", "StaleLeaseError"]


class StaleLeaseError(ValueError):
    """A lease that no longer holds its slot was released."""


@dataclass
class Slot:
    index: int
    buffers: dict[str, "Allocation"]  # one per host tensor parameter, sized from the bounds
    scratch: "Allocation | None"
    accessor: "_native.HostAccessor"
    generation: int = 0
    leased: bool = False
    scratch_used: int = 0
    # (parameter name, shape) -> (view of its buffer at that shape, buffer address): shapes repeat run after run.
    views: dict[tuple[str, tuple[int, ...]], tuple[Any, int]] = field(default_factory=dict)


class Lease:
    """One run's hold on a slot, valid while the slot is still at `generation`."""

    # A plain slotted class: a lease is made per run, and a frozen dataclass's
    # __init__ costs several times more.
    __slots__ = ("slot", "generation")

    def __init__(self, slot: Slot, generation: int) -> None:
        self.slot = slot
        self.generation = generation

    def __repr__(self) -> str:
        return f"Lease(slot={self.slot.index}, generation={self.generation})"


class SlotPool:
    """The free slots, handed out in lease order.

    lock: the lock guarding the pool; an owner that already holds its own
    lock around every lease and release passes it (an RLock), so a lease
    costs one lock instead of two.
    """

    def __init__(self, slots: list[Slot], lock: "threading.RLock | None" = None) -> None:
        self.slots = slots
        self._free: deque[Slot] = deque(slots)
        self._lock = lock if lock is not None else threading.Lock()

    @property
    def depth(self) -> int:
        return len(self.slots)

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def try_lease(self) -> Lease | None:
        with self._lock:
            return self.lease_locked()

    def release(self, lease: Lease) -> None:
        with self._lock:
            self.release_locked(lease)

    # For an owner that already holds the pool's lock (its own RLock, passed at construction):
    # one acquisition per lease or release on the per-run path instead of a nested one.
    def lease_locked(self) -> Lease | None:
        free = self._free
        if not free:
            return None
        slot = free.popleft()
        slot.leased = True
        slot.scratch_used = 0
        return Lease(slot, slot.generation)

    def release_locked(self, lease: Lease) -> None:
        slot = lease.slot
        if not slot.leased or slot.generation != lease.generation:
            raise StaleLeaseError(
                f"stale lease of slot {slot.index}: generation {lease.generation}, slot is at {slot.generation}")
        slot.generation += 1
        slot.leased = False
        self._free.append(slot)
