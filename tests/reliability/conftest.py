"""Shared helpers of the reliability suite: sizes (CI, long, sanitizers), leak baselines, figures.

Sizes. The default run is bounded for CI. TANDEM_LONG=1 runs the long versions
(more hypothesis examples, 100,000 stress dispatches). Under a sanitizer
(scripts/sanitize sets TANDEM_SANITIZER) the counts shrink: the code paths are
the same, each one is just several times slower.

Figures. Tests add what they did to FIGURES (dispatches that survived, faults
injected, inputs fuzzed, leak checks); the terminal summary prints the totals
and, with TANDEM_RELIABILITY_FIGURES=path, writes them as JSON for
tests/RELIABILITY.md.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import threading
import time
from typing import Any, Callable

import pytest

LONG = os.environ.get("TANDEM_LONG", "") not in ("", "0")
SANITIZER = os.environ.get("TANDEM_SANITIZER", "")

# Generous bound for something that should happen promptly (failure detection, not a performance figure).
PATIENCE_S = 60.0 if SANITIZER else 20.0

FIGURES: collections.Counter[str] = collections.Counter()
_figures_lock = threading.Lock()


def record(**counts: int) -> None:
    with _figures_lock:
        FIGURES.update(counts)


def size(default: int, long: int, sanitized: int | None = None) -> int:
    """A count for this run: `long` with TANDEM_LONG=1, `sanitized` under a sanitizer, else `default`."""
    if LONG:
        return long
    if SANITIZER and sanitized is not None:
        return sanitized
    return default


def settle() -> None:
    gc.collect()
    gc.collect()


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def eventually(cond: Callable[[], bool], what: str, timeout: float = PATIENCE_S) -> None:
    """Polls until cond() holds; fails naming `what` after `timeout` (something is stuck)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {timeout} s: {what}")
        time.sleep(0.001)


def counters(rt: Any) -> dict[str, int]:
    """What must come back to its baseline once no run is in flight: device memory, mappings, slots, pool."""
    s = rt.memory_stats()
    e = rt._engine.stats()
    return {
        "bytes_in_use": s["bytes_in_use"],
        "live_allocations": s["live_allocations"],
        "mapped_regions": s["mapped_regions"],
        "free_slots": s["free_slots"],
        "runs_live": e["runs_live"],
        "queued": e["queued"],
        "workers": e["workers"],
    }


def assert_back_to(rt: Any, base: dict[str, int]) -> None:
    """Waits for the native run table to empty (a run leaves it just after notifying), then compares."""
    eventually(lambda: rt._engine.stats()["runs_live"] == 0 and rt._engine.stats()["queued"] == 0,
               "the engine's live-run table and queue empty")
    now = counters(rt)
    assert now == base, f"counters did not come back to their baseline: {now} != {base}"
    record(leak_checks=1)


@pytest.fixture
def device_spy(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every native Device a runtime makes, so its counters can be read after close()."""
    from engine import _native

    created: list = []
    real = _native.Device

    def factory(*args: Any, **kwargs: Any) -> Any:
        d = real(*args, **kwargs)
        created.append(d)
        return d

    monkeypatch.setattr(_native, "Device", factory)
    return created


class ProcessBaseline:
    """OS threads and file descriptors of this process before a test, compared after."""

    def __init__(self) -> None:
        settle()
        self.threads = thread_count()
        self.fds = fd_count()

    def check(self) -> None:
        settle()
        # Threads end asynchronously after join() returns in some runtimes (anyio's idle workers): wait.
        eventually(lambda: thread_count() <= self.threads, f"threads back to {self.threads} (now {thread_count()})")
        assert fd_count() <= self.fds, f"file descriptors leaked: {fd_count()} > {self.fds}"
        record(leak_checks=1)



def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    keys = ["dispatches", "dispatches_survived", "dispatches_failed", "dispatches_cancelled", "faults_injected",
            "inputs_fuzzed", "programs_fuzzed", "leak_checks"]
    parts = [f"{k}={FIGURES[k]}" for k in keys if FIGURES.get(k)]
    parts += [f"{k}={v}" for k, v in sorted(FIGURES.items()) if k not in keys]
    terminalreporter.write_line("reliability figures: " + ", ".join(parts))
    path = os.environ.get("TANDEM_RELIABILITY_FIGURES")
    if path:
        with open(path, "w") as f:
            json.dump({"long": LONG, "sanitizer": SANITIZER or None, **FIGURES}, f, indent=2)
