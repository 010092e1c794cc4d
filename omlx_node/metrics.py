"""Prometheus metrics of a node, named in llama.cpp server's style (`omlx_node:<name>`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from omlx_shared.metric_buckets import LATENCY_BUCKETS



class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("omlx_node:requests", "Sequences submitted", registry=r)
        self.finished = Counter(
            "omlx_node:requests_finished", "Sequences finished, by reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("omlx_node:prompt_tokens", "Prompt tokens received", registry=r)
        self.generated_tokens = Counter(
            "omlx_node:tokens_predicted", "Tokens generated", registry=r
        )
        self.running = Gauge("omlx_node:requests_processing", "Sequences decoding", registry=r)
        self.waiting = Gauge(
            "omlx_node:requests_deferred", "Sequences queued or prefilling", registry=r
        )
        self.ttft = Histogram(
            "omlx_node:time_to_first_token_seconds",
            "From submission to the first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "omlx_node:inter_token_latency_seconds",
            "Between consecutive tokens of a sequence",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.micro_batches = Gauge(
            "omlx_node:micro_batches", "Micro-batches the pipeline head spreads new sequences "
            "over (1: lockstep)", registry=r
        )
        self.load_seconds = Gauge("omlx_node:shard_load_seconds", "Time to load the shard", registry=r)
        self.shard_bytes = Gauge("omlx_node:shard_bytes", "Weight bytes of the loaded shard", registry=r)

    def serve(self, host: str, port: int) -> int:
        """Exports /metrics over HTTP; returns the bound port (useful when port is 0)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        return server.server_port
