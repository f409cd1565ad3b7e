"""scheduler.prometheus.RuntimeCollector: scraped with prometheus_client and parsed back from the text format."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import engine  # noqa: E402
from engine import Out, Scalar  # noqa: E402
from engine import kernels as K  # noqa: E402
from scheduler import AsyncRuntime, Histogram  # noqa: E402
from scheduler.prometheus import RuntimeCollector  # noqa: E402

from .conftest import Gate, _boom, eventually  # noqa: E402

pytestmark = pytest.mark.anyio

REPO = Path(__file__).resolve().parents[2]
LABELS = {"model": "minilm", "replica": "a"}
HISTOGRAMS = ("admission_wait_seconds", "orchestration_seconds", "device_seconds", "run_latency_seconds")


@engine.program(callbacks={"gate": 0})
def gated_maybe_fail(run: engine.Run, value: Scalar(float), fail: Scalar(int), out: Out((8,))):
    """Waits at the gate on the device, then out[...] = value, or a KernelError when fail."""
    run.host("gate")
    run.submit(K.fill, out=out, value=value)
    if fail:
        run.submit(_boom, out=out)


def scrape(registry: CollectorRegistry) -> dict[str, Any]:
    """{family name: family} parsed back from the text exposition."""
    return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}


def sample(families: dict[str, Any], family: str, name: str | None = None, **extra: str) -> float:
    """The one sample `name` (default: the family's own) with the constant labels plus `extra`."""
    want = {**LABELS, **extra}
    found = [s.value for s in families[family].samples if s.name == (name or family) and s.labels == want]
    assert len(found) == 1, (family, name, extra, families[family].samples)
    return float(found[0])


def check_histogram(families: dict[str, Any], name: str) -> tuple[int, float]:
    """Asserts the Prometheus histogram rules; returns (count, sum)."""
    fam = families[name]
    assert fam.type == "histogram"
    buckets = [(float(s.labels["le"]), s.value) for s in fam.samples if s.name == f"{name}_bucket"]
    assert all({k: v for k, v in s.labels.items() if k != "le"} == LABELS for s in fam.samples)
    bounds = [b for b, _ in buckets]
    assert bounds == sorted(bounds) and bounds[-1] == math.inf and len(bounds) == len(set(bounds))
    counts = [c for _, c in buckets]
    assert counts == sorted(counts)  # cumulative: never decreasing
    count = sample(families, name, f"{name}_count")
    assert counts[-1] == count
    total = sample(families, name, f"{name}_sum")
    assert total >= 0 and (total > 0) == (count > 0)
    return int(count), total


async def test_scrape_counts_histograms_and_gauges(make_rt):
    gate = Gate()
    make_rt.gates.append(gate)
    rt = make_rt(gated_maybe_fail, callbacks={"gate": gate}, depth=2)
    registry = CollectorRegistry()
    async with AsyncRuntime(rt, close_runtime=True) as art:
        registry.register(RuntimeCollector(art, labels=LABELS))
        m = scrape(registry)
        for name in ("runs_dispatched", "runs_completed", "runs_failed", "runs_cancelled"):
            assert m[f"tandem_{name}"].type == "counter"
            assert sample(m, f"tandem_{name}", f"tandem_{name}_total") == 0
        for name in HISTOGRAMS:
            assert check_histogram(m, f"tandem_{name}") == (0, 0.0)
        assert sample(m, "tandem_pipeline_depth") == 2 and sample(m, "tandem_runs_in_flight") == 0
        assert "tandem_overlap_ratio" not in m or not m["tandem_overlap_ratio"].samples  # no device work yet

        # Hold the device: one run at the gate, one queued behind it on the only worker, one dispatch waiting.
        held = await art.dispatch(1.0, 0)
        await eventually(lambda: gate.entered == 1)
        doomed = await art.dispatch(2.0, 0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(art.call, 3.0, 0)
            await eventually(lambda: art.waiting == 1)
            m = scrape(registry)
            assert sample(m, "tandem_runs_in_flight") == 2
            assert sample(m, "tandem_dispatches_waiting") == 1
            assert sample(m, "tandem_runs_dispatched", "tandem_runs_dispatched_total") == 2
            assert sample(m, "tandem_runs_completed", "tandem_runs_completed_total") == 0
            assert check_histogram(m, "tandem_run_latency_seconds")[0] == 0
            assert doomed.cancel()  # its tasks never started: a cancelled run
            gate.open()
        await held
        completed, failed = 2, 0
        for i in range(12):
            try:
                await art.call(float(i), int(i % 4 == 1))
                completed += 1
            except engine.KernelError:
                failed += 1
        await art.drain()
        stats = art.stats()
        m = scrape(registry)

    assert (stats.completed, stats.failed, stats.cancelled) == (completed, failed, 1) and failed == 3
    dispatched = completed + failed + 1
    assert stats.dispatched == dispatched
    expected = {"dispatched": dispatched, "completed": completed, "failed": failed, "cancelled": 1}
    for key, value in expected.items():
        assert sample(m, f"tandem_runs_{key}", f"tandem_runs_{key}_total") == value
    # Every run waited for admission and was orchestrated; the cancelled one neither ran nor completed.
    assert check_histogram(m, "tandem_admission_wait_seconds")[0] == dispatched
    assert check_histogram(m, "tandem_orchestration_seconds")[0] == dispatched
    assert check_histogram(m, "tandem_device_seconds")[0] == completed + failed
    latency_count, latency_sum = check_histogram(m, "tandem_run_latency_seconds")
    assert latency_count == completed + failed
    assert latency_sum >= check_histogram(m, "tandem_device_seconds")[1]
    assert sample(m, "tandem_runs_in_flight") == 0 and sample(m, "tandem_dispatches_waiting") == 0
    assert 0.0 <= sample(m, "tandem_overlap_ratio") <= 1.0

    # A closed AsyncRuntime (its runtime closed too) still scrapes, its counters as they were.
    assert art.closed and rt.closed
    after = scrape(registry)
    for key, value in expected.items():
        assert sample(after, f"tandem_runs_{key}", f"tandem_runs_{key}_total") == value
    assert check_histogram(after, "tandem_run_latency_seconds") == (latency_count, latency_sum)
    assert sample(after, "tandem_runs_in_flight") == 0


def _registry(collector: RuntimeCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(collector)
    return registry


class _FakeRuntime:
    """Just what the collector reads; stats() as a test sets it."""

    def __init__(self, art: AsyncRuntime) -> None:
        self.stats_value = art.stats()
        self.in_flight = self.waiting = 0
        self.depth = 3
        bounds = (0.001, 0.01)
        self.hist = Histogram(bounds, (1, 0, 2), 1.5, 3)  # two runs above every bound

    def stats(self) -> Any:
        return self.stats_value

    def histograms(self) -> dict[str, Histogram]:
        return dict.fromkeys(("admission_wait", "orchestration", "device", "latency"), self.hist)


def test_counters_never_go_down_and_buckets_convert(make_rt):
    """A failed write-back moves a run from completed to failed when the loop finishes it: the exported counter
    holds its value rather than drop (Prometheus would read a reset)."""
    fake = _FakeRuntime(AsyncRuntime(make_rt(gated_maybe_fail, callbacks={"gate": Gate()})))
    fake.stats_value = replace(fake.stats_value, dispatched=5, completed=5)
    registry = _registry(RuntimeCollector(fake, labels=LABELS))  # type: ignore[arg-type]
    assert sample(scrape(registry), "tandem_runs_completed", "tandem_runs_completed_total") == 5
    fake.stats_value = replace(fake.stats_value, completed=4, failed=1)
    m = scrape(registry)
    assert sample(m, "tandem_runs_completed", "tandem_runs_completed_total") == 5
    assert sample(m, "tandem_runs_failed", "tandem_runs_failed_total") == 1
    fake.stats_value = replace(fake.stats_value, dispatched=6, completed=6)
    assert sample(scrape(registry), "tandem_runs_completed", "tandem_runs_completed_total") == 6
    buckets = {s.labels["le"]: s.value for s in m["tandem_device_seconds"].samples
               if s.name == "tandem_device_seconds_bucket"}
    assert buckets == {"0.001": 1, "0.01": 1, "+Inf": 3}
    assert sample(m, "tandem_device_seconds", "tandem_device_seconds_count") == 3
    assert sample(m, "tandem_device_seconds", "tandem_device_seconds_sum") == 1.5
    assert sample(m, "tandem_pipeline_depth") == 3


def test_namespace_labels_and_registration(make_rt):
    art = AsyncRuntime(make_rt(gated_maybe_fail, callbacks={"gate": Gate()}))
    collector = RuntimeCollector(art, namespace="svc")
    described = {f.name for f in collector.describe()}
    assert described >= {"svc_runs_dispatched", "svc_run_latency_seconds", "svc_runs_in_flight",
                         "svc_overlap_ratio"}
    assert all(not f.samples for f in collector.describe())
    registry = CollectorRegistry()

    def no_early_scrape() -> Any:
        raise AssertionError("register() must describe, not collect")

    collector.collect = no_early_scrape  # type: ignore[method-assign]
    registry.register(collector)
    with pytest.raises(ValueError, match="Duplicated"):  # describe() names what it exports
        registry.register(RuntimeCollector(art, namespace="svc"))
    del collector.collect
    m = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert m["svc_runs_dispatched"].samples[0].labels == {}  # no constant labels asked for
    assert set(m) >= {f"svc_{h}" for h in HISTOGRAMS}

    for bad in ("", "1x", "a-b", "a:b", None):
        with pytest.raises(ValueError, match="namespace"):
            RuntimeCollector(art, namespace=bad)  # type: ignore[arg-type]
    for labels in ({"1x": "v"}, {"a-b": "v"}, {"__name": "v"}, {"": "v"}):
        with pytest.raises(ValueError, match="label name"):
            RuntimeCollector(art, labels=labels)
    with pytest.raises(ValueError, match="'le' is reserved"):
        RuntimeCollector(art, labels={"le": "1"})
    with pytest.raises(ValueError, match="str value"):
        RuntimeCollector(art, labels={"replica": 1})  # type: ignore[dict-item]


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_import_scheduler_does_not_import_the_optional_exporters():
    r = _python("import sys, scheduler; "
                "print(sorted(m for m in sys.modules if m.split('.')[0] in ('prometheus_client', 'opentelemetry')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_without_prometheus_client_the_import_error_says_what_to_install():
    r = _python("import sys; sys.modules['prometheus_client'] = None\n"
                "try:\n    import scheduler.prometheus\nexcept ImportError as e:\n    print(e)\n")
    assert r.returncode == 0, r.stderr
    assert "pip install 'tandem-engine[metrics]'" in r.stdout
