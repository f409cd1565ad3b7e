"""benchmarks/kernel_bench.py runs in --quick mode and writes finite, positive ratios.
No speed thresholds here: the machine running tests may be busy."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_bench.py"


def test_kernels_benchmark_quick(tmp_path):
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--only", "matmul,gelu,layernorm,attention", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ratio" in proc.stdout and "Scaling" in proc.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "kernels"
    figures = data["figures"]
    assert {r["kernel"] for r in figures["kernels"]} == {"matmul", "gelu", "layernorm", "attention"}
    for r in figures["kernels"]:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        assert r["ours_us"]["median"] > 0 and r["reference_us"]["median"] > 0
    targets = {(r["kernel"], r["shape"]) for r in figures["kernels"] if r["target"] is not None}
    assert ("matmul", "512x512x512") in targets and ("attention", "B2 H8 S128 D32") in targets
    scaling = figures["scaling"]
    assert scaling["speedup"] > 0 and scaling["target"] == 1.7
    assert figures["pinning"]["OPENBLAS_NUM_THREADS"] == "1"
