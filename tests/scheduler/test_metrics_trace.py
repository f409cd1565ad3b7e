"""stats() and the Chrome trace export (async and sync runtimes)."""

from __future__ import annotations

import json
import math
from collections import defaultdict

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import _native
from engine.trace import ADMISSION_TID_BASE, DEVICE_PID, HOST_PID, chrome_trace
from scheduler import AsyncRuntime, Stats

from .conftest import PATIENCE_S, add, eventually, maybe_fail, tagged

pytestmark = pytest.mark.anyio


# -- stats ----------------------------------------------------------------------------------------
async def test_stats_counts_and_percentiles(make_rt):
    rt = make_rt(maybe_fail, depth=2)
    async with AsyncRuntime(rt) as art:
        empty = art.stats()
        assert (empty.dispatched, empty.in_flight, empty.latency.samples) == (0, 0, 0)
        assert empty.overlap_ratio is None

        async def one(i: int):
            try:
                await art.call(float(i), int(i % 10 == 3))
            except Exception:
                pass

        async with anyio.create_task_group() as tg:  # more callers than slots: some wait for admission
            for i in range(40):
                tg.start_soon(one, i)
        fut = await art.dispatch(1.0, 0)
        fut.cancel()
        await art.drain()
        s = art.stats()
    assert isinstance(s, Stats)
    assert (s.dispatched, s.failed, s.in_flight) == (41, 4, 0)
    assert s.completed + s.cancelled == 37 and s.cancelled <= 1
    for p in (s.admission_wait, s.orchestration, s.device, s.latency):
        assert 0.0 <= p.p50 <= p.p90 <= p.p99
    assert s.admission_wait.samples == s.orchestration.samples == 41
    assert s.latency.samples == s.completed + s.failed
    assert s.admission_wait.p99 > 0  # 40 callers on 2 slots waited
    assert s.orchestration.p50 > 0 and s.latency.p50 > 0
    assert s.latency.p50 >= s.device.p50  # end to end includes the device
    d = s.as_dict()
    assert d["latency"]["p99"] == s.latency.p99 and d["dispatched"] == 41


async def test_histograms_and_run_records_cover_every_run_beyond_the_window(make_rt):
    """histograms() counts every run (the stats() window holds 4 here); run_records reads on from a cursor."""
    rt = make_rt(maybe_fail, depth=2)
    async with AsyncRuntime(rt, metrics_window=4) as art:
        assert art.run_records() == [] and art.histograms()["latency"].count == 0
        for i in range(10):
            try:
                await art.call(float(i), int(i == 3))
            except Exception:
                pass
        fut = await art.dispatch(1.0, 0)
        fut.cancel()
        await art.drain()
        h = art.histograms()
        records = art.run_records()
        now = art.now_ns()
    assert set(h) == {"admission_wait", "orchestration", "device", "latency"}
    assert h["admission_wait"].count == h["orchestration"].count == 11
    s_cancelled = 1 if records[-1].outcome == "cancelled" else 0
    assert h["latency"].count == 11 - s_cancelled
    for hist in h.values():
        assert len(hist.counts) == len(hist.bounds) + 1 and sum(hist.counts) == hist.count
        assert list(hist.bounds) == sorted(hist.bounds) and hist.sum >= 0
    assert h["latency"].sum >= h["device"].sum
    assert [r.seq for r in records] == [7, 8, 9, 10]  # the window of 4
    assert all(r.dispatch_ns <= r.admit_ns <= r.launch_ns <= r.sealed_ns <= r.done_ns <= now for r in records)
    assert records[-1].outcome in ("cancelled", "completed")
    for r in records:  # what its tasks took, measured untraced: within its device span (0 if none ran)
        if r.first_start_ns >= 0:
            assert 0 < r.busy_ns <= r.last_end_ns - r.first_start_ns
        else:
            assert r.busy_ns == 0
    assert art.run_records(since=10) == records[-1:] and art.run_records(since=11) == []


async def test_a_run_is_counted_when_the_device_is_done_with_it_before_the_loop_hears(gated_rt, in_thread):
    """Each run records itself where it completes: stats() counts it before the pump or an awaiter has seen it,
    and the counts always add up."""
    rt, gate = gated_rt(depth=2)
    async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
        futs = [await art.dispatch(float(i)) for i in range(2)]
        s = art.stats()
        assert (s.dispatched, s.completed, s.in_flight) == (2, 0, 2)
        gate.open()
        for f in futs:  # block the loop thread on the device: no loop turn, no completion handled
            assert f.native.wait(PATIENCE_S)
        assert art.in_flight == 2  # the scheduler has not finished them
        s = art.stats()
        assert (s.dispatched, s.completed, s.failed, s.cancelled, s.in_flight) == (2, 2, 0, 0, 0)
        assert s.latency.samples == 2 and s.orchestration.samples == 2
        for f in futs:
            await f
        assert art.stats() == s  # finishing on the loop records nothing more


