"""What the node's and the gateway's Prometheus metrics share: latency buckets, and the labels
that say which model (and, on a node, which stage of which plan) every exported series is of.

Names use underscores only (`omlx_...`, `omlx_node_...`): colons are reserved for recording
rules (Prometheus's naming rules; `promtool check metrics` flags them), and prometheus-client
escapes them to underscores whenever Prometheus asks for OpenMetrics, so a dashboard that asks
for the colon name finds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import RestrictedRegistry

# 5 ms (a decode step on a Mac) to 2 min (a cold long prefill); shared, so that dashboards can
# put the node's and the gateway's latencies on one panel.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _Labelled:
    """Every series of `source`, with `labels` added (a series' own labels win)."""

    def __init__(self, source: CollectorRegistry | RestrictedRegistry,
                 labels: Mapping[str, str]):
        self.source, self.labels = source, dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels={**self.labels, **s.labels})
                           for s in family.samples]
            yield out


class _Exported(CollectorRegistry):
    """`labelled`'s registry. A scrape that names series (`/metrics?name[]=...`, as the node
    agent's probe and the rebalancer ask) gets only those, and runs only the collectors that
    export them: a full render, and the worker's PSS walk, cost an idle node's CPU at every
    probe."""

    def __init__(self, source: CollectorRegistry | RestrictedRegistry,
                 labels: Mapping[str, str]):
        super().__init__(auto_describe=False)
        self.source, self.labels = source, labels
        self.register(_Labelled(source, labels))

    def restricted_registry(self, names: Iterable[str]) -> CollectorRegistry:
        return _Exported(self.source.restricted_registry(names), self.labels)


def labelled(source: CollectorRegistry, labels: Mapping[str, str]) -> CollectorRegistry:
    """A registry to export: `source`'s series, read at each scrape, each with `labels`.

    The metrics themselves stay unlabelled, so the code that counts never names its stage, and
    tests read a registry's values by their own labels."""
    return _Exported(source, labels)


class _Merged:
    """The series of several registries; families of the same name become one."""

    def __init__(self, sources: Sequence[CollectorRegistry]):
        self.sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for source in self.sources:
            for family in source.collect():
                out = families.get(family.name)
                if out is None:
                    out = families[family.name] = Metric(family.name, family.documentation,
                                                         family.type, family.unit)
                out.samples.extend(family.samples)
        yield from families.values()


def merged(sources: Sequence[CollectorRegistry]) -> CollectorRegistry:
    """One registry to export several from (each model's, each labelled with its model): the
    text format allows one HELP and TYPE per name, so same-named families are joined."""
    exported = CollectorRegistry(auto_describe=False)
    exported.register(_Merged(sources))
    return exported
