"""Host/device overlap: throughput at depth 1, 2 and 3 against 1 / max(T_host, T_device), and peers.

The program's orchestration does T_host of Python work (holding the GIL, as
real orchestration does) and submits one `spin` task of T_device on the
device. With the pipeline, run N+1's orchestration overlaps run N's device
work, so depth 2 approaches the bound; depth 1 can reach only about
1 / (T_host + T_device).

Beside Tandem, and taking turns with it, its native floor: the native calls
of the same runs (begin a run on a free slot, stage x, submit the kept spin
call, seal; wait for the oldest run when no slot is free) driven from
Python with none of the engine's Python layer around them (binding, the
Run, run.submit's checks, the handle, finishing). Tandem over its floor says
what that layer costs; the floor's own fraction of the bound says what a
Python-driven engine can reach on this machine at all.

Peers do the same work (the same Python host step, the same native `spin`
kernel called directly) at the same depth with as many device threads as
Tandem has pool workers (see peers.py): a sequential loop, a
ThreadPoolExecutor pipeline, asyncio.to_thread, and a Ray Compiled Graph when
ray is installed. Tandem and the thread peers take turns rep by rep, so load
from other processes hits them alike; Ray runs last, on its own (its local
cluster's processes would load the machine for the others). Each peer is
reported as Tandem's throughput over the peer's (above 1: Tandem is faster),
with run latencies (start of the host step to the end of the device step).

    python benchmarks/overlap.py [--quick] [--host-ms 1.0] [--device-ms 1.0] [--workers 1]
                                 [--no-peers] [--no-ray] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import peers  # noqa: E402
from _common import print_table, repeat, write_json  # noqa: E402
from _progress import Progress  # noqa: E402

import engine  # noqa: E402
from engine import kernels as K  # noqa: E402
from tandem.programs import python_work, spin  # noqa: E402  (the same work `tandem trace overlap` shows)

DEPTHS = (1, 2, 3)
CDF_DEPTH = 2  # the depth whose run latencies are kept whole, for the latency CDF


def tandem_sample(rt: engine.Runtime, runs: int, host_s: float, device_ns: int) -> peers.Sample:
    """`runs` pipelined submits: runs per second, and each run's latency from its creation to done."""
    x = np.zeros(16, np.float32)
    handles = []
    t0 = time.perf_counter()
    for _ in range(runs):
        handles.append(rt.submit(x, host_s, device_ns))
    for h in handles:
        h.result()
    return _sample(runs / (time.perf_counter() - t0), handles)


def _sample(rate: float, runs: list[Any]) -> peers.Sample:
    """The rate, and each run's latency from its creation to done (runs: handles or native runs)."""
    times = [r.times() for r in runs]
    return peers.Sample(rate, [(t["done_ns"] - t["created_ns"]) / 1e9 for t in times])


def native_floor_sample(rt: engine.Runtime, runs: int, host_s: float, device_ns: int) -> peers.Sample:
    """The same runs through the runtime's native engine alone: what is left of a run's host cost without
    the engine's Python layer (reaches into the runtime's internals on purpose)."""
    native_engine, table = rt._engine, rt._slot_table
    assert native_engine is not None and table is not None
    call = native_engine.prepare_call(rt._port.native_kernel(K.spin), [], [], [device_ns])  # as run.submit keeps it
    x = np.zeros(16, np.float32)
    staging = [(slot.accessor.map, slot.buffers["x"].addr) for slot in rt._slots]
    begun: list[Any] = []
    oldest = 0
    t0 = time.perf_counter()
    for _ in range(runs):
        lease = native_engine.begin_run_leased(False, table)
        while lease is None:  # every slot held: the oldest run frees one when it completes
            begun[oldest].wait()
            oldest += 1
            lease = native_engine.begin_run_leased(False, table)
        native = lease[0]
        try:
            stage, addr = staging[lease[2]]
            stage(addr, x.nbytes, x, True)
            python_work(host_s)
            native_engine.submit_prepared(native, call)
        except BaseException:
            native.cancel()  # sealed below all the same: an unsealed run would hold close() forever
            raise
        finally:
            native_engine.seal(native)
        begun.append(native)
    for native in begun[oldest:]:
        native.wait()
    return _sample(runs / (time.perf_counter() - t0), begun)


