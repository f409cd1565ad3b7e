"""Per-task scheduling overhead of the native worker pool.

Submits graphs of `noop` tasks from C++ (so the figure is the engine's, not the
cost of a Python call per task): a wide graph of independent tasks and a chain
where each task depends on the previous one. Also the same graphs submitted
task by task from Python, for the cost a Python orchestration sees.

    python benchmarks/native_tasks.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import print_table, repeat, write_json  # noqa: E402

from engine import _native  # noqa: E402


def native_graph(eng: "_native.Engine", shape: str, n: int) -> tuple[float, float]:
    tasks, submit_s, total_s = eng.bench_noop_graph(shape, n)
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer tasks and repetitions")
    ap.add_argument("--json", default=None, help="where to write the JSON figures")
    args = ap.parse_args(argv)
    n = 20_000 if args.quick else 200_000
    reps = 3 if args.quick else 7
    cores = os.cpu_count() or 1
    default_workers = max(1, cores - 1)
    rows, figures = [], {"cores": cores, "tasks_per_graph": n, "graphs": []}
    for workers in sorted({default_workers, 2}):
        device = _native.Device(0)
        eng = _native.Engine(device, workers)
        try:
            for shape in ("wide", "chain"):
                submit = repeat(lambda: native_graph(eng, shape, n)[0], reps)
                total = repeat(lambda: native_graph(eng, shape, n)[1], reps)
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
        finally:
            eng.close()
    print(f"noop task graphs on {cores} cores ({n} tasks per graph, median of {reps})")
    print_table(["workers", "graph", "submit ns/task", "total ns/task", "tasks/s", "from Python ns/task"], rows)
    out = write_json("native_tasks", figures, args.json)
    print(f"wrote {out}")
    return figures


if __name__ == "__main__":
    main()
