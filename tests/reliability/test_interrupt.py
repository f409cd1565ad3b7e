"""Ctrl-C while a synchronous caller waits: KeyboardInterrupt promptly, the runtime usable afterwards.

A run is held on the device by a gate (a host task blocked on an Event, so
the GIL is free) while the main thread waits for it: in RunHandle.result(),
RunHandle.wait(), the blocking call, a submit blocked on back-pressure, or
close() draining. A helper thread sends SIGINT (a real signal, or
_thread.interrupt_main) once the main thread is inside the wait. The
KeyboardInterrupt must arrive while the run is still held: a wait that only
notices the signal when the run completes fails the test. A watchdog opens the
gate after PATIENCE_S so a wait that never notices cannot hang the suite.
"""

from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from typing import Callable

import numpy as np
import pytest

import engine
from engine import In, Out, Scalar
from engine import kernels as K

from .conftest import PATIENCE_S, ProcessBaseline, assert_back_to, counters, record

pytestmark = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                reason="signals are delivered to the main thread")


class HeldGate:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.opened_by_watchdog = False

    def __call__(self) -> None:
        self.entered.set()
        self.release.wait()


@engine.program(callbacks={"gate": 0})
def held(run: engine.Run, x: In((8,)), y: Out((8,)), hold: Scalar(int)):
    if hold:
        run.host("gate")
    run.submit(K.scale, x, out=y, alpha=2.0)


def _main_thread_waiting(names: tuple[str, ...]) -> bool:
    """Whether the main thread's innermost Python frame is one of the waiting functions."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return frame is not None and frame.f_code.co_name in names


class Interrupter:
    """Sends SIGINT to the main thread once it waits inside one of `names`; opens the gate if it never does."""

    def __init__(self, gate: HeldGate, how: str, names: tuple[str, ...]) -> None:
        self.gate, self.how, self.names = gate, how, names
        self.sent = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> "Interrupter":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(PATIENCE_S)

    def _main(self) -> None:
        deadline = time.monotonic() + PATIENCE_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            if _main_thread_waiting(self.names):
                time.sleep(0.05)  # well inside the native wait
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGINT)
                else:
                    _thread.interrupt_main()
                self.sent.set()
                break
            time.sleep(0.002)
        # Watchdog: if the KeyboardInterrupt never surfaces, let the run finish so the test fails, not hangs.
        if not self._stop.wait(PATIENCE_S):
            self.gate.opened_by_watchdog = True
            self.gate.release.set()


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler, whatever an earlier test or library left installed (SIG_IGN makes
    _thread.interrupt_main and a real SIGINT do nothing)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def held_rt():
    base = ProcessBaseline()
    gate = HeldGate()
    rt = held.prepare(workers=1, depth=1, callbacks={"gate": gate})
    try:
        yield rt, gate
    finally:
        gate.release.set()
        rt.close()
    base.check()


X = np.arange(8, dtype=np.float32)

WAYS: dict[str, tuple[Callable, tuple[str, ...]]] = {
    "result": (lambda rt, h: h.result(), ("wait",)),
    "wait": (lambda rt, h: h.wait(), ("wait",)),
    "result-timeout": (lambda rt, h: h.result(timeout=10 * PATIENCE_S), ("wait",)),
    "blocking-call": (lambda rt, h: rt(X, hold=0), ("_admit_blocking",)),  # depth 1: waits for the held run
    "submit-back-pressure": (lambda rt, h: rt.submit(X, hold=0), ("_admit_blocking",)),
}


@pytest.mark.parametrize("how", ["kill", "interrupt_main"])
@pytest.mark.parametrize("way", sorted(WAYS))
def test_keyboard_interrupt_while_a_sync_caller_waits(held_rt, way, how):
    rt, gate = held_rt
    fn, frames = WAYS[way]
    base = counters(rt)
    h = rt.submit(X, hold=1)
    assert gate.entered.wait(PATIENCE_S)
    with Interrupter(gate, how, frames) as intr:
        with pytest.raises(KeyboardInterrupt):
            fn(rt, h)
        assert intr.sent.is_set(), "the main thread never entered the wait"
        assert not gate.opened_by_watchdog, "KeyboardInterrupt only surfaced once the run completed"
        assert not h.done, "the held run cannot have completed"
    record(faults_injected=1)
    # The runtime is usable: the held run completes normally, and new runs go through.
    gate.release.set()
    np.testing.assert_array_equal(h.result(PATIENCE_S), 2 * X)
    np.testing.assert_array_equal(rt(X, hold=0), 2 * X)
    assert_back_to(rt, base)


@pytest.mark.parametrize("how", ["kill", "interrupt_main"])
def test_keyboard_interrupt_while_close_drains_then_close_again(held_rt, how):
    rt, gate = held_rt
    h = rt.submit(X, hold=1)
    assert gate.entered.wait(PATIENCE_S)
    with Interrupter(gate, how, ("close", "_drain_device")) as intr:  # the frame close() waits in
        with pytest.raises(KeyboardInterrupt):
            rt.close()
        assert intr.sent.is_set() and not gate.opened_by_watchdog
    record(faults_injected=1)
    # Interrupted half-way: no new runs are admitted, the held one still completes,
    # and close() called again finishes the job.
    with pytest.raises(engine.ClosedError):
        rt.submit(X, hold=0)
    gate.release.set()
    np.testing.assert_array_equal(h.result(PATIENCE_S), 2 * X)
    rt.close()
    assert rt.closed


def test_interrupt_in_another_thread_is_not_swallowed(held_rt):
    """A waiter in a non-main thread is not interrupted; the main thread's KeyboardInterrupt is raised there."""
    rt, gate = held_rt
    h = rt.submit(X, hold=1)
    assert gate.entered.wait(PATIENCE_S)
    outcome: dict = {}

    def waiter() -> None:
        try:
            outcome["value"] = h.result(PATIENCE_S)
        except BaseException as e:  # noqa: BLE001
            outcome["error"] = e

    t = threading.Thread(target=waiter)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        _thread.interrupt_main()
        for _ in range(1000):  # the main thread handles it at the next bytecode boundary
            time.sleep(0.001)
    gate.release.set()
    t.join(PATIENCE_S)
    assert "error" not in outcome, outcome
    np.testing.assert_array_equal(outcome["value"], 2 * X)
    record(faults_injected=1)


