"""Prometheus metrics of an AsyncRuntime: a prometheus_client custom collector.

    from prometheus_client import CollectorRegistry, generate_latest
    from scheduler.prometheus import RuntimeCollector

    registry = CollectorRegistry()
    registry.register(RuntimeCollector(art, labels={"model": "minilm"}))
    body = generate_latest(registry)   # what GET /metrics serves

Every value is read from the runtime when the registry is scraped
(AsyncRuntime.stats(), histograms(), in_flight, waiting, depth): the collector
keeps no copy of them. With the default namespace "tandem":

counters (every run since the AsyncRuntime was made; see scheduler.Stats)
  tandem_runs_dispatched_total   runs admitted and orchestrated. A dispatch that
                                 timed out or was cancelled waiting for a slot, or
                                 whose arguments or orchestration raised, is no run
  tandem_runs_completed_total    runs the device finished whose outputs were written back
  tandem_runs_failed_total       runs that raised: a failing kernel or host task, or a
                                 write-back into the caller's array that failed
  tandem_runs_cancelled_total    runs cancelled after admission (RunFuture.cancel(),
                                 a cancelled call() or stream()), counted once the
                                 device let go of them
  A run counts as completed, failed or cancelled from the moment the device is
  done with it, so dispatched - completed - failed - cancelled is the number of
  runs the device still holds.

histograms (seconds, over every run, in the runtime's fixed buckets: 10 us doubling to about 10.5 s)
  tandem_admission_wait_seconds  dispatch call to slot lease, every run
  tandem_orchestration_seconds   orchestration start to sealed run (staging included), every run
  tandem_device_seconds          first task start to last task end, completed and failed runs
                                 that ran a task (not cancelled ones)
  tandem_run_latency_seconds     dispatch call to completion (copy-back included), completed
                                 and failed runs (not cancelled ones)

gauges
  tandem_runs_in_flight          AsyncRuntime.in_flight: runs holding a slot until the event
                                 loop has finished them (it can trail the counters by a
                                 loop turn)
  tandem_dispatches_waiting      AsyncRuntime.waiting: dispatches queued for a slot
  tandem_pipeline_depth          AsyncRuntime.depth: the slots
  tandem_overlap_ratio           Stats.overlap_ratio over the recent runs (metrics_window):
                                 absent until the device did any work, since a made-up
                                 value would read as a measurement and NaN breaks graphs

Every sample carries the constant `labels`. A closed AsyncRuntime still scrapes:
the counters and histograms stay as they were, nothing is in flight. One
scrape reads stats() and histograms() one after the other, so a run finishing
in between may show in one and not yet in the other. collect() only reads
the runtime (counts under the native log's lock, sizes of loop-side queues),
so it is safe from the thread of prometheus_client.start_http_server.
"""

from __future__ import annotations

import math
import re
import threading
from typing import TYPE_CHECKING, Iterator, Mapping

try:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
    from prometheus_client.utils import floatToGoString
except ImportError as e:  # an optional extra: the core library does not need it
    raise ImportError(f"scheduler.prometheus needs prometheus_client ({e}): pip install 'tandem-engine[metrics]'") \
        from e

if TYPE_CHECKING:
    from scheduler._metrics import Histogram
    from scheduler.runtime import AsyncRuntime

__all__ = ["RuntimeCollector"]

# Prometheus' classic name rules (what every scraper and query accepts).
_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# (histograms() key, metric name after the namespace, help)
_HISTOGRAMS = (
    ("admission_wait", "admission_wait_seconds", "Time from the dispatch call to the slot lease, every run."),
    ("orchestration", "orchestration_seconds",
     "Time from the start of orchestration to the sealed run, staging included, every run."),
    ("device", "device_seconds",
     "Time from a run's first task start to its last task end, completed and failed runs that ran."),
    ("latency", "run_latency_seconds",
     "Time from the dispatch call to the run's completion, copy-back included, completed and failed runs."),
)
_COUNTERS = (
    ("dispatched", "runs_dispatched", "Runs admitted and orchestrated."),
    ("completed", "runs_completed", "Runs completed with their outputs written back."),
    ("failed", "runs_failed", "Runs failed: a failing kernel or host task, or a failed write-back."),
    ("cancelled", "runs_cancelled", "Runs cancelled after admission."),
)


