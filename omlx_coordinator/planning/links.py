"""The measured links between nodes, as the planner counts them.

A node's links are measured when it joins (omlx_coordinator/nodes/link_survey.py runs
`doctor`'s link probe, omlx_shared/link_probe.py, between it and every other member), and again
once old while the cluster is quiet (omlx_coordinator/nodes/link_freshness.py). The
planner's cost model reads one link a node (NodeSpec.link_ms and link_gbps: towards the next
node of the ring, the one a pipeline stage sends to and a ring all_sum passes through), so each
node gets the measurement of the link to its successor in the order planned. A link not
measured (a node alone, a probe that failed) keeps what the NodeSpec says already. Pure: no
I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from omlx_coordinator.planning.planner import NodeSpec
from omlx_shared.link_probe import LinkMeasurement

# The measured links, each under the pair of node names it joins (a link is symmetric).
MeasuredLinks = Mapping[frozenset[str], LinkMeasurement]


def link_key(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


def with_links(nodes: Sequence[NodeSpec], links: MeasuredLinks) -> list[NodeSpec]:
    """`nodes` (in ring order) with each one's link to the next as measured in `links`."""
    out = list(nodes)
    if len(nodes) < 2:
        return out
    for i, nd in enumerate(nodes):
        link = links.get(link_key(nd.name, nodes[(i + 1) % len(nodes)].name))
        if link is not None:
            out[i] = replace(nd, link_ms=link.latency_us / 1e3, link_gbps=link.gb_per_s)
    return out
