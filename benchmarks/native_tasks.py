"""Per-task scheduling overhead of the native worker pool.

Submits graphs of `noop` tasks from C++ (so the figure is the engine's, not the
cost of a Python call per task): a wide graph of independent tasks and a chain
where each task depends on the previous one. Also the same graphs submitted
task by task from Python, for the cost a Python orchestration sees.

Peers on the same work (n `noop` kernel calls, made from Python): a
sequential loop calling the kernel inline (no scheduling at all: the floor of
a Python call into the kernel), a ThreadPoolExecutor and asyncio.to_thread,
each with as many threads as the pool has workers. They take turns, rep by
rep, with Tandem's wide graph submitted from Python; each is reported as its
ns per task over Tandem's (above 1: Tandem is cheaper per task).

    python benchmarks/native_tasks.py [--quick] [--no-peers] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, repeat, write_json  # noqa: E402
from _progress import Progress  # noqa: E402

from engine import _native  # noqa: E402
from tandem.native_bench import noop_graph  # noqa: E402


def native_graph(workers: int, shape: str, n: int) -> tuple[float, float]:
    """(submit, total) ns per task of n noop tasks submitted from C++ on a fresh engine of `workers` threads."""
    tasks, submit_s, total_s = noop_graph(workers, shape, n)
    return submit_s / tasks * 1e9, total_s / tasks * 1e9


def python_graph(eng: "_native.Engine", device: "_native.Device", shape: str, n: int) -> float:
    noop = eng.kernel("noop")
    buf = device.alloc(64)
    args = [_native.TensorArg(buf.addr, 0, [16], [1], buf.id, 0, 64)] if shape == "chain" else []
    access = [3] if shape == "chain" else []
    run = eng.begin_run()
    t0 = time.perf_counter()
    for _ in range(n):
        eng.submit(run, noop, args, access)
    eng.seal(run)
    run.wait()
    dt = time.perf_counter() - t0
    eng.quiesce(buf.id)
    eng.forget_allocation(buf.id)
    device.free(buf)
    return dt / n * 1e9


PEERS = {"sequential": "sequential loop", "thread_pool": "ThreadPoolExecutor", "to_thread": "asyncio.to_thread"}


def peer_graph(name: str, n: int, workers: int) -> float:
    """ns per task for n `noop` kernel calls made the peer's way from Python."""
    call = _native.call_kernel

    def noop() -> None:
        call("noop", [], [])

    if name == "sequential":
        t0 = time.perf_counter()
        for _ in range(n):
            noop()
        return (time.perf_counter() - t0) / n * 1e9
    if name == "thread_pool":
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            t0 = time.perf_counter()
            for fut in [pool.submit(noop) for _ in range(n)]:
                fut.result()
            return (time.perf_counter() - t0) / n * 1e9

    async def gathered() -> float:
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(workers))
        t0 = time.perf_counter()
        await asyncio.gather(*(asyncio.to_thread(noop) for _ in range(n)))
        return (time.perf_counter() - t0) / n * 1e9

    return asyncio.run(gathered())


def measure_peers(n: int, reps: int, workers: int, progress: Progress) -> dict:
    """Tandem's wide graph from Python and the peers, interleaved rep by rep (one warm-up each)."""
    device = _native.Device(0)
    eng = _native.Engine(device, workers)
    try:
        fns = {"tandem": lambda: python_graph(eng, device, "wide", n)}
        fns.update({name: (lambda name=name: peer_graph(name, n, workers)) for name in PEERS})
        for fn in fns.values():
            fn()
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for r in range(reps):
            for name, fn in fns.items():
                samples[name].append(fn())
            progress.step(f"peers rep {r + 1}/{reps}")
    finally:
        eng.close()
    it = {k: iter(v) for k, v in samples.items()}
    st = {k: repeat(lambda k=k: next(it[k]), reps, warmup=0) for k in samples}
    tandem = st.pop("tandem")
    return {"workers": workers, "tasks": n, "tandem_python_ns_per_task": tandem,
            "peers": {name: {"label": PEERS[name], "ns_per_task": s, "tandem_speedup": s["median"] / tandem["median"]}
                      for name, s in st.items()}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tasks and repetitions")
    ap.add_argument("--no-peers", action="store_true", help="the engine's figures only")
    ap.add_argument("--json", default=None, help="where to write the JSON figures")
    args = ap.parse_args(argv)
    n = 20_000 if args.quick else 200_000
    reps = 3 if args.quick else 7
    cores = os.cpu_count() or 1
    default_workers = cores  # the engine's default pool
    rows, figures = [], {"cores": cores, "tasks_per_graph": n, "graphs": []}
    configs = sorted({default_workers, 2})
    progress = Progress(len(configs) * 2 + (0 if args.no_peers else max(3, reps // 2)), "tasks")
    for workers in configs:
        device = _native.Device(0)
        eng = _native.Engine(device, workers)
        try:
            for shape in ("wide", "chain"):
                submit = repeat(lambda: native_graph(workers, shape, n)[0], reps)
                total = repeat(lambda: native_graph(workers, shape, n)[1], reps)
                py = repeat(lambda: python_graph(eng, device, shape, n // 4), max(3, reps // 2))
                entry = {
                    "workers": workers,
                    "shape": shape,
                    "native_submit_ns_per_task": submit,
                    "native_total_ns_per_task": total,
                    "python_total_ns_per_task": py,
                    "tasks_per_second": 1e9 / total["median"],
                }
                figures["graphs"].append(entry)
                rows.append([workers, shape, submit["median"], total["median"], entry["tasks_per_second"],
                             py["median"]])
                progress.step(f"{workers} workers, {shape}")
        finally:
            eng.close()
    if not args.no_peers:
        figures["peers"] = measure_peers(n // 4, max(3, reps // 2), default_workers, progress)
    progress.close()
    print(f"noop task graphs on {cores} cores ({n} tasks per graph, median of {reps})")
    print_table(["workers", "graph", "submit ns/task", "total ns/task", "tasks/s", "from Python ns/task"], rows)
    if not args.no_peers:
        pf = figures["peers"]
        print()
        print(f"Peers: {pf['tasks']} noop kernel calls from Python, {pf['workers']} thread(s); Tandem/peer = the "
              "peer's ns per task over Tandem's (above 1: Tandem is cheaper)")
        print_table(["runner", "ns/task (median)", "min", "max", "Tandem/peer"],
                    [["Tandem (wide graph from Python)", pf["tandem_python_ns_per_task"]["median"],
                      pf["tandem_python_ns_per_task"]["min"], pf["tandem_python_ns_per_task"]["max"], "1.0"]]
                    + [[p["label"], p["ns_per_task"]["median"], p["ns_per_task"]["min"], p["ns_per_task"]["max"],
                        p["tandem_speedup"]] for p in pf["peers"].values()])
    out = write_json("native_tasks", figures, args.json)
    print(f"wrote {out}")
    return figures


if __name__ == "__main__":
    main()
