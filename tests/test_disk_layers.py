"""The planner with layers on the SSD (omlx_coordinator/planning/disk_layers.py): a node's
--weights-memory caps what a stage holds, the rest of its range streams, the cost is counted,
and RAM elsewhere wins over a disk when it is there."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omlx_coordinator.planning.disk_layers import STREAM_BUFFERS, streamed_layers
from omlx_coordinator.planning.planner import GiB, NodeSpec, PlanError, make_plan
from tests.helpers.layouts import uniform_layout

KW = dict(os_reserve_bytes=0, context_tokens=1024, max_sequences=1)


def test_without_a_cap_a_model_larger_than_memory_is_refused_naming_the_flag():
    lay = uniform_layout(L=16, layer=GiB)  # 16 GiB of layers + 1 GiB embedding and head
    with pytest.raises(PlanError, match="--weights-memory SIZE"):
        make_plan(lay, [NodeSpec("mac", 8 * GiB)], **KW)


def test_a_model_twice_the_memory_streams_the_fewest_layers_that_fit():
    lay = uniform_layout(L=16, layer=GiB)
    cap = 8 * GiB + lay.norm_bytes
    plan = make_plan(lay, [NodeSpec("mac", 9 * GiB, speed=100.0, weights_cap=cap,
                                    disk_gbps=5.0)], **KW)
    stage = plan.stages[0]
    # The cap holds the embedding, norm and head, two streaming buffers and 5 layers.
    assert stage.streamed_layers == 11
    assert stage.weight_bytes == cap == (1 + 5 + STREAM_BUFFERS) * GiB + lay.norm_bytes
    # Each step reads the 11 streamed GiB at 5 GB/s, beside the 16 GiB streamed from memory.
    disk = 11 * GiB / 5e9 * 1e3
    assert stage.est_ms == pytest.approx(disk + 16.5 * GiB / 100e9 * 1e3, rel=1e-3)
    text = "\n".join(plan.explanation)
    assert "Layers [5, 16) of mac stream from its SSD" in text


def test_ram_on_another_node_is_preferred_to_the_disk():
    lay = uniform_layout(L=16, layer=GiB)
    nodes = [NodeSpec("small", 6 * GiB, speed=100.0, weights_cap=6 * GiB),
             NodeSpec("big", 24 * GiB, speed=100.0, link_ms=0.5)]
    plan = make_plan(lay, nodes, **KW)
    assert all(s.streamed_layers == 0 for s in plan.stages)


def test_a_cap_too_small_for_one_layer_and_the_buffers_is_refused():
    lay = uniform_layout(L=4, layer=GiB)
    with pytest.raises(PlanError):
        make_plan(lay, [NodeSpec("mac", 64 * GiB, weights_cap=2 * GiB)], **KW)


def test_streamed_layers_is_the_least_that_fits():
    prefix = [0, 4, 8, 12, 16, 20]  # five layers of 4 bytes
    assert streamed_layers(prefix, 0, 5, 20, 20, True, 4) == 0
    assert streamed_layers(prefix, 0, 5, 20, 19, False, 4) is None
    # 20 - 4n + 2 * 4 <= 19 -> n = 3
    assert streamed_layers(prefix, 0, 5, 20, 19, True, 4) == 3
    assert streamed_layers(prefix, 0, 5, 20, 11, True, 4) is None  # 4 + 8 > 11


def test_streamed_experts_cost_the_share_a_token_routes_to():
    # Layers of 1 GiB of which 7/8 are stacked routed experts, 2 of 16 read at batch 1.
    read = GiB - GiB * 7 // 8 + GiB * 7 // 64
    dense = uniform_layout(L=16, layer=GiB)
    moe = replace(dense, layer_read_bytes=(read,) * 16)
    node = NodeSpec("mac", 9 * GiB, speed=100.0, weights_cap=8 * GiB + dense.norm_bytes,
                    disk_gbps=5.0)
    plans = {name: make_plan(lay, [node], **KW) for name, lay in (("dense", dense), ("moe", moe))}
    assert plans["moe"].stages[0].streamed_layers == plans["dense"].stages[0].streamed_layers == 11
    compute = 16.5 * GiB / 100e9 * 1e3
    assert plans["moe"].stages[0].est_ms == pytest.approx(11 * read / 5e9 * 1e3 + compute)
    text = "\n".join(plans["moe"].explanation)
    assert "at batch 1 only the routed experts of their 11.00 GiB are read" in text, text
    assert "routed experts" not in "\n".join(plans["dense"].explanation)
