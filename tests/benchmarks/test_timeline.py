"""tandem.timeline on a hand-made trace (exact numbers), the progress protocol, and light imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.trace import chrome_trace
from tandem.timeline import lanes, overlap_summary, render_timeline
from tests.benchmarks.conftest import HAVE_MPL, PNG_MAGIC, ROOT

MS = 1_000_000  # ns

# Two runs at depth 2 on one worker: run 1's device task (1-3 ms) overlaps run 2's orchestration (2-3 ms).
SPANS = [(1, 0, "staging", 0, MS // 2), (1, 0, "orchestration", MS // 2, MS),
         (2, 1, "admission", MS // 2, 2 * MS), (2, 1, "orchestration", 2 * MS, 3 * MS)]
EVENTS = [(1, 0, 0, MS, 3 * MS, "spin", True), (1, 1, 0, 3 * MS, 3 * MS + MS // 2, "copy_back", True),
          (2, 0, 0, 3 * MS + MS // 2, 5 * MS, "spin", True)]


def test_overlap_summary_of_a_known_trace():
    s = overlap_summary(chrome_trace(SPANS, EVENTS, workers=1, depth=2))
    assert s["runs"] == 2
    assert s["span_ms"] == pytest.approx(5.0)
    assert s["host_busy_ms"] == pytest.approx(2.0)  # staging + two orchestrations; admission waits are not work
    assert s["device_busy_ms"] == pytest.approx(4.0)
    assert s["overlap_ms"] == pytest.approx(1.0)
    assert s["overlap_of_device"] == pytest.approx(0.25)


def test_lanes_follow_the_trace_order():
    ls = lanes(chrome_trace(SPANS, EVENTS, workers=1, depth=2)["traceEvents"])
    assert [(lane.process, lane.name) for lane in ls] == [("host", "slot 0"), ("host", "slot 1"),
                                                         ("host", "admission 0"), ("device", "worker 0")]


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib (the bench extra) draws the timeline")
def test_render_timeline_writes_a_png(tmp_path):
    out = render_timeline(chrome_trace(SPANS, EVENTS, workers=1, depth=2), tmp_path / "t.png", title="known")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_progress_lines_round_trip(monkeypatch, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import _progress
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    monkeypatch.setenv(_progress.PIPE_ENV, "pipe")
    with _progress.Progress(2, "x") as p:
        p.step("first part")
        p.step("")
    lines = capsys.readouterr().err.splitlines()
    assert [_progress.parse_pipe_line(line) for line in lines] == [(1, 2, "first part"), (2, 2, "")]
    assert _progress.parse_pipe_line("an ordinary line") is None


def imported_after(statement: str) -> set[str]:
    """The modules a fresh interpreter holds after running `statement` (which must succeed)."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return set(json.loads(proc.stdout.splitlines()[-1]))


def test_cli_import_stays_light():
    # `tandem --help` loads the command and nothing of the engine, numpy or the plotting stack.
    loaded = imported_after("import tandem.cli")
    assert "tandem.cli" in loaded
    heavy = {"engine", "engine._native", "numpy", "matplotlib", "torch", "ray"}
    assert not heavy & loaded, heavy & loaded


def test_core_never_imports_the_tooling():
    loaded = imported_after("import engine, engine.trace, engine.distributed, scheduler")
    assert "engine._native" in loaded
    assert not {m for m in loaded if m == "tandem" or m.startswith("tandem.")}
