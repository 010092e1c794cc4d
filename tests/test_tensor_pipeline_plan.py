"""A pipeline of tensor-parallel stages as the planner lays it out
(omlx_coordinator/planning/tensor_pipeline_plan.py, layout_choice.py), pure, on synthetic
clusters: two islands of two Macs each, fast inside, a slow link between them."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omlx_coordinator.planning.layout_choice import candidates, plan_layout
from omlx_coordinator.planning.planner import GiB, NodeSpec, Plan, PlanError
from omlx_coordinator.planning.tensor_pipeline_plan import cuts, make_tensor_pipeline_plan
from tests.helpers.layouts import SETTINGS, layout

FAST, SLOW = 0.02, 1.0  # ms: Thunderbolt 5 RDMA, and Ethernet across a switch


def islands(memory_gib: int = 12, speed: float = 400.0) -> list[NodeSpec]:
    """a0 -fast- a1 -slow- b0 -fast- b1 -slow- (back to a0): each node's link is to the next."""
    return [NodeSpec(name, memory_gib * GiB, speed=speed, link_ms=link, link_gbps=gbps)
            for name, link, gbps in (("a0", FAST, 8.0), ("a1", SLOW, 1.0),
                                     ("b0", FAST, 8.0), ("b1", SLOW, 1.0))]


def test_cuts_make_pipelines_with_a_tensor_stage():
    assert sorted(cuts(3)) == [(1, 2), (2, 1)]
    assert sorted(cuts(4)) == [(1, 1, 2), (1, 2, 1), (1, 3), (2, 1, 1), (2, 2), (3, 1)]


def test_two_islands_a_model_too_big_for_one_choose_tensor_x_pipeline():
    """16 GiB of layers in 12 GiB Macs (8 GiB each after the reserve): no Mac holds it, nor one island as a tensor stage (its
    ranks would each hold half of it, the embedding and head and the KV); all four as one
    tensor stage all-reduce over the slow links; a pipeline of four streams each layer on one
    Mac. Each island a tensor stage of half the layers wins, and `auto` takes it."""
    lay = layout()
    nodes = islands()
    plan = plan_layout(lay, nodes, "auto", **SETTINGS)
    assert plan.parallel == "tensor-pipeline" and plan.layout_name == "tensor x2 > tensor x2"
    assert plan.stage_ranks == (2, 2)
    # The last stage also streams the head: it gets a layer fewer.
    assert [(s.node, s.layer_start, s.layer_end) for s in plan.stages] == [
        ("a0", 0, 17), ("a1", 0, 17), ("b0", 17, 32), ("b1", 17, 32)]
    first, last = plan.stages[0], plan.stages[-1]
    assert first.weight_bytes == 17 * GiB // 4 + lay.embed_bytes
    assert last.weight_bytes == 15 * GiB // 4 + lay.head_bytes + lay.norm_bytes
    assert first.kv_bytes == 17 * (1 << 12) * 4096 * 4 // 2
    assert Plan.from_json(plan.to_json()) == plan
    found = {c.name: c for c in candidates(lay, nodes, **SETTINGS)}
    assert found["one node"].plan is None
    best = found["tensor x2 > tensor x2"]
    assert best.tok_s > max(c.tok_s for name, c in found.items() if name != best.name)
    assert found["tensor x4"].tok_s < found["pipeline x4"].tok_s  # over the slow links
    text = "\n".join(plan.explanation)
    assert "Layout (--parallel auto): tensor x2 > tensor x2" in text
    assert "Stage 0: tensor x2 over a0, a1, layers [0, 17)" in text
    assert "Stage 1: tensor x2 over b0, b1, layers [17, 32)" in text
    assert "pipeline x4:" in text and "tensor x4:" in text and "<- chosen" in text


def test_explicit_tensor_pipeline_and_its_limits():
    lay = layout()
    assert plan_layout(lay, islands(), "tensor-pipeline", **SETTINGS).stage_ranks == (2, 2)
    # Three survivors: a stage of two and one alone, on whichever side is faster.
    three = plan_layout(lay, islands()[:3], "tensor-pipeline", **SETTINGS)
    assert three.stage_ranks in ((2, 1), (1, 2)) and three.parallel == "tensor-pipeline"
    # Two: one tensor stage until a third node comes.
    two = plan_layout(lay, islands(64)[:2], "tensor-pipeline", **SETTINGS)
    assert two.layout_name == "tensor x2"
    assert "make no pipeline of tensor-parallel stages" in two.explanation[-1]
    with pytest.raises(PlanError, match="drop it for --parallel tensor-pipeline"):
        plan_layout(lay, islands(), "tensor-pipeline", split=[8] * 4, **SETTINGS)
    with pytest.raises(PlanError, match="no cut of the nodes"):
        make_tensor_pipeline_plan(lay, islands(8), **SETTINGS)
    gpt_oss = layout(shape=(("model_type", "gpt_oss"), ("num_attention_heads", 5)))
    with pytest.raises(PlanError, match="5 attention heads .* which do not divide over"):
        make_tensor_pipeline_plan(gpt_oss, islands(), **SETTINGS)


def test_the_draft_model_is_held_by_rank_0_alone():
    """A draft model (speculative decoding) is loaded on the head stage's rank 0 only: the plan
    counts it on a0 and nowhere else, moves layers off the head stage when a0 cannot hold it
    beside its share, and says so when no cut can."""
    lay = layout()
    plain = make_tensor_pipeline_plan(lay, islands(), **SETTINGS)
    small = make_tensor_pipeline_plan(replace(lay, draft_bytes=GiB), islands(), **SETTINGS)
    assert [s.weight_bytes - p.weight_bytes for s, p in zip(small.stages, plain.stages)] == [
        GiB, 0, 0, 0]
    assert "(rank 0 also the draft model, 1.00 GiB)" in small.explanation[1]
    large = make_tensor_pipeline_plan(replace(lay, draft_bytes=4 * GiB), islands(), **SETTINGS)
    a0, a1 = large.stages[:2]
    assert a0.layer_end == a1.layer_end < plain.stages[0].layer_end
    assert a0.memory_bytes - a1.memory_bytes == 4 * GiB
    assert a0.weight_bytes + a0.kv_bytes <= 8 * GiB  # its 12 GiB less the 4 GiB reserve
    with pytest.raises(PlanError, match=r"rank 0 also the draft model \(12.00 GiB\)"):
        make_tensor_pipeline_plan(replace(lay, draft_bytes=12 * GiB), islands(), **SETTINGS)
