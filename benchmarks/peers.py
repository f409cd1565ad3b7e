"""Peers: the same host + device work pipelined without Tandem, the way people do it today.

A unit of work is a host step (Python that holds the GIL, like orchestration)
followed by a device step (a native call that releases the GIL, like a kernel).
Each peer runs `runs` units with at most `depth` in flight, with the same
meaning of depth as Tandem's: the host step of unit N+depth starts only once
unit N has finished. Every peer gives the device as many threads as Tandem's
pool has workers, so none gets more cores than Tandem has.

- sequential: host then device, one unit after the other (no pipelining);
- thread_pool: the host loop hands each device step to a ThreadPoolExecutor;
- to_thread: an asyncio loop awaits `asyncio.to_thread(device)` per unit;
- ray_compiled_graph: the device step runs in a Ray actor behind a Ray
  Compiled Graph (`experimental_compile(enable_asyncio=True,
  _max_inflight_executions=depth)`, `await execute_async(...)`), host step on
  the driver's event loop. Only when the `ray` extra is installed.

Each measurement returns the throughput and each unit's latency (host step
start to device step end; perf_counter is CLOCK_MONOTONIC on Linux, so a Ray
actor's timestamps compare with the driver's).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

HostStep = Callable[[], None]
DeviceStep = Callable[[], None]
# Builds the device step inside the process that runs it (a Ray actor cannot receive a bound native call).
DeviceFactory = Callable[[], DeviceStep]


@dataclass(frozen=True)
class Work:
    host: HostStep
    device_factory: DeviceFactory


@dataclass
class Sample:
    runs_per_s: float
    latencies_s: list[float]


PEERS: dict[str, str] = {  # name -> label in tables and plots
    "sequential": "sequential loop",
    "thread_pool": "ThreadPoolExecutor",
    "to_thread": "asyncio.to_thread",
    "ray_compiled_graph": "Ray Compiled Graph",
}


def spin_device(ns: int) -> DeviceFactory:
    """The built-in `spin` kernel for `ns` nanoseconds, called directly (GIL released)."""

    def make() -> DeviceStep:
        from engine import _native

        call = _native.call_kernel
        return lambda: call("spin", [], [ns])

    return make


def _timed(device: DeviceStep) -> float:
    device()
    return time.perf_counter()


def sequential(work: Work, runs: int) -> Sample:
    device = work.device_factory()
    lat: list[float] = []
    t0 = time.perf_counter()
    for _ in range(runs):
        s = time.perf_counter()
        work.host()
        device()
        lat.append(time.perf_counter() - s)
    return Sample(runs / (time.perf_counter() - t0), lat)


def thread_pool(work: Work, runs: int, depth: int, workers: int) -> Sample:
    device = work.device_factory()
    starts: list[float] = []
    futures: list[concurrent.futures.Future[float]] = []
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        window: deque[concurrent.futures.Future[float]] = deque()
        t0 = time.perf_counter()
        for _ in range(runs):
            if len(window) == depth:
                window.popleft().result()
            starts.append(time.perf_counter())
            work.host()
            fut = pool.submit(_timed, device)
            futures.append(fut)
            window.append(fut)
        for fut in window:
            fut.result()
        rate = runs / (time.perf_counter() - t0)
    return Sample(rate, [f.result() - s for f, s in zip(futures, starts)])


def to_thread(work: Work, runs: int, depth: int, workers: int) -> Sample:
    device = work.device_factory()

    async def pipeline() -> Sample:
        # asyncio.to_thread uses the loop's default executor: size it like Tandem's pool.
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(workers))
        starts: list[float] = []
        tasks: list[asyncio.Task[float]] = []
        window: deque[asyncio.Task[float]] = deque()
        t0 = time.perf_counter()
        for _ in range(runs):
            if len(window) == depth:
                await window.popleft()
            starts.append(time.perf_counter())
            work.host()
            task = asyncio.ensure_future(asyncio.to_thread(_timed, device))
            tasks.append(task)
            window.append(task)
        for task in window:
            await task
        rate = runs / (time.perf_counter() - t0)
        return Sample(rate, [t.result() - s for t, s in zip(tasks, starts)])

    return asyncio.run(pipeline())


def ray_installed() -> bool:
    """Ray the package, not a folder named ray on the path (Ray's own /tmp/ray imports as an empty namespace)."""
    spec = importlib.util.find_spec("ray")
    return spec is not None and spec.origin is not None


def ray_unavailable(workers: int) -> str | None:
    """Why the Ray peer cannot run here, or None."""
    if not ray_installed():
        return "ray is not installed (pip install 'tandem-engine[ray]')"
    if workers != 1:
        return "the Ray peer models one device worker (one actor); measured with --workers 1 only"
    return None


def _device_actor(make: DeviceFactory) -> type:
    """A local class, so Ray pickles it by value (the benchmarks/ folder is not importable in a worker)."""

    class DeviceActor:
        def __init__(self) -> None:
            self._device = make()

        def step(self, _unit: int) -> float:
            self._device()
            return time.perf_counter()

    return DeviceActor


class RayCompiledGraph:
    """A local Ray instance with one device actor; `measure(depth, ...)` compiles a graph per depth."""

    def __init__(self, work: Work) -> None:
        import logging

        import ray

        self._ray = ray
        self._work = work
        # Two CPUs for Ray's bookkeeping: one actor needs one; the driver is not counted. address="local": a
        # private instance, never a cluster that RAY_ADDRESS or /tmp/ray/ray_current_cluster points at (a
        # leftover of a killed run there would make ray.init refuse num_cpus, or measure someone else's cluster).
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)
        try:
            self._actor = ray.remote(num_cpus=1)(_device_actor(work.device_factory)).remote()
            ray.get(self._actor.step.remote(0))  # the actor is up before anything is timed
        except BaseException:
            ray.shutdown()
            raise

    def measure(self, depth: int, runs: int, samples: int, warmup: int = 1) -> list[Sample]:
        """`warmup` + `samples` pipelines of `runs` units through one compiled graph with `depth` in flight."""
        from ray.dag import InputNode

        with InputNode() as unit:
            dag = self._actor.step.bind(unit)
        host = self._work.host

        async def pipelines() -> list[Sample]:
            cdag = dag.experimental_compile(enable_asyncio=True, _max_inflight_executions=depth)
            try:
                out = []
                for i in range(warmup + samples):
                    starts: list[float] = []
                    ends: list[float] = [0.0] * runs
                    window: deque[tuple[int, Any]] = deque()
                    t0 = time.perf_counter()
                    for k in range(runs):
                        if len(window) == depth:
                            j, fut = window.popleft()
                            ends[j] = await fut  # a compiled-graph future is awaited once: keep its value
                        starts.append(time.perf_counter())
                        host()
                        window.append((k, await cdag.execute_async(k)))
                    for j, fut in window:
                        ends[j] = await fut
                    rate = runs / (time.perf_counter() - t0)
                    if i >= warmup:
                        out.append(Sample(rate, [e - s for e, s in zip(ends, starts)]))
                return out
            finally:
                cdag.teardown()

        return asyncio.run(pipelines())

    def close(self) -> None:
        self._ray.shutdown()
