"""The soak benchmark's short version: RSS after run 25,000 within 5% of RSS after run 10,000.

benchmarks/soak.py --quick drives 25,000 dispatches (random cancellations and
failing kernels) and exits non-zero on RSS growth of 5% or more, a device
counter off its baseline, or a wrong result. The full 100,000-run version:
python benchmarks/soak.py (see tests/RELIABILITY.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import LONG, SANITIZER, record

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


@pytest.mark.skipif(bool(SANITIZER), reason="a sanitizer's shadow memory and quarantine make RSS meaningless")
def test_rss_does_not_grow_over_the_soak(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(SOAK), "--json", str(out)] + ([] if LONG else ["--quick"])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    assert figures["rss_ratio"] < 1.05, figures
    assert figures["wrong"] == 0
    assert figures["counters_after"] == figures["counters_base"]
    assert figures["ok"] > 0 and figures["failed"] > 0 and figures["cancelled"] > 0
    assert figures["ok"] + figures["failed"] + figures["cancelled"] == figures["runs"]
    record(dispatches=figures["runs"], dispatches_survived=figures["ok"], dispatches_failed=figures["failed"],
           dispatches_cancelled=figures["cancelled"], faults_injected=figures["failed"], leak_checks=1,
           soak_rss_ratio_permille=round(1000 * figures["rss_ratio"]))
