"""Dispatch cost: awaited dispatches per second for a one-`noop`-task program, against the floor.

What is compared, side by side in one process and on one event loop:

- engine: AsyncRuntime over a program that submits one `noop` task. At depth 1
  the figure is the round trip of `await art.call()`; at depth d it is the rate
  of a pipeline that keeps d runs in flight (dispatch, and once d are in
  flight await the oldest before dispatching again).
- floor: the same loop handing bare futures to a native thread and getting
  them back through the loop, with nothing of the engine's Python layers. A
  bare future is the loop's own (asyncio.Future; a trio.Event under trio).
  The native thread is a worker of a separate, bare native engine
  (engine._native.Engine, not the runtime under test): per future we make a
  native run with one `noop` task, the worker executes it and pushes the
  run's id to the native notifier, whose eventfd wakes the loop, which
  completes the future. The loop watches the fd the way the scheduler does on
  each backend (a persistent reader under asyncio, a wait_readable task under
  trio), so the floor and the engine pay for the same wake-up.
  Why this floor: it is the cheapest honest way for this machine to hand work
  to a thread that does not hold the GIL and hear back on the loop. A thread
  hop is inherent (the device is another thread), and so is the loop wake-up;
  what the floor leaves out is exactly the engine's own cost (binding,
  admission, slots, staging, orchestration, futures, finishing, metrics).
  Alternatives considered: a run with zero tasks is sealed and completed
  inline by the caller, so it measures no thread hop at all (it is printed as
  a reference row, "loop wake-up only"); a Python threading.Thread completing
  futures with loop.call_soon_threadsafe pays for the GIL hand-off and is
  slower, which would flatter the engine (also printed, asyncio only).
- asyncio.to_thread and a ThreadPoolExecutor: the usual way to call the
  synchronous Runtime from async code, at the same concurrency (asyncio only).

Each engine and floor figure is reported twice: wall time per operation
(what the targets are defined on) and the event loop thread's CPU time per
operation (the host work each operation costs; it does not move with the
waits that a shared machine adds to wall time).

Targets (from the issue): at depth 1 the awaited call costs at most 1.5x the
floor's round trip; at depth 8 the dispatch rate is at least half the floor's
pipelined rate. Published reference points: Ray Compiled Graphs under 50 us
per execution; JAX about 7 us per trivial jitted call.

    python benchmarks/dispatch.py [--quick] [--backend asyncio|trio] [--ops N] [--reps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import queue
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import anyio  # noqa: E402

from _common import print_table, repeat, write_json  # noqa: E402

import engine  # noqa: E402
from engine import _native  # noqa: E402
from engine import kernels as K  # noqa: E402
from scheduler import AsyncRuntime  # noqa: E402

DEPTHS = (1, 2, 4, 8)


@engine.program
def one_noop(run: engine.Run):
    run.submit(K.noop)


# -- the floor -------------------------------------------------------------------------------------
class NativeFloor:
    """Bare loop futures completed by a native worker thread through an eventfd."""

    def __init__(self, zero_tasks: bool = False) -> None:
        self.device = _native.Device(0)
        self.eng = _native.Engine(self.device, 1)
        self.noop = self.eng.kernel("noop")
        self.zero_tasks = zero_tasks  # reference: sealed and completed inline, no thread hop
        self.futures: dict[int, Any] = {}

    def close(self) -> None:
        self.eng.close(True)

    async def run(self, n: int, depth: int) -> float:
        """Seconds per awaited operation with `depth` in flight."""
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            return await self._run_asyncio(loop, n, depth)
        return await self._run_task_pump(n, depth)

    def _hand_off(self) -> int:
        run = self.eng.begin_run(True)
        if not self.zero_tasks:
            self.eng.submit(run, self.noop, [], [])
        self.eng.seal(run)
        return run.id

    async def _run_asyncio(self, loop: asyncio.AbstractEventLoop, n: int, depth: int) -> float:
        futures = self.futures
        eng = self.eng

        def on_readable() -> None:
            for rid in eng.drain_completed():
                futures.pop(rid).set_result(None)

        loop.add_reader(eng.notifier_fd, on_readable)
        try:
            window: deque[asyncio.Future[None]] = deque()
            t0 = time.perf_counter()
            for _ in range(n):
                if len(window) == depth:
                    await window.popleft()
                fut = loop.create_future()
                futures[self._hand_off()] = fut
                window.append(fut)
            while window:
                await window.popleft()
            return (time.perf_counter() - t0) / n
        finally:
            loop.remove_reader(eng.notifier_fd)

    async def _run_task_pump(self, n: int, depth: int) -> float:
        futures = self.futures
        eng = self.eng

        async def pump(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            while True:
                await anyio.wait_readable(eng.notifier_fd)
                for rid in eng.drain_completed():
                    futures.pop(rid).set()

        async with anyio.create_task_group() as tg:
            await tg.start(pump)
            window: deque[anyio.Event] = deque()
            t0 = time.perf_counter()
            for _ in range(n):
                if len(window) == depth:
                    await window.popleft().wait()
                ev = anyio.Event()
                futures[self._hand_off()] = ev
                window.append(ev)
            while window:
                await window.popleft().wait()
            dt = (time.perf_counter() - t0) / n
            tg.cancel_scope.cancel()
        return dt


async def python_thread_floor(n: int, depth: int) -> float:
    """Reference (asyncio): a Python thread completes futures via call_soon_threadsafe."""
    loop = asyncio.get_running_loop()
    q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def worker() -> None:
        while True:
            fut = q.get()
            if fut is None:
                return
            loop.call_soon_threadsafe(fut.set_result, None)

    th = threading.Thread(target=worker, daemon=True)
    th.start()
    try:
        window: deque[asyncio.Future[None]] = deque()
        t0 = time.perf_counter()
        for _ in range(n):
            if len(window) == depth:
                await window.popleft()
            fut = loop.create_future()
            q.put(fut)
            window.append(fut)
        while window:
            await window.popleft()
        return (time.perf_counter() - t0) / n
    finally:
        q.put(None)
        th.join()


# -- the engine --------------------------------------------------------------------------------------
async def engine_rate(art: AsyncRuntime, n: int, depth: int) -> float:
    """Seconds per awaited dispatch with `depth` runs in flight."""
    t0 = time.perf_counter()
    if depth == 1:
        for _ in range(n):
            await art.call()
    else:
        window: deque[Any] = deque()
        for _ in range(n):
            if len(window) == depth:
                await window.popleft()
            window.append(await art.dispatch())
        while window:
            await window.popleft()
    return (time.perf_counter() - t0) / n


# -- the usual thread wrappers (asyncio) ------------------------------------------------------------------
async def threaded_rate(rt: engine.Runtime, n: int, depth: int, how: str) -> float:
    loop = asyncio.get_running_loop()
    per_task = max(1, n // depth)
    pool = concurrent.futures.ThreadPoolExecutor(depth) if how == "executor" else None

    async def caller() -> None:
        for _ in range(per_task):
            if pool is None:
                await asyncio.to_thread(rt)
            else:
                await loop.run_in_executor(pool, rt)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(depth)))
        return (time.perf_counter() - t0) / (per_task * depth)
    finally:
        if pool is not None:
            pool.shutdown()


# -- driver ------------------------------------------------------------------------------------------------
async def measure(n: int, reps: int, backend: str) -> dict[str, Any]:
    floor = NativeFloor()
    echo = NativeFloor(zero_tasks=True)
    figures: dict[str, Any] = {"backend": backend, "ops_per_measurement": n, "depths": []}

    try:
        for depth in DEPTHS:
            rt = one_noop.prepare(depth=depth, workers=1)
            try:
                async with AsyncRuntime(rt) as art:
                    samples: dict[str, list[float]] = {"floor": [], "engine": [], "floor_cpu": [], "engine_cpu": []}
                    # Interleaved repetitions: slow drifts of a shared machine hit both alike.
                    await floor.run(n // 10, depth)
                    await engine_rate(art, n // 10, depth)
                    for _ in range(reps):
                        for name, fn in (("floor", floor.run), ("engine", lambda k, d: engine_rate(art, k, d))):
                            wall, cpu = await timed(fn, n, depth)
                            samples[name].append(wall)
                            samples[name + "_cpu"].append(cpu)
                    entry: dict[str, Any] = {"depth": depth}
                    for name, vals in samples.items():
                        entry[name] = summarize(vals)
                    entry["loop_wakeup_only"] = summarize([await echo.run(n, depth) for _ in range(max(1, reps // 2))])
                    st = art.stats()
                    entry["engine_stats"] = {"orchestration_p50_us": st.orchestration.p50 * 1e6,
                                             "latency_p50_us": st.latency.p50 * 1e6}
                if backend == "asyncio":
                    entry["python_thread_floor"] = summarize(
                        [await python_thread_floor(n, depth) for _ in range(max(1, reps // 2))])
                    entry["asyncio_to_thread"] = summarize(
                        [await threaded_rate(rt, n // 4, depth, "to_thread") for _ in range(max(1, reps // 2))])
                    entry["thread_pool_executor"] = summarize(
                        [await threaded_rate(rt, n // 4, depth, "executor") for _ in range(max(1, reps // 2))])
            finally:
                rt.close()
            entry["cost_ratio"] = entry["engine"]["median"] / entry["floor"]["median"]
            entry["rate_ratio"] = 1.0 / entry["cost_ratio"]
            entry["cpu_ratio"] = entry["engine_cpu"]["median"] / entry["floor_cpu"]["median"]
            figures["depths"].append(entry)
    finally:
        floor.close()
        echo.close()
    return figures


async def timed(fn: Any, n: int, depth: int) -> tuple[float, float]:
    """(wall seconds per op as fn measures it, loop-thread CPU seconds per op).

    The CPU figure counts only the event loop's thread: the work the host
    does per operation, unaffected by how long it waited for the device or
    for a CPU (this machine is shared, so waits are noisy).
    """
    c0 = time.thread_time()
    wall = await fn(n, depth)
    return wall, (time.thread_time() - c0) / n


def summarize(values: list[float]) -> dict[str, float]:
    """_common.repeat()'s statistics over measurements already taken (they are awaited, and interleaved)."""
    it = iter(values)
    return repeat(lambda: next(it), len(values), warmup=0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer operations and repetitions")
    ap.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio")
    ap.add_argument("--ops", type=int, default=None, help="awaited operations per measurement")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per figure (the median is reported)")
    ap.add_argument("--json", default=None, help="where to write the JSON figures")
    args = ap.parse_args(argv)
    n = args.ops or (2_000 if args.quick else 20_000)
    reps = args.reps or (3 if args.quick else 7)
    load_before = os.getloadavg()
    figures = anyio.run(measure, n, reps, args.backend, backend=args.backend)
    figures["cores"] = os.cpu_count()
    # The machine may be shared: the load says how much the wall-time figures can be trusted.
    figures["load_average"] = {"before": load_before, "after": os.getloadavg()}

    us = 1e6
    rows = []
    for e in figures["depths"]:
        row = [e["depth"], e["floor"]["median"] * us, e["engine"]["median"] * us, e["cost_ratio"],
               1 / e["floor"]["median"], 1 / e["engine"]["median"], e["rate_ratio"],
               e["floor_cpu"]["median"] * us, e["engine_cpu"]["median"] * us, e["cpu_ratio"],
               e["loop_wakeup_only"]["median"] * us]
        if args.backend == "asyncio":
            row += [e["python_thread_floor"]["median"] * us, e["asyncio_to_thread"]["median"] * us,
                    e["thread_pool_executor"]["median"] * us]
        rows.append(row)
    headers = ["depth", "floor us/op", "engine us/op", "engine/floor", "floor ops/s", "engine ops/s",
               "rate engine/floor", "floor cpu us/op", "engine cpu us/op", "cpu engine/floor", "wake-only us/op"]
    if args.backend == "asyncio":
        headers += ["py-thread us/op", "to_thread us/op", "TPE us/op"]
    print(f"awaited dispatches of a one-noop program ({args.backend}, {os.cpu_count()} cores, "
          f"{n} ops per measurement, median of {reps}; us/op is wall time, cpu us/op the loop thread's CPU time)")
    print_table(headers, rows)
    print(f"load average before / after: {figures['load_average']['before'][0]:.2f} / "
          f"{figures['load_average']['after'][0]:.2f} (on {os.cpu_count()} cores)")

    d1 = next(e for e in figures["depths"] if e["depth"] == 1)
    d8 = next(e for e in figures["depths"] if e["depth"] == 8)
    targets = {
        "depth1_cost_ratio": d1["cost_ratio"], "depth1_target": 1.5, "depth1_met": d1["cost_ratio"] <= 1.5,
        "depth8_rate_ratio": d8["rate_ratio"], "depth8_target": 0.5, "depth8_met": d8["rate_ratio"] >= 0.5,
    }
    figures["targets"] = targets
    print(f"\ndepth 1: engine round trip = {d1['cost_ratio']:.2f}x the floor's (target <= 1.5x): "
          f"{'met' if targets['depth1_met'] else 'MISSED'}")
    print(f"depth 8: engine rate = {d8['rate_ratio']:.2f}x the floor's pipelined rate (target >= 0.5x): "
          f"{'met' if targets['depth8_met'] else 'MISSED'}")
    out = write_json(f"dispatch_{args.backend}", figures, args.json)
    print(f"figures written to {out}")
    return figures


if __name__ == "__main__":
    main()
