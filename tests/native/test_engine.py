"""The task graph, dependency tracking, worker pool and notifier of engine._native."""

from __future__ import annotations

import os
import random
import select
import threading
import time

import numpy as np
import pytest

from engine import _native

from .graph_helpers import READ, READWRITE, WRITE, RandomGraph, arg, read_vec, user_kernel_library, write_vec


@pytest.fixture
def kernels(eng):
    lib = user_kernel_library()
    return {
        "fill": eng.kernel("fill"),
        "copy": eng.kernel("copy"),
        "add_one": eng.load_kernel(lib, "user_add_one"),
        "fail": eng.load_kernel(lib, "user_fail"),
        "noop": eng.kernel("noop"),
        "spin": eng.kernel("spin"),
    }


class Recorder:
    """Host kernels that log (name, phase) so tests can observe execution order."""

    def __init__(self, eng):
        self.log: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.eng = eng
        self.count = 0

    def kernel(self, name: str, delay: float = 0.0):
        self.count += 1

        def fn(*arrays):
            with self.lock:
                self.log.append((name, "start"))
            if delay:
                time.sleep(delay)  # releases the GIL, so a wrongly unordered task could interleave
            with self.lock:
                self.log.append((name, "end"))

        return self.eng.register_host_kernel(f"rec_{name}_{self.count}", fn)

    def ended_before_started(self, a: str, b: str) -> bool:
        return self.log.index((a, "end")) < self.log.index((b, "start"))


@pytest.mark.parametrize(
    "first,second",
    [(WRITE, READ), (READ, WRITE), (WRITE, WRITE), (READWRITE, READ), (READ, READWRITE)],
    ids=["RAW", "WAR", "WAW", "RW-then-R", "R-then-RW"],
)
def test_conflicting_accesses_run_in_submission_order(device, eng, first, second):
    buf = device.alloc(1024)
    rec = Recorder(eng)
    a, b = rec.kernel("a", delay=0.05), rec.kernel("b")
    run = eng.begin_run()
    eng.submit(run, a, [arg(buf, 0, 128)], [first])
    eng.submit(run, b, [arg(buf, 64, 128)], [second])  # overlaps a's bytes 256..512
    eng.seal(run)
    assert run.wait(10)
    assert rec.ended_before_started("a", "b")


@pytest.mark.parametrize("readers", [1, 8, 9, 40])  # a completion readies up to 8 tasks inline, more spill
def test_a_write_releases_every_task_waiting_for_it(device, eng, kernels, readers):
    src = device.alloc(64)
    outs = [device.alloc(64) for _ in range(readers)]
    run = eng.begin_run()
    eng.submit(run, kernels["spin"], [arg(src)], [READWRITE], [2_000_000])  # they all queue behind it
    eng.submit(run, kernels["fill"], [arg(src)], [WRITE], [7.0])
    for out in outs:  # each reads what the fill wrote: the fill's completion makes all of them ready at once
        eng.submit(run, kernels["copy"], [arg(src), arg(out)], [READ, WRITE])
    eng.seal(run)
    assert run.wait(10) and not run.failed
    for out in outs:
        np.testing.assert_array_equal(read_vec(device, out), np.full(16, 7.0, np.float32))
    assert eng.stats()["tasks_executed"] >= readers + 2


def test_reads_of_the_same_bytes_and_disjoint_writes_run_concurrently(device, eng):
    buf = device.alloc(1024)
    barrier = threading.Barrier(2, timeout=5)

    def meet(*arrays):
        barrier.wait()  # both must be running at once, or this times out

    k = eng.register_host_kernel("meet", meet)
    for tags in [(READ, READ), (WRITE, WRITE)]:
        run = eng.begin_run()
        eng.submit(run, k, [arg(buf, 0, 64)], [tags[0]])
        eng.submit(run, k, [arg(buf, 0 if tags[0] == READ else 64, 64)], [tags[1]])
        eng.seal(run)
        assert run.wait(10)
        assert not run.failed, run.failure()


