"""A tensor split that would cut a quantized weight inside a quantization group is refused when
the plan is made (omlx_shared/tensor_split.py's group_cut), not when a node loads it: `auto`
falls back to another layout and says why tensor was not chosen. Nodes that dequantize (a CPU)
may cut groups."""

from __future__ import annotations

from dataclasses import replace

import pytest

from omlx_coordinator.planning.layout_choice import plan_layout
from omlx_coordinator.planning.model_layout import read_layout
from omlx_coordinator.planning.planner import PlanError
from tests.helpers.layouts import SETTINGS, layout, macs
from tests.tiny_models import build_model


def quantized(hidden: int, heads: int, kv: int, width: int, group: int = 64):
    return layout(shape=(("model_type", "llama"), ("hidden_size", hidden),
                         ("num_attention_heads", heads), ("num_key_value_heads", kv),
                         ("intermediate_size", width), ("head_dim", hidden // heads),
                         ("group_size", group)))


# 4 heads of 16 features: rank 1's query heads start at feature 32 of o_proj's 64 inputs.
OFF_GROUPS = quantized(hidden=64, heads=4, kv=2, width=128)
CUT = ("m cannot run tensor-parallel over 2 nodes: a rank's share of the attention output's "
       "input features (query heads x head_dim) starts at feature 32 of 64, inside a "
       "quantization group of 64 (the model is quantized with group_size 64)")


def test_a_split_inside_a_group_is_refused_at_plan_time():
    with pytest.raises(PlanError) as err:
        plan_layout(OFF_GROUPS, macs(2, 64, 0.02), "tensor", **SETTINGS)
    assert CUT in str(err.value) and "(mac0, mac1 keep the weights quantized)" in str(err.value)


def test_auto_falls_back_and_says_why_tensor_was_not_chosen():
    plan = plan_layout(OFF_GROUPS, macs(2, 64, 0.02), "auto", **SETTINGS)
    assert plan.parallel == "pipeline"
    assert f"Tensor parallel not chosen: {CUT}" in "\n".join(plan.explanation)


def test_nodes_that_dequantize_may_cut_groups():
    cpus = [replace(nd, dequantizes=True) for nd in macs(2, 64, 0.02)]
    assert plan_layout(OFF_GROUPS, cpus, "tensor", **SETTINGS).layout_name == "tensor x2"


def test_an_mlp_width_split_inside_a_group_is_refused():
    # Heads of 64 features fall on the groups; mlx-lm's shard() halves a width of 192 at 96.
    lay = quantized(hidden=256, heads=4, kv=2, width=192)
    with pytest.raises(PlanError, match=r"the MLP intermediate size starts at feature 96 of "
                                        r"192, inside a quantization group of 64"):
        plan_layout(lay, macs(2, 64, 0.02), "tensor", **SETTINGS)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_group_aligned_splits_are_planned(ranks):
    lay = quantized(hidden=256, heads=4, kv=2, width=512)
    plan = plan_layout(lay, macs(ranks, 64, 0.02), "tensor", **SETTINGS)
    assert plan.layout_name == f"tensor x{ranks}"


def test_a_checkpoints_quantization_is_read_and_matches_the_nodes_refusal(tmp_path):
    """The tiny llama quantized in groups of 32: 2 ranks fall on the groups; 3 cut one at
    feature 48, which the node refuses at load too (tests/test_tensor_shard.py)."""
    lay = read_layout(build_model(tmp_path / "q", "llama", num_layers=1, quantize_bits=8))
    assert lay.group_cut(2) == ""
    assert "starts at feature 48 of 64, inside a quantization group of 32" in lay.group_cut(3)
    assert read_layout(build_model(tmp_path / "f", "llama", num_layers=1)).group_cut(3) == ""
