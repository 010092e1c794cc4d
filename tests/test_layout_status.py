"""What `status` shows of a layout (omlx_coordinator/planning/tensor_plan.py's rank_heads, the
CLI's ranks_lines): a tensor-parallel stage's ranks and the heads each holds, as the sharders
split them; nothing for a pipeline."""

from __future__ import annotations

from omlx_cluster.client import ranks_lines
from omlx_coordinator.planning.layout_choice import plan_layout
from omlx_coordinator.planning.tensor_plan import rank_heads
from tests.helpers.layouts import LLAMA_8B, SETTINGS, layout, macs


def test_three_ranks_of_32_heads_and_8_kv_heads():
    lay = layout()
    plan = plan_layout(lay, macs(3, 64, 0.02), "tensor", **SETTINGS)
    assert rank_heads(plan, lay) == [
        {"rank": 0, "node": "mac0", "q_heads": [0, 12], "kv_heads": [0, 1, 2]},
        {"rank": 1, "node": "mac1", "q_heads": [12, 24], "kv_heads": [3, 4, 5]},
        {"rank": 2, "node": "mac2", "q_heads": [24, 32], "kv_heads": [6, 7]}]
    assert ranks_lines(rank_heads(plan, lay)) == [
        "  rank 0 mac0: q heads [0, 12), KV heads [0, 3)",
        "  rank 1 mac1: q heads [12, 24), KV heads [3, 6)",
        "  rank 2 mac2: q heads [24, 32), KV heads [6, 8)"]


def test_a_kv_head_held_twice_is_listed_on_both_ranks():
    shape = (("model_type", "llama"), ("hidden_size", 64), ("num_attention_heads", 4),
             ("num_key_value_heads", 2), ("intermediate_size", 128))
    lay = layout(shape=shape)
    plan = plan_layout(lay, macs(3, 64, 0.02), "tensor", **SETTINGS)
    heads = rank_heads(plan, lay)
    assert [(r["q_heads"], r["kv_heads"]) for r in heads] == [
        ([0, 2], [0]), ([2, 3], [1]), ([3, 4], [1])]
    assert ranks_lines(heads)[2] == "  rank 2 mac2: q heads [3, 4), KV heads [1, 2)"


def test_a_pipeline_has_no_ranks_of_heads():
    lay = layout(shape=LLAMA_8B)
    plan = plan_layout(lay, macs(2, 64, 0.02), "pipeline", **SETTINGS)
    assert rank_heads(plan, lay) == [] and ranks_lines([]) == []
