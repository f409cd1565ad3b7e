"""benchmarks/dispatch.py runs end to end and reports the figures it promises; a generous guard on its depth-8 ratio."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import anyio
import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "dispatch.py"


def load_benchmark():
    saved = list(sys.path)
    sys.path.insert(0, str(BENCH.parent))  # for its `_common` import
    try:
        spec = importlib.util.spec_from_file_location("dispatch_benchmark", BENCH)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved
    return mod


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_dispatch_benchmark_smoke(tmp_path, capsys, backend):
    mod = load_benchmark()
    out = tmp_path / "dispatch.json"
    figures = mod.main(["--ops", "100", "--reps", "1", "--backend", backend, "--json", str(out)])
    assert [e["depth"] for e in figures["depths"]] == [1, 2, 4, 8]
    for e in figures["depths"]:
        assert e["floor"]["median"] > 0 and e["engine"]["median"] > 0
        assert e["cost_ratio"] == pytest.approx(e["engine"]["median"] / e["floor"]["median"])
        if backend == "asyncio":
            assert e["asyncio_to_thread"]["median"] > 0 and e["thread_pool_executor"]["median"] > 0
    assert set(figures["targets"]) >= {"depth1_cost_ratio", "depth8_rate_ratio", "depth1_met", "depth8_met"}
    assert json.loads(out.read_text())["figures"]["backend"] == backend
    assert "engine/floor" in capsys.readouterr().out


@pytest.mark.skipif(bool(os.environ.get("TANDEM_SANITIZER")), reason="a sanitizer's instrumentation skews the ratio")
def test_a_pipelined_dispatch_costs_the_loop_at_most_a_few_times_the_floor():
    """The loop thread's CPU per dispatch at depth 8, engine over floor, best of interleaved short trials.

    A regression guard with a generous margin, not the target (benchmarks/dispatch.py
    measures that): about 1.8 here when this was written, 2.6-3.2 before the per-run
    work moved to native code. CPU time of the loop thread, not wall time, so that
    waits on a shared machine do not count.
    """
    mod = load_benchmark()
    rt = mod.one_noop.prepare(depth=8, workers=1)
    floor = mod.NativeFloor()

    async def measure() -> tuple[float, float]:
        best = {"floor": float("inf"), "engine": float("inf")}
        async with mod.AsyncRuntime(rt) as art:
            await mod.engine_rate(art, 500, 8)
            await floor.run(500, 8)
            for _ in range(15):
                for name in ("floor", "engine"):
                    c0 = time.thread_time()
                    if name == "floor":
                        await floor.run(2000, 8)
                    else:
                        await mod.engine_rate(art, 2000, 8)
                    best[name] = min(best[name], time.thread_time() - c0)
        return best["engine"], best["floor"]

    try:
        engine_cpu, floor_cpu = anyio.run(measure)
    finally:
        floor.close()
        rt.close()
    print(f"\n[dispatch guard] engine {engine_cpu * 500:.2f} us/op, floor {floor_cpu * 500:.2f} us/op of loop CPU")
    assert engine_cpu <= 3.5 * floor_cpu, f"engine {engine_cpu * 500:.2f} us/op vs floor {floor_cpu * 500:.2f} us/op"
