"""Shared fixtures and host kernels for the engine API tests."""

from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

import engine
from engine import _native


# -- host kernels (numpy inside): fn(*inputs, out, *scalars) ---------------------------------
@engine.host_kernel
def k_add(a, b, out):
    np.add(a, b, out=out)


@engine.host_kernel
def k_mul(a, b, out):
    np.multiply(a, b, out=out)


@engine.host_kernel
def k_matmul(a, b, out):
    np.matmul(a, b, out=out)


@engine.host_kernel
def k_copy(a, out):
    out[...] = a


@engine.host_kernel
def k_scale(a, out, factor):
    np.multiply(a, factor, out=out)


@engine.host_kernel
def k_relu(a, out):
    np.maximum(a, 0, out=out)


# -- fixtures -------------------------------------------------------------------------------
@pytest.fixture
def prepared():
    """prepared(prog, **prepare_kwargs) -> Runtime, closed at teardown."""
    runtimes = []

    def make(prog, **kwargs):
        rt = prog.prepare(**kwargs)
        runtimes.append(rt)
        return rt

    yield make
    for rt in runtimes:
        rt.close()


@pytest.fixture
def device_spy(monkeypatch):
    """Records every native Device a runtime creates, so tests can read its counters after close."""
    created: list = []
    real = _native.Device

    def factory(*args, **kwargs):
        d = real(*args, **kwargs)
        created.append(d)
        return d

    monkeypatch.setattr(_native, "Device", factory)
    return created


def pool_threads() -> set[int]:
    """OS thread ids of this process's engine pool workers (named tandem-pool-N natively)."""
    out = set()
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().startswith("tandem-pool"):
                    out.add(int(t))
        except OSError:  # the thread ended meanwhile
            pass
    return out


def pool_threads_within(allowed: set[int], timeout: float = 5.0) -> bool:
    """Polls until every pool worker thread of this process is one of `allowed` (False after `timeout` s).

    By identity, not by count: other libraries' threads (Ray's, anyio's) come and go
    in a long test session. A joined thread can outlive pthread_join in
    /proc/self/task for a moment, hence the polling.
    """
    deadline = time.monotonic() + timeout
    while not pool_threads() <= allowed:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def thread_ids() -> set[int]:
    """OS thread ids of this process: compare sets, so threads other tests leave
    behind (or that end meanwhile) do not count."""
    return {int(t) for t in os.listdir("/proc/self/task")}


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def settle() -> None:
    gc.collect()
    gc.collect()


class Gate:
    """A host kernel `gate(a, out, key)` that records its start and blocks until key is opened.

    Tests use it to hold runs in flight and observe ordering through recorded events.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, int]] = []
        self._gates: dict[int, threading.Event] = {}
        self._started: dict[int, threading.Event] = {}
        self._all_open = False

    def _event(self, table: dict, key: int) -> threading.Event:
        with self.lock:
            ev = table.get(key)
            if ev is None:
                ev = table[key] = threading.Event()
                if table is self._gates and self._all_open:
                    ev.set()
            return ev

    def record(self, what: str, key: int) -> None:
        with self.lock:
            self.events.append((what, key))

    def open(self, key: int) -> None:
        self._event(self._gates, key).set()

    def open_all(self) -> None:
        with self.lock:
            self._all_open = True
            events = list(self._gates.values())
        for ev in events:
            ev.set()

    def wait_started(self, key: int, timeout: float = 10) -> bool:
        return self._event(self._started, key).wait(timeout)

    def has_started(self, key: int) -> bool:
        return self._event(self._started, key).is_set()

    def kernel(self):
        gate = self

        @engine.host_kernel(name="gate")
        def gate_kernel(a, out, key):
            key = int(key)
            gate.record("start", key)
            gate._event(gate._started, key).set()
            ev = gate._event(gate._gates, key)
            ok = ev.wait(20)
            gate.record("end", key)
            if not ok:
                raise RuntimeError(f"gate {key} was never opened")
            out[...] = a + key

        return gate_kernel
