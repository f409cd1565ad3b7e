"""The tooling away from the checkout: where `tandem bench` finds its scripts, and that they run from there.

An installed wheel carries the benchmark scripts (and the examples two of them
import) under tandem/bench_suite/, as pyproject.toml's wheel.packages table
maps them. These tests lay that part of the wheel out from the same table in a
temporary folder with no checkout around it and run the scripts from there;
.ci/run also builds a real wheel, installs it into a fresh venv and runs
`tandem bench tasks --quick` from a temporary directory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem import bench_command
from tests.benchmarks.conftest import ROOT, tandem

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the checks do not depend on the version

pytestmark = pytest.mark.timeout(300)


def wheel_packages() -> dict[str, str]:
    """pyproject.toml's wheel.packages: {path in the wheel: source folder in the checkout}."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["scikit-build"]["wheel"]["packages"]
    assert isinstance(packages, dict), "wheel.packages maps wheel paths to source folders"
    return packages


def lay_out_tooling(site: Path) -> Path:
    """The tandem package as a wheel lays it out (its Python files and the shipped suite) under `site`."""
    for target, source in wheel_packages().items():
        if target == "tandem" or target.startswith("tandem/"):
            shutil.copytree(ROOT / source, site / target, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "results", "*.so"))
    return site / "tandem"


def test_the_wheel_ships_the_suite_and_the_examples_it_imports():
    packages = wheel_packages()
    assert packages["tandem/bench_suite/benchmarks"] == "benchmarks"
    assert packages["tandem/bench_suite/examples"] == "examples"  # decode.py and model.py import examples.*
    assert bench_command.SHIPPED_SUITE == "bench_suite"


def test_in_a_checkout_the_checkout_scripts_and_results_folder(tmp_path):
    scripts = bench_command.locate(cwd=tmp_path)
    assert scripts == bench_command.BenchScripts(ROOT / "benchmarks", shipped=False,
                                                 default_out=ROOT / "benchmarks" / "results")


def test_without_a_checkout_the_shipped_scripts_and_a_folder_in_the_cwd(tmp_path):
    package = lay_out_tooling(tmp_path / "site")
    scripts = bench_command.locate(package_dir=package, cwd=tmp_path / "work")
    assert scripts == bench_command.BenchScripts(package / "bench_suite" / "benchmarks", shipped=True,
                                                 default_out=tmp_path / "work" / "tandem-bench-results")


def test_the_shipped_scripts_when_told_even_in_a_checkout(tmp_path):
    checkout = tmp_path / "checkout"
    package = lay_out_tooling(checkout)
    (checkout / "pyproject.toml").write_text("")
    shutil.copytree(ROOT / "benchmarks", checkout / "benchmarks", ignore=shutil.ignore_patterns("__pycache__",
                                                                                                "results"))
    assert bench_command.locate(package_dir=package).folder == checkout / "benchmarks"
    told = bench_command.locate(package_dir=package, shipped=True, cwd=tmp_path)
    assert told.shipped and told.folder == package / "bench_suite" / "benchmarks"
    # A folder named benchmarks beside the package is no checkout without a pyproject.toml.
    (checkout / "pyproject.toml").unlink()
    assert bench_command.locate(package_dir=package).shipped


def test_no_scripts_anywhere_is_a_clear_error(tmp_path):
    (tmp_path / "tandem").mkdir()
    with pytest.raises(bench_command.ScriptsNotFound, match="no benchmark scripts"):
        bench_command.locate(package_dir=tmp_path / "tandem")


def test_shipped_scripts_run_with_no_checkout_around(tmp_path):
    """The decode benchmark (sibling imports, examples.decoder) from the shipped layout, cwd elsewhere."""
    package = lay_out_tooling(tmp_path / "site")
    work = tmp_path / "work"
    work.mkdir()
    code = ("import sys; from pathlib import Path; from tandem import bench_command as b; "
            "scripts = b.locate(package_dir=Path(sys.argv[1])); assert scripts.shipped, scripts; "
            "sys.exit(b.run(['decode'], scripts=scripts, out=None, quick=True, plots=False, ray=False, trace=False))")
    proc = subprocess.run([sys.executable, "-c", code, str(package)], cwd=work, capture_output=True, text=True,
                          timeout=240)
    out = work / "tandem-bench-results"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"]["decode"]["status"] == "ok"
    assert json.loads((out / "decode.json").read_text())["figures"]["speedup_depth2_over_depth1"] > 0
    command = (out / "decode.log").read_text().splitlines()[0]
    assert str(package / "bench_suite" / "benchmarks" / "decode.py") in command, command


def test_bench_and_trace_from_another_directory(tmp_path):
    """`tandem bench` and `tandem trace` with relative output paths, run outside the checkout."""
    proc = tandem("bench", "tasks", "--quick", "--no-plots", "--out", "bench-out", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "bench-out" / "tasks.json").read_text())["figures"]
    assert {g["shape"] for g in figures["graphs"]} == {"wide", "chain"}
    assert json.loads((tmp_path / "bench-out" / "summary.json").read_text())["benchmarks"]["tasks"]["status"] == "ok"

    proc = tandem("trace", "overlap", "--runs", "4", cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = json.loads((tmp_path / "trace_overlap.json").read_text())["traceEvents"]
    assert sum(1 for e in events if e.get("cat") == "run") == 4
