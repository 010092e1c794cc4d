"""Prometheus metrics of the gateway, named in llama.cpp server's style (`omlx_<name>`), and the
service discovery that points Prometheus at every node's."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from omlx_coordinator.frontdoor.usage import Usage
from omlx_coordinator.nodes.weight_transfer import WeightCounters
from omlx_coordinator.planning.planner import Plan
from omlx_shared.prometheus import LATENCY_BUCKETS, labelled, merged

if TYPE_CHECKING:  # the manager imports nothing from here
    from omlx_coordinator.models.lifecycle import ModelManager

PRESSURE_LEVELS = {"normal": 0, "warn": 1, "critical": 2}


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

    def register(self, collector) -> None:
        """Adds a collector read at each scrape (its series' own model label wins)."""
        self.registry.register(collector)


def exposition(models: Sequence[GatewayMetrics]) -> bytes:
    """/metrics of every model's series in Prometheus's text format."""
    return generate_latest(merged([m._exported for m in models]))


class UsageCollector:
    """Each key's usage of each model (usage.py, kept across restarts), labelled by the key's
    name, never the key."""

    def __init__(self, usage: Usage):
        self.usage = usage

    def collect(self) -> Iterator[Metric]:
        labels = ["key", "model"]
        families = {f: CounterMetricFamily(f"omlx_key_{f}", f"{what} of the key's requests",
                                           labels=labels)
                    for f, what in (("requests", "Admitted requests"),
                                    ("prompt_tokens", "Prompt tokens"),
                                    ("cached_tokens", "Prompt tokens the prefix cache served"),
                                    ("completion_tokens", "Generated tokens"),
                                    ("errors", "Failed generations"))}
        for key, models in self.usage.totals().items():
            for model, counts in models.items():
                for f, family in families.items():
                    family.add_metric([key, model], getattr(counts, f))
        yield from families.values()


class ModelsCollector:
    """Every model's lifecycle and memory, read from the manager at scrape time: its state,
    leases, loads and unloads, and per node its workers' real footprint and MLX memory, and
    the memory each node's OS reports."""

    def __init__(self, manager: ModelManager):
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        m = self.manager
        loaded = GaugeMetricFamily("omlx_model_loaded", "1 while the model is loaded (0: "
                                   "unloaded or loading)", labels=["model"])
        state = GaugeMetricFamily("omlx_model_state", "1 for the model's state: loaded, "
                                  "loading, unloaded", labels=["model", "state"])
        leases = GaugeMetricFamily("omlx_model_leases", "Requests holding the model (never "
                                   "evicted while > 0)", labels=["model"])
        pinned = GaugeMetricFamily("omlx_model_pinned", "1 when the model is pinned",
                                   labels=["model"])
        loads = CounterMetricFamily("omlx_model_loads", "Loads of the model", labels=["model"])
        unloads = CounterMetricFamily("omlx_model_unloads", "Unloads of the model, by reason: "
                                      "evicted, ttl, pressure, request", labels=["model", "reason"])
        load_s = GaugeMetricFamily("omlx_model_load_seconds", "The model's last load, eviction "
                                   "included", labels=["model"])
        footprint = GaugeMetricFamily("omlx_model_footprint_bytes", "Real memory of the model's "
                                      "worker on a node (PSS / phys_footprint)",
                                      labels=["model", "node"])
        active = GaugeMetricFamily("omlx_model_mlx_active_bytes", "MLX active memory of the "
                                   "model's worker on a node", labels=["model", "node"])
        accepted = GaugeMetricFamily("omlx_model_speculative_acceptance_rate", "Drafted tokens "
                                     "that stood on the model's head worker on a node, since "
                                     "it started", labels=["model", "node"])
        per_step = GaugeMetricFamily("omlx_model_speculative_tokens_per_step", "Tokens a "
                                     "drafting sequence got per step there, mean since it "
                                     "started", labels=["model", "node"])
        held = GaugeMetricFamily("omlx_model_queue_held", "Requests of the model the gateway "
                                 "holds, decoding or waiting (n choices count n)", labels=["model"])
        bound = GaugeMetricFamily("omlx_model_queue_limit", "Its bound (--max-queue): past it "
                                  "requests are refused with 429", labels=["model"])
        unread = GaugeMetricFamily("omlx_model_unread_chunks_max", "The most token chunks a "
                                   "running sequence has waiting for its client to read",
                                   labels=["model"])
        running = GaugeMetricFamily("omlx_model_slots_running", "Requests holding one of the "
                                    "model's running slots, by priority class",
                                    labels=["model", "class"])
        waiting = GaugeMetricFamily("omlx_model_slots_waiting", "Requests waiting for one, by "
                                    "priority class", labels=["model", "class"])
        for model in m.models:
            waits = model.gate.waiting
            for cls, n in model.gate.running.items():
                running.add_metric([model.name, cls], n)
                waiting.add_metric([model.name, cls], waits[cls])
            loaded.add_metric([model.name], float(model.state == "loaded"))
            held.add_metric([model.name], model.admission.held)
            bound.add_metric([model.name], model.admission.limit)
            unread.add_metric([model.name], max((d.node.session.unread()
                                                 for d in m.replicas[model.name] if d.node),
                                                default=0))
            for s in ("loaded", "loading", "unloaded"):
                state.add_metric([model.name, s], float(model.state == s))
            leases.add_metric([model.name], model.leases)
            pinned.add_metric([model.name], float(model.pinned))
            loads.add_metric([model.name], model.loads)
            for reason, n in model.unloads.items():
                unloads.add_metric([model.name, reason], n)
            load_s.add_metric([model.name], model.load_seconds)
        available = GaugeMetricFamily("omlx_cluster_node_memory_available_bytes", "Memory the "
                                      "node's OS could give now", labels=["node"])
        total = GaugeMetricFamily("omlx_cluster_node_memory_total_bytes", "The node's memory",
                                  labels=["node"])
        pressure = GaugeMetricFamily("omlx_cluster_node_memory_pressure", "The node's memory "
                                     "pressure: 0 normal, 1 warn, 2 critical", labels=["node"])
        for node in m.cluster.members:
            h = node.health
            if h is None:
                continue
            for w in h.workers:
                footprint.add_metric([w.model_id, node.name], w.footprint_bytes)
                active.add_metric([w.model_id, node.name], w.mlx_active_bytes)
                if w.rank == 0:
                    accepted.add_metric([w.model_id, node.name], w.speculative_acceptance_rate)
                    per_step.add_metric([w.model_id, node.name], w.speculative_tokens_per_step)
            if h.memory_total_bytes:
                available.add_metric([node.name], h.memory_available_bytes)
                total.add_metric([node.name], h.memory_total_bytes)
                pressure.add_metric([node.name], PRESSURE_LEVELS.get(h.memory_pressure, 0))
        yield from (loaded, state, leases, pinned, loads, unloads, load_s, footprint, active,
                    accepted, per_step, available, total, pressure, held, bound, unread, running, waiting)


def prometheus_targets(nodes: list[dict], plans: list[tuple[str, Plan]]) -> list[dict]:
    """Prometheus's HTTP service discovery (`http_sd_configs`) from `Cluster.nodes`: a target
    group for each stage of each model's active plan (`plans`: model name, plan) whose shard
    worker exports metrics, labelled as the node labels its own series
    (omlx_node.metrics.IDENTITY_LABELS), so that `up` of a stage that stops answering says
    which one it is."""
    alive = {n["id"]: n for n in nodes if n["alive"]}
    out = []
    for model, plan in plans:
        for rank, s in enumerate(plan.stages):
            node = alive.get(s.node)
            worker = next((w for w in node["workers"] if w["model"] == model),
                          None) if node else None
            if worker is None or not worker["metrics"]:
                continue
            out.append({"targets": [worker["metrics"]],
                        "labels": {"node": s.node, "model": model, "plan": plan.plan_hash,
                                   "stage": str(rank),
                                   "layers": f"{s.layer_start}:{s.layer_end}"}})
    return out
