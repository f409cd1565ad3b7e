"""Observers of engine._native: task observers (TraceRecorder, attached with
Engine.add_observer) and run observers (RunLog, handed to a run by seal_logged)."""

from __future__ import annotations

import threading

import pytest

from engine import _native

from .graph_helpers import user_kernel_library


def run_tasks(eng, kernel, n: int) -> "_native.Run":
    """A run of n independent calls of `kernel`, sealed and waited for."""
    run = eng.begin_run()
    for _ in range(n):
        eng.submit(run, kernel, [], [])
    eng.seal(run)
    assert run.wait(10)
    return run


def keys(events) -> list[tuple[int, int]]:
    return sorted((e[0], e[1]) for e in events)


def test_a_recorder_records_each_executed_task_in_drain_s_tuple_shape(eng):
    rec = _native.TraceRecorder()
    assert isinstance(rec, _native.TaskObserver)
    assert eng.add_observer(rec)
    before = eng.now_ns()
    run = run_tasks(eng, eng.kernel("noop"), 5)
    after = eng.now_ns()
    events = rec.drain()
    assert keys(events) == [(run.id, i) for i in range(5)]
    for run_id, index, worker, start, end, name, ok in events:
        assert (name, ok) == ("noop", True)
        assert 0 <= worker < eng.workers or worker == -1  # -1: the thread waiting for the run ran it
        assert before <= start <= end <= after
    assert rec.drain() == []  # drained: it starts afresh
    assert rec.dropped == 0


def test_no_events_reach_a_recorder_that_is_not_attached(eng):
    rec = _native.TraceRecorder()
    run_tasks(eng, eng.kernel("noop"), 20)
    assert eng.add_observer(rec) and eng.remove_observer(rec)
    run_tasks(eng, eng.kernel("noop"), 20)
    assert rec.drain() == []


def test_an_observer_attached_mid_stream_sees_every_later_task_and_none_before(eng):
    noop = eng.kernel("noop")
    stream = eng.begin_run()  # one run whose tasks straddle the attach
    for _ in range(50):
        eng.submit(stream, noop, [], [])
    early = run_tasks(eng, noop, 10)
    rec = _native.TraceRecorder()
    eng.add_observer(rec)
    for _ in range(50):
        eng.submit(stream, noop, [], [])
    eng.seal(stream)
    assert stream.wait(10)
    late = run_tasks(eng, noop, 10)
    got = set(keys(rec.drain()))
    assert {(late.id, i) for i in range(10)} <= got
    assert {(stream.id, i) for i in range(50, 100)} <= got  # submitted after the attach
    assert not any(run_id == early.id for run_id, _ in got)


def test_two_recorders_both_see_events_and_removing_one_stops_only_its_events(eng):
    noop = eng.kernel("noop")
    a, b = _native.TraceRecorder(), _native.TraceRecorder()
    assert eng.add_observer(a) and eng.add_observer(b)
    both = run_tasks(eng, noop, 8)
    assert keys(a.drain()) == keys(b.drain()) == [(both.id, i) for i in range(8)]
    assert eng.remove_observer(a)
    only_b = run_tasks(eng, noop, 8)
    assert a.drain() == []
    assert keys(b.drain()) == [(only_b.id, i) for i in range(8)]
    assert eng.remove_observer(b)
    run_tasks(eng, noop, 8)
    assert a.drain() == [] and b.drain() == []


def test_attach_is_idempotent_and_detach_says_whether_it_was_attached(eng):
    rec = _native.TraceRecorder()
    assert eng.add_observer(rec)
    assert not eng.add_observer(rec)  # once only: it is not told twice per task
    run = run_tasks(eng, eng.kernel("noop"), 3)
    assert keys(rec.drain()) == [(run.id, i) for i in range(3)]
    assert eng.remove_observer(rec)
    assert not eng.remove_observer(rec)
    assert not eng.remove_observer(_native.TraceRecorder())
    with pytest.raises(ValueError, match="null observer"):
        eng.add_observer(None)
    with pytest.raises(TypeError):
        eng.add_observer(_native.RunLog(1))  # a run observer is not a task observer


def test_failed_tasks_are_reported_not_ok_and_skipped_tasks_not_at_all(eng):
    fail = eng.load_kernel(user_kernel_library(), "user_fail")
    rec = _native.TraceRecorder()
    eng.add_observer(rec)
    run = eng.begin_run()
    eng.submit(run, fail, [], [])
    eng.seal(run)
    assert run.wait(10) and run.failed
    cancelled = eng.begin_run()
    cancelled.cancel()
    for _ in range(5):
        eng.submit(cancelled, eng.kernel("noop"), [], [])
    eng.seal(cancelled)
    assert cancelled.wait(10)
    events = rec.drain()
    assert [(e[0], e[1], e[5], e[6]) for e in events] == [(run.id, 0, "user_fail", False)]