class RuntimeCollector:
    """Exports an AsyncRuntime's counts, duration histograms and pipeline gauges (see the module docstring).

    namespace: the prefix of every metric name. labels: constant labels on
    every sample (e.g. {"model": "minilm"} when one process serves several).
    """

    def __init__(self, art: "AsyncRuntime", *, namespace: str = "tandem",
                 labels: Mapping[str, str] | None = None) -> None:
        if not isinstance(namespace, str) or not _NAME.fullmatch(namespace):
            raise ValueError(f"namespace must be a Prometheus name ([a-zA-Z_][a-zA-Z0-9_]*), got {namespace!r}")
        labels = dict(labels or {})
        for name, value in labels.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name) or name.startswith("__"):
                raise ValueError(f"label name {name!r} is not a Prometheus label name "
                                 "([a-zA-Z_][a-zA-Z0-9_]*, not starting with __)")
            if name == "le":
                raise ValueError("label name 'le' is reserved for the histograms' buckets")
            if not isinstance(value, str):
                raise ValueError(f"label {name!r} must have a str value, got {type(value).__name__} {value!r}")
        self._art = art
        self._ns = namespace
        self._label_names = list(labels)
        self._label_values = list(labels.values())
        # stats() moves a run whose write-back failed from completed to failed when the loop finishes it: a
        # scrape in between would see completed go down, which Prometheus takes for a counter reset. So the
        # exported value never goes below the highest one exported.
        self._completed_floor = 0
        self._lock = threading.Lock()  # scrapes may come from several threads

    def describe(self) -> Iterator[Metric]:
        """The metric families without samples: registering reads names here instead of scraping early."""
        counters, histograms, gauges = self._families()
        return iter([*counters, *histograms, *gauges])

    def collect(self) -> Iterator[Metric]:
        art = self._art
        stats = art.stats()
        counters, histograms, gauges = self._families()
        values = {"dispatched": stats.dispatched, "completed": stats.completed, "failed": stats.failed,
                  "cancelled": stats.cancelled}
        with self._lock:
            values["completed"] = self._completed_floor = max(self._completed_floor, stats.completed)
        for (key, _, _), counter in zip(_COUNTERS, counters):
            counter.add_metric(self._label_values, values[key])
            yield counter
        hists = art.histograms()
        for (key, _, _), histogram in zip(_HISTOGRAMS, histograms):
            h = hists[key]
            histogram.add_metric(self._label_values, _cumulative(h), h.sum)
            yield histogram
        in_flight, waiting, depth, overlap = gauges
        for gauge, value in ((in_flight, art.in_flight), (waiting, art.waiting), (depth, art.depth)):
            gauge.add_metric(self._label_values, value)
            yield gauge
        if stats.overlap_ratio is not None:
            overlap.add_metric(self._label_values, stats.overlap_ratio)
            yield overlap

    def _families(self) -> tuple[list[CounterMetricFamily], list[HistogramMetricFamily], list[GaugeMetricFamily]]:
        ns, labels = self._ns, self._label_names
        counters = [CounterMetricFamily(f"{ns}_{name}", doc, labels=labels) for _, name, doc in _COUNTERS]
        histograms = [HistogramMetricFamily(f"{ns}_{name}", doc, labels=labels, unit="seconds")
                      for _, name, doc in _HISTOGRAMS]
        gauges = [
            GaugeMetricFamily(f"{ns}_runs_in_flight", "Runs holding a pipeline slot.", labels=labels),
            GaugeMetricFamily(f"{ns}_dispatches_waiting", "Dispatches waiting for a pipeline slot.", labels=labels),
            GaugeMetricFamily(f"{ns}_pipeline_depth", "Pipeline slots: runs that may be in flight at once.",
                              labels=labels),
            GaugeMetricFamily(f"{ns}_overlap_ratio",
                              "Share of the device's busy time during which the host was orchestrating, over the "
                              "recent runs; absent before any device work.", labels=labels),
        ]
        return counters, histograms, gauges

    def __repr__(self) -> str:
        return f"<RuntimeCollector {self._ns} {dict(zip(self._label_names, self._label_values))} of {self._art!r}>"


def _cumulative(h: "Histogram") -> list[tuple[str, float]]:
    """Prometheus buckets from the runtime's per-bucket counts: cumulative, le-labelled, ending in +Inf.

    The overflow bucket only enters the +Inf total, which is therefore the
    histogram's count (HistogramMetricFamily derives _count from it).
    """
    out: list[tuple[str, float]] = []
    total = 0
    for bound, n in zip(h.bounds, h.counts):
        total += n
        out.append((floatToGoString(bound), total))
    out.append((floatToGoString(math.inf), total + sum(h.counts[len(h.bounds):])))
    return out
