"""engine.distributed: per-run dispatch overhead across processes, and pipelining across workers.

1. Dispatch overhead. A one-submission program (copy 16 floats on chip
   worker 0) run back to back, against the floor of this machine measured
   in the same process, interleaved rep by rep: a bare round trip to a
   spawned process over the same primitives (write the input into shared
   memory, a small pickled message through a pipe, the process copies in
   shared memory and answers, read the output back). Reported as a ratio:
   what binding, staging, orchestration, the dependency graph, the worker's
   engine run and completion delivery add to the bare round trip. Twice:
   with both ends of the bare trip asleep in a blocking read until the
   message comes, and with both polling for it first (200 us, as Tandem's
   readers do). On a VM the first pays a wake-up of a halted CPU when the
   host happens to halt it (its figure moves between about 18 and 55 us from
   run to run); the second is the floor that compares like with like.
   Both runtime paths are measured twice more with the program prepared
   with capture=True (engine.distributed.capture: a replay skips the
   orchestration function), as ratios over the uncaptured ones.
2. Pipelining. A data-parallel MLP (batch shards, resident weights per
   worker) streamed through scheduler.AsyncRuntime at depth 1, 2 and 3 on
   one runtime: throughput, speedup over depth 1, and the fraction of the
   overlap bound 1 / max(T_host, T_worker), with T_host (staging,
   orchestration, seal) and T_worker (first task start to last task end)
   measured per run at depth 1. On a 2-core machine the 2 workers and the
   host share the cores, so the overlap has little idle CPU to use. The
   same program prepared with capture=True is streamed at depth 3 in the
   same reps. Then the same at depth 3 (and depth 1, for its bound) over a
   sweep of batch sizes (--sweep-batches): a shard's work grows with the
   batch while the host's fixed cost a run does not, and each point says
   what the machine's cores allow at its measured CPU a run.
3. With --ray: the same on Ray, in a local two-node cluster
   (ray.cluster_utils.Cluster; one pool thread per worker). Per-run overhead of the
   one-copy program through RayTransport (sync and awaited) against a bare
   Ray Compiled Graph doing the same single-actor step (an actor running
   the same copy program on its own engine), interleaved rep by rep, with
   both actors on the driver's node, then both on the other node; and
   data-parallel scaling: a wide MLP (RAY_D -> RAY_H -> RAY_D) streamed at
   depth 3 on one worker on one node against two workers on two nodes, over
   a sweep of batch sizes (--ray-batches): small batches show Ray's per-call
   cost, large ones a size where the shards' compute dominates it.

    python benchmarks/distributed.py [--quick] [--runs N] [--reps N] [--batch B] [--workers N]
                                     [--sweep-batches B,B,...|none] [--ray]
                                     [--ray-batches B,B,...] [--ray-channel auto|actor|compiled] [--json PATH]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import sys
import time
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anyio  # noqa: E402
import numpy as np  # noqa: E402
from _common import print_table, repeat, spread, write_json  # noqa: E402

import engine  # noqa: E402
import engine.distributed as dist  # noqa: E402
from engine import _native  # noqa: E402
from engine import In, Out  # noqa: E402
from engine.distributed.worker import DEFAULT_SPIN_US  # noqa: E402
from engine import kernels as K  # noqa: E402
from scheduler import AsyncRuntime  # noqa: E402

N = 16  # floats per run in the overhead test
D, H = 128, 512  # MLP widths in the pipelining test
# The Ray scaling test's MLP: RAY_H / 2 flops per byte moved (x in, y out), so that at the larger batches of
# the sweep a shard's compute (tens of ms) outweighs what Ray spends on a call (a few ms of CPU here).
RAY_D, RAY_H = 256, 8192


# -- programs (module level: chip workers import them from this script) -----------------------------
@engine.program
def copy16(run: engine.Run, x: In((N,)), y: Out((N,))):
    run.submit(K.copy, x, out=y)


@dist.program
def one_copy(orch: dist.Orchestrator, x: In((N,)), y: Out((N,))):
    orch.submit(copy16, x, y, worker=0)


@engine.program
def mlp_shard(run: engine.Run, x: In(("B", D)), w1: In((D, H)), w2: In((H, D)), y: Out(("B", D))):
    h = run.scratch(("B", H), "float32")
    run.submit(K.matmul, x, w1, out=h)
    run.submit(K.gelu, h, out=h)
    run.submit(K.matmul, h, w2, out=y)


@dist.program
def dp_mlp(orch: dist.Orchestrator, x: In(("B", D)), w1: dist.PerWorker(In((D, H))),
           w2: dist.PerWorker(In((H, D))), y: Out(("B", D))):
    for i, (xs, ys) in enumerate(zip(orch.split(x), orch.split(y))):
        orch.submit(mlp_shard, xs, w1[i], w2[i], ys, worker=i)


@engine.program
def wide_shard(run: engine.Run, x: In(("B", RAY_D)), w1: In((RAY_D, RAY_H)), w2: In((RAY_H, RAY_D)),
               y: Out(("B", RAY_D))):
    h = run.scratch(("B", RAY_H), "float32")
    run.submit(K.matmul, x, w1, out=h)
    run.submit(K.gelu, h, out=h)
    run.submit(K.matmul, h, w2, out=y)


@dist.program
def dp_wide_mlp(orch: dist.Orchestrator, x: In(("B", RAY_D)), w1: dist.PerWorker(In((RAY_D, RAY_H))),
                w2: dist.PerWorker(In((RAY_H, RAY_D))), y: Out(("B", RAY_D))):
    for i, (xs, ys) in enumerate(zip(orch.split(x), orch.split(y))):
        orch.submit(wide_shard, xs, w1[i], w2[i], ys, worker=i)


# -- the floor: a bare shared-memory + pipe round trip -------------------------------------------------
def _bare_server(conn, name: str, spin_us: int) -> None:
    from engine import _native

    shm = SharedMemory(name=name)
    x = np.ndarray((N,), np.float32, buffer=shm.buf, offset=0)
    y = np.ndarray((N,), np.float32, buffer=shm.buf, offset=64)
    fds = [conn.fileno()]
    try:
        while True:
            if spin_us:
                _native.wait_readable(fds, spin_us)  # polls spin_us, then sleeps until readable
            msg = pickle.loads(conn.recv_bytes())
            if msg is None:
                return
            np.copyto(y, x)
            conn.send_bytes(pickle.dumps(("done", msg[1])))
    finally:
        del x, y
        shm.close()


class BareRoundTrip:
    """A spawned process that copies x to y in shared memory per message: the floor of one remote run.

    spin_us=0: both ends sleep in a blocking read until the message comes (the baseline issue 19 names).
    spin_us > 0: both ends poll that long before they sleep, as Tandem's readers do (ProcessTransport's
    spin_us): on a VM, where waking a sleeping reader costs tens of microseconds, this is the floor that
    compares like with like.
    """

    def __init__(self, spin_us: int = 0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.spin_us = spin_us
        self.shm = SharedMemory(create=True, size=128)
        self.conn, child = ctx.Pipe()
        self._fds = [self.conn.fileno()]
        self.proc = ctx.Process(target=_bare_server, args=(child, self.shm.name, spin_us), daemon=True)
        self.proc.start()
        child.close()
        self.x = np.ndarray((N,), np.float32, buffer=self.shm.buf, offset=0)
        self.y = np.ndarray((N,), np.float32, buffer=self.shm.buf, offset=64)

    def __call__(self, x: np.ndarray, y: np.ndarray, seq: int) -> None:
        np.copyto(self.x, x)
        self.conn.send_bytes(pickle.dumps(("call", seq, 0, {}, (("s", 0, 0, (N,), (1,), "float32"),))))
        if self.spin_us:
            _native.wait_readable(self._fds, self.spin_us)
        pickle.loads(self.conn.recv_bytes())
        np.copyto(y, self.y)

    def close(self) -> None:
        self.conn.send_bytes(pickle.dumps(None))
        self.proc.join()
        del self.x, self.y
        self.shm.close()
        self.shm.unlink()


def per_run_seconds(fn, runs: int) -> float:
    t0 = time.perf_counter()
    for i in range(runs):
        fn(i)
    return (time.perf_counter() - t0) / runs


def overhead_against(drt: dist.DistributedRuntime, baseline: Any, label: str, key: str, runs: int, reps: int,
                     prefix: str = "", also: tuple[Any, str, str] | None = None,
                     captured: dist.DistributedRuntime | None = None) -> tuple[list[list], dict]:
    """Per-run cost of the one-copy program on `drt` (sync and awaited) against `baseline(i)` doing the same
    copy, interleaved rep by rep; figures named <key>_us, sync_over_<key>, async_over_<key>. also: a second
    baseline (fn, label, key) measured in the same reps, with its own figures and a column of ratios.
    captured: the same program prepared with capture=True, measured in the same reps (figures prefixed
    captured_, and captured_over_uncaptured for each mode)."""
    x = np.arange(N, dtype=np.float32)
    y = np.zeros(N, np.float32)
    runtimes = [("", "", drt)] + ([("captured ", "captured_", captured)] if captured is not None else [])
    for _, _, rt in runtimes:
        np.testing.assert_array_equal(rt(x), x)

    def async_per_run(rt: dist.DistributedRuntime) -> float:
        async def main() -> float:
            async with AsyncRuntime(rt) as art:
                for _ in range(runs // 10):
                    await art.call(x, y)
                t0 = time.perf_counter()
                for _ in range(runs):
                    await art.call(x, y)
                return (time.perf_counter() - t0) / runs

        return anyio.run(main)

    baselines = [(baseline, label, key)] + ([also] if also is not None else [])
    samples: dict[str, list[float]] = {k: [] for _, _, k in baselines}
    for _, kp, _ in runtimes:
        samples[f"{kp}sync"], samples[f"{kp}async"] = [], []

    def one_rep() -> float:  # interleaved: they all see the same machine state
        for fn, _, k in baselines:
            samples[k].append(per_run_seconds(lambda i: fn(x, y, i), runs))
        for _, kp, rt in runtimes:
            samples[f"{kp}sync"].append(per_run_seconds(lambda i: rt(x, y), runs))
            samples[f"{kp}async"].append(async_per_run(rt))
        return samples["sync"][-1] / samples[key][-1]

    sync_ratio = repeat(one_rep, reps)
    med = {k: float(np.median(v[-reps:])) for k, v in samples.items()}

    def over(a: str, b: str) -> float:  # the median of the per-rep ratios
        return float(np.median([p / q for p, q in zip(samples[a][-reps:], samples[b][-reps:])]))

    figures: dict[str, Any] = {"runs": runs, "reps": reps}
    rows = []
    for _, lab, k in baselines:
        figures[f"{k}_us"] = med[k] * 1e6
        rows.append([lab, med[k] * 1e6, *(med[k] / med[b] for _, _, b in baselines)])
    for lp, kp, _ in runtimes:
        for mode, what in (("sync", "drt(x) (sync)"), ("async", "await art.call(x)")):
            m = f"{kp}{mode}"
            figures[f"{m}_us"] = med[m] * 1e6
            for _, _, b in baselines:
                figures[f"{m}_over_{b}"] = over(m, b)
            rows.append([f"{prefix}{lp}{what}", med[m] * 1e6, *(figures[f"{m}_over_{b}"] for _, _, b in baselines)])
            if kp:
                figures[f"{m}_over_uncaptured"] = over(m, mode)
    figures[f"sync_over_{key}"] = sync_ratio  # the headline ratio with its spread
    return rows, figures


def overhead(runs: int, reps: int) -> tuple[list[list], dict]:
    bare = BareRoundTrip()
    polling = BareRoundTrip(DEFAULT_SPIN_US)
    drt = one_copy.prepare(workers=1, worker_threads=1, depth=2)
    captured = one_copy.prepare(workers=1, worker_threads=1, depth=2, capture=True)
    try:
        return overhead_against(drt, bare, "bare shm + pipe round trip", "bare", runs, reps,
                                also=(polling, f"bare, both ends polling {DEFAULT_SPIN_US} us first", "bare_polling"),
                                captured=captured)
    finally:
        drt.close()
        captured.close()
        bare.close()
        polling.close()


# One stream's figures: runs/s, host orchestration p50 (s), worker p50 (s), host CPU (s a run), workers' CPU (s a run)
StreamFigures = tuple[float, float, float, float, float]


def dp_streams(runs: int, reps: int, batch: int, workers: int, depths: tuple[int, ...],
               captured_depth: int | None) -> dict[int, list[StreamFigures]]:
    """The data-parallel MLP streamed at each depth, reps interleaved; key -depth: the same program prepared with
    capture=True, streamed at captured_depth in the same reps (None: not measured)."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((D, H)) * 0.05).astype(np.float32)
    w2 = (rng.standard_normal((H, D)) * 0.05).astype(np.float32)
    xs = [rng.standard_normal((batch, D)).astype(np.float32) for _ in range(8)]
    modes = (False, True) if captured_depth is not None else (False,)
    drts = {c: dp_mlp.prepare(workers=workers, worker_threads=1, depth=max(depths), bounds={"B": batch}, capture=c)
            for c in modes}
    try:
        weights = {c: ([rt.alloc_tensor((D, H), init=w1, worker_id=i) for i in range(workers)],
                       [rt.alloc_tensor((H, D), init=w2, worker_id=i) for i in range(workers)])
                   for c, rt in drts.items()}
        outs = [np.empty((batch, D), np.float32) for _ in range(max(depths))]

        async def stream(depth: int, captured: bool = False) -> StreamFigures:
            drt, (w1s, w2s) = drts[captured], weights[captured]
            items = [(xs[i % len(xs)], w1s, w2s, outs[i % len(outs)]) for i in range(runs)]
            async with AsyncRuntime(drt) as art:
                cpu0 = cpu_seconds(drt.pids)
                t0 = time.perf_counter()
                async for _ in art.stream(items, depth=depth):
                    pass
                rate = runs / (time.perf_counter() - t0)
                cpu1 = cpu_seconds(drt.pids)
                s = art.stats()
            return rate, s.orchestration.p50, s.device.p50, (cpu1[0] - cpu0[0]) / runs, (cpu1[1] - cpu0[1]) / runs

        results: dict[int, list[StreamFigures]] = {d: [] for d in depths}
        if captured_depth is not None:
            results[-captured_depth] = []

        for _ in range(1 + reps):  # a warm-up rep first, as repeat() does
            for depth in depths:
                results[depth].append(anyio.run(stream, depth))
            if captured_depth is not None:
                results[-captured_depth].append(anyio.run(stream, captured_depth, True))
    finally:
        for rt in drts.values():
            rt.close()
    return {k: v[1:] for k, v in results.items()}


