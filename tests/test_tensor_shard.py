"""The generic tensor-parallel sharder (omlx_node/tensor_shard.py) on tiny random fp32 models:
its table of families against mlx-lm's classes, and each rank's slice of a layer's attention and
MLP summing to the whole, even, uneven and with KV heads replicated. (The ranks run in one
process here, over a group of one whose all_sum passes its input through, and their parts are
summed by the test; tests/test_tensor_parallel.py runs them as processes.)"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from omlx_node.tensor_shard import ShardError, common_shape_refusal, shard_layer
from omlx_shared.tensor_split import ALIASES, COMMON_SHAPE, head_slice
from tests.tiny_models import FAMILY_CONFIGS, instantiate, tiny_config


def test_common_shape_table_is_mlx_lms_classes():
    """Every family the tiny models build is in COMMON_SHAPE exactly when its layers pass."""
    for family in FAMILY_CONFIGS:
        model = instantiate(tiny_config(family, num_layers=2))
        fits = all(common_shape_refusal(layer) == "" for layer in model.layers)
        assert fits == (ALIASES.get(family, family) in COMMON_SHAPE), family
    assert COMMON_SHAPE <= {ALIASES.get(f, f) for f in FAMILY_CONFIGS}


@pytest.mark.parametrize("family, why", [
    ("olmo2", "its attention's q_norm spans more than one head"),
    ("phi3", "its self_attn has no q_proj linear projection"),
    ("glm4_moe", "its MoE block holds gate, neither experts, a shared MLP nor a router"),
    ("gpt_oss", "its attention does not name its head counts (n_heads and n_kv_heads)"),
])
def test_other_shapes_are_named(family, why):
    model = instantiate(tiny_config(family, num_layers=2))
    assert common_shape_refusal(model.layers[-1]) == why


@pytest.mark.parametrize("n_heads, n_kv, ranks, want", [
    (4, 2, 2, [(0, 2, (0,)), (2, 4, (1,))]),
    # Uneven: KV head 1 is read by the query heads of ranks 1 and 2, and held by both.
    (4, 2, 3, [(0, 2, (0,)), (2, 3, (1,)), (3, 4, (1,))]),
    # Fewer KV heads than ranks: each rank holds the one.
    (4, 1, 2, [(0, 2, (0,)), (2, 4, (0,))]),
    # Rank 1's heads 3-5 read KV heads 0, 1, 1: one copy a query head keeps its groups equal.
    (8, 2, 3, [(0, 3, (0,)), (3, 6, (0, 1, 1)), (6, 8, (1,))]),
    # As many KV heads as ranks or more: whole groups, nothing held twice.
    (32, 8, 3, [(0, 12, (0, 1, 2)), (12, 24, (3, 4, 5)), (24, 32, (6, 7))]),
    (6, 3, 2, [(0, 4, (0, 1)), (4, 6, (2,))]),
])
def test_head_slices(n_heads, n_kv, ranks, want):
    got = [head_slice(n_heads, n_kv, ranks, r) for r in range(ranks)]
    assert [(s.q_start, s.q_end, s.kv) for s in got] == want


def feed_forward(layer):
    return layer.get("mlp") or layer.block_sparse_moe


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "cohere2", "granite",
                                    "qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("n_heads, n_kv, ranks", [
    (4, 2, 2), (4, 2, 3), (8, 2, 3), (6, 3, 4), (4, 1, 2), (6, 2, 4), (6, 3, 2), (12, 6, 4)])
def test_rank_slices_sum_to_the_whole(family, n_heads, n_kv, ranks):
    """The last layer (qwen3_moe's first is dense) of each rank: attention and MLP (or MoE
    block: every expert's and the shared expert's width split, the router whole)."""
    config = tiny_config(family, num_layers=2, hidden_size=16 * n_heads, extra_config={
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv, "head_dim": 16})
    whole = instantiate(config).layers[-1]
    x = mx.random.normal((2, 5, config["hidden_size"]), key=mx.random.key(1))
    want_attn, want_mlp = whole.self_attn(x, None, None), feed_forward(whole)(x)
    group = mx.distributed.init()  # of one: its all_sum is the identity
    attn = mlp = 0
    for rank in range(ranks):
        layer = instantiate(config).layers[-1]
        shard_layer(layer, ranks, rank, group)
        hs = head_slice(n_heads, n_kv, ranks, rank)
        assert layer.self_attn.q_proj.weight.shape[0] == 16 * (hs.q_end - hs.q_start)
        assert layer.self_attn.k_proj.weight.shape[0] == 16 * len(hs.kv)
        attn = attn + layer.self_attn(x, None, None)
        mlp = mlp + feed_forward(layer)(x)
    assert mx.allclose(attn, want_attn, atol=1e-5).item()
    assert mx.allclose(mlp, want_mlp, atol=1e-5).item()


def quantized_layer(config: dict):
    model = instantiate(config)
    nn.quantize(model, group_size=32, bits=8)
    return model.layers[0]


def test_quantized_slices_sum_to_the_whole():
    """A GPU keeps the weights quantized: slices fall on whole quantization groups."""
    config = tiny_config("llama", num_layers=1)
    whole = quantized_layer(config)
    x = mx.random.normal((2, 5, config["hidden_size"]), key=mx.random.key(1))
    group = mx.distributed.init()
    attn = mlp = 0
    for rank in range(2):
        layer = quantized_layer(config)
        shard_layer(layer, 2, rank, group)
        attn = attn + layer.self_attn(x, None, None)
        mlp = mlp + layer.mlp(x)
    assert mx.allclose(attn, whole.self_attn(x, None, None), atol=1e-4).item()
    assert mx.allclose(mlp, whole.mlp(x), atol=1e-4).item()


def test_quantized_heads_off_the_groups_are_refused():
    """3 ranks of 4 heads of 16: rank 1's o_proj columns [32, 48) cut a group of 32."""
    layer = quantized_layer(tiny_config("llama", num_layers=1))
    with pytest.raises(ShardError, match=r"input features \[32, 48\) do not fall on the "
                                         r"quantization groups of 32; dequantize the model"):
        shard_layer(layer, 3, 1, mx.distributed.init())
