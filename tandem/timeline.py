"""A PNG timeline of a Chrome trace (engine.trace's layout), and the host/device overlap it shows.

One lane per track of the trace, in the trace's own order: the host process's
slots (a light bar per run, from staging to its last task, with its staging
and orchestration drawn solid inside) and admission waits, then the device
process's pool workers (a bar per task, coloured by kernel). A last lane
marks when host and device were busy at the same time, which is the overlap
the pipeline exists for; `overlap_summary` gives the same as numbers.

matplotlib (the `bench` extra) is imported only by `render_timeline`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Lane", "load_trace", "lanes", "overlap_summary", "render_timeline"]

Interval = tuple[float, float]  # (start, end) in microseconds

HOST_COLORS = {"staging": "#ff7f0e", "orchestration": "#1f77b4", "admission": "#c7c7c7"}
RUN_COLOR = "#dbe9f6"
COPY_BACK_COLOR = "#8c8c8c"
BOTH_COLOR = "#d4a017"
KERNEL_PALETTE = ["#2ca02c", "#d62728", "#9467bd", "#17becf", "#bcbd22", "#e377c2", "#8c564b", "#7f7f7f"]


@dataclass
class Lane:
    pid: int
    tid: int
    process: str
    name: str
    sort: tuple[int, int]
    events: list[dict[str, Any]] = field(default_factory=list)


def load_trace(trace: str | os.PathLike[str] | dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
    """The trace's events, from a path, a dict with "traceEvents", or a bare event list."""
    data = json.loads(Path(trace).read_text()) if isinstance(trace, (str, os.PathLike)) else trace
    return list(data["traceEvents"] if isinstance(data, dict) else data)


def lanes(events: list[dict[str, Any]]) -> list[Lane]:
    """One lane per (process, thread) that has complete ("X") events, sorted as the trace's metadata says."""
    proc_name: dict[int, str] = {}
    proc_sort: dict[int, int] = {}
    thread_name: dict[tuple[int, int], str] = {}
    thread_sort: dict[tuple[int, int], int] = {}
    for e in events:
        if e.get("ph") != "M":
            continue
        pid, tid, args = e.get("pid", 0), e.get("tid"), e.get("args", {})
        if e["name"] == "process_name":
            proc_name[pid] = str(args.get("name", pid))
        elif e["name"] == "process_sort_index":
            proc_sort[pid] = int(args.get("sort_index", 0))
        elif e["name"] == "thread_name" and tid is not None:
            thread_name[(pid, tid)] = str(args.get("name", tid))
        elif e["name"] == "thread_sort_index" and tid is not None:
            thread_sort[(pid, tid)] = int(args.get("sort_index", 0))
    out: dict[tuple[int, int], Lane] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        key = (e.get("pid", 0), e.get("tid", 0))
        lane = out.get(key)
        if lane is None:
            lane = out[key] = Lane(key[0], key[1], proc_name.get(key[0], str(key[0])),
                                   thread_name.get(key, str(key[1])),
                                   (proc_sort.get(key[0], key[0]), thread_sort.get(key, key[1])))
        lane.events.append(e)
    return sorted(out.values(), key=lambda lane: lane.sort)


