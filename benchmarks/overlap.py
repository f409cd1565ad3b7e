"""Host/device overlap: throughput at depth 1, 2 and 3 against 1 / max(T_host, T_device).

The program's orchestration does T_host of Python work (holding the GIL, as
real orchestration does) and submits one `spin` task of T_device on the
device. With the pipeline, run N+1's orchestration overlaps run N's device
work, so depth 2 approaches the bound; depth 1 can reach only about
1 / (T_host + T_device).

    python benchmarks/overlap.py [--quick] [--host-ms 1.0] [--device-ms 1.0] [--workers 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import print_table, repeat, write_json  # noqa: E402

import engine  # noqa: E402
from engine import In, Scalar  # noqa: E402
from engine import kernels as K  # noqa: E402


def python_work(seconds: float) -> None:
    """Busy Python work for `seconds` (the GIL stays held, like real orchestration)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@engine.program
def spin_program(run: engine.Run, x: In((16,)), host_s: Scalar(float), device_ns: Scalar(int)):
    python_work(host_s)
    run.submit(K.spin, ns=device_ns)


def throughput(rt: engine.Runtime, runs: int, host_s: float, device_ns: int) -> float:
    """Runs per second over `runs` pipelined submits."""
    x = np.zeros(16, np.float32)
    handles = []
    t0 = time.perf_counter()
    for _ in range(runs):
        handles.append(rt.submit(x, host_s, device_ns))
    for h in handles:
        h.result()
    return runs / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--host-ms", type=float, default=1.0)
    ap.add_argument("--device-ms", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runs = 100 if args.quick else 400
    reps = 3 if args.quick else 5
    host_s, device_ns = args.host_ms / 1e3, int(args.device_ms * 1e6)
    bound = 1.0 / max(host_s, device_ns / 1e9)
    serial = 1.0 / (host_s + device_ns / 1e9)
    rows, figures = [], {"host_ms": args.host_ms, "device_ms": args.device_ms, "workers": args.workers,
                         "bound_runs_per_s": bound, "serial_runs_per_s": serial, "depths": []}
    for depth in (1, 2, 3):
        with spin_program.prepare(depth=depth, workers=args.workers) as rt:
            stats = repeat(lambda: throughput(rt, runs, host_s, device_ns), reps)
        ratio = stats["median"] / bound
        figures["depths"].append({"depth": depth, "runs_per_s": stats, "fraction_of_bound": ratio})
        rows.append([depth, stats["median"], stats["min"], stats["max"], ratio])
    print(f"T_host={args.host_ms} ms, T_device={args.device_ms} ms, {args.workers} pool worker(s); "
          f"bound 1/max = {bound:.0f} runs/s, serial 1/(sum) = {serial:.0f} runs/s")
    print_table(["depth", "runs/s (median)", "min", "max", "fraction of bound"], rows)
    out = write_json("overlap", figures, args.json)
    print(f"wrote {out}")
    return figures


if __name__ == "__main__":
    main()
