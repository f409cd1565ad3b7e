"""Per-run timings and counts behind AsyncRuntime.stats().

All timestamps are on the engine's clock (the one task timings use), so host
and device intervals can be compared directly. Percentiles and the overlap
ratio cover the most recent `window` runs; the counts cover every run.

Each finished run leaves one record in a native fixed-size ring, written by
the run itself as it completes (see Metrics).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine import _native

__all__ = ["Histogram", "Metrics", "Percentiles", "RunRecord", "Stats"]


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
    A run counts as completed, failed or cancelled from the moment the device
    is done with it (in_flight: the others).

    Timings (seconds, over the most recent finished runs): admission_wait from
    the dispatch call to the slot lease; orchestration from its start (the
    lease, or the worker thread taking it up with orchestrate_in_thread) to the
    sealed run, staging included; device from the run's first task start to
    its last task end; latency from the dispatch call until the run completed
    (its outputs in place, copy-back included). device and latency cover
    completed and failed runs, not cancelled ones.

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


@dataclass(frozen=True)
class Histogram:
    """One duration over every run so far, in buckets (what a Prometheus histogram exports).

    counts[i] runs took at most bounds[i] seconds and more than bounds[i - 1];
    counts[-1] (one more than there are bounds) took longer than every bound.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float  # seconds
    count: int


@dataclass(frozen=True)
class RunRecord:
    """One finished run's timings, on the engine's clock (AsyncRuntime.now_ns()); -1: the device never ran it."""

    seq: int  # the record's number: AsyncRuntime.run_records(seq + 1) reads on after it
    dispatch_ns: int
    admit_ns: int
    launch_ns: int
    sealed_ns: int
    first_start_ns: int
    last_end_ns: int
    done_ns: int
    outcome: str  # "completed", "failed" or "cancelled"
    # Its tasks' execution time, summed: on one worker the device's busy time for it, which the span
    # last_end_ns - first_start_ns exceeds by the gaps between its tasks (-1: not measured, a distributed run).
    busy_ns: int = -1


_OUTCOMES = ("completed", "failed", "cancelled")


def _percentiles(p50: int, p90: int, p99: int, samples: int) -> Percentiles:
    return Percentiles(p50 / 1e9, p90 / 1e9, p99 / 1e9, samples)


# Fields of one run's record (engine._native.RunLog.recent()).
_T_DISPATCH, _T_ADMIT, _T_LAUNCH, _T_LAUNCHED, _FIRST, _LAST, _T_DONE, _KIND, _BUSY = range(9)


class Metrics:
    """What stats() reports for one AsyncRuntime.

    Each launched run records its own timings when it completes, natively,
    wherever it completes (engine._native.RunLog, handed to the run when it
    is sealed): the event loop does nothing per run for the statistics but
    count the dispatch. The log keeps the most recent `window` records in a
    fixed ring of machine integers, so a long steady stream of runs leaves no
    Python object behind for the garbage collector (whose pauses would show
    up as loop lag); the statistics are computed natively when stats() asks.
    """

    def __init__(self, window: int = 10_000) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
            raise ValueError(f"metrics window must be a positive int, got {window!r}")
        self.log = _native.RunLog(window)
        # Runs the device completed whose outputs could not be written back into the caller's arrays:
        # the log counts them completed, their futures fail.
        self.writeback_failures = 0

    def histograms(self) -> dict[str, Histogram]:
        bounds = tuple(b / 1e9 for b in _native.RunLog.histogram_bounds_ns())
        return {name: Histogram(bounds, counts, total / 1e9, n)
                for name, (counts, total, n) in self.log.histograms().items()}

    def records(self, since: int) -> list[RunRecord]:
        first, records = self.log.since(since)
        return [RunRecord(first + i, r[_T_DISPATCH], r[_T_ADMIT], r[_T_LAUNCH], r[_T_LAUNCHED], r[_FIRST], r[_LAST],
                          r[_T_DONE], _OUTCOMES[r[_KIND]], r[_BUSY]) for i, r in enumerate(records)]

    def snapshot(self) -> Stats:
        dispatched, completed, failed, cancelled = self.log.counts()
        completed -= self.writeback_failures
        failed += self.writeback_failures
        # Natively, with the GIL let go: over a full window of runs the same in Python held the loop for
        # tens of milliseconds (5 ms for 1,000 runs).
        admission, orchestration, device, latency, overlap = self.log.summary()
        return Stats(
            dispatched=dispatched,
            completed=completed,
            failed=failed,
            cancelled=cancelled,
            in_flight=dispatched - completed - failed - cancelled,
            admission_wait=_percentiles(*admission),
            orchestration=_percentiles(*orchestration),
            device=_percentiles(*device),
            latency=_percentiles(*latency),
            overlap_ratio=overlap,
        )