def view(buf: "_native.Buffer", start: int, shape: list[int], strides: list[int]) -> "_native.TensorArg":
    """A float32 strided view of buf from element `start`, with its exact extent as the tracked byte range."""
    last = start + sum((n - 1) * s for n, s in zip(shape, strides))
    return _native.TensorArg(buf.addr + 4 * start, 0, shape, strides, buf.id, 4 * start, 4 * (last + 1))


def meeting_kernel(eng, parties: int = 2):
    barrier = threading.Barrier(parties, timeout=5)

    def meet(*arrays):
        barrier.wait()  # every party must be running at once, or this times out

    return eng.register_host_kernel(f"meet{parties}", meet)


@pytest.mark.parametrize("views", [
    # the two column halves of an 8 x 16 matrix: their extents overlap, their bytes do not
    [(0, [8, 8], [16, 1]), (8, [8, 8], [16, 1])],
    # two heads of a [2, 3, 4 x 5] tensor (every outer stride a multiple of the row pitch)
    [(5, [2, 3, 5], [60, 20, 1]), (10, [2, 3, 5], [60, 20, 1])],
    # one row's tail and the next row's head of a pitch-16 layout, as [2, 4] views
    [(12, [2, 4], [16, 1]), (16, [2, 4], [16, 1])],
], ids=["column-halves", "heads", "tail-and-head"])
def test_writes_to_disjoint_column_slices_of_the_same_rows_run_concurrently(device, eng, views):
    buf = device.alloc(4 * 256)
    k = meeting_kernel(eng)
    run = eng.begin_run()
    for start, shape, strides in views:
        eng.submit(run, k, [view(buf, start, shape, strides)], [WRITE])
    eng.seal(run)
    assert run.wait(10)
    assert not run.failed, run.failure()


@pytest.mark.parametrize("first,second", [
    ((0, [8, 9], [16, 1]), (8, [8, 8], [16, 1])),  # column 8 in both
    ((14, [3, 4], [16, 1]), (16, [3, 2], [16, 1])),  # the first's rows wrap into columns 0-1 of the next row
    ((0, [8, 8], [16, 1]), (8, [8, 8], [32, 1])),  # other pitches: the extents decide
    ((0, [8, 8], [16, 1]), (0, [2, 2, 8], [64, 16, 1])),  # an outer stride of whole rows: columns decide
    ((0, [4, 8], [16, 1]), (0, [64], [1])),  # a contiguous view over the rows
    ((0, [2, 4, 8], [40, 16, 1]), (8, [4, 8], [16, 1])),  # an outer stride not a multiple of the pitch
])
def test_column_slices_that_may_share_bytes_are_ordered(device, eng, first, second):
    buf = device.alloc(4 * 256)
    rec = Recorder(eng)
    a, b = rec.kernel("a", delay=0.05), rec.kernel("b")
    run = eng.begin_run()
    eng.submit(run, a, [view(buf, *first)], [WRITE])
    eng.submit(run, b, [view(buf, *second)], [READ])
    eng.seal(run)
    assert run.wait(10)
    assert rec.ended_before_started("a", "b")


def test_a_read_of_the_whole_matrix_waits_for_every_column_slice_written(device, eng):
    buf = device.alloc(4 * 128)
    rec = Recorder(eng)
    left, right, reader = rec.kernel("left", delay=0.05), rec.kernel("right", delay=0.05), rec.kernel("reader")
    run = eng.begin_run()
    eng.submit(run, left, [view(buf, 0, [8, 8], [16, 1])], [WRITE])
    eng.submit(run, right, [view(buf, 8, [8, 8], [16, 1])], [WRITE])
    eng.submit(run, reader, [view(buf, 0, [8, 16], [16, 1])], [READ])
    eng.seal(run)
    assert run.wait(10)
    assert rec.ended_before_started("left", "reader") and rec.ended_before_started("right", "reader")


