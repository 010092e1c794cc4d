"""Prometheus metrics of the gateway, named in llama.cpp server's style (`omlx_<name>`), and the
service discovery that points Prometheus at every node's."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from omlx_coordinator.planner import Plan
from omlx_coordinator.weight_transfer import WeightCounters
from omlx_shared.prometheus import LATENCY_BUCKETS, labelled


class _WeightCollector:
    """Reads the cluster's transfer counters at scrape time (they count every chunk sent)."""

    def __init__(self, counters: WeightCounters):
        self.counters = counters

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("omlx_weight_bytes_sent",
                                  "Weight bytes sent to nodes that lacked them",
                                  value=self.counters.bytes_sent)
        yield CounterMetricFamily("omlx_weight_files_sent",
                                  "Weight files nodes received and verified",
                                  value=self.counters.files_sent)


class GatewayMetrics:
    def __init__(self, weights: WeightCounters | None = None, model: str = "") -> None:
        """`model`: the model served, a label on every exported series."""
        self.registry = r = CollectorRegistry()
        self._exported = labelled(r, {"model": model})
        if weights is not None:
            r.register(_WeightCollector(weights))
        self.requests = Counter(
            "omlx_requests", "HTTP generation requests, by endpoint and outcome",
            ["endpoint", "outcome"], registry=r,
        )
        self.prompt_tokens = Counter("omlx_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("omlx_tokens_predicted", "Tokens generated", registry=r)
        self.running = Gauge(
            "omlx_requests_processing", "Requests that have produced their first token", registry=r
        )
        self.waiting = Gauge(
            "omlx_requests_deferred", "Requests waiting for their first token", registry=r
        )
        self.ttft = Histogram(
            "omlx_time_to_first_token_seconds", "From request to first token",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "omlx_inter_token_latency_seconds", "Between consecutive streamed tokens",
            buckets=LATENCY_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "omlx_request_duration_seconds", "Whole request", buckets=LATENCY_BUCKETS, registry=r
        )
        self.rebalances = Counter(
            "omlx_rebalances", "Layer moves of the rebalancer, by reason (imbalance, "
            "memory_pressure, manual)", ["reason"], registry=r)
        self.predicted_bottleneck = Gauge(
            "omlx_predicted_bottleneck_seconds", "The pipeline's slowest stage per decode step "
            "at the measured speeds: the current split's, and the best split's", ["plan"],
            registry=r)

    def exposition(self) -> bytes:
        """/metrics in Prometheus's text format."""
        return generate_latest(self._exported)


def prometheus_targets(nodes: list[dict], model: str, plan: Plan | None) -> list[dict]:
    """Prometheus's HTTP service discovery (`http_sd_configs`) from `Cluster.nodes`: a target
    group for each stage of the active plan whose shard worker exports metrics, labelled as
    the node labels its own series (omlx_node.metrics.IDENTITY_LABELS), so that `up` of a
    stage that stops answering says which one it is."""
    if plan is None:
        return []
    ranks = {s.node: rank for rank, s in enumerate(plan.stages)}
    return [{"targets": [n["metrics"]],
             "labels": {"node": n["id"], "model": model, "plan": plan.plan_hash,
                        "stage": str(ranks[n["id"]]), "layers": "{}:{}".format(*n["layers"])}}
            for n in nodes if n["alive"] and n["metrics"] and n["layers"] and n["id"] in ranks]