def median_of(samples: list[StreamFigures], i: int) -> float:
    """The median over repetitions of one figure of the stream (StreamFigures' index i)."""
    return float(np.median([r[i] for r in samples]))


def depth_figures(depth: int, samples: list[StreamFigures], depth1: list[StreamFigures], bound: float,
                  cores: int) -> dict[str, Any]:
    """One depth's medians, its fraction of the bound, and what the machine's cores allow at its CPU cost a run."""
    def med(i: int) -> float:
        return median_of(samples, i)

    host_cpu, workers_cpu = med(3), med(4)
    # The bound assumes a core each for the host and every worker, which a machine with fewer cores cannot give:
    # at this CPU cost a run (polling included) the cores allow at most this many runs/s.
    cpu_ceiling = cores / (host_cpu + workers_cpu) if host_cpu + workers_cpu > 0 else float("inf")
    return {"depth": depth, "runs_per_s": med(0),
            "speedup_over_depth1": float(np.median([r[0] / b[0] for r, b in zip(samples, depth1)])),
            "fraction_of_bound": med(0) / bound, "host_ms_p50": med(1) * 1e3, "device_ms_p50": med(2) * 1e3,
            "host_cpu_ms_per_run": host_cpu * 1e3, "workers_cpu_ms_per_run": workers_cpu * 1e3,
            "cpu_ceiling_runs_per_s": cpu_ceiling, "cpu_ceiling_over_bound": cpu_ceiling / bound}