def test_runs_sharing_memory_are_ordered_across_runs(device, eng):
    rec = Recorder(eng)
    buf = device.alloc(256)
    w, r = rec.kernel("writer", delay=0.05), rec.kernel("reader")
    run1, run2 = eng.begin_run(), eng.begin_run()
    eng.submit(run1, w, [arg(buf)], [WRITE])
    eng.submit(run2, r, [arg(buf)], [READ])
    eng.seal(run2)
    eng.seal(run1)
    assert run1.wait(10) and run2.wait(10)
    assert rec.ended_before_started("writer", "reader")


def test_runs_over_disjoint_memory_execute_concurrently(device, eng):
    bufs = [device.alloc(256), device.alloc(256)]
    barrier = threading.Barrier(2, timeout=10)
    workers_seen = []

    def meet(x):
        barrier.wait()  # returns only when the other run's task is running too
        workers_seen.append(threading.get_native_id())

    k = eng.register_host_kernel("meet_across_runs", meet)
    runs = []
    for b in bufs:
        run = eng.begin_run()
        eng.submit(run, k, [arg(b)], [WRITE])
        eng.seal(run)
        runs.append(run)
    for run in runs:
        assert run.wait(20)
        assert not run.failed, run.failure()
    assert len(set(workers_seen)) == 2


def test_random_graphs_in_concurrent_runs_match_a_sequential_reference(device, eng, kernels):
    rng = random.Random(1234)
    nbufs, size = 5, 96
    bufs = [device.alloc(4 * size) for _ in range(nbufs)]
    state = [np.arange(size, dtype=np.float32) * (i + 1) for i in range(nbufs)]
    for b, s in zip(bufs, state):
        write_vec(device, b, s)
    runs = []
    for _ in range(60):  # all submitted back to back: many runs in flight at once
        g = RandomGraph.make(rng, nbufs, size, nops=rng.randint(1, 25))
        run = eng.begin_run()
        g.submit(eng, run, bufs, kernels)
        eng.seal(run)
        g.reference(state)
        runs.append(run)
    for run in runs:
        assert run.wait(30)
        assert not run.failed, run.failure()
    for b, s in zip(bufs, state):
        np.testing.assert_array_equal(read_vec(device, b), s)