def test_observers_attached_and_detached_while_tasks_run(eng):
    """add/remove race the workers: every event a recorder gets is a real task, reported once."""
    noop = eng.kernel("noop")
    recorders = [_native.TraceRecorder() for _ in range(3)]
    stop = threading.Event()

    def toggle():
        i = 0
        while not stop.is_set():
            rec = recorders[i % len(recorders)]
            eng.add_observer(rec)
            if i % 2:
                eng.remove_observer(rec)
            i += 1
        for rec in recorders:
            eng.remove_observer(rec)

    t = threading.Thread(target=toggle)
    t.start()
    runs = []
    try:
        for _ in range(20):
            runs.append(run_tasks(eng, noop, 200))
    finally:
        stop.set()
        t.join()
    valid = {(r.id, i) for r in runs for i in range(200)}
    for rec in recorders:
        got = keys(rec.drain())
        assert len(got) == len(set(got))
        assert set(got) <= valid
    run_tasks(eng, noop, 10)  # every recorder detached: nothing more arrives
    assert all(rec.drain() == [] for rec in recorders)


def test_a_recorder_outlives_its_engine_and_keeps_what_it_recorded(device):
    e = _native.Engine(device, 1)
    rec = _native.TraceRecorder()
    e.add_observer(rec)
    run = run_tasks(e, e.kernel("noop"), 4)
    e.close()
    del e
    assert keys(rec.drain()) == [(run.id, i) for i in range(4)]


def test_a_run_reports_to_its_log_once_when_it_completes(eng):
    """seal_logged hands the run its RunLog: counted launched at the seal, recorded at completion only."""
    log = _native.RunLog(64)
    gate = threading.Event()
    gated = eng.register_host_kernel("gate", lambda: gate.wait(10))
    run = eng.begin_run()
    eng.submit(run, gated, [], [])
    t0 = eng.now_ns()
    eng.seal_logged(run, log, t0, 0)
    assert log.counts() == (1, 0, 0, 0) and log.recent() == []  # launched, not done: no record yet
    gate.set()
    assert run.wait(10)
    assert log.counts() == (1, 1, 0, 0)
    (record,) = log.recent()
    assert record[0] == t0 and record[7] == 0
    # Its one task's time: measured by the engine whether or not anyone traces; within the run's device span.
    assert 0 < record[8] <= record[5] - record[4]
    eng.seal_logged(run, log, t0, 0)  # sealed already: not reported again
    # Many runs completing on the workers at once: each recorded exactly once.
    runs = []
    for _ in range(40):
        r = eng.begin_run()
        eng.submit(r, eng.kernel("noop"), [], [])
        eng.seal_logged(r, log, eng.now_ns(), 0)
        runs.append(r)
    for r in runs:
        assert r.wait(10)
    assert log.counts() == (41, 41, 0, 0)
    assert len(log.recent()) == 41


def test_run_log_histograms_cover_every_run_and_since_reads_on_from_a_cursor():
    """The histograms count every run, not the window's; since() resumes where a reader left off."""
    bounds = _native.RunLog.histogram_bounds_ns()
    assert bounds[0] == 10_000 and all(b == 2 * a for a, b in zip(bounds, bounds[1:]))
    log = _native.RunLog(2)
    # (dispatch, admit, launch, sealed, first_start, last_end, done, kind): waits of 0, 15 us and 1 s.
    log.record(0, 0, 0, 5_000, 10, 30_000, 40_000, 0)
    log.record(0, 15_000, 15_000, 20_000, -1, -1, 25_000, 1)  # failed before any task ran: no device time
    log.record(0, 10**9, 10**9, 10**9, 10**9, 10**9, 10**9, 2)  # cancelled: no device or latency sample
    h = log.histograms()
    assert set(h) == {"admission_wait", "orchestration", "device", "latency"}
    counts, total, n = h["admission_wait"]
    assert n == 3 and total == 15_000 + 10**9 and len(counts) == len(bounds) + 1
    assert counts[0] == 1 and counts[1] == 1 and counts[bounds.index(1_310_720_000)] == 1 and sum(counts) == 3
    assert h["device"][2] == 1 and h["device"][1] == 29_990
    assert h["latency"][2] == 2 and h["latency"][1] == 65_000
    assert log.recorded == 3 and len(log.recent()) == 2
    first, records = log.since(0)  # the first record left the window of two
    assert first == 1 and [r[7] for r in records] == [1, 2] and [r[8] for r in records] == [-1, -1]  # busy unknown
    assert log.since(2) == (2, records[1:]) and log.since(3) == (3, []) and log.since(99) == (3, [])
    log.record(0, 40_000, 0, 0, -1, -1, 10**11, 0)  # past every bound: the overflow bucket
    assert log.histograms()["latency"][0][-1] == 1 and log.since(3)[1][0][7] == 0
