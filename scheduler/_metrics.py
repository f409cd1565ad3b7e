"""Per-run timings and counts behind AsyncRuntime.stats().

All timestamps are on the engine's clock (the one task timings use), so host
and device intervals can be compared directly. Percentiles and the overlap
ratio cover the most recent `window` runs; the counts cover every run.

Each finished run leaves one record in a fixed-size ring of machine
integers: recording allocates no Python object that outlives it, so a long
steady stream of runs does not feed the garbage collector (whose pauses would
show up as loop lag).
"""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from engine import _native
    from scheduler._futures import RunFuture

__all__ = ["Metrics", "Stats", "Percentiles"]


@dataclass(frozen=True)
class Percentiles:
    """Nearest-rank percentiles in seconds over `samples` runs (all 0.0 without samples)."""

    p50: float
    p90: float
    p99: float
    samples: int


@dataclass(frozen=True)
class Stats:
    """A snapshot of an AsyncRuntime.

    Counts: dispatched = completed + failed + cancelled + in_flight. A run is
    dispatched once it was admitted and orchestrated; a dispatch that gave up
    before admission, or whose arguments or orchestration raised, is no run.

    Timings (seconds, over the most recent finished runs): admission_wait from the dispatch call to the slot
    lease; orchestration from the lease to the sealed run (staging included);
    device from the run's first task start to its last task end; latency from
    the dispatch call until the loop delivered the outcome. device and latency
    cover completed and failed runs, not cancelled ones.

    overlap_ratio: the time the host was orchestrating while the device was
    busy, over the time the device was busy (None before any device work).
    1.0 means host work was entirely hidden behind device work.
    """

    dispatched: int
    completed: int
    failed: int
    cancelled: int
    in_flight: int
    admission_wait: Percentiles
    orchestration: Percentiles
    device: Percentiles
    latency: Percentiles
    overlap_ratio: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentiles(values_ns: Iterable[int]) -> Percentiles:
    s = sorted(values_ns)
    n = len(s)
    if n == 0:
        return Percentiles(0.0, 0.0, 0.0, 0)

    def rank(p: float) -> float:
        return s[max(0, math.ceil(p / 100.0 * n) - 1)] / 1e9

    return Percentiles(rank(50), rank(90), rank(99), n)


def _union(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _total(intervals: list[tuple[int, int]]) -> int:
    return sum(e - s for s, e in intervals)


def _intersection(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0
    while i < len(a) and j < len(b):
        start = max(a[i][0], b[j][0])
        end = min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_ratio(host: Iterable[tuple[int, int]], device: Iterable[tuple[int, int]]) -> float | None:
    dev = _union(device)
    busy = _total(dev)
    if busy == 0:
        return None
    return _intersection(_union(host), dev) / busy


class Ring:
    """The last `size` records of `width` int64 fields each, packed in one buffer.

    A record is written with one struct.pack_into call: storing the fields
    one by one into an array costs twice as much per run.
    """

    __slots__ = ("data", "size", "width", "next", "count", "pack_into", "_record")

    def __init__(self, size: int, width: int = 1) -> None:
        self._record = struct.Struct(f"={width}q")
        self.pack_into = self._record.pack_into  # pack_into(ring.data, ring.advance(), *fields)
        self.data = bytearray(self._record.size * size)
        self.size = size
        self.width = width
        self.next = 0  # the slot the next record goes to
        self.count = 0

    def advance(self) -> int:
        """Claims the next record; returns its byte offset in data."""
        i = self.next
        self.next = i + 1 if i + 1 < self.size else 0
        if self.count < self.size:
            self.count += 1
        return i * self._record.size

    def append(self, *fields: int) -> None:
        self.pack_into(self.data, self.advance(), *fields)

    def __len__(self) -> int:
        return self.count

    def records(self) -> list[tuple[int, ...]]:
        n = self.count * self._record.size
        return list(self._record.iter_unpack(memoryview(self.data)[:n]))


# Fields of one run's record.
_T_DISPATCH, _T_ADMIT, _T_LAUNCH, _T_LAUNCHED, _FIRST, _LAST, _T_DONE, _KIND = range(8)
_COMPLETED, _FAILED, _CANCELLED = 0, 1, 2


class Metrics:
    """Collects what stats() reports. Called on the loop thread only.

    One record per finished run, written field by field into a ring (no
    allocation); the statistics are computed when stats() asks.
    """

    def __init__(self, window: int = 10_000) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"metrics window must be a positive int, got {window!r}")
        self.dispatched = self.completed = self.failed = self.cancelled = 0  # dispatched: runs launched
        self._runs = Ring(window, 8)

    def finished(self, fut: "RunFuture", device_span: tuple[int, int], failed: bool, cancelled: bool,
                 now_ns: int) -> None:
        """A run released its slot: cancelled, or failed (a kernel or its copy-back), or completed.

        device_span: (first task start, last task end) on the engine clock, -1 when none ran.
        """
        if cancelled:
            self.cancelled += 1
            kind = _CANCELLED
        elif failed:
            self.failed += 1
            kind = _FAILED
        else:
            self.completed += 1
            kind = _COMPLETED
        ring = self._runs
        first, last = device_span
        ring.pack_into(ring.data, ring.advance(), fut.t_dispatch, fut.t_admit, fut.t_launch, fut.t_launched, first, last,
                       now_ns, kind)

    def snapshot(self, in_flight: int) -> Stats:
        admission, orchestration, device, latency = [], [], [], []
        host_busy, device_busy = [], []
        for r in self._runs.records():
            admission.append(r[_T_ADMIT] - r[_T_DISPATCH])
            orchestration.append(r[_T_LAUNCHED] - r[_T_LAUNCH])
            host_busy.append((r[_T_LAUNCH], r[_T_LAUNCHED]))
            ran = r[_FIRST] >= 0 and r[_LAST] >= r[_FIRST]
            if ran:
                device_busy.append((r[_FIRST], r[_LAST]))
            if r[_KIND] != _CANCELLED:
                if ran:
                    device.append(r[_LAST] - r[_FIRST])
                latency.append(r[_T_DONE] - r[_T_DISPATCH])
        return Stats(
            dispatched=self.dispatched,
            completed=self.completed,
            failed=self.failed,
            cancelled=self.cancelled,
            in_flight=in_flight,
            admission_wait=percentiles(admission),
            orchestration=percentiles(orchestration),
            device=percentiles(device),
            latency=percentiles(latency),
            overlap_ratio=overlap_ratio(host_busy, device_busy),
        )
