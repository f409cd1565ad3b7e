"""benchmarks/dispatch.py runs end to end and reports the figures it promises (tiny sizes: no timing checks)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "dispatch.py"


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_dispatch_benchmark_smoke(tmp_path, capsys, backend):
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH.parent))  # for its `_common` import
    try:
        spec = importlib.util.spec_from_file_location("dispatch_benchmark", BENCH)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out = tmp_path / "dispatch.json"
        figures = mod.main(["--ops", "100", "--reps", "1", "--backend", backend, "--json", str(out)])
    finally:
        sys.path[:] = saved
    assert [e["depth"] for e in figures["depths"]] == [1, 2, 4, 8]
    for e in figures["depths"]:
        assert e["floor"]["median"] > 0 and e["engine"]["median"] > 0
        assert e["cost_ratio"] == pytest.approx(e["engine"]["median"] / e["floor"]["median"])
        if backend == "asyncio":
            assert e["asyncio_to_thread"]["median"] > 0 and e["thread_pool_executor"]["median"] > 0
    assert set(figures["targets"]) >= {"depth1_cost_ratio", "depth8_rate_ratio", "depth1_met", "depth8_met"}
    assert json.loads(out.read_text())["figures"]["backend"] == backend
    assert "engine/floor" in capsys.readouterr().out
