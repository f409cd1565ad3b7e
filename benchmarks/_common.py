"""Shared plumbing for the benchmarks: repetitions, medians, environment, JSON."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

RESULTS_DIR = Path(__file__).parent / "results"


def run_worker(script: str, args: list[str]) -> dict[str, Any]:
    """Runs `script args --out FILE` in a fresh interpreter (one engine alone in its process, from the
    directory above benchmarks/, where examples/ is) and returns the JSON the worker wrote to FILE."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        subprocess.run([sys.executable, script, *args, "--out", str(out)], check=True,
                       cwd=Path(script).resolve().parents[1])
        return json.loads(out.read_text())


def repeat(fn: Callable[[], float], reps: int, warmup: int = 1) -> dict[str, float]:
    """Runs fn (which returns one measurement) warmup + reps times; median and spread."""
    for _ in range(warmup):
        fn()
    return spread([fn() for _ in range(reps)])


def spread(values: list[float]) -> dict[str, float]:
    """Median and spread of repeated measurements."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
        "reps": len(values),
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_idle() -> dict[str, Any]:
    """The kernel's idle driver, and on a KVM guest with `haltpoll` how long an idle vCPU polls before it
    halts. How long a thread that wakes a sleeping one waits depends on it: a halted vCPU must be kicked
    by the hypervisor (tens of us here, paid by the waker: a pool worker announcing a completion)."""
    def read(path: str) -> str | None:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return None

    poll_ns = read("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    return {"driver": read("/sys/devices/system/cpu/cpuidle/current_driver"),
            "guest_halt_poll_ns": int(poll_ns) if poll_ns is not None and poll_ns.isdigit() else None}


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_version() -> str:
    """The installed tandem-engine's version: what an installed copy of these scripts measures (no git there)."""
    try:
        return importlib.metadata.version("tandem-engine")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def environment() -> dict[str, Any]:
    import numpy

    env: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cpuidle": cpu_idle(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "tandem": package_version(),
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import torch

        env["torch"] = torch.__version__
    except ImportError:
        env["torch"] = None
    return env


def write_json(name: str, figures: dict[str, Any], path: str | os.PathLike[str] | None = None) -> Path:
    out = Path(path) if path else RESULTS_DIR / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": name, "environment": environment(), "figures": figures}, indent=2))
    return out


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
