"""The planner against a brute-force optimum, its refusals and explanations; read_layout on tiny
real model folders; parse_node_arg; and one small calibration run.

The brute force below re-implements the cost model from the planner's docstring independently
(plain sums over the layer list, every contiguous split enumerated) so that a bug in the
planner's DP or in its cost helpers shows up as a disagreement.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from omlx_coordinator.planning.model_layout import LayerKV, ModelLayout, read_layout
from omlx_coordinator.planning.node_args import parse_node_arg, parse_size
from omlx_coordinator.planning.plan_table import format_plan
from omlx_coordinator.planning.planner import (
    GiB,
    NodeSpec,
    Plan,
    PlanError,
    compute_plan_hash,
    make_plan,
    ram_proportional_split,
)
from tests.helpers.layouts import uniform_layout

MiB = 1 << 20
RESERVE = 1 * GiB


# ------------------------------------------------------------------ independent brute force


def stage_memory(lay: ModelLayout, a: int, b: int, kv_tokens: int) -> int:
    mem = sum(lay.layer_bytes[a:b]) + (b - a) * lay.kv_bytes_per_token_per_layer * kv_tokens
    first, last = a == 0, b == lay.num_layers
    if first:
        mem += lay.embed_bytes
    if last:
        mem += lay.norm_bytes + lay.head_bytes
        if lay.tied_embeddings and not first:
            mem += lay.embed_bytes
    return mem


def stage_ms(lay: ModelLayout, node: NodeSpec, a: int, b: int) -> float:
    streamed = sum(lay.layer_bytes[a:b])
    last = b == lay.num_layers
    if last:
        streamed += lay.norm_bytes + (lay.embed_bytes if lay.tied_embeddings else lay.head_bytes)
    link = 0.0 if (a == 0 and last) else node.link_ms
    return streamed / (node.speed * 1e9) * 1e3 + link


def brute_force(lay, nodes, reserve, kv_tokens):
    """(best bottleneck, least latency among optimal splits) over every contiguous split of the
    layers over the nodes in order, zeros meaning 'left out'; None if nothing fits."""
    L, n = lay.num_layers, len(nodes)
    results = []
    for cuts in itertools.combinations_with_replacement(range(L + 1), n - 1):
        bounds = (0, *cuts, L)
        times = []
        for node, a, b in zip(nodes, bounds, bounds[1:]):
            if b == a:
                continue
            if stage_memory(lay, a, b, kv_tokens) + node.cache_bytes > node.memory_bytes - reserve:
                break
            times.append(stage_ms(lay, node, a, b))
        else:
            results.append((max(times), sum(times)))
    if not results:
        return None
    best = min(r[0] for r in results)
    return best, min(s for m, s in results if m <= best * (1 + 1e-9))


def random_cluster(rng: random.Random, n: int, L: int):
    tied = rng.random() < 0.4
    layer_bytes = tuple(rng.randint(20, 200) * MiB for _ in range(L))
    embed = rng.randint(50, 400) * MiB
    lay = ModelLayout(
        model_id="synthetic",
        num_layers=L,
        layer_bytes=layer_bytes,
        embed_bytes=embed,
        head_bytes=0 if tied else embed,
        norm_bytes=rng.randint(1, 64) * 1024,
        tied_embeddings=tied,
        kv_bytes_per_token_per_layer=rng.choice([512, 1024, 4096]),
    )
    kv_tokens = rng.choice([0, 256, 4096])
    need = stage_memory(lay, 0, L, kv_tokens)  # everything on one node
    nodes = [
        NodeSpec(
            name=f"n{j}",
            # From "holds a few layers" to "holds everything": tight and loose clusters alike.
            memory_bytes=RESERVE + int(need * rng.uniform(0.05, 1.1)),
            speed=rng.choice([0.5, 1.0, 2.0, 3.7, 8.0]) * rng.uniform(0.8, 1.2),
            link_ms=rng.choice([0.0, 0.0, 0.3, 2.0, 25.0]),
            cache_bytes=rng.choice([0, 0, 64 * MiB, 512 * MiB]),
        )
        for j in range(n)
    ]
    return lay, nodes, kv_tokens


def cluster_sizes(rng: random.Random, count: int):
    """(nodes, layers) pairs over 2-5 nodes and 8-40 layers, keeping the brute force small."""
    out = []
    while len(out) < count:
        n, L = rng.randint(2, 5), rng.randint(8, 40)
        if math.comb(L + n - 1, n - 1) <= 25000:
            out.append((n, L))
    return out


def test_matches_brute_force_on_random_heterogeneous_clusters():
    rng = random.Random(20240607)
    checked = refused = 0
    for n, L in cluster_sizes(rng, 120):
        lay, nodes, kv_tokens = random_cluster(rng, n, L)
        expected = brute_force(lay, nodes, RESERVE, kv_tokens)
        kw = dict(os_reserve_bytes=RESERVE, context_tokens=kv_tokens, max_sequences=1)
        if expected is None:
            with pytest.raises(PlanError):
                make_plan(lay, nodes, **kw)
            refused += 1
            continue
        plan = make_plan(lay, nodes, **kw)
        best, latency = expected
        assert plan.bottleneck_ms <= best * 1.01 and plan.bottleneck_ms >= best * (1 - 1e-9)
        assert plan.bottleneck_ms == pytest.approx(best, rel=1e-9)
        # Ties on the bottleneck go to the least per-token latency.
        assert sum(s.est_ms for s in plan.stages) == pytest.approx(latency, rel=1e-9)
        # The plan is what it says: contiguous, in node order, fits, estimates recomputed.
        by_name = {nd.name: nd for nd in nodes}
        order = [nd.name for nd in nodes]
        assert [order.index(s.node) for s in plan.stages] == sorted(
            order.index(s.node) for s in plan.stages
        )
        assert plan.stages[0].layer_start == 0 and plan.stages[-1].layer_end == L
        for s, t in zip(plan.stages, plan.stages[1:]):
            assert s.layer_end == t.layer_start
        for s in plan.stages:
            assert s.layer_end > s.layer_start
            node = by_name[s.node]
            assert s.cache_bytes == node.cache_bytes
            assert s.memory_bytes == stage_memory(lay, s.layer_start, s.layer_end,
                                                  kv_tokens) + node.cache_bytes
            assert s.memory_bytes <= s.memory_budget == node.memory_bytes - RESERVE
            assert s.est_ms == pytest.approx(
                stage_ms(lay, by_name[s.node], s.layer_start, s.layer_end)
            )
        checked += 1
    assert checked >= 60 and refused >= 5  # both outcomes exercised


def test_order_search_matches_brute_force_over_permutations():
    rng = random.Random(7)
    for _ in range(15):
        n, L = rng.randint(2, 4), rng.randint(8, 14)
        lay, nodes, kv_tokens = random_cluster(rng, n, L)
        best = min(
            (r[0] for perm in itertools.permutations(nodes)
             if (r := brute_force(lay, list(perm), RESERVE, kv_tokens))),
            default=None,
        )
        kw = dict(os_reserve_bytes=RESERVE, context_tokens=kv_tokens, max_sequences=1)
        if best is None:
            with pytest.raises(PlanError):
                make_plan(lay, nodes, order="search", **kw)
            continue
        plan = make_plan(lay, nodes, order="search", **kw)
        assert plan.bottleneck_ms == pytest.approx(best, rel=1e-9)
        given = brute_force(lay, nodes, RESERVE, kv_tokens)
        if given:
            assert plan.bottleneck_ms <= given[0] * (1 + 1e-9)


def test_beats_ram_proportional_split_with_a_slow_big_node():
    lay = uniform_layout()
    nodes = [
        NodeSpec("fast1", 48 * GiB, speed=400.0, link_ms=0.5),
        NodeSpec("fast2", 48 * GiB, speed=400.0, link_ms=0.5),
        NodeSpec("bigslow", 192 * GiB, speed=60.0, link_ms=0.5),
    ]
    ram = ram_proportional_split(lay, nodes)
    assert ram == [5, 6, 21]  # exo's cumulative rounding of 48:48:192
    plan = make_plan(lay, nodes, split=None)
    ram_plan = make_plan(lay, nodes, split=ram)
    assert plan.bottleneck_ms < 0.5 * ram_plan.bottleneck_ms
    assert plan.split[-1] < ram[-1]  # the slow node keeps fewer layers
    text = "\n".join(plan.explanation)
    assert "RAM-proportional split (exo) [5, 6, 21]" in text
    assert "Even split [11, 11, 10]" in text
    assert "bottleneck" in text.lower()


def test_leaves_out_a_node_whose_link_costs_more_than_it_helps():
    lay = uniform_layout(L=8)
    nodes = [
        NodeSpec("a", 64 * GiB, speed=100.0, link_ms=0.1),
        NodeSpec("far", 64 * GiB, speed=100.0, link_ms=500.0),
        NodeSpec("b", 64 * GiB, speed=100.0, link_ms=0.1),
    ]
    plan = make_plan(lay, nodes, context_tokens=1024, max_sequences=1)
    assert [s.node for s in plan.stages] == ["a", "b"]
    assert any(line.startswith("Left out: far") for line in plan.explanation)


def test_refuses_with_missing_bytes_overall_and_per_node():
    lay = uniform_layout(L=16, layer=2 * GiB)  # 32 GiB of layers + 1 GiB embed/head
    nodes = [NodeSpec("a", 16 * GiB), NodeSpec("b", 20 * GiB)]
    kw = dict(os_reserve_bytes=4 * GiB, context_tokens=4096, max_sequences=8)
    need = stage_memory(lay, 0, 16, 4096 * 8)
    have = (16 - 4) * GiB + (20 - 4) * GiB
    with pytest.raises(PlanError) as info:
        make_plan(lay, nodes, **kw)
    e = info.value
    assert e.missing_bytes == need - have
    assert "Missing overall: " in str(e) and str(need - have) in str(e)
    assert set(e.missing_by_node) == {"a", "b"}
    assert all(v > 0 for v in e.missing_by_node.values())
    # The closest split spreads the shortfall: together the nodes lack exactly what is missing.
    assert sum(e.missing_by_node.values()) == need - have
    for name, short in e.missing_by_node.items():
        assert f"{name}: layers" in str(e) and str(short) in str(e)


def test_each_stage_counts_its_workers_ram_prefix_cache():
    """A node's --hot-cache-max-size is memory its shard worker takes beside the weights and KV:
    a model that just fits a node without it does not fit with it, and the refusal says so."""
    lay = uniform_layout(L=4, layer=GiB)  # 4 GiB of layers + 1 GiB embedding and head
    kw = dict(os_reserve_bytes=GiB, context_tokens=0, max_sequences=1)
    need = stage_memory(lay, 0, 4, 0)
    plan = make_plan(lay, [NodeSpec("a", need + GiB)], **kw)
    assert plan.stages[0].memory_bytes == need and plan.stages[0].cache_bytes == 0
    cached = NodeSpec("a", need + GiB, cache_bytes=GiB)
    with pytest.raises(PlanError) as info:
        make_plan(lay, [cached], **kw)
    assert info.value.missing_bytes == GiB
    assert "prefix cache" in str(info.value) and "--hot-cache-max-size" in str(info.value)
    # Given the memory for it, the stage shows the cache in what it uses.
    plan = make_plan(lay, [NodeSpec("a", need + 2 * GiB, cache_bytes=GiB)], **kw)
    stage = plan.stages[0]
    assert (stage.cache_bytes, stage.memory_bytes, stage.memory_budget) == (
        GiB, need + GiB, need + GiB)
    assert "prefix cache 1.00 GiB" in "\n".join(plan.explanation)


def test_refuses_when_the_total_fits_but_no_contiguous_split_does():
    lay = ModelLayout("chunky", 3, (6 * GiB,) * 3, 0 + 1, 0, 0, True, 0)
    nodes = [NodeSpec("a", 10 * GiB), NodeSpec("b", 10 * GiB)]
    with pytest.raises(PlanError) as info:
        make_plan(lay, nodes, os_reserve_bytes=0, context_tokens=0)
    assert info.value.missing_bytes == 0
    assert "no contiguous split fits" in str(info.value)
    assert info.value.missing_by_node  # some node of the closest split is over


def test_user_split_is_validated_and_explained():
    lay = uniform_layout(L=9)
    nodes = [NodeSpec("a", 64 * GiB, 100.0), NodeSpec("b", 64 * GiB, 300.0),
             NodeSpec("c", 64 * GiB, 100.0)]
    kw = dict(context_tokens=1024, max_sequences=1)
    plan = make_plan(lay, nodes, split=[1, 6, 2], **kw)
    assert [(s.node, s.layer_start, s.layer_end) for s in plan.stages] == [
        ("a", 0, 1), ("b", 1, 7), ("c", 7, 9)
    ]
    text = "\n".join(plan.explanation)
    assert "Split given by the user: [1, 6, 2]" in text and "The optimal split" in text
    assert plan.bottleneck_ms >= make_plan(lay, nodes, **kw).bottleneck_ms

    with pytest.raises(PlanError, match=r"covers 8 layers but uniform has 9"):
        make_plan(lay, nodes, split=[1, 5, 2], **kw)
    with pytest.raises(PlanError, match=r"gives b no layers \(an empty stage\)"):
        make_plan(lay, nodes, split=[4, 0, 5], **kw)
    with pytest.raises(PlanError, match=r"has 2 entries but there are 3 nodes"):
        make_plan(lay, nodes, split=[4, 5], **kw)
    with pytest.raises(PlanError, match=r"counts must be positive"):
        make_plan(lay, nodes, split=[4, 6, -1], **kw)
    small = [NodeSpec("a", 64 * GiB), NodeSpec("b", 4 * GiB), NodeSpec("c", 64 * GiB)]
    with pytest.raises(PlanError) as info:
        make_plan(lay, small, split=[1, 6, 2], os_reserve_bytes=0, **kw)
    assert set(info.value.missing_by_node) == {"b"}
    assert "for the split [1, 6, 2]" in str(info.value) and "b: layers [1, 7)" in str(info.value)
    # A node whose reserve and prefix cache take more than its memory says so, and by how much
    # (its shortfall is that plus what its layers need).
    under = [NodeSpec("a", 64 * GiB), NodeSpec("b", 4 * GiB, cache_bytes=GiB),
             NodeSpec("c", 64 * GiB)]
    with pytest.raises(PlanError) as info:
        make_plan(lay, under, split=[1, 6, 2], os_reserve_bytes=8 * GiB, **kw)
    assert ("b: layers [1, 7) need" in str(info.value) and "no room: the 8.00 GiB OS reserve "
            "and the 1.00 GiB prefix cache take 5.00 GiB more than the node's 4.00 GiB"
            in str(info.value))


def test_single_node_holds_a_tied_embedding_once_and_pays_no_link():
    lay = uniform_layout(L=4, tied=True)
    plan = make_plan(lay, [NodeSpec("solo", 64 * GiB, 100.0, link_ms=5.0)])
    (stage,) = plan.stages
    assert stage.weight_bytes == sum(lay.layer_bytes) + lay.embed_bytes + lay.norm_bytes
    assert stage.est_ms == pytest.approx(stage_ms(lay, NodeSpec("x", 1, 100.0, 5.0), 0, 4))
    two = make_plan(lay, [NodeSpec("a", 64 * GiB, 100.0), NodeSpec("b", 64 * GiB, 100.0)])
    assert two.stages[-1].weight_bytes == (
        sum(lay.layer_bytes[two.stages[-1].layer_start:]) + lay.embed_bytes + lay.norm_bytes
    )


def test_plan_hash_is_stable_documented_and_sensitive_to_ranges():
    lay = uniform_layout(L=9)
    nodes = [NodeSpec("a", 64 * GiB), NodeSpec("b", 64 * GiB), NodeSpec("c", 64 * GiB)]
    plan = make_plan(lay, nodes, split=[1, 6, 2])
    canonical = '{"model_id":"uniform","stages":[["a",0,1],["b",1,7],["c",7,9]],"v":1}'
    assert plan.plan_hash == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert plan.plan_hash == make_plan(lay, nodes, split=[1, 6, 2]).plan_hash
    assert len(plan.plan_hash) == 16
    # Ranges, node names and the model change it; speeds and budgets do not.
    assert make_plan(lay, nodes, split=[2, 5, 2]).plan_hash != plan.plan_hash
    renamed = [NodeSpec("a", 64 * GiB), NodeSpec("b2", 64 * GiB), NodeSpec("c", 64 * GiB)]
    assert make_plan(lay, renamed, split=[1, 6, 2]).plan_hash != plan.plan_hash
    faster = [NodeSpec(n.name, 96 * GiB, speed=9.0) for n in nodes]
    assert make_plan(lay, faster, split=[1, 6, 2]).plan_hash == plan.plan_hash
    assert compute_plan_hash("other", [("a", 0, 1), ("b", 1, 7), ("c", 7, 9)]) != plan.plan_hash

    again = Plan.from_json(plan.to_json())
    assert again == plan and json.loads(plan.to_json())["plan_hash"] == plan.plan_hash
    tampered = json.loads(plan.to_json())
    tampered["stages"][0]["layer_end"] = 2
    with pytest.raises(PlanError, match="does not match"):
        Plan.from_json(json.dumps(tampered))


def test_format_plan_shows_the_stages_and_the_reasoning():
    lay = uniform_layout(L=8)
    nodes = [NodeSpec("mac1", 64 * GiB, 200.0, 0.5), NodeSpec("mac2", 32 * GiB, 100.0, 0.5)]
    text = format_plan(make_plan(lay, nodes, context_tokens=1024))
    for piece in ("mac1", "mac2", "[0,", "Bottleneck", "RAM-proportional", "Even split"):
        assert piece in text


def test_planner_modules_do_not_import_mlx():
    code = (
        "import sys, omlx_coordinator.planning.planner, omlx_coordinator.planning.model_layout, omlx_node.calibrate;"
        "assert not any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules), 'mlx imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


# ------------------------------------------------------------------ read_layout


def file_tensor_bytes(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "numpy") as f:
            total += sum(f.get_tensor(k).nbytes for k in f.keys())
    return total


@pytest.mark.parametrize("bits", [None, 4])
def test_read_layout_on_tiny_llama(tmp_path: Path, bits: int | None):
    from tests.tiny_models import build_model

    folder = build_model(tmp_path / "m", family="llama", num_layers=3, quantize_bits=bits)
    lay = read_layout(folder)
    assert lay.model_id == "m" and lay.num_layers == 3 and not lay.tied_embeddings
    assert (
        sum(lay.layer_bytes) + lay.embed_bytes + lay.head_bytes + lay.norm_bytes
        == file_tensor_bytes(folder)
    )
    assert len(set(lay.layer_bytes)) == 1  # identical layers
    assert lay.norm_bytes == 64 * 4  # hidden 64, float32
    if bits is None:
        assert lay.embed_bytes == lay.head_bytes == 384 * 64 * 4
    else:  # packed 4-bit weights + float32 scales and biases per group of 32
        assert lay.embed_bytes == 384 * 64 // 2 + 2 * 384 * (64 // 32) * 4
    # 2 (K and V) x 2 KV heads x head_dim 64/4 x 2 bytes
    assert lay.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 2
    assert read_layout(folder, kv_dtype_bytes=4).kv_bytes_per_token_per_layer == 2 * 2 * 16 * 4


def test_read_layout_sharded_tied_qwen3(tmp_path: Path):
    from safetensors.numpy import load_file, save_file

    from tests.tiny_models import build_model

    folder = build_model(tmp_path / "q", family="qwen3", num_layers=4, quantize_bits=4)
    whole = read_layout(folder, model_id="qwen-tiny")
    assert whole.tied_embeddings and whole.head_bytes == 0 and whole.model_id == "qwen-tiny"
    assert whole.kv_bytes_per_token_per_layer == 2 * 2 * 16 * 2  # head_dim from the config

    # Re-shard into two files with an index, as large checkpoints ship.
    tensors = load_file(str(folder / "model.safetensors"))
    names = sorted(tensors)
    parts = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(folder / fname))
        weight_map.update({k: fname for k in keys})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = read_layout(folder, model_id="qwen-tiny")
    assert sharded == whole
    assert sum(sharded.layer_bytes) + sharded.embed_bytes + sharded.norm_bytes == (
        file_tensor_bytes(folder)
    )


def test_read_layout_refuses_tensors_it_cannot_place(tmp_path: Path):
    import numpy as np
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2}
    ))
    save_file({
        "model.embed_tokens.weight": np.zeros((4, 8), np.float16),
        "model.layers.0.mlp.weight": np.zeros((8, 8), np.float16),
        "speculator.proj.weight": np.zeros((8, 8), np.float16),
        # mlx-lm's multimodal wrappers drop their vision parts: nothing to place.
        "vision_tower.patch.weight": np.zeros((8, 8), np.float16),
    }, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="speculator.proj.weight") as err:
        read_layout(tmp_path)
    assert "vision_tower" not in str(err.value)


def routed_bytes(folder: Path, layer: int) -> int:
    """Bytes of a layer's routed experts (not its shared experts), read from the file."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "numpy") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys()
                   if f".layers.{layer}." in k and (".switch_mlp." in k or ".experts." in k))