def machine_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def depth1_bound(depth1: list[StreamFigures]) -> float:
    """1 / max(T_host, T_worker), each the median of its per-run p50s at depth 1."""
    return 1.0 / max(median_of(depth1, 1), median_of(depth1, 2))


def pipelining(runs: int, reps: int, batch: int, workers: int) -> tuple[list[list], dict]:
    results = dp_streams(runs, reps, batch, workers, (1, 2, 3), captured_depth=3)
    bound, cores = depth1_bound(results[1]), machine_cores()
    rows, figures = [], {"batch": batch, "width": D, "hidden": H, "workers": workers, "runs": runs, "reps": reps,
                         "depths": []}
    for depth in (1, 2, 3):
        d = depth_figures(depth, results[depth], results[1], bound, cores)
        figures["depths"].append(d)
        rows.append([depth, d["runs_per_s"], d["speedup_over_depth1"], d["fraction_of_bound"], d["host_ms_p50"],
                     d["device_ms_p50"], d["host_cpu_ms_per_run"], d["workers_cpu_ms_per_run"],
                     d["cpu_ceiling_over_bound"]])
    captured = results[-3]
    figures["captured_depth3"] = {
        "runs_per_s": median_of(captured, 0),
        "over_uncaptured": float(np.median([r[0] / u[0] for r, u in zip(captured, results[3])])),
        "host_ms_p50": median_of(captured, 1) * 1e3,
        "host_cpu_ms_per_run": median_of(captured, 3) * 1e3}
    figures["cores"] = cores
    figures["speedup_depth2"] = spread([r[0] / b[0] for r, b in zip(results[2], results[1])])
    figures["depth1_runs_per_s"] = figures["depths"][0]["runs_per_s"]
    figures["bound_runs_per_s"] = bound
    return rows, figures