def _merge(intervals: list[Interval]) -> list[Interval]:
    merged: list[Interval] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((s, e))
    return merged


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _total(intervals: list[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def _busy(events: list[dict[str, Any]], lanes_: list[Lane]) -> tuple[list[Interval], list[Interval]]:
    """Merged intervals when the host worked (staging, orchestration) and when any device worker ran a task."""
    host: list[Interval] = []
    device: list[Interval] = []
    for lane in lanes_:
        for e in lane.events:
            iv = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
            if lane.process == "device":
                device.append(iv)
            elif lane.process == "host" and e.get("cat") == "host":
                host.append(iv)
    return _merge(host), _merge(device)


def overlap_summary(trace: str | os.PathLike[str] | dict[str, Any] | list[Any]) -> dict[str, float]:
    """Milliseconds of the traced span: host busy, device busy, and both at once; and the run count."""
    events = load_trace(trace)
    ls = lanes(events)
    host, device = _busy(events, ls)
    xs = [e for lane in ls for e in lane.events]
    t0 = min((float(e["ts"]) for e in xs), default=0.0)
    t1 = max((float(e["ts"]) + float(e.get("dur", 0)) for e in xs), default=0.0)
    both = _total(_intersect(host, device))
    device_ms = _total(device) / 1e3
    return {"span_ms": (t1 - t0) / 1e3, "host_busy_ms": _total(host) / 1e3, "device_busy_ms": device_ms,
            "overlap_ms": both / 1e3, "overlap_of_device": both / 1e3 / device_ms if device_ms else 0.0,
            "runs": float(sum(1 for e in xs if e.get("cat") == "run"))}


def _kernel_colors(ls: list[Lane]) -> dict[str, str]:
    names: dict[str, float] = {}
    for lane in ls:
        if lane.process == "device":
            for e in lane.events:
                if e.get("cat") != "copy_back":
                    names[e["name"]] = names.get(e["name"], 0.0) + float(e.get("dur", 0))
    # The busiest kernels get their own colours; the rest share the palette's last.
    ranked = sorted(names, key=lambda n: -names[n])
    return {n: KERNEL_PALETTE[min(i, len(KERNEL_PALETTE) - 1)] for i, n in enumerate(ranked)}


def render_timeline(trace: str | os.PathLike[str] | dict[str, Any] | list[Any], png: str | os.PathLike[str], *,
                    title: str | None = None) -> Path:
    """Draws the trace as a PNG timeline (matplotlib with the Agg backend) and returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display and no GUI toolkit
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = load_trace(trace)
    ls = lanes(events)
    if not ls:
        raise ValueError("the trace has no complete events to draw")
    xs = [e for lane in ls for e in lane.events]
    t0 = min(float(e["ts"]) for e in xs)
    ms = lambda us: (us - t0) / 1e3  # noqa: E731
    colors = _kernel_colors(ls)
    host, device = _busy(events, ls)
    both = _intersect(host, device)
    summary = overlap_summary(events)

    n = len(ls) + 1
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.45 * n))
    span = max(summary["span_ms"], 1e-6)
    for row, lane in enumerate(ls):
        y = n - 1 - row
        for e in sorted(lane.events, key=lambda e: -float(e.get("dur", 0))):  # outer spans first, inner on top
            start, width = ms(float(e["ts"])), float(e.get("dur", 0)) / 1e3
            cat = e.get("cat")
            if cat == "run":
                ax.broken_barh([(start, width)], (y - 0.42, 0.84), facecolors=RUN_COLOR, edgecolors="#6b8fb5",
                               linewidth=0.6)
                if width > span / 40:
                    ax.text(start + width / 2, y + 0.3, e["name"].replace("run ", "r"), ha="center", va="center",
                            fontsize=6, color="#34506e")
            elif cat == "admission":
                ax.broken_barh([(start, width)], (y - 0.25, 0.5), facecolors=HOST_COLORS["admission"],
                               hatch="//", edgecolors="#999999", linewidth=0.3)
            elif lane.process == "device":
                color = COPY_BACK_COLOR if cat == "copy_back" else colors.get(e["name"], KERNEL_PALETTE[-1])
                ax.broken_barh([(start, width)], (y - 0.35, 0.7), facecolors=color, edgecolors="white",
                               linewidth=0.3)
            else:
                ax.broken_barh([(start, width)], (y - 0.28, 0.45),
                               facecolors=HOST_COLORS.get(e["name"], "#aaaaaa"), linewidth=0)
    ax.broken_barh([(ms(s), (e - s) / 1e3) for s, e in both], (-0.3, 0.6), facecolors=BOTH_COLOR, linewidth=0)

    ax.set_yticks(range(n))
    ax.set_yticklabels(["host + device busy"] + [f"{lane.process}: {lane.name}" for lane in reversed(ls)],
                       fontsize=8)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("time, ms")
    ax.grid(axis="x", alpha=0.3)
    handles = [Patch(facecolor=RUN_COLOR, edgecolor="#6b8fb5", label="run (slot held)"),
               Patch(facecolor=HOST_COLORS["staging"], label="staging"),
               Patch(facecolor=HOST_COLORS["orchestration"], label="orchestration"),
               Patch(facecolor=HOST_COLORS["admission"], hatch="//", label="admission wait")]
    handles += [Patch(facecolor=c, label=f"task: {k}") for k, c in list(colors.items())[:len(KERNEL_PALETTE) - 1]]
    if len(colors) >= len(KERNEL_PALETTE):
        handles.append(Patch(facecolor=KERNEL_PALETTE[-1], label="task: other kernels"))
    handles += [Patch(facecolor=COPY_BACK_COLOR, label="copy back"),
                Patch(facecolor=BOTH_COLOR, label="host and device both busy")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), borderaxespad=0)
    ax.set_title((title + "\n" if title else "") +
                 f"{int(summary['runs'])} runs in {summary['span_ms']:.2f} ms; host busy "
                 f"{summary['host_busy_ms']:.2f} ms, device busy {summary['device_busy_ms']:.2f} ms, both "
                 f"{summary['overlap_ms']:.2f} ms ({100 * summary['overlap_of_device']:.0f}% of device time)",
                 fontsize=9)
    fig.tight_layout()
    out = Path(png)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
