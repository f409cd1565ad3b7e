"""OpenTelemetry spans of an AsyncRuntime's runs, read after the fact from its run records.

    from scheduler.otel import RunSpanExporter

    exporter = RunSpanExporter(art, attributes={"model": "minilm"})
    async with anyio.create_task_group() as tg:
        await tg.start(exporter.run)          # exports what finished, every `interval` seconds
        ...
        tg.cancel_scope.cancel()              # run() exports the last records as it stops

Each finished run becomes a span "tandem.run" from its dispatch call to its
completion, with child spans
  admission      dispatch call -> slot lease
  orchestration  orchestration start -> sealed run (staging included)
  device         first task start -> last task end (only for runs that ran a task); its attribute
                 tandem.device.busy_ns is the tasks' own time summed (a single-device runtime's runs),
                 less than the span by the gaps between them
  completion     last task end (or the sealed run, when no task ran) -> completion
and the attributes tandem.run.seq and tandem.run.outcome ("completed",
"failed", "cancelled"), plus the constant `attributes`. A failed run's span
has status ERROR. (A run whose device work completed but whose write-back into
the caller's array failed is recorded as completed: the record is written
where the device finishes.)

The spans are made after the run finished, not while it runs: the engine
records every run natively (AsyncRuntime.run_records), and reading those
records keeps the per-run cost off the event loop. run() makes the spans in a
worker thread, so a slow span processor (a SimpleSpanProcessor in front of a
network exporter) does not stall the loop; a BatchSpanProcessor is the usual
choice anyway.

Timestamps. The records are on the engine's monotonic clock
(AsyncRuntime.now_ns()); OpenTelemetry wants nanoseconds since the epoch. The
offset between the two is sampled once, at the first export, by reading the
wall clock between two engine clock reads. Taken once, it keeps every span on
one consistent timeline: a wall clock stepped later (NTP, by hand) does not
make spans jump or overlap wrongly, at the price of drifting from wall time by
the clocks' slew over a long-lived process.

Runs lost. The runtime keeps the records of its last metrics_window runs. If
more than that finish between two reads, the oldest are gone: they are
counted in `dropped` (and the first span after the gap carries
tandem.runs_dropped, how many runs were lost just before it) rather than
silently missing. Use a larger metrics_window or a shorter interval.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING, Mapping

import anyio
from anyio.abc import TaskStatus

try:
    from opentelemetry import trace
    from opentelemetry.trace import Status, StatusCode
    from opentelemetry.util.types import AttributeValue
except ImportError as e:  # an optional extra: the core library does not need it
    raise ImportError(f"scheduler.otel needs OpenTelemetry ({e}): pip install 'tandem-engine[otel]'") from e

if TYPE_CHECKING:
    from scheduler._metrics import RunRecord
    from scheduler.runtime import AsyncRuntime

__all__ = ["RunSpanExporter"]


class RunSpanExporter:
    """Turns an AsyncRuntime's finished runs into OpenTelemetry spans (see the module docstring).

    tracer_provider: where the spans go (default: the global one,
    opentelemetry.trace.get_tracer_provider()). tracer_name: the
    instrumentation scope's name. attributes: set on every run's root span.
    interval: seconds between two reads in run().
    """

    def __init__(self, art: "AsyncRuntime", *, tracer_provider: "trace.TracerProvider | None" = None,
                 tracer_name: str = "tandem", attributes: Mapping[str, AttributeValue] | None = None,
                 interval: float = 1.0) -> None:
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < math.inf:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self._art = art
        self._tracer = trace.get_tracer(tracer_name, tracer_provider=tracer_provider)
        self._attributes = dict(attributes or {})
        self._interval = float(interval)
        self._next = 0  # the seq of the next record to read
        self._offset: int | None = None  # epoch ns minus engine ns, sampled at the first export
        self._dropped = 0
        self._exported = 0
        # The cursor moves under the lock: flush() may be called from any thread while run() reads on the loop.
        self._lock = threading.Lock()

    @property
    def dropped(self) -> int:
        """Runs that left the runtime's record window before they were read: no span was made for them."""
        return self._dropped

    @property
    def exported(self) -> int:
        """Runs exported as spans so far."""
        return self._exported

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Exports the runs finished since the last read every `interval` seconds, until cancelled.

        Reads once more as it stops, so the runs finished before the
        cancellation are exported too.
        """
        task_status.started()
        try:
            while True:
                records, gap = self._read()
                if records:
                    # Not abandoned on cancellation: records read are always exported.
                    await anyio.to_thread.run_sync(self._emit, records, gap)
                await anyio.sleep(self._interval)
        finally:
            self._emit(*self._read())

    def flush(self) -> int:
        """Exports the runs finished since the last read, here and now; returns how many."""
        records, gap = self._read()
        self._emit(records, gap)
        return len(records)

    def _read(self) -> tuple[list[RunRecord], int]:
        """The records not read yet, and how many runs were lost before the first of them."""
        with self._lock:
            records = self._art.run_records(self._next)
            if not records:
                return records, 0
            gap = records[0].seq - self._next
            self._dropped += gap
            self._next = records[-1].seq + 1
            if self._offset is None:
                self._offset = _clock_offset(self._art)
            return records, gap

    def _emit(self, records: list[RunRecord], gap: int) -> None:
        offset = self._offset
        for i, r in enumerate(records):
            assert offset is not None
            self._emit_one(r, offset, gap if i == 0 else 0)
        with self._lock:
            self._exported += len(records)

    def _emit_one(self, r: RunRecord, offset: int, dropped_before: int) -> None:
        tracer = self._tracer
        attributes: dict[str, AttributeValue] = {**self._attributes, "tandem.run.seq": r.seq,
                                                 "tandem.run.outcome": r.outcome}
        if dropped_before:
            attributes["tandem.runs_dropped"] = dropped_before
        start, end = r.dispatch_ns + offset, max(r.done_ns, r.dispatch_ns) + offset
        root = tracer.start_span("tandem.run", start_time=start, attributes=attributes)
        if r.outcome == "failed":
            root.set_status(Status(StatusCode.ERROR, "the run failed"))
        parent = trace.set_span_in_context(root)
        ran = r.first_start_ns >= 0 and r.last_end_ns >= r.first_start_ns  # -1: the device never ran it

        def child(name: str, start_ns: int, end_ns: int, attrs: dict[str, AttributeValue] | None = None) -> None:
            # Clocks of different processes (the distributed runtime's) can disagree by a hair: never end early.
            span = tracer.start_span(name, context=parent, start_time=start_ns + offset, attributes=attrs)
            span.end(end_time=max(start_ns, end_ns) + offset)

        child("admission", r.dispatch_ns, r.admit_ns)
        child("orchestration", r.launch_ns, r.sealed_ns)
        if ran:  # the span covers the gaps between its tasks; busy is their own time, where measured
            child("device", r.first_start_ns, r.last_end_ns,
                  {"tandem.device.busy_ns": r.busy_ns} if r.busy_ns >= 0 else None)
        child("completion", r.last_end_ns if ran else r.sealed_ns, r.done_ns)
        root.end(end_time=end)

    def __repr__(self) -> str:
        return f"<RunSpanExporter next={self._next} exported={self._exported} dropped={self._dropped}>"


def _clock_offset(art: "AsyncRuntime") -> int:
    """Epoch ns minus engine ns, the wall clock read between two engine clock reads."""
    before = art.now_ns()
    wall = time.time_ns()
    after = art.now_ns()
    return wall - (before + after) // 2
