"""The measured links a node's join records (omlx_coordinator/planning/links.py), as the planner
counts them: each node's link to its ring successor replaces the assumed default, and the
layout `auto` picks follows what was measured."""

from __future__ import annotations

from omlx_coordinator.planning.layout_choice import plan_layout
from omlx_coordinator.planning.links import link_key, with_links
from omlx_coordinator.planning.planner import GiB, NodeSpec
from omlx_shared.link_probe import LinkMeasurement
from tests.helpers.layouts import SETTINGS, layout


def macs(n: int) -> list[NodeSpec]:
    return [NodeSpec(f"mac{i}", 64 * GiB, speed=400.0) for i in range(n)]


def measured(latency_us: float, gb_per_s: float, *pairs: tuple[str, str]
             ) -> dict[frozenset[str], LinkMeasurement]:
    return {link_key(a, b): LinkMeasurement(gb_per_s, latency_us, 8 << 20) for a, b in pairs}


def test_each_node_gets_its_successors_link_and_unmeasured_ones_keep_the_default():
    nodes = macs(3)
    nodes[2] = NodeSpec("mac2", 64 * GiB, speed=400.0, link_ms=0.7, link_gbps=1.0)
    links = measured(50.0, 4.0, ("mac1", "mac0")) | measured(350.0, 0.9, ("mac1", "mac2"))
    out = with_links(nodes, links)
    assert [(n.link_ms, n.link_gbps) for n in out] == [(0.05, 4.0), (0.35, 0.9), (0.7, 1.0)]
    assert [n.name for n in out] == ["mac0", "mac1", "mac2"]
    # A node alone sends over no link.
    assert with_links(nodes[:1], links) == nodes[:1]


def test_a_fast_measured_link_chooses_tensor_a_slow_one_does_not():
    lay = layout(layer_gib=0.75)  # 24 GiB of layers: over 2 Macs of 24 GiB usable each...
    small = [NodeSpec(f"mac{i}", 28 * GiB, speed=400.0) for i in range(2)]
    fast = with_links(small, measured(20.0, 10.0, ("mac0", "mac1")))
    plan = plan_layout(lay, fast, "auto", **SETTINGS)
    assert plan.layout_name == "tensor x2", plan.explanation
    slow = with_links(small, measured(350.0, 1.0, ("mac0", "mac1")))
    plan = plan_layout(lay, slow, "auto", **SETTINGS)
    assert plan.layout_name == "pipeline x2", plan.explanation
    assert any("Tensor parallel not chosen: its 65 all-reduces at 0.716 ms each" in line
               for line in plan.explanation), plan.explanation


def test_the_measured_latency_is_what_the_prediction_counts():
    lay = layout()
    plans = [plan_layout(lay, with_links(macs(2), measured(us, 5.0, ("mac0", "mac1"))),
                         "tensor", **SETTINGS) for us in (10.0, 110.0)]
    # 65 all-reduces a token, each 2(N-1) = 2 messages of the link's latency, and the split
    # head's all_gather, N-1 = 1: 0.1 ms more a message is 13.1 ms more a token.
    assert abs((plans[1].bottleneck_ms - plans[0].bottleneck_ms) - 13.1) < 1e-6
