"""Chrome trace export (the JSON that Perfetto and chrome://tracing open).

Layout:
- process "host": one track per pipeline slot. Each run on a slot is a span
  "run <id>" from the start of staging to the end of its last task (copy-back
  included); inside it "staging" and "orchestration". Admission waits start
  before the slot is free, so they would overlap the previous run on the
  slot's track and break nesting; they get their own "admission" tracks
  instead, as many as overlapping waits need (interval partitioning).
- process "device": one track per pool worker, a span per task named by its
  kernel ("copy_back" for the copy of an output to its host array).

Input is what Runtime.drain_trace() returns: host spans
(run_id, slot, name, start_ns, end_ns) and task events
(run_id, task_index, worker, start_ns, end_ns, kernel, ok), all on the
engine's clock. Timestamps are written in microseconds (the format's unit).
"""

from __future__ import annotations

import heapq
import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["chrome_trace", "export_chrome_trace", "HOST_PID", "DEVICE_PID", "ADMISSION_TID_BASE"]

HOST_PID = 1
DEVICE_PID = 2
ADMISSION_TID_BASE = 1000  # host tracks at and above this hold admission waits

HostSpan = tuple[int, int, str, int, int]
TaskEvent = tuple[int, int, int, int, int, str, bool]


def _us(ns: int) -> float:
    return ns / 1000.0


def _complete(name: str, pid: int, tid: int, start_ns: int, end_ns: int, cat: str,
              args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": _us(start_ns),
            "dur": _us(max(0, end_ns - start_ns)), "args": args}


def _meta(kind: str, pid: int, tid: int | None, name: str, sort_index: int | None = None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": kind, "ph": "M", "pid": pid, "args": {"name": name}}]
    if tid is not None:
        out[0]["tid"] = tid
    if sort_index is not None:
        sort_kind = "thread_sort_index" if tid is not None else "process_sort_index"
        entry: dict[str, Any] = {"name": sort_kind, "ph": "M", "pid": pid, "args": {"sort_index": sort_index}}
        if tid is not None:
            entry["tid"] = tid
        out.append(entry)
    return out


def _admission_lanes(waits: list[HostSpan]) -> list[int]:
    """Lane per wait so that waits in one lane never overlap (fewest lanes: greedy by start)."""
    order = sorted(range(len(waits)), key=lambda i: (waits[i][3], waits[i][4]))
    lanes = [0] * len(waits)
    free: list[tuple[int, int]] = []  # (end_ns of the lane's last wait, lane)
    n_lanes = 0
    for i in order:
        start, end = waits[i][3], waits[i][4]
        if free and free[0][0] <= start:
            _, lane = heapq.heappop(free)
        else:
            lane = n_lanes
            n_lanes += 1
        lanes[i] = lane
        heapq.heappush(free, (end, lane))
    return lanes


def chrome_trace(spans: Iterable[HostSpan], events: Iterable[TaskEvent], *, workers: int,
                 depth: int) -> dict[str, Any]:
    """Builds the trace as a dict in the Chrome trace event format."""
    # Rows as plain Python values (any sequence of the right length will do, numpy ints included),
    # in lists: events are read more than once.
    host_spans: list[HostSpan] = [(int(r), int(slot), str(name), int(t0), int(t1)) for r, slot, name, t0, t1 in spans]
    task_events: list[TaskEvent] = [(int(r), int(task), int(worker), int(t0), int(t1), str(name), bool(ok))
                                    for r, task, worker, t0, t1, name, ok in events]
    trace: list[dict[str, Any]] = []
    trace += _meta("process_name", HOST_PID, None, "host", 0)
    trace += _meta("process_name", DEVICE_PID, None, "device", 1)
    for s in range(depth):
        trace += _meta("thread_name", HOST_PID, s, f"slot {s}", s)
    seen_workers = {e[2] for e in task_events}
    for w in sorted(set(range(workers)) | seen_workers):
        trace += _meta("thread_name", DEVICE_PID, w, f"worker {w}" if w >= 0 else "caller", w)

    # The run's extent on its slot: from its first host span to its last task.
    slot_of: dict[int, int] = {}
    begin: dict[int, int] = {}
    end: dict[int, int] = {}
    waits: list[HostSpan] = []
    body: list[HostSpan] = []
    for span in host_spans:
        run_id, slot, name, t0, t1 = span
        if name == "admission":
            waits.append(span)
            continue
        body.append(span)
        slot_of[run_id] = slot
        begin[run_id] = min(begin.get(run_id, t0), t0)
        end[run_id] = max(end.get(run_id, t1), t1)
    for run_id, _task, _worker, _t0, t1, _name, _ok in task_events:
        if run_id in end:
            end[run_id] = max(end[run_id], t1)

    for run_id in sorted(begin, key=lambda r: begin[r]):
        trace.append(_complete(f"run {run_id}", HOST_PID, slot_of[run_id], begin[run_id], end[run_id], "run",
                               {"run": run_id, "slot": slot_of[run_id]}))
    for run_id, slot, name, t0, t1 in sorted(body, key=lambda s: (s[3], s[4])):
        trace.append(_complete(name, HOST_PID, slot, t0, t1, "host", {"run": run_id, "slot": slot}))

    lanes = _admission_lanes(waits)
    for lane in sorted(set(lanes)):
        trace += _meta("thread_name", HOST_PID, ADMISSION_TID_BASE + lane, f"admission {lane}",
                       ADMISSION_TID_BASE + lane)
    for (run_id, slot, name, t0, t1), lane in zip(waits, lanes):
        trace.append(_complete(name, HOST_PID, ADMISSION_TID_BASE + lane, t0, t1, "admission",
                               {"run": run_id, "slot": slot}))

    for run_id, task, worker, t0, t1, name, ok in sorted(task_events, key=lambda e: (e[3], e[4])):
        trace.append(_complete(name, DEVICE_PID, worker, t0, t1, "copy_back" if name == "copy_back" else "task",
                               {"run": run_id, "task": task, "ok": ok}))
    return {"traceEvents": trace, "displayTimeUnit": "ns"}


def export_chrome_trace(path: str | os.PathLike[str], spans: Sequence[HostSpan], events: Sequence[TaskEvent], *,
                        workers: int, depth: int) -> Path:
    """Writes chrome_trace(...) to `path` as JSON and returns the path."""
    out = Path(path)
    out.write_text(json.dumps(chrome_trace(spans, events, workers=workers, depth=depth)))
    return out
