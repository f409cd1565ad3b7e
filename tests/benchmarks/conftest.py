"""Shared by the benchmark tests: one `tandem bench all --quick --trace` run for the whole session."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tandem(*args: str, timeout: float = 900, cwd: Path = ROOT,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `tandem` command, run as `python -m tandem` (from the repository's root unless `cwd` says)."""
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


@pytest.fixture(scope="session")
def bench_all(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path, dict]:
    """(the finished process, its output folder, its summary.json) of `tandem bench all --quick --trace`."""
    out = tmp_path_factory.mktemp("bench")
    # An ambient Ray address nobody answers at (as a leftover /tmp/ray/ray_current_cluster or a user's
    # RAY_ADDRESS would be): the benchmarks start their own Ray instances and must not be led to it.
    proc = tandem("bench", "all", "--quick", "--trace", "--out", str(out), env={"RAY_ADDRESS": "127.0.0.1:9"})
    summary_path = out / "summary.json"
    assert summary_path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out, json.loads(summary_path.read_text())
