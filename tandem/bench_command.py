"""`tandem bench NAME...`: finds the benchmark scripts and runs them through their driver.

The scripts live in the repository's benchmarks/ folder; benchmarks/_suite.py
runs each in its own process. Where they are found:

- a source checkout (this package imported from the tree, as an editable
  install does): the checkout's benchmarks/, writing to benchmarks/results/ by
  default, as when the scripts are run by hand;
- an installed wheel: the copy shipped in the package, tandem/bench_suite/
  (benchmarks/ and the examples/ that the decode and model benchmarks import;
  the `wheel.packages` table in pyproject.toml puts them there), writing to
  ./tandem-bench-results in the current directory by default, never into the
  installation.

The current directory plays no part in the choice: an installed engine always
runs the scripts of its own version.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

NAMES = ("tasks", "kernels", "overlap", "dispatch", "model", "sweep", "decode", "capture", "distributed", "service")
# What "all" runs: every name but `service` (the HTTP service under load, benchmarks/service.py), which is
# run by name until it has a plot and a schema in the suite's tests like the others.
ALL = tuple(n for n in NAMES if n != "service")
PACKAGE_DIR = Path(__file__).resolve().parent
SHIPPED_SUITE = "bench_suite"  # tandem/bench_suite/{benchmarks,examples} in a wheel
SHIPPED_DEFAULT_OUT = "tandem-bench-results"  # in the current directory


class ScriptsNotFound(RuntimeError):
    """Neither a checkout's benchmarks/ nor a shipped copy is where this package expects them."""


@dataclass(frozen=True)
class BenchScripts:
    folder: Path  # holds _suite.py and the benchmark scripts
    shipped: bool  # the copy installed with the package, not a checkout's
    default_out: Path


def _suite_folder(folder: Path) -> Path | None:
    return folder if (folder / "_suite.py").is_file() else None


def locate(*, shipped: bool = False, package_dir: Path = PACKAGE_DIR, cwd: Path | None = None) -> BenchScripts:
    """The checkout's scripts when this package runs from one (unless `shipped`), else the ones it ships.

    A checkout is the package's parent folder holding pyproject.toml and
    benchmarks/_suite.py; site-packages never holds a pyproject.toml.
    """
    root = package_dir.parent
    checkout = None if shipped or not (root / "pyproject.toml").is_file() else _suite_folder(root / "benchmarks")
    if checkout is not None:
        return BenchScripts(checkout, shipped=False, default_out=checkout / "results")
    copy = _suite_folder(package_dir / SHIPPED_SUITE / "benchmarks")
    if copy is not None:
        return BenchScripts(copy, shipped=True, default_out=(cwd or Path.cwd()) / SHIPPED_DEFAULT_OUT)
    where = "shipped with the package" if shipped else "in a checkout or shipped with the package"
    raise ScriptsNotFound(f"no benchmark scripts {where} around {package_dir} (an editable install runs the "
                          "checkout's benchmarks/; a wheel ships them under tandem/bench_suite/)")


def run(names: list[str], *, scripts: BenchScripts, out: Path | None, quick: bool, plots: bool, ray: bool,
        trace: bool) -> int:
    """Runs the named benchmarks (or all of NAMES for "all") with the driver in `scripts`; its exit code."""
    chosen = list(dict.fromkeys([n for name in names for n in (ALL if name == "all" else (name,))]))
    sys.path.insert(0, str(scripts.folder))  # the driver and the scripts import each other as siblings
    try:
        suite = importlib.import_module("_suite")
    finally:
        sys.path.remove(str(scripts.folder))
    return int(suite.run(chosen, quick=quick, out_dir=out or scripts.default_out, plots=plots, ray=ray,
                          trace=trace))
