"""Pipeline slots: `depth` buffer sets, each leased to exactly one run at a time.

A lease carries the slot's generation. Releasing advances the generation, so
a stale lease (released already, or from an earlier run) is rejected and a
slot can never be released twice.

A local Runtime keeps its lease state natively (engine._native.SlotTable: a
run takes its slot when it begins and frees it when it completes, with no
Python in between); Slot holds what the Python side needs of a slot, its
buffers and views. SlotPool is the same discipline in Python, for runtimes
whose runs complete in other processes (engine.distributed).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from engine import _native

if TYPE_CHECKING:
    from engine.tensor import Allocation

__all__ = ["Slot", "Lease", "SlotPool", "StaleLeaseError"]


StaleLeaseError = _native.StaleLeaseError
"""A lease that no longer holds its slot was released (a ValueError); raised by SlotPool and SlotTable alike."""


@dataclass
class Slot:
    """What the Python side needs of one local slot; its lease state is the native SlotTable's."""

    index: int
    buffers: dict[str, "Allocation"]  # one per host tensor parameter, sized from the bounds
    scratch: "Allocation | None"
    accessor: "_native.HostAccessor"
    # (parameter name, shape) -> (view of its buffer at that shape, buffer address): shapes repeat run after run.
    views: dict[tuple[str, tuple[int, ...]], tuple[Any, int]] = field(default_factory=dict)


class Lease:
    """One run's hold on a slot of a SlotPool, valid while the slot is still at `generation`."""

    # A plain slotted class: a lease is made per run, and a frozen dataclass's
    # __init__ costs several times more.
    __slots__ = ("slot", "generation")

    def __init__(self, slot: Any, generation: int) -> None:
        self.slot = slot
        self.generation = generation

    def __repr__(self) -> str:
        return f"Lease(slot={self.slot.index}, generation={self.generation})"


class SlotPool:
    """The free slots, handed out in release order; slots are any objects with an `index` (0..depth-1)."""

    def __init__(self, slots: Sequence[Any]) -> None:
        if [s.index for s in slots] != list(range(len(slots))):
            raise ValueError("SlotPool: slot indexes must be 0..depth-1 in order")
        self.slots = list(slots)
        self._free: deque[Any] = deque(slots)
        self._generation = [0] * len(slots)
        self._leased = [False] * len(slots)
        self._lock = threading.Lock()

    @property
    def depth(self) -> int:
        return len(self.slots)

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def generation(self, slot: Any) -> int:
        """How many times `slot` was released."""
        return self._generation[slot.index]

    def leased(self, slot: Any) -> bool:
        return self._leased[slot.index]

    def try_lease(self) -> Lease | None:
        with self._lock:
            if not self._free:
                return None
            slot = self._free.popleft()
            self._leased[slot.index] = True
            return Lease(slot, self._generation[slot.index])

    def release(self, lease: Lease) -> None:
        with self._lock:
            i = lease.slot.index
            if not self._leased[i] or self._generation[i] != lease.generation:
                raise StaleLeaseError(f"stale lease of slot {i}: generation {lease.generation}, "
                                      f"slot is at {self._generation[i]}")
            self._generation[i] += 1
            self._leased[i] = False
            self._free.append(lease.slot)
