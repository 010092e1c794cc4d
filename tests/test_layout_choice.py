"""The layout a model gets (omlx_coordinator/planning/layout_choice.py, tensor_plan.py) as pure functions
on synthetic clusters: `--parallel tensor` refused where it cannot be, and `auto` choosing
tensor over a fast link, a pipeline over a slow one, one node when the model fits one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omlx_coordinator.planning.layout_choice import candidates, plan_layout
from omlx_coordinator.planning.planner import GiB, Plan, PlanError
from omlx_coordinator.planning.tensor_plan import make_tensor_plan
from tests.helpers.layouts import LLAMA_8B, SETTINGS, layout, macs


def test_tensor_plan_splits_layers_kv_and_head_keeps_embedding_whole():
    lay = layout()
    plan = make_tensor_plan(lay, macs(2, 64, 0.05), **SETTINGS)
    assert plan.parallel == "tensor" and plan.layout_name == "tensor x2"
    assert [(s.layer_start, s.layer_end) for s in plan.stages] == [(0, 32), (0, 32)]
    rank = plan.stages[0]
    # The untied head split by vocabulary (omlx_node/tensor_shard.py's split_vocab).
    assert rank.weight_bytes == (16 * GiB // 2 + lay.embed_bytes + lay.head_bytes // 2
                                 + lay.norm_bytes)
    assert rank.kv_bytes == 32 * (1 << 12) * 4096 * 4 // 2
    # The hash names the layout: a pipeline's ranges never collide with it, and it round-trips.
    assert Plan.from_json(plan.to_json()) == plan


def test_tensor_plan_counts_the_draft_model_on_rank_0_alone():
    """A draft model (speculative decoding) is loaded on rank 0 only: counted there, and a
    rank 0 that cannot hold it beside its share is short by what it lacks."""
    plain = make_tensor_plan(layout(), macs(2, 64, 0.05), **SETTINGS)
    drafting = make_tensor_plan(replace(layout(), draft_bytes=GiB), macs(2, 64, 0.05),
                                **SETTINGS)
    assert [d.weight_bytes - p.weight_bytes for d, p in zip(drafting.stages, plain.stages)] == [
        GiB, 0]
    assert "rank 0 also the draft model, 1.07 GB" in drafting.explanation[0]
    free = 60 * GiB - plain.stages[0].memory_bytes  # 64 GiB less the 4 GiB reserve
    with pytest.raises(PlanError, match="rank 0 also the draft model") as err:
        make_tensor_plan(replace(layout(), draft_bytes=free + 1), macs(2, 64, 0.05), **SETTINGS)
    assert err.value.missing_by_node == {"mac0": 1}


@pytest.mark.parametrize("shape, nodes, why", [
    ((("model_type", "olmo2"), ("num_attention_heads", 8)), 2,
     "model family 'olmo2' has no tensor-parallel split: mlx-lm has no Model.shard() for it"),
    ((("model_type", "gpt_oss"), ("num_attention_heads", 32)), 3,
     "gpt_oss has 32 attention heads (num_attention_heads), which do not divide over 3 ranks"),
    (LLAMA_8B, 33, "llama has 32 attention heads (num_attention_heads), fewer than the 33 ranks"),
])
def test_tensor_refused_at_plan_time_saying_why(shape, nodes, why):
    with pytest.raises(PlanError) as err:
        plan_layout(layout(shape=shape), macs(nodes, 64, 0.05), "tensor", **SETTINGS)
    assert f"m cannot run tensor-parallel over {nodes} nodes" in str(err.value)
    assert why in str(err.value)


def test_tensor_needs_two_nodes_and_room_on_each():
    with pytest.raises(PlanError, match="at least 2 nodes"):
        make_tensor_plan(layout(), macs(1, 64, 0.05), **SETTINGS)
    # One node (the first to join, or the survivor of a lost rank) serves alone meanwhile.
    alone = plan_layout(layout(), macs(1, 64, 0.05), "tensor", **SETTINGS)
    assert alone.layout_name == "pipeline x1"
    assert "mac0 serves the whole model alone until a second node joins" in alone.explanation[-1]
    with pytest.raises(PlanError, match="does not fit tensor-parallel over 2 nodes") as err:
        plan_layout(layout(), macs(2, 12, 0.05), "tensor", **SETTINGS)
    assert set(err.value.missing_by_node) == {"mac0", "mac1"}


def test_a_split_is_a_pipeline():
    with pytest.raises(PlanError, match="drop it for --parallel tensor"):
        plan_layout(layout(), macs(2, 64, 0.05), "tensor", split=[16, 16], **SETTINGS)
    assert plan_layout(layout(), macs(2, 64, 0.05), "auto", split=[16, 16],
                       **SETTINGS).parallel == "pipeline"


def test_auto_fast_link_chooses_tensor():
    """Thunderbolt-class link (0.02 ms): 65 all-reduces cost ~2.6 ms, halving ~41 ms."""
    plan = plan_layout(layout(), macs(2, 64, 0.02), "auto", **SETTINGS)
    assert plan.layout_name == "tensor x2"
    text = "\n".join(plan.explanation)
    assert "Layout (--parallel auto): tensor x2" in text
    for name in ("one node (mac", "pipeline x2", "tensor x2"):
        assert f"  {name}" in text


def test_auto_slow_link_and_a_model_too_big_for_one_chooses_pipeline():
    """Wi-Fi-class link (2 ms): 65 all-reduces cost 260 ms a token; the model needs both."""
    plan = plan_layout(layout(), macs(2, 16, 2.0), "auto", **SETTINGS)
    assert plan.layout_name == "pipeline x2"
    text = "\n".join(plan.explanation)
    assert "one node: cannot serve: no node holds the whole model" in text
    assert ("Tensor parallel not chosen: its 65 all-reduces at 4.003 ms each and the head's "
            "all_gather" in text)


def test_auto_model_that_fits_one_fast_node_over_a_slow_link_stays_on_one():
    """exo #2070's shape: two fast Macs, a model that fits one, a link slower than the
    halved reads save: one node, not a pipeline (which only adds its links) nor tensor."""
    found = candidates(layout(), macs(2, 64, 1.0), **SETTINGS)
    rates = {c.name.split(" (")[0]: c.tok_s for c in found}
    assert rates["one node"] > rates["pipeline x2"] and rates["one node"] > rates["tensor x2"]
    plan = plan_layout(layout(), macs(2, 64, 1.0), "auto", **SETTINGS)
    assert plan.layout_name == "pipeline x1" and plan.stages[0].layer_end == 32


def test_auto_family_without_tensor_split_never_tensor():
    shape = (("model_type", "olmo2"), ("num_attention_heads", 8))
    plan = plan_layout(layout(shape=shape), macs(2, 16, 0.02), "auto", **SETTINGS)
    assert plan.layout_name == "pipeline x2"
    assert "tensor x2: cannot serve: m cannot run tensor-parallel" in "\n".join(plan.explanation)


def test_nothing_fits_says_what_is_missing():
    with pytest.raises(PlanError) as err:
        plan_layout(layout(), macs(2, 8, 0.02), "auto", **SETTINGS)
    assert err.value.missing_bytes > 0 and "does not fit" in str(err.value)


def test_bad_parallel_is_refused():
    with pytest.raises(PlanError, match="parallel must be one of auto, pipeline, tensor"):
        plan_layout(layout(), macs(2, 64, 0.02), "sideways")


def test_uneven_split_plans_the_largest_rank():
    """32 heads and 8 KV heads over 3 nodes: 3, 3 and 2 KV heads with their query heads; each
    rank is planned as the largest share, 3/8, not a third."""
    plan = plan_layout(layout(), macs(3, 64, 0.05), "tensor", **SETTINGS)
    assert plan.layout_name == "tensor x3"
    assert plan.stages[0].weight_bytes == (16 * GiB * 3 // 8 + (1 << 29) + -(-(1 << 29) // 3)
                                           + (1 << 13))
    assert plan.stages[0].kv_bytes == 32 * (1 << 12) * 4096 * 4 * 3 // 8
    assert "up to 38% (an uneven split) of every layer" in "\n".join(plan.explanation)


def _with_layer_ms(nodes: list, ms: float) -> list:
    return [replace(nd, layer_ms=ms) for nd in nodes]


@pytest.mark.parametrize("link_ms, winner", [(0.02, "tensor x2"), (1.0, "one node")])
def test_a_layers_fixed_cost_is_paid_whole_by_every_rank(link_ms, winner):
    """NodeSpec.layer_ms (what `join` measures beside the speed): one node and a pipeline pay it
    once a layer, and so does each tensor rank, whose share of the weights does not shrink it.
    So every layout's token takes 32 x 0.5 ms longer, tensor's lead over one node narrows, and
    the choice between them stays."""
    plain = {c.name.split(" (")[0]: c for c in candidates(layout(), macs(2, 64, link_ms),
                                                           **SETTINGS)}
    fixed = {c.name.split(" (")[0]: c for c in candidates(
        layout(), _with_layer_ms(macs(2, 64, link_ms), 0.5), **SETTINGS)}
    for name in ("one node", "pipeline x2", "tensor x2"):
        assert abs(1e3 / fixed[name].tok_s - 1e3 / plain[name].tok_s - 32 * 0.5) < 1e-9, name
    assert max(fixed.values(), key=lambda c: c.tok_s).name.startswith(winner)
    assert max(plain.values(), key=lambda c: c.tok_s).name.startswith(winner)
    if winner == "tensor x2":
        assert (fixed["tensor x2"].tok_s / fixed["one node"].tok_s
                < plain["tensor x2"].tok_s / plain["one node"].tok_s)
    assert fixed["one node"].why.startswith("17.717 GB streamed a token at 400 GB/s, 32 layers "
                                            "at 0.5 ms: 60.29 ms")
    assert "with its layers' fixed costs" in fixed["tensor x2"].why


def test_a_pipeline_gives_fewer_layers_to_a_node_whose_layers_cost_more():
    """Two nodes of one speed, one paying 2 ms a layer beyond its reads (a CPU's op dispatch):
    the split moves layers off it, as a slower speed would."""
    nodes = macs(2, 64, 0.02)
    nodes[1] = replace(nodes[1], layer_ms=2.0)
    plan = plan_layout(layout(), [*nodes], "pipeline", **SETTINGS)
    counts = [s.layer_end - s.layer_start for s in plan.stages]
    assert counts[0] > counts[1], counts
    assert "and 2 ms a layer" in "\n".join(plan.explanation)