def test_read_layout_sizes_each_layer_cache_as_its_family_keeps_it(tmp_path: Path):
    from tests.tiny_models import build_model

    full = 2 * 2 * 16 * 2  # keys + values x 2 KV heads x head_dim 16 x 2 bytes
    window = LayerKV(full, window=8)
    # gpt-oss alternates sliding-window and full layers; Gemma 3 here globalises every 2nd.
    for family in ("gpt_oss", "gemma3_text"):
        lay = read_layout(build_model(tmp_path / family, family, num_layers=4))
        assert lay.layer_kv == (window, LayerKV(full)) * 2, family
        assert lay.kv_bytes(0, 4096) == 8 * full and lay.kv_bytes(1, 4096) == 4096 * full
    # MLA caches one latent (rank 16) and one RoPE key (8 dims) per token for all heads.
    lay = read_layout(build_model(tmp_path / "ds", "deepseek_v3", num_layers=4))
    assert lay.layer_kv == (LayerKV((16 + 8) * 2),) * 4
    # Gated DeltaNet layers: a conv window of 3 over q, k, v (2x2x16 + 4x16 channels, 2 bytes)
    # and a float32 state of 4 value heads x 16 x 16, whatever the context.
    lay = read_layout(build_model(tmp_path / "qn", "qwen3_next", num_layers=4))
    linear = LayerKV(0, state_bytes=3 * (2 * 2 * 16 + 4 * 16) * 2 + 4 * 16 * 16 * 4)
    assert lay.layer_kv == (linear, LayerKV(full)) * 2
    assert lay.kv_bytes(0, 10) == lay.kv_bytes(0, 100_000)
    # A dense family keeps the simple form.
    assert read_layout(build_model(tmp_path / "l", "llama", num_layers=2)).layer_kv == ()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral", "gpt_oss"])