async def test_a_failed_write_back_counts_as_failed_not_completed(make_rt):
    rt = make_rt(add, bounds={"B": 4})
    async with AsyncRuntime(rt) as art:
        x = np.ones((2, 4), np.float32)
        z = np.zeros((4, 2), np.float32).T  # not contiguous: staged and written back after the run
        fut = await art.dispatch(x, x, z)
        z.flags.writeable = False  # the caller broke its own output array meanwhile
        with pytest.raises(ValueError):
            await fut
        s = art.stats()
        assert (s.dispatched, s.completed, s.failed) == (1, 0, 1)


async def test_overlap_ratio_sees_host_work_hidden_behind_the_device(gated_rt):
    rt, gate = gated_rt(depth=2)
    async with AsyncRuntime(rt) as art:
        first = await art.dispatch(1.0)
        await eventually(lambda: gate.entered == 1)  # the device is busy with the first run...
        second = await art.dispatch(2.0)  # ...while the host orchestrates the second
        gate.open()
        await first
        await second
        s = art.stats()
    assert s.overlap_ratio is not None and 0.0 < s.overlap_ratio <= 1.0
    assert s.device.p50 > 0


# -- the window's statistics, against a plain reference -------------------------------------------
def nearest_rank(values: list[int]) -> tuple[int, int, int, int]:
    s = sorted(values)
    if not s:
        return (0, 0, 0, 0)
    return (*(s[max(0, math.ceil(p / 100.0 * len(s)) - 1)] for p in (50, 90, 99)), len(s))


def union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def reference_summary(records: list[tuple[int, ...]]) -> tuple:
    """What RunLog.summary() must say, computed the plain way: walking both interval unions."""
    ran = [r for r in records if r[4] >= 0 and r[5] >= r[4]]
    device = union([(r[4], r[5]) for r in ran])
    host = union([(r[2], r[3]) for r in records])
    both = sum(max(0, min(he, de) - max(hs, ds)) for hs, he in host for ds, de in device)
    busy = sum(e - s for s, e in device)
    return (nearest_rank([r[1] - r[0] for r in records]), nearest_rank([r[3] - r[2] for r in records]),
            nearest_rank([r[5] - r[4] for r in ran if r[7] != 2]),
            nearest_rank([r[6] - r[0] for r in records if r[7] != 2]),
            both / busy if busy else None)


def summary_of(records: list[tuple[int, ...]]) -> tuple:
    log = _native.RunLog(max(1, len(records)))
    for r in records:
        log.record(*r)
    return log.summary()


times = st.integers(-5, 60)


@st.composite
def run_records(draw: st.DrawFn) -> tuple[int, ...]:
    dispatch, admit, launch, sealed, done = (draw(times) for _ in range(5))
    first = draw(st.sampled_from([-1, draw(times)]))
    last = draw(st.sampled_from([-1, draw(times)]))  # some ran, some never did, some backwards
    return (dispatch, admit, launch, sealed, first, last, done, draw(st.integers(0, 2)))


@settings(max_examples=300, deadline=None)
@given(st.lists(run_records(), max_size=40))
def test_window_summary_matches_a_plain_reference(records):
    """Percentiles and the overlap ratio, native, equal what walking the records in Python gives: exactly."""
    assert summary_of(records) == reference_summary(records)


def test_window_summary_cases():
    assert summary_of([])[4] is None  # no device time: no ratio
    p = summary_of([(0, i, 0, 0, -1, -1, 0, 0) for i in range(1, 101)])[0]
    assert p == (50, 90, 99, 100)  # nearest rank
    # host [0, 5) against device [0, 10): half of the device's busy time had the host busy too
    assert summary_of([(0, 0, 0, 5, 0, 10, 10, 0)])[4] == 0.5
    host = [(0, 3), (2, 6), (20, 30)]
    device = [(4, 8), (5, 7), (25, 35)]
    records = [(0, 0, h[0], h[1], d[0], d[1], 40, 0) for h, d in zip(host, device)]
    assert summary_of(records)[4] == pytest.approx(7 / 14)
    # cancelled runs count towards admission and orchestration, not device or latency
    assert summary_of([(0, 1, 0, 1, 0, 4, 9, 2)])[2:4] == ((0, 0, 0, 0), (0, 0, 0, 0))


def test_run_log_window_and_counts():
    log = _native.RunLog(3)
    for i in range(5):  # (dispatch, admit, launch, sealed, first, last, done, kind)
        log.record(i, i, i, i, -1, -1, 10 * i, i % 3)
    log.launched()
    assert log.window == 3 and [r[6] for r in log.recent()] == [20, 30, 40]  # the window's, oldest first
    assert log.counts() == (1, 2, 2, 1)  # (launched, completed, failed, cancelled): every run's
    with pytest.raises(ValueError):
        log.record(0, 0, 0, 0, -1, -1, 0, 3)
    with pytest.raises(ValueError):
        _native.RunLog(0)