def test_random_graphs_from_several_threads_on_disjoint_buffers(device, eng, kernels):
    def worker(seed: int, errors: list) -> None:
        rng = random.Random(seed)
        bufs = [device.alloc(4 * 48) for _ in range(3)]
        state = [np.full(48, seed, np.float32) for _ in range(3)]
        for b, s in zip(bufs, state):
            write_vec(device, b, s)
        runs = []
        for _ in range(30):
            g = RandomGraph.make(rng, 3, 48, nops=10)
            run = eng.begin_run()
            g.submit(eng, run, bufs, kernels)
            eng.seal(run)
            g.reference(state)
            runs.append(run)
        for run in runs:
            run.wait(30)
        try:
            for b, s in zip(bufs, state):
                np.testing.assert_array_equal(read_vec(device, b), s)
        except AssertionError as e:
            errors.append(e)

    errors: list = []
    threads = [threading.Thread(target=worker, args=(s, errors)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors


def test_early_tasks_start_before_the_run_is_sealed(device, eng, kernels):
    buf = device.alloc(64)
    run = eng.begin_run()
    eng.submit(run, kernels["fill"], [arg(buf)], [WRITE], [3.0])
    deadline = time.monotonic() + 10
    while eng.stats()["tasks_executed"] < 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert eng.stats()["tasks_executed"] == 1
    assert not run.done  # not sealed yet: the run cannot be complete
    eng.seal(run)
    assert run.wait(10)
    assert (read_vec(device, buf) == 3.0).all()


def test_failing_kernel_fails_only_its_run(device, eng, kernels):
    a, b = device.alloc(64), device.alloc(64)
    bad = eng.begin_run()
    eng.submit(bad, kernels["fill"], [arg(a)], [WRITE], [1.0])
    eng.submit(bad, kernels["fail"], [arg(a)], [READWRITE])
    eng.submit(bad, kernels["fill"], [arg(a)], [WRITE], [2.0])  # skipped: after the failure
    eng.seal(bad)
    good = eng.begin_run()
    eng.submit(good, kernels["fill"], [arg(b)], [WRITE], [5.0])
    eng.seal(good)
    assert bad.wait(10) and good.wait(10)
    assert bad.failed and not good.failed
    index, kernel, message = bad.failure()
    assert index == 1 and kernel == "user_fail" and "failing on purpose" in message
    assert (read_vec(device, a) == 1.0).all(), "tasks after the failure must be skipped"
    assert (read_vec(device, b) == 5.0).all()
    # the pool carries on
    again = eng.begin_run()
    eng.submit(again, kernels["fill"], [arg(a)], [WRITE], [7.0])
    eng.seal(again)
    assert again.wait(10) and not again.failed
    assert (read_vec(device, a) == 7.0).all()


def test_python_host_task_raising_fails_its_run_with_the_message(device, eng):
    def boom(x):
        raise ZeroDivisionError("host task blew up")

    k = eng.register_host_kernel("boom", boom)
    run = eng.begin_run()
    eng.submit(run, k, [arg(device.alloc(16))], [READ])
    eng.seal(run)
    assert run.wait(10)
    index, kernel, message = run.failure()
    assert (index, kernel) == (0, "boom") and "host task blew up" in message


def test_host_task_sees_device_memory_as_numpy(device, eng, kernels):
    buf = device.alloc(4 * 8)
    write_vec(device, buf, np.arange(8))
    src = device.alloc(4 * 8)
    write_vec(device, src, np.full(8, 3.0))
    flags = []

    def scale_by(x, s, scale):
        flags.append((x.flags.writeable, s.flags.writeable))
        x *= s * scale

    k = eng.register_host_kernel("scale_by", scale_by)
    run = eng.begin_run()
    eng.submit(run, k, [arg(buf), arg(src)], [READWRITE, READ], [2])
    eng.seal(run)
    assert run.wait(10) and not run.failed, run.failure()
    # A read-write argument arrives writable, a read-only one read-only; both view device memory.
    assert flags == [(True, False)]
    np.testing.assert_array_equal(read_vec(device, buf), np.arange(8) * 6)


def test_cancel_skips_tasks_not_started(device, eng, kernels):
    buf = device.alloc(64)
    run = eng.begin_run()
    eng.submit(run, kernels["spin"], [arg(buf)], [WRITE], [50_000_000])
    for v in range(20):
        eng.submit(run, kernels["fill"], [arg(buf)], [WRITE], [float(v)])
    eng.seal(run)
    assert run.cancel()
    assert run.wait(10)
    assert run.cancelled
    assert eng.stats()["tasks_skipped"] >= 20
    assert not run.cancel()  # already done


def test_workers_run_while_the_caller_holds_the_gil(device, eng, kernels):
    run = eng.begin_run()
    eng.submit(run, kernels["spin"], [], [], [20_000_000])
    eng.seal(run)
    deadline = time.monotonic() + 10
    while not run.done and time.monotonic() < deadline:
        pass  # pure Python spin: never releases the GIL voluntarily
    assert run.done


def test_notifier_fd_one_wakeup_delivers_every_completed_run(device, eng, kernels):
    fd = eng.notifier_fd
    r, _, _ = select.select([fd], [], [], 0)
    assert not r
    runs = []
    for _ in range(10):
        run = eng.begin_run(notify=True)
        eng.submit(run, kernels["noop"], [], [])
        eng.seal(run)
        runs.append(run)
    for run in runs:
        assert run.wait(10)
    r, _, _ = select.select([fd], [], [], 5)
    assert r == [fd]
    assert sorted(eng.drain_completed()) == sorted(run.id for run in runs)
    r, _, _ = select.select([fd], [], [], 0)
    assert not r, "drain resets the fd"
    assert eng.drain_completed() == []
    silent = eng.begin_run()  # notify=False runs never reach the notifier
    eng.seal(silent)
    assert silent.wait(1)
    assert not eng.wait_completed(0.01)


def test_notifier_counts_its_wakeups_and_the_time_they_took(device, eng, kernels):
    before = eng.stats()
    silent = eng.begin_run()  # notify=False: never written
    eng.seal(silent)
    assert silent.wait(10)
    assert eng.stats()["notifier_writes"] == before["notifier_writes"]
    for i in range(3):  # one write per batch: drained between runs, each completion writes again
        run = eng.begin_run(notify=True)
        eng.submit(run, kernels["noop"], [], [])
        eng.seal(run)
        assert eng.wait_completed(10)
        assert eng.drain_completed() == [run.id]
        stats = eng.stats()
        assert stats["notifier_writes"] == before["notifier_writes"] + i + 1
    assert stats["notifier_write_ns"] > before["notifier_write_ns"]
    batch = [eng.begin_run(notify=True) for _ in range(5)]  # completed before a drain: one write for all
    for run in batch:
        eng.seal(run)
    for run in batch:
        assert run.wait(10)
    assert sorted(eng.drain_completed()) == sorted(run.id for run in batch)
    assert eng.stats()["notifier_writes"] == stats["notifier_writes"] + 1


def test_wait_completed_blocks_until_a_run_completes(device, eng, kernels):
    run = eng.begin_run(notify=True)
    eng.submit(run, kernels["spin"], [], [], [5_000_000])
    eng.seal(run)
    assert eng.wait_completed(10)
    assert eng.drain_completed() == [run.id]


def test_close_drains_queued_work(device, kernels):
    e = _native.Engine(device, 1)
    buf = device.alloc(64)
    spin = e.kernel("spin")
    runs = []
    for _ in range(20):
        run = e.begin_run()
        e.submit(run, spin, [arg(buf)], [READWRITE], [1_000_000])
        e.seal(run)
        runs.append(run)
    e.close()
    assert all(r.done and not r.cancelled for r in runs)
    stats = e.stats()
    assert stats["tasks_executed"] == 20 and stats["workers"] == 0 and stats["runs_live"] == 0
    with pytest.raises(_native.ClosedError):
        e.begin_run()
    e.close()  # idempotent


def test_close_with_cancel_skips_queued_work_and_seals_open_runs(device):
    e = _native.Engine(device, 1)
    buf = device.alloc(64)
    runs = []
    for _ in range(50):
        run = e.begin_run()
        e.submit(run, e.kernel("spin"), [arg(buf)], [READWRITE], [2_000_000])
        e.seal(run)
        runs.append(run)
    open_run = e.begin_run()
    e.submit(open_run, e.kernel("noop"), [], [])
    e.close(True)
    assert all(r.done for r in runs + [open_run])
    # A run the worker finished before close() (submitting 50 can outlast a 2 ms spin on a slow
    # machine) completed normally; every later one was cancelled.
    finished_first = next((i for i, r in enumerate(runs) if r.cancelled), len(runs))
    assert all(r.cancelled for r in runs[finished_first:] + [open_run])
    assert finished_first <= 10
    stats = e.stats()
    assert stats["tasks_executed"] + stats["tasks_skipped"] == 51
    assert stats["tasks_skipped"] >= 40, "cancelled work must not run"
    with pytest.raises(_native.ClosedError):
        e.submit(open_run, e.kernel("noop"), [], [])


def test_close_from_several_threads(device):
    e = _native.Engine(device, 2)
    run = e.begin_run()
    e.submit(run, e.kernel("spin"), [], [], [20_000_000])
    e.seal(run)
    threads = [threading.Thread(target=e.close) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert run.done and e.closed


def test_bookkeeping_does_not_grow_over_100k_tasks(device, eng, kernels):
    bufs = [device.alloc(256) for _ in range(4)]
    args = [arg(b) for b in bufs]
    noop = kernels["noop"]
    peak = 0
    for i in range(1000):
        run = eng.begin_run()
        for j in range(100):
            k = (i + j) % 4
            eng.submit(run, noop, [args[k], args[(k + 1) % 4]], [READ, WRITE])
        eng.seal(run)
        if i % 50 == 0:
            peak = max(peak, eng.stats()["tracker_records"])
            run.wait(10)
    run.wait(30)
    stats = eng.stats()
    assert stats["tasks_submitted"] == 100_000
    assert stats["runs_live"] == 0
    assert peak < 5_000 and stats["tracker_records"] < 5_000


def test_user_library_kernels(device, eng, kernels):
    src, dst = device.alloc(4 * 5), device.alloc(4 * 5)
    write_vec(device, src, np.arange(5))
    run = eng.begin_run()
    eng.submit(run, kernels["add_one"], [arg(src), arg(dst)], [READ, WRITE])
    eng.seal(run)
    assert run.wait(10) and not run.failed
    np.testing.assert_array_equal(read_vec(device, dst), np.arange(5) + 1)
    with pytest.raises(ValueError, match="no symbol 'nope'"):
        eng.load_kernel(user_kernel_library(), "nope")
    with pytest.raises(ValueError, match="cannot load kernel library"):
        eng.load_kernel("/nonexistent/libx.so", "f")
    with pytest.raises(ValueError, match="already registered"):
        eng.load_kernel(user_kernel_library(), "user_add_one")


def test_submit_rejects_bad_arguments_and_keeps_the_engine_usable(device, eng, kernels):
    run = eng.begin_run()
    with pytest.raises(ValueError, match="access tags"):
        eng.submit(run, kernels["noop"], [arg(device.alloc(16))], [])
    with pytest.raises(ValueError, match="not read, write or read-write"):
        eng.submit(run, kernels["noop"], [arg(device.alloc(16))], [9])
    with pytest.raises(TypeError, match="scalar"):
        eng.submit(run, kernels["noop"], [], [], ["x"])
    with pytest.raises(ValueError, match="unknown kernel"):
        eng.kernel("nope")
    eng.seal(run)
    with pytest.raises(ValueError, match="sealed"):
        eng.submit(run, kernels["noop"], [], [])
    assert run.wait(5) and run.task_count == 0


def test_copy_back_through_the_runs_accessor(device, eng, kernels):
    buf = device.alloc(4 * 16)
    host = np.zeros(16, np.float32)
    acc = _native.HostAccessor(device)
    acc.add(buf.addr, buf.size, host)
    run = eng.begin_run()
    run.attach_accessor(acc)
    eng.submit(run, kernels["fill"], [arg(buf)], [WRITE], [4.5])
    eng.submit_copy_back(run, arg(buf), buf.addr)
    eng.seal(run)
    assert run.wait(10) and not run.failed, run.failure()
    assert (host == 4.5).all()
    assert acc.mapping_count() == 0, "the run closes its accessor when it completes"
    assert device.stats()["mapped_regions"] == 0


def test_run_times_are_ordered(device, eng, kernels):
    run = eng.begin_run()
    eng.submit(run, kernels["spin"], [], [], [2_000_000])
    eng.seal(run)
    run.wait(10)
    t = run.times()
    assert t["created_ns"] <= t["first_start_ns"] <= t["last_end_ns"] <= t["done_ns"]
    assert t["busy_ns"] >= 2_000_000


def test_default_worker_count_is_one_per_core(device):
    e = _native.Engine(device, 0)
    try:
        assert e.workers == (os.cpu_count() or 1)
    finally:
        e.close()


@pytest.mark.parametrize("spin_us", [0, 50])
def test_spin_window_is_per_engine_and_zero_still_wakes_workers(device, spin_us):
    e = _native.Engine(device, 1, spin_us)
    try:
        for _ in range(50):  # each run finds the worker asleep (spin 0) or spinning
            run = e.begin_run()
            e.submit(run, e.kernel("noop"), [], [])
            e.seal(run)
            assert run.wait(10)
        assert e.stats()["tasks_executed"] == 50
    finally:
        e.close()
    with pytest.raises(ValueError, match="spin_us"):
        _native.Engine(device, 1, -1)


def _run_unwaited(e, kernel, scalars_per_task) -> "_native.Run":
    """A run of one task per scalars entry, polled until done: a waiter would run its tasks itself."""
    run = e.begin_run()
    for scalars in scalars_per_task:
        e.submit(run, kernel, [], [], scalars)
    e.seal(run)
    deadline = time.monotonic() + 10
    while not run.done:
        assert time.monotonic() < deadline
        time.sleep(0.0005)
    return run


def _asleep_pool(device, spin_s: float = 0.5) -> "_native.Engine":
    """An engine of two workers that spun out their window (spin_s) and sleep."""
    e = _native.Engine(device, 2, int(spin_s * 1e6))
    time.sleep(spin_s * 1.5)
    return e


def test_a_spinning_worker_takes_new_tasks_without_waking_a_sleeping_one(device):
    e = _asleep_pool(device)
    try:
        before = e.stats()["worker_wakeups"]
        _run_unwaited(e, e.kernel("noop"), [[]])  # no spinner: one sleeper is woken, and spins after it
        assert e.stats()["worker_wakeups"] == before + 1
        for _ in range(20):  # well within its window: the spinning worker takes each, the sleeper sleeps on
            time.sleep(0.005)  # the worker back in its spin (it marks a run done just before)
            _run_unwaited(e, e.kernel("noop"), [[]])
        stats = e.stats()
        assert stats["worker_wakeups"] == before + 1
        assert stats["tasks_executed"] == 21
    finally:
        e.close()


def test_tasks_beyond_the_spinning_workers_wake_sleeping_ones(device):
    e = _asleep_pool(device)
    rec = _native.TraceRecorder()
    assert e.add_observer(rec)
    try:
        before = e.stats()["worker_wakeups"]
        # Two independent tasks at once, each long enough that a woken worker is up before the other ends.
        run = _run_unwaited(e, e.kernel("spin"), [[200_000_000], [200_000_000]])
        assert e.stats()["worker_wakeups"] >= before + 2  # one more when the first woken was not yet back
        workers = sorted(ev[2] for ev in rec.drain() if ev[0] == run.id)
        assert workers == [0, 1]  # both ran: nothing was left queued behind one worker
    finally:
        e.close()


def test_a_sealed_run_records_its_kind_and_ordered_timings_in_its_log(eng, kernels, device):
    log = _native.RunLog(8)
    t0 = eng.now_ns()
    done = eng.begin_run(False)
    eng.submit(done, kernels["noop"], [], [])
    eng.seal_logged(done, log, t0, 0)
    failed = eng.begin_run(False)
    eng.submit(failed, kernels["fail"], [], [])
    eng.seal_logged(failed, log, t0, eng.now_ns())
    cancelled = eng.begin_run(False)
    cancelled.cancel()
    eng.seal_logged(cancelled, log, t0, 0)
    unlogged = eng.begin_run(False)
    eng.seal_logged(unlogged, None, t0, 0)  # None: a plain seal
    for r in (done, failed, cancelled, unlogged):
        assert r.wait(10)
    assert log.counts() == (3, 1, 1, 1)  # (launched, completed, failed, cancelled)
    records = {r[7]: r for r in log.recent()}
    for kind, (dispatch, admit, launch, sealed, first, last, finished, _, busy) in records.items():
        assert dispatch <= admit <= launch <= sealed <= finished, kind
        if kind == 2:
            assert (first, last, busy) == (-1, -1, 0)  # no task ran: none took any time
        else:
            assert admit <= first <= last <= finished
            assert 0 <= busy <= last - first  # the task's own time, within the run's device span
    # A run sealed already keeps what it had: a second seal_logged neither counts nor records it again.
    eng.seal_logged(done, log, t0, 0)
    assert log.counts() == (3, 1, 1, 1)


# -- caller_runs: the driving thread is one of the executors (a chip worker's serving thread) ----------------
def test_a_caller_runs_engine_has_one_pool_thread_fewer_and_runs_queued_tasks_on_the_caller(device):
    e = _native.Engine(device, 1, caller_runs=True)
    try:
        assert e.caller_runs and e.workers == 1 and e.stats()["workers"] == 0  # no thread of its own
        buf = device.alloc(64)
        ran_on = []
        host = e.register_host_kernel("where", lambda *arrays: ran_on.append(threading.get_ident()))
        run = e.begin_run()
        e.submit(run, e.kernel("fill"), [arg(buf)], [WRITE], [3.0])
        e.submit(run, host, [arg(buf)], [READ])
        e.seal(run)
        time.sleep(0.05)
        assert not run.done and e.queued_tasks == 1  # nobody else runs them: the fill waits in the queue
        assert e.run_queued() == 2  # the fill, then its dependent, handed straight to the same thread
        assert run.done and e.queued_tasks == 0 and ran_on == [threading.get_ident()]
        np.testing.assert_array_equal(read_vec(device, buf), np.full(16, 3.0, np.float32))
    finally:
        e.close()


def test_run_queued_stops_between_tasks_once_its_fd_is_readable(device):
    e = _native.Engine(device, 1, caller_runs=True)
    r, w = os.pipe()
    try:
        bufs = [device.alloc(64) for _ in range(5)]
        runs = []
        for buf in bufs:  # independent runs: all five are queued at once
            run = e.begin_run()
            e.submit(run, e.kernel("spin"), [arg(buf)], [READWRITE], [2_000_000])
            e.seal(run)
            runs.append(run)
        os.write(w, b"x")  # a message is waiting: one task, then back to the caller
        assert e.run_queued(r) == 1 and e.queued_tasks == 4
        assert sum(run.done for run in runs) == 1
        assert e.run_queued() == 4 and all(run.done for run in runs)
    finally:
        os.close(r)
        os.close(w)
        e.close()


def test_a_waiter_on_a_caller_runs_engine_runs_the_other_runs_tasks_its_run_waits_for(device):
    e = _native.Engine(device, 1, caller_runs=True)
    try:
        buf, out = device.alloc(64), device.alloc(64)
        first, second = e.begin_run(), e.begin_run()
        e.submit(first, e.kernel("fill"), [arg(buf)], [WRITE], [5.0])
        e.submit(second, e.kernel("copy"), [arg(buf), arg(out)], [READ, WRITE])  # after first's write
        e.seal(second)
        e.seal(first)
        assert second.wait(10)  # no pool thread: the waiter itself runs first's fill, then the copy
        assert first.done
        np.testing.assert_array_equal(read_vec(device, out), np.full(16, 5.0, np.float32))
    finally:
        e.close()


@pytest.mark.parametrize("cancel", [False, True])
def test_closing_a_caller_runs_engine_runs_or_skips_what_is_queued(device, cancel):
    e = _native.Engine(device, 1, caller_runs=True)
    buf = device.alloc(64)
    runs = []
    for _ in range(10):
        run = e.begin_run()
        e.submit(run, e.kernel("spin"), [arg(buf)], [READWRITE], [100_000])
        e.seal(run)
        runs.append(run)
    e.close(cancel)  # no pool thread would ever take them: close runs (or skips) them itself
    assert all(run.done for run in runs) and all(run.cancelled == cancel for run in runs)
    stats = e.stats()
    assert stats["runs_live"] == 0 and stats["tasks_executed" if not cancel else "tasks_skipped"] == 10
    assert e.run_queued() == 0  # closed: nothing to run, and no error
