"""Pipeline slots: `depth` buffer sets, each leased to exactly one run at a time.

A lease carries the slot's generation. Releasing advances the generation, so
a stale lease (released already, or from an earlier run) is rejected and a
slot can never be released twice.

The lease state lives natively (engine._native.SlotTable). A local Runtime's
table holds each slot's host-tensor accessor: a run takes its slot when it
begins and frees it when it completes, with no Python in between. A
DistributedRuntime's table has no accessors (its runs complete in other
processes) and it releases a slot when it finishes the run. Slot holds what
the Python side needs of a local slot, its buffers and views.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeAlias

from engine import _native
from engine.dtypes import DType
from engine.orchestration import ScratchArena
from engine.tensor import DeviceTensor, contiguous_strides

if TYPE_CHECKING:
    from engine.tensor import Allocation

__all__ = ["Slot", "SlotLease", "StaleLeaseError", "slot_view"]


StaleLeaseError = _native.StaleLeaseError
"""A lease that no longer holds its slot was released (a ValueError)."""

# What SlotTable.try_lease() hands out and release(*lease) takes: (slot index, generation).
SlotLease: TypeAlias = "tuple[int, int]"


@dataclass
class Slot:
    """What the Python side needs of one local slot; its lease state is the native SlotTable's."""

    index: int
    buffers: dict[str, "Allocation"]  # one per host tensor parameter, sized from the bounds
    scratch: "Allocation | None"
    accessor: "_native.HostAccessor"
    # (parameter name, shape) -> (view of its buffer at that shape, buffer address): shapes repeat run after run.
    views: dict[tuple[str, tuple[int, ...]], tuple[Any, int]] = field(default_factory=dict)
    arena: ScratchArena = field(init=False)  # the scratch of the run holding the slot: reset when one launches

    def __post_init__(self) -> None:
        self.arena = ScratchArena(self.scratch, 0, self.scratch.size if self.scratch is not None else 0)


def slot_view(slot: Slot, name: str, shape: tuple[int, ...], dtype: DType) -> tuple[DeviceTensor, int]:
    """The slot buffer of `name` viewed at a run's shape, and the buffer's address.

    Cached: shapes repeat run after run.
    """
    cache = slot.views
    key = (name, shape)
    hit = cache.get(key)
    if hit is None:
        buf = slot.buffers[name]
        hit = (DeviceTensor(buf, 0, shape, contiguous_strides(shape), dtype), buf.addr)
        if len(cache) > 64:
            cache.clear()
        cache[key] = hit
    return hit
