"""The service's own Prometheus metrics (minilm_*), beside the runtime's (tandem_*, scheduler.prometheus)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from examples.minilm.batching import MicroBatcher
from examples.minilm.model import MiniLMEncoder

__all__ = ["BatcherCollector", "ObservedEncoder", "ServiceMetrics"]


class ServiceMetrics:
    """The service's own metrics (minilm_*), in the app's registry beside the runtime's (tandem_*)."""

    def __init__(self, registry: CollectorRegistry, max_batch: int) -> None:
        sizes = [float(2 ** i) for i in range(max(1, max_batch).bit_length() + 1)]  # 1, 2, 4, ... past max_batch
        self.requests = Counter("minilm_http_requests", "HTTP requests by route, method and status code.",
                                ["route", "method", "status"], registry=registry)
        self.latency = PromHistogram("minilm_http_request_duration_seconds",
                                     "Time from the request's arrival to its response, by route.", ["route"],
                                     registry=registry)
        self.in_progress = Gauge("minilm_http_requests_in_progress", "HTTP requests being handled, by route.",
                                 ["route"], registry=registry)
        self.request_texts = PromHistogram("minilm_request_texts", "Inputs per successful embeddings request.",
                                           buckets=sizes, registry=registry)
        self.run_texts = PromHistogram("minilm_run_texts", "Texts per engine run (the micro-batch size).",
                                       buckets=sizes, registry=registry)
        self.tokens = Counter("minilm_tokens", "Tokens embedded ([CLS] and [SEP] included), as reported in usage.",
                              registry=registry)


class ObservedEncoder:
    """The encoder as the batcher sees it, with every run's size observed. Looks dispatch up on each call."""

    def __init__(self, encoder: MiniLMEncoder, metrics: ServiceMetrics) -> None:
        self._encoder = encoder
        self._metrics = metrics
        self.max_batch = encoder.max_batch

    async def dispatch(self, token_lists: Sequence[np.ndarray]) -> Any:
        fut = await self._encoder.dispatch(token_lists)
        self._metrics.run_texts.observe(len(token_lists))
        return fut

    def padded_length(self, longest: int) -> int:
        return self._encoder.padded_length(longest)


class BatcherCollector:
    """The MicroBatcher's counts and queue, read at scrape time."""

    def __init__(self, batcher: MicroBatcher) -> None:
        self._batcher = batcher

    def describe(self) -> list[Metric]:
        return self._families()

    def collect(self) -> list[Metric]:
        return self._families(filled=True)

    def _families(self, filled: bool = False) -> list[Metric]:
        b, s = self._batcher, self._batcher.stats
        specs: list[tuple[type, str, str, int]] = [
            (GaugeMetricFamily, "minilm_queued_texts", "Texts waiting to be dispatched to the engine.",
             b.queued_texts),
            (GaugeMetricFamily, "minilm_queued_requests", "Requests waiting to be dispatched to the engine.",
             b.queued_requests),
            (CounterMetricFamily, "minilm_batcher_runs", "Engine runs the batcher dispatched.", s.runs),
            (CounterMetricFamily, "minilm_batcher_texts", "Texts the batcher dispatched.", s.texts),
            (CounterMetricFamily, "minilm_batcher_requests", "Requests the batcher dispatched.", s.requests),
            (CounterMetricFamily, "minilm_requests_rejected",
             "Requests refused with 503 because the queue was full (max_queue).", s.rejected),
            (CounterMetricFamily, "minilm_requests_timed_out",
             "Requests not dispatched within their deadline (504); nothing of them ran.", s.timed_out),
        ]
        return [kind(name, doc, value=value if filled else None) for kind, name, doc, value in specs]