def test_read_layout_streams_routed_experts_at_their_active_share(tmp_path: Path, family: str):
    """2 of 4 experts per token: a decode step streams half of the routed experts' bytes, all
    of the shared experts, the router and attention; memory holds every expert."""
    from tests.tiny_models import build_model

    folder = build_model(tmp_path / family, family, num_layers=4)
    lay = read_layout(folder)
    assert sum(lay.layer_bytes) + lay.embed_bytes + lay.head_bytes + lay.norm_bytes == (
        file_tensor_bytes(folder))
    for i in range(4):
        routed = routed_bytes(folder, i)
        assert lay.stream_bytes(i) == lay.layer_bytes[i] - routed // 2, (family, i)
    if family in ("qwen3_moe", "deepseek_v3"):  # their first layer is dense
        assert lay.stream_bytes(0) == lay.layer_bytes[0]


def test_plan_reserves_kv_by_layer_kind_and_times_active_experts():
    full, window = LayerKV(4096), LayerKV(4096, window=1024)
    lay = ModelLayout("swa-moe", 4, (1 * GiB,) * 4, 64 * MiB, 64 * MiB, 4096, False, 4096,
                      layer_kv=(window, full, window, full),
                      layer_stream_bytes=(GiB // 4,) * 4)
    plan = make_plan(lay, [NodeSpec("a", 64 * GiB, speed=100.0)], os_reserve_bytes=RESERVE,
                     context_tokens=8192, max_sequences=4)
    (stage,) = plan.stages
    assert stage.kv_bytes == 4 * (2 * 4096 * 1024 + 2 * 4096 * 8192)
    streamed = GiB + 4096 + 64 * MiB  # active layer bytes, norm, head
    assert stage.est_ms == pytest.approx(streamed / 100e9 * 1e3)
    text = "\n".join(plan.explanation)
    assert "per full-attention layer; sliding-window and linear-attention layers hold less" in text
    assert "Mixture of experts: a decode step streams" in text
    with pytest.raises(ValueError, match="2 layer caches"):
        ModelLayout("bad", 4, (1,) * 4, 1, 1, 1, False, 1, layer_kv=(full, full))


# ------------------------------------------------------------------ CLI parsing


def test_parse_node_arg():
    assert parse_node_arg("mac1=64GiB,speed=2.5,link_ms=0.6") == NodeSpec(
        "mac1", 64 * GiB, 2.5, 0.6
    )
    assert parse_node_arg("m2=96GB") == NodeSpec("m2", 96 * 10**9)
    assert parse_node_arg("m3=512MiB,link_ms=3") == NodeSpec("m3", 512 * MiB, 1.0, 3.0)
    assert parse_node_arg("m4=1.5TiB").memory_bytes == int(1.5 * (1 << 40))
    assert parse_node_arg("m5=16GiB,weights=8GiB,disk_gbps=5") == NodeSpec(
        "m5", 16 * GiB, weights_cap=8 * GiB, disk_gbps=5.0)
    assert parse_node_arg("m6=16GiB,speed=5,layer_ms=0.6") == NodeSpec(
        "m6", 16 * GiB, 5.0, layer_ms=0.6)
    assert parse_size("16 gib") == 16 * GiB
    for bad, why in [
        ("mac1", "NAME=MEM"),
        ("=64GiB", "NAME=MEM"),
        ("mac1=64", "not a number with a unit"),
        ("mac1=64G", "unknown unit 'G'"),
        ("mac1=64GiB,speed=fast", "'speed=fast' is not a number"),
        ("mac1=64GiB,speed=0", "speed must be a positive"),
        ("mac1=64GiB,link_ms=-1", "link_ms must be >= 0"),
        ("mac1=64GiB,layer_ms=-0.5", "layer_ms must be >= 0"),
        ("mac1=64GiB,color=red", "unknown option 'color=red'"),
        ("mac1=64GiB,speed=1,speed=2", "speed given twice"),
        ("mac1=64GiB,weights=8", "'weights=8' is not a size"),
        ("mac1=64GiB,disk_gbps=0", "disk_gbps > 0"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_node_arg(bad)


# ------------------------------------------------------------------ calibration (MLX)


def test_measure_speed_returns_bytes_per_second():
    pytest.importorskip("mlx.core")
    from omlx_node.calibrate import measure_speed

    speed = measure_speed(seconds=0.05, dim=256, matrices=2)
    assert math.isfinite(speed) and speed > 1e6  # any machine streams more than 1 MB/s


@pytest.mark.parametrize("tie", [True, None])
def test_a_head_mlx_lm_drops_is_not_planned(tmp_path: Path, tie: bool | None):
    """A config that ties the head (or, for llama, says nothing) makes mlx-lm drop an lm_head
    tensor the checkpoint ships: the last stage then holds the embedding instead."""
    from tests.tiny_models import build_model

    folder = build_model(tmp_path / "m", family="llama", num_layers=2)
    config = json.loads((folder / "config.json").read_text())
    if tie is None:
        del config["tie_word_embeddings"]
    else:
        config["tie_word_embeddings"] = tie
    (folder / "config.json").write_text(json.dumps(config))
    lay = read_layout(folder)
    assert lay.tied_embeddings and lay.head_bytes == 0
    assert lay.total_weight_bytes == file_tensor_bytes(folder) - lay.embed_bytes  # lm_head: same size
