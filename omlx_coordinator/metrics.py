"""Prometheus metrics of the gateway, named in llama.cpp server's style (`omlx:<name>`)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from omlx_coordinator.weight_transfer import WeightCounters
from omlx_shared.metric_buckets import LATENCY_BUCKETS


class _WeightCollector:
    """Reads the cluster's transfer counters at scrape time (they count every chunk sent)."""

    def __init__(self, counters: WeightCounters):
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("omlx:weight_bytes_sent",
                                  "Weight bytes sent to nodes that lacked them",
                                  value=self.counters.bytes_sent)
        yield CounterMetricFamily("omlx:weight_files_sent",
                                  "Weight files nodes received and verified",
                                  value=self.counters.files_sent)


class GatewayMetrics:
    def __init__(self, weights: WeightCounters | None = None) -> None:
        self.registry = r = CollectorRegistry()
        if weights is not None:
            r.register(_WeightCollector(weights))
        self.requests = Counter(
            "omlx:requests", "HTTP generation requests, by endpoint and outcome",
            ["endpoint", "outcome"], registry=r,
        )
        self.prompt_tokens = Counter("omlx:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("omlx:tokens_predicted", "Tokens generated", registry=r)
        self.running = Gauge(
            "omlx:requests_processing", "Requests that have produced their first token", registry=r
        )
        self.waiting = Gauge(
            "omlx:requests_deferred", "Requests waiting for their first token", registry=r
        )
        self.ttft = Histogram(
            "omlx:time_to_first_token_seconds", "From request to first token",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "omlx:inter_token_latency_seconds", "Between consecutive streamed tokens",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "omlx:request_duration_seconds", "Whole request", buckets=LATENCY_BUCKETS, registry=r
        )