def fails_after_holding(gate: HeldGate) -> engine.Program:
    @engine.program(callbacks={"gate": 0})
    def prog(run: engine.Run, x: In((8,)), y: Out((8,))):
        run.host("gate")  # holds the device
        run.submit(K.scale, x, out=y, alpha=2.0)
        if not run.planning:
            assert gate.entered.wait(PATIENCE_S)  # the held task is under way: cancelling cannot skip it
            raise ValueError("orchestration failed after its first task started")

    return prog


@pytest.mark.parametrize("how", ["kill", "interrupt_main"])
def test_keyboard_interrupt_while_a_failed_orchestration_waits_for_its_tasks_keeps_the_slot(how):
    """The error path of a launch waits for the tasks it started before it frees the slot; Ctrl-C there
    must neither skip that wait (the device still uses the slot) nor lose the slot."""
    base_process = ProcessBaseline()
    gate = HeldGate()
    rt = fails_after_holding(gate).prepare(workers=1, depth=1, callbacks={"gate": gate})
    try:
        base = counters(rt)
        with Interrupter(gate, how, ("_wait_through_interrupts",)) as intr:
            def open_after_signal() -> None:
                if intr.sent.wait(PATIENCE_S):
                    time.sleep(0.1)  # the wait goes on past the signal
                gate.release.set()

            opener = threading.Thread(target=open_after_signal)
            opener.start()
            with pytest.raises(KeyboardInterrupt) as ei:
                rt.submit(X)
            opener.join(PATIENCE_S)
            assert intr.sent.is_set() and not gate.opened_by_watchdog
        # The orchestration's error is kept as the context of the interrupt.
        assert isinstance(ei.value.__context__, ValueError)
        del ei  # its traceback holds the launch's frame, and with it the native engine (and its eventfd)
        record(faults_injected=2)
        assert_back_to(rt, base)  # the slot came back, after the device let go of it
    finally:
        gate.release.set()
        rt.close()
    base_process.check()
