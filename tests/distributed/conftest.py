"""Fixtures for the distributed tests: runtimes prepared once per module, and cleanup checks.

Starting chip workers costs about a second (each spawned process imports the
engine), so a module prepares each runtime once (module scope) and closes it
at the end, checking that the workers were reaped and the shared memory
removed.
"""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np
import pytest

import engine.distributed as dist

WORKERS = 2
THREADS = 1  # executors per worker (its serving thread alone): 2 workers on 2 cores


# The CPUs this process may bind its threads to (none where threads cannot be bound).
BINDABLE = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_setaffinity") else []


def assert_follows_senders(drt: dist.DistributedRuntime, thread: threading.Thread | None, follow: bool) -> None:
    """This thread bound to one CPU after another, a submitted run each time (its request wakes the transport's
    `thread`): that thread ends up bound to the same CPU when it follows its senders, left as it was if not."""
    assert thread is not None and thread.native_id is not None
    before = os.sched_getaffinity(thread.native_id)
    try:
        for cpu in (BINDABLE[-1], BINDABLE[0], BINDABLE[-1]):
            os.sched_setaffinity(0, {cpu})  # this thread only
            threading.Event().wait(0.05)  # longer than any spin: the transport's thread is asleep when the run goes
            np.testing.assert_array_equal(drt.submit(np.zeros(2, np.float32), 1).result(timeout=30),
                                          np.ones(2, np.float32))
            expected = {cpu} if follow else before
            deadline = time.monotonic() + 10.0  # it may hand the reply on before the wake-up that moves it
            while os.sched_getaffinity(thread.native_id) != expected and time.monotonic() < deadline:
                threading.Event().wait(0.01)
            assert os.sched_getaffinity(thread.native_id) == expected
    finally:
        os.sched_setaffinity(0, BINDABLE)


def shm_present(names: list[str]) -> list[str]:
    """Which of these shared-memory names still exist."""
    try:
        listing = set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # not Linux
        return []
    return [n for n in names if n in listing]


def assert_reaped(pids: list[int]) -> None:
    """Every pid is gone and reaped: not our child any more (no zombie), not running."""
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def assert_cleaned_up(drt: dist.DistributedRuntime) -> None:
    names = drt.shared_memory_names
    assert names, "the runtime reports its shared-memory names"
    assert drt.closed
    assert shm_present(names) == []
    assert_reaped(drt.pids)


@pytest.fixture(scope="module")
def prepare():
    """prepare(program, **kwargs) -> DistributedRuntime (2 workers, 1 thread each), closed at module end."""
    made: list[dist.DistributedRuntime] = []

    def make(prog: dist.DistributedProgram, **kwargs) -> dist.DistributedRuntime:
        kwargs.setdefault("workers", WORKERS)
        kwargs.setdefault("worker_threads", THREADS)
        drt = prog.prepare(**kwargs)
        made.append(drt)
        return drt

    yield make
    for drt in made:
        drt.close()
        assert_cleaned_up(drt)


def gelu(h: np.ndarray) -> np.ndarray:
    erf = np.vectorize(math.erf)
    return (0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))).astype(np.float32)


def mlp_reference(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    return gelu(x.astype(np.float64) @ w1) @ w2


def randn(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def reply_threads(drt: dist.DistributedRuntime) -> list[int]:
    """Wraps the transport's reply handler so that each reply records the thread that took it."""
    transport = drt._transport
    handle = transport._on_message
    seen: list[int] = []

    def recording(worker, msg):
        seen.append(threading.get_ident())
        handle(worker, msg)

    transport._on_message = recording
    return seen


def sync_calls_then_submits(drt: dist.DistributedRuntime, timeout: float) -> list[int]:
    """Three drt(x) calls of the `slow` program have both workers' replies taken on this thread, then four
    submitted runs have theirs taken by another: the reply recorder (reply_threads), emptied, for what follows."""
    seen = reply_threads(drt)
    zeros, ones = np.zeros(2, np.float32), np.ones(2, np.float32)
    for _ in range(3):
        np.testing.assert_array_equal(drt(zeros, 1), ones)
    assert len(seen) == 6 and set(seen) == {threading.get_ident()}  # each call: both workers' replies
    seen.clear()
    handles = [drt.submit(zeros, 1) for _ in range(4)]
    for h in handles:
        np.testing.assert_array_equal(h.result(timeout=timeout), ones)
    assert len(seen) == 8 and threading.get_ident() not in seen
    seen.clear()
    return seen


def callers_and_submitters(drt: dist.DistributedRuntime, seconds: float, timeout: float) -> list[int]:
    """Two threads calling drt(zeros, 1) and one submitting pairs of runs of the `slow` program, for a few
    seconds: the runs each completed (every thread's count); fails on a wrong result, an error or a thread
    that never returned (a reader blocked on a message another took)."""
    zeros, ones = np.zeros(2, np.float32), np.ones(2, np.float32)
    stop = time.monotonic() + seconds
    done: list[int] = []
    errors: list[BaseException] = []

    def calls() -> None:
        try:
            n = 0
            while time.monotonic() < stop:
                np.testing.assert_array_equal(drt(zeros, 1), ones)
                n += 1
            done.append(n)
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    def submits() -> None:
        try:
            n = 0
            while time.monotonic() < stop:
                for h in [drt.submit(zeros, 1) for _ in range(2)]:
                    np.testing.assert_array_equal(h.result(timeout=timeout), ones)
                    n += 1
            done.append(n)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=f, daemon=True) for f in (calls, calls, submits)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a reader blocked: a thread never returned"
    assert errors == [] and len(done) == 3
    return done
