"""`tandem bench all --quick` and `tandem trace`: JSON schemas, finite positive ratios, plots, traces.

One `tandem bench all --quick` run serves every benchmark's test (it is the
expensive part). No timing thresholds: only that each figure exists, is
finite and positive, and that the files a user is promised are there.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.benchmarks.conftest import HAVE_MPL, PNG_MAGIC, tandem

_RAY = importlib.util.find_spec("ray")
HAVE_RAY = _RAY is not None and _RAY.origin is not None  # not a namespace: Ray's /tmp/ray imports as one from /tmp
pytestmark = pytest.mark.timeout(900)  # the session's one `bench all --quick` run is set up by the first test


def finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# -- per-benchmark schemas: each returns the ratios that must be finite and positive ------------------------
def tasks_schema(f: dict) -> list[float]:
    assert {g["shape"] for g in f["graphs"]} == {"wide", "chain"}
    ratios = [g["native_total_ns_per_task"]["median"] for g in f["graphs"]] + [g["tasks_per_second"] for g in
                                                                              f["graphs"]]
    peers = f["peers"]["peers"]
    assert set(peers) == {"sequential", "thread_pool", "to_thread"}
    return ratios + [p["tandem_speedup"] for p in peers.values()] + [f["peers"]["tandem_python_ns_per_task"]["median"]]


def kernels_schema(f: dict) -> list[float]:
    assert f["kernels"]
    for k in f["kernels"]:
        assert k["kernel"] and k["shape"] and k["dtype"] and k["reference"]
    return [k["ratio"] for k in f["kernels"]] + [k["ours_us"]["median"] for k in f["kernels"]]


def overlap_schema(f: dict) -> list[float]:
    assert [d["depth"] for d in f["depths"]] == [1, 2, 3]
    assert f["bound_runs_per_s"] > f["serial_runs_per_s"] > 0
    ratios = [d["fraction_of_bound"] for d in f["depths"]] + [d["latency_ms"]["p50"] for d in f["depths"]]
    for d in f["depths"]:  # the native floor, measured beside Tandem at every depth
        floor = d["native_floor"]
        ratios += [floor["runs_per_s"]["median"], floor["fraction_of_bound"], floor["tandem_over_floor"]]
    for name in ("sequential", "thread_pool", "to_thread"):
        peer = f["peers"][name]
        assert peer["available"], peer
        assert [d["depth"] for d in peer["depths"]] == [1, 2, 3]
        ratios += [d["tandem_speedup"] for d in peer["depths"]] + [d["runs_per_s"]["median"] for d in peer["depths"]]
    ray = f["peers"]["ray_compiled_graph"]
    if ray["available"]:
        ratios += [d["tandem_speedup"] for d in ray["depths"]]
    else:
        assert ray["reason"], "a skipped Ray peer says why"
    samples = f["latency_cdf"]["samples_ms"]
    assert {"tandem", "sequential", "thread_pool", "to_thread"} <= set(samples)
    return ratios + [v for s in samples.values() for v in s]


def dispatch_schema(f: dict) -> list[float]:
    assert [d["depth"] for d in f["depths"]] == [1, 2, 4, 8]
    return [d[k] for d in f["depths"] for k in ("cost_ratio", "rate_ratio", "cpu_ratio")] + [
        d[k]["median"] for d in f["depths"] for k in ("asyncio_to_thread", "thread_pool_executor", "engine", "floor")]


def model_schema(f: dict) -> list[float]:
    assert [r["batch"] for r in f["encode"]] == [1, 8, 32]
    return [r[k] for r in f["encode"] for k in ("one_ratio", "engine_one_sps", "torch_one_sps")]


def sweep_schema(f: dict) -> list[float]:
    assert f["engines"] == ["tandem", "torch", "ort"]
    shapes = [(s["seq_len"], s["batch"]) for s in f["shapes"]]
    assert shapes == [(16, 1), (16, 8), (64, 1), (64, 8)]
    out = []
    for e in f["engines"]:
        rows = f["results"][e]["rows"]
        assert [(r["seq_len"], r["batch"]) for r in rows] == shapes
        # every shape checked against torch's embeddings: Tandem's tightly, the peers' as the same model
        min_cos, max_diff = (1 - 1e-6, 1e-5) if e == "tandem" else (0.999, 1.0)
        assert all(r["cosine_vs_torch"] >= min_cos and r["max_abs_diff_vs_torch"] <= max_diff for r in rows)
        out += [r["sentences_per_s"] for r in rows] + [r["p99_ms"] for r in rows if r["batch"] == 1]
        out += [r["fraction_of_sgemm"] for r in rows]
    return out + [r[e] for r in f["ratios_to_torch"] for e in f["engines"]] + [f["machine_sgemm_gflops"]]


def decode_schema(f: dict) -> list[float]:
    assert [d["depth"] for d in f["depths"]] == [1, 2]
    return [f["speedup_depth2_over_depth1"], f["overlap_figure"], f["bound_tokens_per_s"]] + [
        d["tokens_per_s"]["median"] for d in f["depths"]]


def capture_schema(f: dict) -> list[float]:
    names = [w["workload"] for w in f["workloads"]]
    assert names[0] == "tasks" and "decoder" in names
    return [w[k] for w in f["workloads"] for k in ("orchestration_ratio", "runs_per_s_ratio", "host_per_run_ratio")] + [
        w[mode][k] for w in f["workloads"] for mode in ("captured", "uncaptured")
        for k in ("runs_per_s", "orchestration_us", "host_per_run_us")]


def distributed_schema(f: dict) -> list[float]:
    assert [d["depth"] for d in f["pipelining"]["depths"]] == [1, 2, 3]
    return [f["overhead"]["sync_over_bare"]["median"], f["overhead"]["async_over_bare"],
            f["overhead"]["sync_over_bare_polling"], f["overhead"]["async_over_bare_polling"]] + [
        d[k] for d in f["pipelining"]["depths"] for k in ("fraction_of_bound", "speedup_over_depth1", "runs_per_s",
                                                          "host_cpu_ms_per_run", "workers_cpu_ms_per_run",
                                                          "cpu_ceiling_over_bound")] + [
        p[k] for p in f["pipelining_sweep"]["points"] for k in ("fraction_of_bound", "of_cpu_ceiling",
                                                                "cpu_ceiling_over_bound")]


SCHEMAS: dict[str, Callable[[dict], list[float]]] = {
    "tasks": tasks_schema, "kernels": kernels_schema, "overlap": overlap_schema, "dispatch": dispatch_schema,
    "model": model_schema, "sweep": sweep_schema, "decode": decode_schema, "capture": capture_schema,
    "distributed": distributed_schema,
}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_bench_quick_json_schema_and_ratios(bench_all, name):
    proc, out, summary = bench_all
    entry = summary["benchmarks"][name]
    if entry["status"] == "skipped":  # an optional extra is not installed (the model needs `models`)
        assert "missing" in entry["reason"]
        pytest.skip(entry["reason"])
    assert entry["status"] == "ok", Path(entry["log"]).read_text()[-3000:]
    data = json.loads(Path(entry["json"]).read_text())
    env = data["environment"]
    assert env["cpu"] and env["cores"] >= 1 and env["python"] and env["numpy"] and env["commit"] and env["date"]
    assert "torch" in env
    ratios = SCHEMAS[name](data["figures"])
    assert ratios and all(finite_positive(r) for r in ratios), [r for r in ratios if not finite_positive(r)]
    assert entry["headlines"] and all(finite_positive(v) for v in entry["headlines"].values()), entry["headlines"]
    # The table went to the terminal, and the summary names the benchmark.
    assert f"{name}: done in" in proc.stdout
    if HAVE_MPL:
        assert entry["plots"], "matplotlib is installed: each benchmark draws at least one plot"
        for png in entry["plots"]:
            assert Path(png).read_bytes()[:8] == PNG_MAGIC
    else:
        assert entry["plots"] == [] and "matplotlib is not installed" in proc.stdout


def test_bench_summary_describes_the_machine(bench_all):
    proc, out, summary = bench_all
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    env = summary["environment"]
    assert env["cores"] >= 1 and env["cpu"]
    assert summary["quick"] is True
    assert list(summary["benchmarks"]) == list(SCHEMAS)
    assert "Summary (" in proc.stdout


def test_ray_peer_runs_or_says_why_not(bench_all):
    _, _, summary = bench_all
    if summary["benchmarks"]["overlap"]["status"] != "ok":
        pytest.fail("the overlap benchmark did not run")
    ray = json.loads(Path(summary["benchmarks"]["overlap"]["json"]).read_text())["figures"]["peers"][
        "ray_compiled_graph"]
    if HAVE_RAY:
        assert ray["available"], ray["reason"]
        assert all(finite_positive(d["tandem_speedup"]) for d in ray["depths"])
    else:
        assert not ray["available"] and "not installed" in ray["reason"]


def test_bench_rejects_unknown_names():
    proc = tandem("bench", "nosuch", timeout=60)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


# -- tandem trace ----------------------------------------------------------------------------------------
def trace_tracks(path: Path) -> dict[str, set[str]]:
    """{process name: {thread names that hold complete events}}."""
    events = json.loads(path.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    out: dict[str, set[str]] = {}
    for e in events:
        if e.get("ph") == "X":
            out.setdefault(procs[e["pid"]], set()).add(threads[(e["pid"], e["tid"])])
    return out


@pytest.mark.parametrize("program", ["overlap", "mlp", "tests.benchmarks.traced_program:source"])
def test_trace_writes_chrome_json_with_host_and_worker_tracks(tmp_path, program):
    out = tmp_path / "t.json"
    proc = tandem("trace", program, "--runs", "6", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tracks = trace_tracks(out)
    assert any(t.startswith("slot ") for t in tracks["host"]), tracks
    # Tasks run on pool workers, or on the thread waiting for their run ("caller"): tiny tasks often there.
    assert tracks["device"] and all(t.startswith("worker ") or t == "caller" for t in tracks["device"]), tracks
    events = json.loads(out.read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("cat") == "run") == 6
    assert any(e.get("name") == "orchestration" for e in events)
    assert "both at once" in proc.stdout
    png = out.with_suffix(".png")
    if HAVE_MPL:
        assert png.read_bytes()[:8] == PNG_MAGIC
    else:
        assert not png.exists() and "no PNG timeline" in proc.stdout


def test_trace_rejects_a_bad_program_spec(tmp_path):
    for spec, message in (("nosuch", "module:function"), ("nosuch_module_xyz:fn", "no module named"),
                          ("tests.benchmarks.traced_program:nosuch", "no attribute")):
        proc = tandem("trace", spec, "--out", str(tmp_path / "t.json"), timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, (spec, proc.stderr)


def test_bench_option_trace_writes_timeline(bench_all):
    _, out, summary = bench_all
    tracks = trace_tracks(out / "trace_overlap.json")
    assert any(t.startswith("slot ") for t in tracks["host"]) and "worker 0" in tracks["device"], tracks
    if HAVE_MPL:
        assert (out / "trace_overlap.png").read_bytes()[:8] == PNG_MAGIC
        assert summary["trace"]["png"] == str(out / "trace_overlap.png")
