"""Per-run timings and counts behind AsyncRuntime.stats().

All timestamps are on the engine's clock (the one task timings use), so host
and device intervals can be compared directly. Percentiles and the overlap
ratio cover the most recent `window` runs; the counts cover every run.

Samples go into fixed-size rings of machine integers: recording a run
allocates no Python object that outlives it, so a long steady stream of runs
does not feed the garbage collector (whose pauses would show up as loop lag).
"""

from __future__ import annotations

import math
from array import array
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

    Timings (seconds): admission_wait from the dispatch call to the slot
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
    """The last `size` int64 values (or pairs of them, with width=2)."""

    __slots__ = ("_data", "_size", "_width", "_next", "_count")

    def __init__(self, size: int, width: int = 1) -> None:
        self._data = array("q", bytes(8 * size * width))
        self._size = size
        self._width = width
        self._next = 0
        self._count = 0

    def append(self, a: int, b: int = 0) -> None:
        i = self._next * self._width
        self._data[i] = a
        if self._width == 2:
            self._data[i + 1] = b
        self._next = (self._next + 1) % self._size
        if self._count < self._size:
            self._count += 1

    def __len__(self) -> int:
        return self._count

    def values(self) -> list[int]:
        return list(self._data[: self._count * self._width]) if self._width == 1 else []

    def pairs(self) -> list[tuple[int, int]]:
        d = self._data
        return [(d[2 * i], d[2 * i + 1]) for i in range(self._count)] if self._width == 2 else []


class Metrics:
    """Collects what stats() reports. Called on the loop thread only."""

    def __init__(self, window: int = 10_000) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"metrics window must be a positive int, got {window!r}")
        self.dispatched = self.completed = self.failed = self.cancelled = 0
        self._admission = Ring(window)
        self._orchestration = Ring(window)
        self._device = Ring(window)
        self._latency = Ring(window)
        self._host_busy = Ring(window, 2)
        self._device_busy = Ring(window, 2)

    def launched(self, fut: "RunFuture") -> None:
        self.dispatched += 1
        self._admission.append(fut.t_admit - fut.t_dispatch)
        self._orchestration.append(fut.t_launched - fut.t_launch)
        self._host_busy.append(fut.t_launch, fut.t_launched)

    def finished(self, fut: "RunFuture", native: "_native.Run", failed: bool, cancelled: bool, now_ns: int) -> None:
        """A run released its slot: failed (its kernel or copy-back failed) or cancelled or completed."""
        times = native.times()
        first, last = times["first_start_ns"], times["last_end_ns"]
        ran = first >= 0 and last >= first
        if ran:
            self._device_busy.append(first, last)
        if cancelled:
            self.cancelled += 1
            return
        if failed:
            self.failed += 1
        else:
            self.completed += 1
        if ran:
            self._device.append(last - first)
        self._latency.append(now_ns - fut.t_dispatch)

    def snapshot(self, in_flight: int) -> Stats:
        return Stats(
            dispatched=self.dispatched,
            completed=self.completed,
            failed=self.failed,
            cancelled=self.cancelled,
            in_flight=in_flight,
            admission_wait=percentiles(self._admission.values()),
            orchestration=percentiles(self._orchestration.values()),
            device=percentiles(self._device.values()),
            latency=percentiles(self._latency.values()),
            overlap_ratio=overlap_ratio(self._host_busy.pairs(), self._device_busy.pairs()),
        )