def stats(values: list[float]) -> dict[str, float]:
    """_common.repeat()'s statistics over measurements already taken (they were interleaved)."""
    it = iter(values)
    return repeat(lambda: next(it), len(values), warmup=0)


def latency_ms(samples: list[peers.Sample]) -> dict[str, float]:
    lat = sorted(v * 1e3 for s in samples for v in s.latencies_s)
    pick = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "mean": statistics.fmean(lat)}


def interleaved(fns: dict[str, Callable[[], peers.Sample]], reps: int,
                progress: Progress, label: str) -> dict[str, list[peers.Sample]]:
    """One warm-up each, then `reps` rounds taking the fns in turn (the order rotates every round)."""
    out: dict[str, list[peers.Sample]] = {k: [] for k in fns}
    names = list(fns)
    for name in names:
        fns[name]()
    progress.step(f"{label} warm-up")
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(fns[name]())
        progress.step(f"{label} rep {r + 1}/{reps}")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer runs and repetitions")
    ap.add_argument("--host-ms", type=float, default=1.0)
    ap.add_argument("--device-ms", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--no-peers", action="store_true", help="Tandem only")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray Compiled Graph peer")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runs = 60 if args.quick else 400
    reps = 3 if args.quick else 5
    host_s, device_ns = args.host_ms / 1e3, int(args.device_ms * 1e6)
    bound = 1.0 / max(host_s, device_ns / 1e9)
    serial = 1.0 / (host_s + device_ns / 1e9)
    work = peers.Work(lambda: python_work(host_s), peers.spin_device(device_ns))

    ray_reason = "disabled (--no-peers)" if args.no_peers else (
        "disabled (--no-ray)" if args.no_ray else peers.ray_unavailable(args.workers))
    steps = len(DEPTHS) * (reps + 1) + (0 if ray_reason else len(DEPTHS) + 1)
    samples: dict[str, dict[int, list[peers.Sample]]] = {}
    load_before = os.getloadavg()
    with Progress(steps, "overlap") as progress:
        for depth in DEPTHS:
            with spin.prepare(depth=depth, workers=args.workers) as rt:
                fns: dict[str, Callable[[], peers.Sample]] = {
                    "tandem": lambda: tandem_sample(rt, runs, host_s, device_ns),  # noqa: B023
                    "native_floor": lambda: native_floor_sample(rt, runs, host_s, device_ns)}  # noqa: B023
                if not args.no_peers:
                    if depth == 1:  # no depth of its own: measured once, beside Tandem at depth 1
                        fns["sequential"] = lambda: peers.sequential(work, runs)
                    fns["thread_pool"] = lambda: peers.thread_pool(work, runs, depth, args.workers)  # noqa: B023
                    fns["to_thread"] = lambda: peers.to_thread(work, runs, depth, args.workers)  # noqa: B023
                for name, got in interleaved(fns, reps, progress, f"depth {depth}").items():
                    samples.setdefault(name, {})[depth] = got
        if ray_reason is None:
            try:
                progress.step("starting Ray")
                ray_peer = peers.RayCompiledGraph(work)
                try:
                    for depth in DEPTHS:
                        samples.setdefault("ray_compiled_graph", {})[depth] = ray_peer.measure(depth, runs, reps)
                        progress.step(f"Ray depth {depth}")
                finally:
                    ray_peer.close()
            except Exception as e:  # a local Ray that cannot start is a skipped peer, not a failed benchmark
                ray_reason = f"Ray failed: {type(e).__name__}: {e}"
                samples.pop("ray_compiled_graph", None)

    figures: dict[str, Any] = {"host_ms": args.host_ms, "device_ms": args.device_ms, "workers": args.workers,
                               "bound_runs_per_s": bound, "serial_runs_per_s": serial, "runs": runs, "reps": reps,
                               "depths": []}
    tandem_rate: dict[int, float] = {}
    rows = []
    for depth in DEPTHS:
        got = samples["tandem"][depth]
        st = stats([s.runs_per_s for s in got])
        tandem_rate[depth] = st["median"]
        floor = stats([s.runs_per_s for s in samples["native_floor"][depth]])
        figures["depths"].append({"depth": depth, "runs_per_s": st, "fraction_of_bound": st["median"] / bound,
                                  "latency_ms": latency_ms(got),
                                  "native_floor": {"runs_per_s": floor, "fraction_of_bound": floor["median"] / bound,
                                                   "tandem_over_floor": st["median"] / floor["median"]}})
        rows.append([depth, st["median"], st["min"], st["max"], st["median"] / bound, floor["median"] / bound,
                     st["median"] / floor["median"]])

    figures["peers"] = {}
    for name, label in peers.PEERS.items():
        entry: dict[str, Any] = {"label": label, "available": name in samples, "reason": None, "depths": []}
        if name == "ray_compiled_graph" and name not in samples:
            entry["reason"] = ray_reason
        elif args.no_peers:
            entry["reason"] = "disabled (--no-peers)"
        for depth in DEPTHS if name in samples else ():
            # The sequential loop has no depth: its one figure stands beside every depth.
            got = samples[name][1 if name == "sequential" else depth]
            st = stats([s.runs_per_s for s in got])
            entry["depths"].append({"depth": depth, "runs_per_s": st, "fraction_of_bound": st["median"] / bound,
                                    "tandem_speedup": tandem_rate[depth] / st["median"],
                                    "latency_ms": latency_ms(got)})
        figures["peers"][name] = entry
    # Whole latency samples at one depth (the last repetition's), for the CDF plot.
    figures["latency_cdf"] = {"depth": CDF_DEPTH, "samples_ms": {
        name: [round(v * 1e3, 4) for v in per_depth[1 if name == "sequential" else CDF_DEPTH][-1].latencies_s]
        for name, per_depth in samples.items()}}
    figures["load_average"] = {"before": load_before, "after": os.getloadavg()}

    print(f"T_host={args.host_ms} ms, T_device={args.device_ms} ms, {args.workers} pool worker(s); "
          f"bound 1/max = {bound:.0f} runs/s, serial 1/(sum) = {serial:.0f} runs/s; {runs} runs x {reps} reps")
    print_table(["depth", "runs/s (median)", "min", "max", "fraction of bound", "native floor's fraction",
                 "Tandem over floor"], rows)
    if not args.no_peers:
        print()
        print("Peers on the same work, same depth; Tandem/peer = Tandem's runs/s over the peer's (above 1: Tandem "
              "is faster)")
        prow = [["Tandem", *(tandem_rate[d] for d in DEPTHS), *("1.0" for _ in DEPTHS),
                 figures["depths"][CDF_DEPTH - 1]["latency_ms"]["p50"]]]
        skipped = []
        for entry in figures["peers"].values():
            if not entry["available"]:
                skipped.append(f"{entry['label']} skipped: {entry['reason']}")
                continue
            ds = entry["depths"]
            prow.append([entry["label"], *(d["runs_per_s"]["median"] for d in ds),
                         *(d["tandem_speedup"] for d in ds), ds[CDF_DEPTH - 1]["latency_ms"]["p50"]])
        print_table(["runner", *(f"runs/s d{d}" for d in DEPTHS), *(f"Tandem/peer d{d}" for d in DEPTHS),
                     f"p50 latency ms d{CDF_DEPTH}"], prow)
        for line in skipped:
            print(line)
    print(f"load average before / after: {load_before[0]:.2f} / {figures['load_average']['after'][0]:.2f} "
          f"({os.cpu_count()} cores)")
    out = write_json("overlap", figures, args.json)
    print(f"wrote {out}")
    return figures


if __name__ == "__main__":
    main()