def batch_sweep(runs: int, reps: int, batches: list[int], workers: int) -> tuple[list[list], dict]:
    """The data-parallel MLP at depth 3 (and depth 1, for its bound) over batch sizes: where the shards' work
    grows against the host's fixed cost a run, and where the machine's cores, not the host path, set the limit."""
    cores = machine_cores()
    rows, points = [], []
    for batch in batches:
        # Fewer runs for larger batches (a run's work grows with the batch), never so few that depth 3 has no
        # steady state.
        n = max(40, runs * 64 // batch)
        results = dp_streams(n, reps, batch, workers, (1, 3), captured_depth=None)
        bound = depth1_bound(results[1])
        d3 = depth_figures(3, results[3], results[1], bound, cores)
        point = {"batch": batch, "runs": n, "bound_runs_per_s": bound, **{k: v for k, v in d3.items() if k != "depth"},
                 "of_cpu_ceiling": d3["runs_per_s"] / d3["cpu_ceiling_runs_per_s"]}
        points.append(point)
        rows.append([batch, bound, d3["runs_per_s"], d3["fraction_of_bound"], d3["cpu_ceiling_over_bound"],
                     point["of_cpu_ceiling"], d3["host_cpu_ms_per_run"], d3["workers_cpu_ms_per_run"]])
    return rows, {"workers": workers, "width": D, "hidden": H, "reps": reps, "cores": cores, "points": points}


def cpu_seconds(worker_pids: list[int]) -> tuple[float, float]:
    """CPU seconds used so far by this process (every thread) and by the worker processes together (summed over
    their threads' /proc schedstat, in ns; 0 where there is no /proc)."""
    workers = 0
    for pid in worker_pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    workers += int(f.read().split()[0])  # ns on a CPU
        except (OSError, IndexError, ValueError):  # not Linux, or a thread or the worker is gone meanwhile
            pass
    return time.process_time(), workers / 1e9


# -- Ray: the transport against a bare Compiled Graph, and scaling over nodes ------------------------------
class CopyStep:
    """The bare Compiled Graph peer: an actor that runs the same copy program on its own engine."""

    def __init__(self) -> None:
        self.rt = copy16.prepare(workers=1, depth=1)

    def step(self, x: np.ndarray) -> np.ndarray:
        return self.rt(x)


def ray_overhead(runs: int, reps: int, channel: str, node: str) -> tuple[list[list], dict]:
    """The one-copy program through RayTransport against a bare Compiled Graph step, both actors on `node`.

    Both on the same node, as where an actor runs decides what its channel to the driver costs: on
    another node than the driver's, a bare step costs 3-4x what it costs on the driver's
    (measured 2026-12-06, two-node local cluster), which would swamp what is being compared.
    """
    import ray
    from ray.dag import InputNode
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    on_node = {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
    drt = one_copy.prepare(workers=1, worker_threads=1, depth=2,
                           transport=dist.RayTransport(channel=channel, worker_options=on_node))
    actor = cgraph = None
    try:
        actor = ray.remote(num_cpus=1)(CopyStep).options(**on_node).remote()
        with InputNode() as inp:
            dag = actor.step.bind(inp)
        cgraph = dag.experimental_compile()
        np.testing.assert_array_equal(cgraph.execute(np.ones(N, np.float32)).get(), np.ones(N, np.float32))
        actor_node = ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
        assert actor_node == node and drt._transport.node_ids == [node], "both actors must be on the node asked"
        bare = cgraph
        rows, figures = overhead_against(drt, lambda x, y, i: bare.execute(x).get(),
                                         "bare Compiled Graph step (same copy program)", "cgraph", runs, reps,
                                         "RayTransport ")
        figures["node"] = node
        figures["socket_workers"] = drt._transport.socket_workers  # "auto": [0] on the driver's node
        figures["sharing_workers"] = drt._transport.sharing_workers  # of those, the ones mapping the regions
        return rows, figures
    finally:
        drt.close()
        if cgraph is not None:
            cgraph.teardown()
        if actor is not None:
            ray.kill(actor)


def ray_scaling(batch: int, runs: int, reps: int, channel: str) -> dict:
    """The wide MLP at `batch` rows, depth 3: one worker on one node against two workers on two nodes."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((RAY_D, RAY_H)) / np.sqrt(RAY_D)).astype(np.float32)
    w2 = (rng.standard_normal((RAY_H, RAY_D)) / np.sqrt(RAY_H)).astype(np.float32)
    xs = [rng.standard_normal((batch, RAY_D)).astype(np.float32) for _ in range(4)]
    outs = [np.empty((batch, RAY_D), np.float32) for _ in range(3)]
    runtimes = {}
    try:
        for workers in (1, 2):
            drt = dp_wide_mlp.prepare(workers=workers, worker_threads=1, depth=3, bounds={"B": batch},
                                      transport=dist.RayTransport(placement="spread", channel=channel))
            runtimes[workers] = (drt, [drt.alloc_tensor((RAY_D, RAY_H), init=w1, worker_id=i) for i in range(workers)],
                                 [drt.alloc_tensor((RAY_H, RAY_D), init=w2, worker_id=i) for i in range(workers)])
        nodes = {w: len(set(rt[0]._transport.node_ids)) for w, rt in runtimes.items()}
        # The two runtimes compute the same thing: a shard split wrongly would not be a measurement.
        ref = [runtimes[w][0](xs[0], runtimes[w][1], runtimes[w][2]) for w in (1, 2)]
        np.testing.assert_allclose(ref[1], ref[0], rtol=1e-5, atol=1e-5)

        async def stream(workers: int) -> float:
            drt, w1s, w2s = runtimes[workers]
            items = [(xs[i % len(xs)], w1s, w2s, outs[i % 3]) for i in range(runs)]
            async with AsyncRuntime(drt) as art:
                t0 = time.perf_counter()
                async for _ in art.stream(items, depth=3):
                    pass
                return runs / (time.perf_counter() - t0)

        rates: dict[int, list[float]] = {1: [], 2: []}

        def one_rep() -> float:  # interleaved: both see the same machine state
            for workers in (1, 2):
                rates[workers].append(anyio.run(stream, workers))
            return rates[2][-1] / rates[1][-1]

        speedup = repeat(one_rep, reps)
    finally:
        for drt, _, _ in runtimes.values():
            drt.close()
    med = {w: float(np.median(r[-reps:])) for w, r in rates.items()}
    return {"batch": batch, "runs": runs, "nodes": nodes, "one_node_runs_per_s": med[1],
            "two_nodes_runs_per_s": med[2], "one_node_ms_per_run": 1e3 / med[1],
            "gflop_per_run": 4 * batch * RAY_D * RAY_H / 1e9, "two_over_one": speedup}


def ray_section(runs: int, reps: int, batches: list[int], channel: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    # Two logical CPUs per node: the scaling test keeps a one-worker and a two-worker runtime alive at once
    # (interleaved reps); every worker runs one pool thread, so the two physical cores are what they share.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    try:
        driver_node = ray.get_runtime_context().get_node_id()
        other_node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != driver_node)
        overheads = {}
        for where, node in (("driver's node", driver_node), ("other node", other_node)):
            rows, overheads[where] = ray_overhead(runs, reps, channel, node)
            print(f"Ray ({channel} channel): per-run overhead, 1 chip worker and the bare actor on the {where}, "
                  f"{runs} runs x {reps} reps (medians; ratios per rep, interleaved):")
            print_table(["path", "us per run", "over Compiled Graph"], rows)
            print()
        # About the same time per measurement at every size, and enough runs that filling and draining the
        # depth-3 pipeline is a small part of it; at most 5 reps (a large batch's rep takes seconds).
        points = [ray_scaling(b, max(16, (16384 if runs >= 300 else 8192) // b), min(reps, 5), channel)
                  for b in batches]
        print(f"Ray: data-parallel MLP ({RAY_D}->{RAY_H}->{RAY_D}), 1 thread per worker, AsyncRuntime.stream "
              "depth 3, one worker on one node against two workers on two nodes (medians; ratios per rep):")
        print_table(["batch", "GFLOP per run", "one node ms/run", "one node runs/s", "two nodes runs/s",
                     "over one node"],
                    [[p["batch"], p["gflop_per_run"], p["one_node_ms_per_run"], p["one_node_runs_per_s"],
                      p["two_nodes_runs_per_s"], p["two_over_one"]["median"]] for p in points])
        print()
        scaling = {"width": RAY_D, "hidden": RAY_H, "depth": 3, "reps": min(reps, 5), "points": points}
    finally:
        ray.shutdown()
        cluster.shutdown()
    # "overhead": on the driver's node, what Ray on one machine is; the other node for a cluster's remote worker
    return {"channel": channel, "overhead": overheads["driver's node"], "overhead_other_node": overheads["other node"],
            "scaling": scaling}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer runs and repetitions")
    ap.add_argument("--runs", type=int, default=None, help="runs per measurement")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (medians are reported)")
    ap.add_argument("--batch", type=int, default=64, help="MLP batch in the pipelining test (split over the workers)")
    ap.add_argument("--workers", type=int, default=2, help="chip workers in the pipelining test")
    ap.add_argument("--sweep-batches", default=None,
                    help="batch sizes of the data-parallel sweep at depth 3, comma-separated (default 64,512,2048,8192; "
                         "--quick: 2048); 'none' skips it")
    ap.add_argument("--ray", action="store_true", help="also measure RayTransport in a local two-node Ray cluster")
    ap.add_argument("--ray-batches", default=None,
                    help="batch sizes of the Ray scaling sweep, comma-separated (default 256,512,1024,2048; "
                         "--quick: 256,2048)")
    ap.add_argument("--ray-channel", choices=("auto", "actor", "compiled"), default="auto",
                    help="RayTransport's channel: its default (a socket to a worker on the driver's node, actor "
                         "calls across nodes), plain actor calls, or a Compiled Graph per worker")
    ap.add_argument("--json", default=None, help="where to write the JSON figures")
    args = ap.parse_args(argv)
    # Short batches and many repetitions: on a shared machine the load changes by the second, and a
    # ratio of two batches measured a fraction of a second apart is what stays comparable.
    runs = args.runs or (100 if args.quick else 300)
    reps = args.reps or (2 if args.quick else 15)

    load_before = os.getloadavg()
    rows, over = overhead(runs, reps)
    print(f"Per-run dispatch overhead, 1 chip worker, {runs} runs x {reps} reps (medians; ratios per rep, "
          "interleaved):")
    print_table(["path", "us per run", "over bare", "over polling bare"], rows)
    print()
    prow, pipe = pipelining(max(40, runs // 2), reps, args.batch, args.workers)
    print(f"Data-parallel MLP B={args.batch} ({D}->{H}->{D}) on {args.workers} chip worker(s) x 1 thread, "
          f"AsyncRuntime.stream; bound 1/max(T_host, T_worker) at depth 1 = {pipe['bound_runs_per_s']:.0f} runs/s:")
    print_table(["depth", "runs/s", "over depth 1", "of bound", "host ms p50", "worker ms p50", "host CPU ms/run",
                 "workers CPU ms/run", f"{pipe['cores']} cores allow, of bound"], prow)
    cap = pipe["captured_depth3"]
    print(f"captured (capture=True), depth 3: {cap['runs_per_s']:.3g} runs/s, {cap['over_uncaptured']:.3g}x uncaptured; "
          f"host ms p50 {cap['host_ms_p50']:.3g}, host CPU ms/run {cap['host_cpu_ms_per_run']:.3g}")
    print()
    figures: dict = {"overhead": over, "pipelining": pipe}
    sweep_arg = args.sweep_batches or ("2048" if args.quick else "64,512,2048,8192")
    if sweep_arg != "none":
        srows, sweep = batch_sweep(max(40, runs // 2), reps, [int(b) for b in sweep_arg.split(",")], args.workers)
        print(f"Data-parallel MLP over batch sizes ({D}->{H}->{D}, {args.workers} chip workers x 1 thread), depth 3 "
              f"against depth 1's bound, and against what {sweep['cores']} cores allow at its CPU a run:")
        print_table(["batch", "bound runs/s", "runs/s", "of bound", "cores allow, of bound", "of what cores allow",
                     "host CPU ms/run", "workers CPU ms/run"], srows)
        print()
        figures["pipelining_sweep"] = sweep
    if args.ray:
        batches = [int(b) for b in (args.ray_batches or ("256,2048" if args.quick else "256,512,1024,2048")).split(",")]
        figures["ray"] = ray_section(runs, reps, batches, args.ray_channel)
    load = {"before": load_before, "after": os.getloadavg()}  # 1/5/15-minute load averages: a shared machine
    print(f"load average before {load_before[0]:.2f}, after {load['after'][0]:.2f} ({os.cpu_count()} cores)")
    figures["load_average"] = load
    out = write_json("distributed", figures, args.json)
    print(f"wrote {out}")
    return figures


if __name__ == "__main__":
    main()