# -- trace ------------------------------------------------------------------------------------------
def check_trace(trace: dict) -> dict:
    """Validates structure and nesting; returns spans grouped for further checks."""
    events = trace["traceEvents"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events if e["ph"] == "M" and "name" in e["args"]}
    assert names[(HOST_PID, None)] == "host" and names[(DEVICE_PID, None)] == "device"
    spans = [e for e in events if e["ph"] == "X"]
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0
        assert (e["pid"], e["tid"]) in names  # every track is named
    eps = 1e-3  # microseconds: float rounding
    by_track: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in spans:
        by_track[(e["pid"], e["tid"])].append(e)
    runs = {e["args"]["run"]: e for e in spans if e["cat"] == "run"}

    def inside(child: dict, parent: dict) -> bool:
        return parent["ts"] - eps <= child["ts"] and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + eps

    for (pid, tid), track in by_track.items():
        if pid == HOST_PID and tid < ADMISSION_TID_BASE:  # a slot: runs one after another, phases inside
            run_spans = sorted((e for e in track if e["cat"] == "run"), key=lambda e: e["ts"])
            for a, b in zip(run_spans, run_spans[1:]):
                assert a["ts"] + a["dur"] <= b["ts"] + eps, "two runs overlap on one slot"
            for e in track:
                if e["cat"] == "host":
                    assert e["name"] in ("staging", "orchestration")
                    assert inside(e, runs[e["args"]["run"]])
        else:  # admission lanes and workers: spans never overlap within a track
            seq = sorted(track, key=lambda e: e["ts"])
            for a, b in zip(seq, seq[1:]):
                assert a["ts"] + a["dur"] <= b["ts"] + eps, f"overlap on track {(pid, tid)}"
    tasks = [e for e in spans if e["pid"] == DEVICE_PID]
    for t in tasks:  # each task nests in its run's span (the run's extent across tracks)
        if t["args"]["run"] in runs:
            assert inside(t, runs[t["args"]["run"]])
    return {"runs": runs, "tasks": tasks, "spans": spans}


def overlapping(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


async def test_async_trace_exports_nested_spans_and_overlapping_runs(gated_rt, tmp_path):
    rt, gate = gated_rt(depth=2)
    path = tmp_path / "trace.json"
    async with AsyncRuntime(rt) as art:
        art.set_tracing(True)
        first = await art.dispatch(1.0)
        await eventually(lambda: gate.entered == 1)  # the device works on the first run...
        second = await art.dispatch(2.0)  # ...while the host stages and orchestrates the second

        async def third():
            await art.call(3.0)

        async with anyio.create_task_group() as tg:
            tg.start_soon(third)
            await eventually(lambda: art.waiting == 1)  # the third waits for admission
            gate.open()
        await first
        await second
        async for _ in art.stream([(float(i),) for i in range(6)]):
            pass
        art.export_trace(path)
        art.set_tracing(False)
    trace = json.loads(path.read_text())
    got = check_trace(trace)
    runs, tasks, spans = got["runs"], got["tasks"], got["spans"]
    assert len(runs) == 9
    assert {t["name"] for t in tasks} == {"callback:gate", "fill", "copy_back"}
    assert {r["tid"] for r in runs.values()} == {0, 1}
    admissions = [e for e in spans if e["name"] == "admission"]
    assert len(admissions) == 9 and all(e["tid"] >= ADMISSION_TID_BASE for e in admissions)
    third_wait = next(e for e in admissions if e["args"]["run"] == max(runs) - 6)
    assert third_wait["dur"] > 0
    # Pipelining is visible: the first two runs overlap in time on their two slots, and the
    # second was orchestrated on the host while the first run's gate task held the device.
    r1, r2 = runs[min(runs)], runs[min(runs) + 1]
    assert r1["tid"] != r2["tid"] and overlapping(r1, r2)
    gate_task = next(t for t in tasks if t["args"]["run"] == min(runs) and t["name"] == "callback:gate")
    orch2 = next(e for e in spans if e["name"] == "orchestration" and e["args"]["run"] == min(runs) + 1)
    assert overlapping(orch2, gate_task)


def test_sync_runtime_trace(make_rt, tmp_path):
    rt = make_rt(add, depth=2, bounds={"B": 4})
    x = np.ones((2, 4), np.float32)
    rt.set_tracing(True)
    handles = [rt.submit(x, x) for _ in range(5)]
    for h in handles:
        h.result()
    path = tmp_path / "sync.json"
    rt.export_trace(path)
    got = check_trace(json.loads(path.read_text()))
    assert len(got["runs"]) == 5
    assert sorted({t["name"] for t in got["tasks"]}) == ["add", "copy_back"]


def test_chrome_trace_lays_overlapping_admission_waits_on_separate_lanes():
    spans = [(1, 0, "admission", 0, 100), (2, 0, "admission", 10, 200), (3, 0, "admission", 150, 300),
             (1, 0, "staging", 100, 110), (1, 0, "orchestration", 110, 120)]
    events = [(1, 0, 0, 115, 140, "noop", True)]
    trace = chrome_trace(spans, events, workers=1, depth=1)
    waits = sorted((e for e in trace["traceEvents"] if e.get("name") == "admission"), key=lambda e: e["ts"])
    assert [e["tid"] - ADMISSION_TID_BASE for e in waits] == [0, 1, 0]
    run = next(e for e in trace["traceEvents"] if e.get("cat") == "run")
    assert (run["ts"], run["dur"]) == (0.1, pytest.approx(0.04))  # staging start to the last task's end
    check_trace(trace)
