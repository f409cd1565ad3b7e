"""scheduler.otel.RunSpanExporter: one span tree per finished run, into the OpenTelemetry SDK's in-memory exporter."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterator

import anyio
import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402

import engine  # noqa: E402
from scheduler import AsyncRuntime  # noqa: E402
from scheduler.otel import RunSpanExporter  # noqa: E402

from .conftest import eventually, maybe_fail  # noqa: E402

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
PHASES = ("admission", "orchestration", "device", "completion")


@pytest.fixture
def memory() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def trees(spans: Any) -> dict[int, tuple[Any, dict[str, Any]]]:
    """{run seq: (root span, {child name: child span})}, checking the links on the way."""
    roots = {s.context.span_id: s for s in spans if s.name == "tandem.run"}
    children: dict[int, dict[str, Any]] = defaultdict(dict)
    for s in spans:
        if s.name == "tandem.run":
            assert s.parent is None
            continue
        assert s.name in PHASES and s.parent is not None
        root = roots[s.parent.span_id]
        assert s.context.trace_id == root.context.trace_id
        assert s.name not in children[root.context.span_id]  # one of each per run
        children[root.context.span_id][s.name] = s
    out = {}
    for span_id, root in roots.items():
        seq = root.attributes["tandem.run.seq"]
        assert seq not in out  # nothing exported twice
        out[seq] = (root, children[span_id])
    return out


async def test_each_run_is_a_span_with_its_phases(make_rt, memory):
    provider, exported = memory
    rt = make_rt(maybe_fail, depth=2)
    async with AsyncRuntime(rt) as art:
        spans = RunSpanExporter(art, tracer_provider=provider, attributes={"model": "minilm"})
        assert spans.flush() == 0 and exported.get_finished_spans() == ()
        wall_before = time.time_ns()
        outcomes = []
        for i in range(6):
            try:
                await art.call(float(i), int(i == 2))
                outcomes.append("completed")
            except engine.KernelError:
                outcomes.append("failed")
        fut = await art.dispatch(1.0, 0)
        fut.cancel()
        await art.drain()
        outcomes.append(art.run_records(6)[0].outcome)  # cancelled, unless the device was quicker
        assert spans.flush() == 7
        wall_after = time.time_ns()
        assert spans.flush() == 0  # nothing new: nothing exported twice

    runs = trees(exported.get_finished_spans())
    assert sorted(runs) == list(range(7))
    assert (spans.exported, spans.dropped) == (7, 0)
    for seq, (root, phases) in runs.items():
        assert root.attributes["tandem.run.outcome"] == outcomes[seq]
        assert root.attributes["model"] == "minilm"
        assert "tandem.runs_dropped" not in root.attributes
        # Engine clock mapped onto the epoch: within the wall-clock window of the runs (1 ms for the mapping's
        # own error, the spread of the two engine clock reads around the wall clock's).
        assert wall_before - 1_000_000 <= root.start_time <= root.end_time <= wall_after + 1_000_000
        expected = set(PHASES) if outcomes[seq] != "cancelled" else set(PHASES) - {"device"}
        if outcomes[seq] == "cancelled" and "device" in phases:
            expected.add("device")  # its task had started before the cancel arrived
        assert set(phases) == expected
        for child in phases.values():
            assert child.start_time <= child.end_time
        if "device" in phases:  # its tasks' own time, within the span that also covers the gaps between them
            device = phases["device"]
            assert 0 <= device.attributes["tandem.device.busy_ns"] <= device.end_time - device.start_time
        assert root.start_time == phases["admission"].start_time
        assert phases["admission"].end_time <= phases["orchestration"].start_time
        assert phases["completion"].end_time == root.end_time
        if outcomes[seq] == "failed":
            assert root.status.status_code is StatusCode.ERROR
        else:
            assert root.status.status_code is StatusCode.UNSET
    assert outcomes.count("failed") == 1


async def test_runs_that_left_the_window_unread_are_counted_dropped(make_rt, memory):
    provider, exported = memory
    rt = make_rt(maybe_fail, depth=2)
    async with AsyncRuntime(rt, metrics_window=2) as art:
        spans = RunSpanExporter(art, tracer_provider=provider)
        for i in range(5):
            await art.call(float(i), 0)
        assert spans.flush() == 2  # runs 0..2 left the window of 2 before the first read
        assert spans.dropped == 3
        await art.call(5.0, 0)
        assert spans.flush() == 1 and spans.dropped == 3  # read on in time: nothing more lost
        for i in range(3):
            await art.call(float(i), 0)
        assert spans.flush() == 2 and spans.dropped == 4
    runs = trees(exported.get_finished_spans())
    assert sorted(runs) == [3, 4, 5, 7, 8]
    assert runs[3][0].attributes["tandem.runs_dropped"] == 3
    assert runs[7][0].attributes["tandem.runs_dropped"] == 1
    assert all("tandem.runs_dropped" not in runs[s][0].attributes for s in (4, 5, 8))
    assert spans.exported == 5


async def test_run_loop_exports_in_the_background_and_on_stop(gated_rt, memory):
    provider, exported = memory
    rt, gate = gated_rt(depth=2)
    async with AsyncRuntime(rt) as art:
        polling = RunSpanExporter(art, tracer_provider=provider, interval=0.01)
        asleep = RunSpanExporter(art, interval=3600.0)  # the global (no-op) provider: counts only
        async with anyio.create_task_group() as tg:
            await tg.start(polling.run)
            await tg.start(asleep.run)
            gate.open()
            for i in range(3):
                await art.call(float(i))
            await eventually(lambda: polling.exported == 3)
            assert asleep.exported == 0
            tg.cancel_scope.cancel()  # both read once more as they stop
    assert polling.exported == asleep.exported == 3
    assert sorted(trees(exported.get_finished_spans())) == [0, 1, 2]


def test_interval_is_checked(make_rt):
    art = AsyncRuntime(make_rt(maybe_fail))
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ValueError, match="interval"):
            RunSpanExporter(art, interval=bad)  # type: ignore[arg-type]


def test_without_opentelemetry_the_import_error_says_what_to_install():
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "try:\n    import scheduler.otel\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install 'tandem-engine[otel]'" in r.stdout
