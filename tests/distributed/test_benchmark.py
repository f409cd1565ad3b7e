"""benchmarks/distributed.py runs in --quick mode and writes finite, positive figures (no timing thresholds)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "distributed.py"


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_benchmark(tmp_path):
    out = tmp_path / "distributed.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--runs", "40", "--sweep-batches", "128,256",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "distributed"
    over = data["figures"]["overhead"]
    for key in ("bare_us", "bare_polling_us", "sync_us", "async_us", "async_over_bare", "sync_over_bare_polling",
                "async_over_bare_polling", "captured_sync_us", "captured_async_us", "captured_sync_over_bare_polling",
                "captured_sync_over_uncaptured", "captured_async_over_uncaptured"):
        assert _positive(over[key]), key
    assert _positive(over["sync_over_bare"]["median"])
    pipe = data["figures"]["pipelining"]
    assert _positive(pipe["captured_depth3"]["runs_per_s"]) and _positive(pipe["captured_depth3"]["over_uncaptured"])
    assert [d["depth"] for d in pipe["depths"]] == [1, 2, 3]
    for d in pipe["depths"]:
        assert _positive(d["runs_per_s"]) and _positive(d["speedup_over_depth1"]) and _positive(d["fraction_of_bound"])
        assert _positive(d["host_ms_p50"]) and _positive(d["device_ms_p50"])
        # CPU a run, measured (this process's threads, the workers' from /proc), and what the cores allow at that cost
        assert _positive(d["host_cpu_ms_per_run"]) and _positive(d["workers_cpu_ms_per_run"])
        assert d["cpu_ceiling_runs_per_s"] == pytest.approx(
            pipe["cores"] / ((d["host_cpu_ms_per_run"] + d["workers_cpu_ms_per_run"]) / 1e3))
    sweep = data["figures"]["pipelining_sweep"]
    assert [p["batch"] for p in sweep["points"]] == [128, 256]
    for p in sweep["points"]:
        assert p["runs"] >= 40 and _positive(p["bound_runs_per_s"]) and _positive(p["runs_per_s"])
        assert p["fraction_of_bound"] == pytest.approx(p["runs_per_s"] / p["bound_runs_per_s"])
        assert p["of_cpu_ceiling"] == pytest.approx(p["runs_per_s"] / p["cpu_ceiling_runs_per_s"])
        assert p["cpu_ceiling_runs_per_s"] == pytest.approx(
            sweep["cores"] / ((p["host_cpu_ms_per_run"] + p["workers_cpu_ms_per_run"]) / 1e3))
    assert "over polling bare" in proc.stdout and "over depth 1" in proc.stdout and "cores allow" in proc.stdout
    assert "over batch sizes" in proc.stdout and "of what cores allow" in proc.stdout


@pytest.mark.slow
def test_quick_benchmark_with_ray(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "distributed.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--runs", "40", "--reps", "1", "--ray",
                           "--ray-batches", "64,128", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ray_figures = json.loads(out.read_text())["figures"]["ray"]
    assert ray_figures["channel"] == "auto"
    # The default reaches a worker on the driver's node through its socket (mapping the driver's regions), one on
    # another node by actor calls
    here, there = ray_figures["overhead"], ray_figures["overhead_other_node"]
    assert here["socket_workers"] == here["sharing_workers"] == [0]
    assert there["socket_workers"] == there["sharing_workers"] == []
    # Both placements, each with the bare actor on the transport worker's node (a fair comparison)
    assert ray_figures["overhead"]["node"] != ray_figures["overhead_other_node"]["node"]
    for over in (ray_figures["overhead"], ray_figures["overhead_other_node"]):
        for key in ("cgraph_us", "sync_us", "async_us", "async_over_cgraph"):
            assert _positive(over[key]), key
    scaling = ray_figures["scaling"]
    assert [p["batch"] for p in scaling["points"]] == [64, 128]
    for p in scaling["points"]:
        assert p["nodes"] == {"1": 1, "2": 2}
        assert _positive(p["one_node_runs_per_s"]) and _positive(p["two_nodes_runs_per_s"])
        assert _positive(p["two_over_one"]["median"]) and _positive(p["gflop_per_run"])
    assert "over Compiled Graph" in proc.stdout and "over one node" in proc.stdout
