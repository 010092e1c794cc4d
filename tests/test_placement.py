"""Placement of several models over one cluster (omlx_coordinator/models/placement.py), on synthetic
topologies: shared budgets, replicas on disjoint nodes, the auto-replica rule, and LRU eviction.
Pure: no MLX, no I/O."""

from __future__ import annotations

import random

import pytest

from omlx_coordinator.models.placement import (
    EvictionError,
    LoadedModel,
    PlanSettings,
    decode_rate,
    eviction_order,
    free_budgets,
    held_by,
    place_evicting,
    place_model,
    plan_bytes,
)
from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_coordinator.planning.planner import GiB, NodeSpec, PlanError, compute_plan_hash, make_plan

# No OS reserve and no KV: a model's size is its weights, which keeps the arithmetic readable.
BARE = PlanSettings(os_reserve_bytes=0, context_tokens=0, max_sequences=8)


def model(gib: int, model_id: str = "m", layers: int | None = None) -> ModelLayout:
    """`gib` GiB of weights: one GiB per layer unless `layers` says otherwise, no embedding or
    head, so any split costs exactly its layers."""
    n = layers or gib
    return ModelLayout(model_id, n, (gib * GiB // n,) * n, 0, 0, 0, False, 0)


def nodes(*gibs: float, speeds: list[float] | None = None) -> list[NodeSpec]:
    return [NodeSpec(f"n{i}", int(g * GiB), (speeds or [1.0] * len(gibs))[i])
            for i, g in enumerate(gibs)]


def node_sets(plans) -> list[set[str]]:
    return [{s.node for s in p.stages} for p in plans]


def check_placement(layout, cluster, held, plans, settings) -> None:
    """Every replica covers every layer, replicas share no node, and on every node what they
    hold plus what others hold stays within its memory less the OS reserve."""
    for plan in plans:
        assert plan.stages[0].layer_start == 0 and plan.stages[-1].layer_end == layout.num_layers
        assert all(a.layer_end == b.layer_start for a, b in zip(plan.stages, plan.stages[1:]))
        assert plan.plan_hash == compute_plan_hash(
            layout.model_id, [(s.node, s.layer_start, s.layer_end) for s in plan.stages])
    sets = node_sets(plans)
    assert sum(len(s) for s in sets) == len(set().union(*sets)), "replicas share a node"
    ours = plan_bytes(*plans)
    for node in cluster:
        used = ours.get(node.name, 0) + held.get(node.name, 0)
        if node.name in ours:
            assert used <= node.memory_bytes - settings.os_reserve_bytes


# ------------------------------------------------------------------ budgets and bytes


def test_free_budgets_take_what_others_hold_off_each_node() -> None:
    cluster = nodes(64, 32, 16)
    free = free_budgets(cluster, {"n0": 10 * GiB, "n2": 20 * GiB, "gone": 5 * GiB})
    assert [n.name for n in free] == ["n0", "n1", "n2"]
    assert [n.memory_bytes for n in free] == [54 * GiB, 32 * GiB, 0]  # n2 overcommitted: 0
    assert [n.speed for n in free] == [n.speed for n in cluster]


def test_plan_bytes_is_what_the_stages_hold_and_sums_over_replicas() -> None:
    layout = ModelLayout("kv", 4, (GiB,) * 4, 100, 200, 7, False, 1000)
    settings = PlanSettings(os_reserve_bytes=0, context_tokens=10, max_sequences=2)
    plans = place_model(layout, nodes(3, 3, 5, 5), {}, replicas=2, settings=settings)
    per_plan = [plan_bytes(p) for p in plans]
    for plan, held in zip(plans, per_plan):
        assert sum(held.values()) == layout.total_weight_bytes + 4 * 1000 * 10 * 2
        assert held == {s.node: s.weight_bytes + s.kv_bytes for s in plan.stages}
    assert plan_bytes(*plans) == {**per_plan[0], **per_plan[1]}


def test_every_models_worker_on_a_node_pays_its_own_prefix_cache() -> None:
    """Each model's shard worker on a node keeps its own RAM prefix cache: two 6 GiB models fit
    a 16 GiB node with a 1 GiB cache per worker (14 GiB), not with 3 GiB each (18 GiB)."""
    cluster = [NodeSpec("n0", 16 * GiB, cache_bytes=GiB)]
    [first] = place_model(model(6, "a"), cluster, {}, settings=BARE)
    assert plan_bytes(first) == {"n0": 7 * GiB}  # its weights and its worker's cache
    [second] = place_model(model(6, "b"), cluster, plan_bytes(first), settings=BARE)
    assert plan_bytes(first, second) == {"n0": 14 * GiB}
    big = [NodeSpec("n0", 16 * GiB, cache_bytes=3 * GiB)]
    [first] = place_model(model(6, "a"), big, {}, settings=BARE)
    with pytest.raises(PlanError, match="prefix cache"):
        place_model(model(6, "b"), big, plan_bytes(first), settings=BARE)


def test_one_replica_is_the_planner_over_the_shared_budgets() -> None:
    layout, cluster, held = model(20), nodes(16, 16, 16), {"n0": 10 * GiB}
    [plan] = place_model(layout, cluster, held, settings=BARE)
    expected = make_plan(layout, free_budgets(cluster, held), os_reserve_bytes=0,
                         context_tokens=0, max_sequences=8)
    assert plan.plan_hash == expected.plan_hash
    assert plan_bytes(plan)["n0"] <= 6 * GiB  # n0 shares its 16 GiB with another model's 10


def test_a_user_split_places_one_replica_only() -> None:
    layout, cluster = model(8), nodes(8, 8)
    [plan] = place_model(layout, cluster, {}, split=[3, 5], settings=BARE)
    assert plan.split == [3, 5]
    with pytest.raises(PlanError, match="one pipeline"):
        place_model(layout, cluster, {}, replicas=2, split=[3, 5], settings=BARE)


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "two"])
def test_a_bad_replica_count_is_refused(bad) -> None:
    with pytest.raises(PlanError, match="replicas must be"):
        place_model(model(4), nodes(8), {}, replicas=bad, settings=BARE)


# ------------------------------------------------------------------ replicas


def test_replicas_take_disjoint_nodes_and_leftovers_join_where_they_help() -> None:
    layout, cluster = model(10), nodes(16, 16, 16)
    plans = place_model(layout, cluster, {}, replicas=2, settings=BARE)
    check_placement(layout, cluster, {}, plans, BARE)
    # Two single-node replicas; the third node lowers one replica's bottleneck, so it joins it
    # (as make_plan would use it for one replica).
    assert sorted(len(s) for s in node_sets(plans)) == [1, 2]


def test_replicas_are_carved_best_fit_so_the_next_one_still_fits() -> None:
    # 80 GiB on 60+60+30+30: taking the two big nodes for the first replica would leave 60 GiB,
    # too little for a second; best fit pairs each big node with a small one.
    layout, cluster = model(80), nodes(60, 60, 30, 30)
    plans = place_model(layout, cluster, {}, replicas=2, settings=BARE)
    check_placement(layout, cluster, {}, plans, BARE)
    assert sorted(sorted(s) for s in node_sets(plans)) == [["n0", "n2"], ["n1", "n3"]]


def test_what_other_models_hold_keeps_a_replica_off_a_node() -> None:
    layout, cluster = model(10), nodes(16, 16, 16)
    held = {"n1": 8 * GiB}  # n1 has 8 GiB left: too little for a 10 GiB replica of its own
    plans = place_model(layout, cluster, held, replicas=2, settings=BARE)
    check_placement(layout, cluster, held, plans, BARE)
    # n1's 8 GiB still serve as a stage of a replica, which it makes faster.
    assert node_sets(plans) == [{"n0", "n1"}, {"n2"}]


def test_too_many_replicas_names_the_shortfall() -> None:
    layout, cluster = model(10), nodes(16, 16, 6)
    with pytest.raises(PlanError) as err:
        place_model(layout, cluster, {}, replicas=3, settings=BARE)
    text = str(err.value)
    assert "2 of 3 replicas fit" in text
    assert "replica 3 does not fit on the nodes left (n2)" in text
    assert "Missing overall: 4.00 GiB" in text
    assert err.value.missing_bytes == 4 * GiB


def test_no_node_left_for_the_next_replica() -> None:
    with pytest.raises(PlanError, match="no node is left for replica 3, which needs at least "
                                        "10.00 GiB"):
        place_model(model(10), nodes(16, 16), {}, replicas=3, settings=BARE)


def test_a_model_that_fits_nowhere_names_the_shortfall_in_gib() -> None:
    cluster, held = nodes(16, 16), {"n0": 12 * GiB, "n1": 12 * GiB}
    for replicas in (1, 2, "auto"):
        with pytest.raises(PlanError, match=r"Missing overall: 2\.00 GiB") as err:
            place_model(model(10), cluster, held, replicas=replicas, settings=BARE)
        assert err.value.missing_bytes == 2 * GiB


# ------------------------------------------------------------------ auto


def test_auto_gives_one_replica_per_node_that_holds_the_model() -> None:
    layout, cluster = model(10), nodes(16, 16, 16, 16)
    plans = place_model(layout, cluster, {}, replicas="auto", settings=BARE)
    check_placement(layout, cluster, {}, plans, BARE)
    assert node_sets(plans) == [{"n0"}, {"n1"}, {"n2"}, {"n3"}]
    pipeline = place_model(layout, cluster, {}, replicas=1, settings=BARE)[0]
    assert len(pipeline.stages) == 4
    rate = sum(decode_rate(p, BARE) for p in plans)
    assert rate == pytest.approx(4 * decode_rate(pipeline, BARE))  # 4 batches against one


def test_auto_pairs_nodes_when_a_model_needs_two() -> None:
    layout, cluster = model(24), nodes(16, 16, 16, 16)
    plans = place_model(layout, cluster, {}, replicas="auto", settings=BARE)
    check_placement(layout, cluster, {}, plans, BARE)
    assert sorted(len(s) for s in node_sets(plans)) == [2, 2]


def test_auto_is_one_pipeline_when_the_model_needs_every_node() -> None:
    layout, cluster = model(40), nodes(16, 16, 16)
    [plan] = place_model(layout, cluster, {}, replicas="auto", settings=BARE)
    assert len(plan.stages) == 3


def test_auto_keeps_a_slow_node_as_its_own_replica_but_not_as_a_stage() -> None:
    layout = model(10, layers=100)  # fine layers: the slow node can take a few
    # Both hold the model: the slow node's replica adds its batch (10 + 1 speed units).
    plans = place_model(layout, nodes(16, 16, speeds=[10, 1]), {}, "auto", settings=BARE)
    assert node_sets(plans) == [{"n0"}, {"n1"}]
    # The slow node cannot hold it alone: as a stage it would only lengthen every token's trip
    # (the planner's one-pipeline plan uses it, to lower the bottleneck).
    cluster = nodes(16, 6, speeds=[10, 1])
    assert len(place_model(layout, cluster, {}, 1, settings=BARE)[0].stages) == 2
    [plan] = place_model(layout, cluster, {}, "auto", settings=BARE)
    assert [s.node for s in plan.stages] == ["n0"]


def test_auto_leaves_room_taken_by_other_models() -> None:
    layout, cluster = model(10), nodes(16, 16, 16)
    held = {"n1": 12 * GiB}
    plans = place_model(layout, cluster, held, replicas="auto", settings=BARE)
    check_placement(layout, cluster, held, plans, BARE)
    assert node_sets(plans) == [{"n0"}, {"n2"}]


def random_layout(rng: random.Random) -> ModelLayout:
    L = rng.randint(4, 12)
    tied = rng.random() < 0.4
    embed = rng.randint(1, 4) * GiB // 4
    return ModelLayout("r", L, tuple(rng.randint(1, 8) * GiB // 4 for _ in range(L)), embed,
                       0 if tied else embed, 4096, tied, rng.choice([0, 1024]))


def test_random_clusters_keep_every_budget_and_auto_is_the_best_candidate() -> None:
    rng = random.Random(12)
    placed = 0
    for _ in range(60):
        layout = random_layout(rng)
        settings = PlanSettings(os_reserve_bytes=rng.choice([0, GiB]), context_tokens=256,
                                max_sequences=rng.choice([1, 8]))
        size = layout.total_weight_bytes
        cluster = [NodeSpec(f"n{j}", int(size * rng.uniform(0.2, 1.3)) + settings.os_reserve_bytes,
                            rng.choice([0.5, 1.0, 4.0]), rng.choice([0.0, 0.5]))
                   for j in range(rng.randint(1, 5))]
        held = {n.name: int(n.memory_bytes * rng.uniform(0, 0.3)) for n in cluster
                if rng.random() < 0.5}
        rates = {}
        for replicas in (1, 2, 3, "auto"):
            try:
                plans = place_model(layout, cluster, held, replicas, settings=settings)
            except PlanError:
                continue
            assert len(plans) == (replicas if isinstance(replicas, int) else len(plans))
            check_placement(layout, cluster, held, plans, settings)
            rates[replicas] = sum(decode_rate(p, settings) for p in plans)
            placed += 1
        if "auto" in rates:
            assert rates["auto"] >= max(rates.values()) * (1 - 1e-9)
    assert placed > 60


# ------------------------------------------------------------------ eviction


def loaded(model_id: str, last_used: float, **by_node_gib) -> LoadedModel:
    return LoadedModel(model_id, {n: int(g * GiB) for n, g in by_node_gib.items()}, last_used)


def test_eviction_goes_least_recently_used_first_and_skips_pinned_and_busy() -> None:
    models = [
        loaded("old", 1, n0=4),
        LoadedModel("pinned", {"n0": 8 * GiB}, last_used=0, pinned=True),
        LoadedModel("busy", {"n0": 8 * GiB}, last_used=0.5, in_flight=2),
        loaded("mid", 2, n0=4),
        loaded("new", 3, n0=4),
    ]
    assert eviction_order(models, {"n0": 6 * GiB}) == ["old", "mid"]
    assert eviction_order(models, {"n0": 0}) == []
    assert eviction_order(models, {}) == []


def test_eviction_spares_a_model_the_others_make_unnecessary() -> None:
    # LRU takes "small" then "big"; "big" alone frees enough, so "small" is spared.
    models = [loaded("small", 1, n0=2), loaded("big", 2, n0=20), loaded("other", 0, n1=30)]
    assert eviction_order(models, {"n0": 10 * GiB}) == ["big"]
    # A model on another node never helps and is never evicted for it.
    assert eviction_order(models, {"n0": 1 * GiB}) == ["small"]


def test_eviction_needs_on_several_nodes() -> None:
    models = [loaded("a", 1, n0=5), loaded("b", 2, n1=5), loaded("c", 3, n0=5, n1=5)]
    assert eviction_order(models, {"n0": 4 * GiB, "n1": 4 * GiB}) == ["a", "b"]
    assert eviction_order(models, {"n0": 8 * GiB, "n1": 4 * GiB}) == ["a", "c"]


def test_eviction_that_cannot_make_room_names_the_shortfall_and_what_holds_it() -> None:
    models = [loaded("idle", 1, n0=4),
              LoadedModel("pinned", {"n0": 8 * GiB}, last_used=0, pinned=True),
              LoadedModel("busy", {"n1": 3 * GiB}, last_used=0, in_flight=1)]
    with pytest.raises(EvictionError) as err:
        eviction_order(models, {"n0": 10 * GiB, "n1": 1 * GiB})
    text = str(err.value)
    assert "n0: 6.00 GiB short; pinned or in use there: pinned (8.00 GiB, pinned)" in text
    assert "n1: 1.00 GiB short; pinned or in use there: busy (3.00 GiB, 1 in flight)" in text
    assert err.value.missing_by_node == {"n0": 6 * GiB, "n1": 1 * GiB}
    assert isinstance(err.value, PlanError)


def test_place_evicting_evicts_only_what_the_new_model_needs() -> None:
    cluster = nodes(16, 16)
    models = [loaded("a", 1, n0=12), loaded("b", 2, n1=12),
              LoadedModel("p", {"n0": 2 * GiB}, last_used=0, pinned=True)]
    # 10 GiB fits on neither node beside a and b: evicting a (the LRU) frees n0.
    plans, evicted = place_evicting(model(10), cluster, models, settings=BARE)
    assert evicted == ["a"]
    check_placement(model(10), cluster, held_by(models[1:]), plans, BARE)
    # 4 GiB fits beside them: nothing is evicted.
    plans, evicted = place_evicting(model(4), cluster, models, settings=BARE)
    assert evicted == [] and plans
    # Two replicas of 10 GiB need both nodes: both idle models go, oldest first.
    plans, evicted = place_evicting(model(10), cluster, models, 2, settings=BARE)
    assert evicted == ["a", "b"] and len(plans) == 2


def test_place_evicting_refuses_when_pinned_and_busy_models_hold_the_room() -> None:
    cluster = nodes(16, 16)
    models = [loaded("idle", 5, n0=4),
              LoadedModel("p", {"n0": 10 * GiB}, last_used=0, pinned=True),
              LoadedModel("busy", {"n1": 13 * GiB}, last_used=0, in_flight=3)]
    with pytest.raises(EvictionError) as err:
        place_evicting(model(10), cluster, models, settings=BARE)
    text = str(err.value)
    assert "even after evicting every idle unpinned model (idle)" in text
    assert "p (10.00 GiB, pinned), busy (13.00 GiB, 3 in flight)" in text
    assert "Missing overall: 1.00 GiB" in text and err.value.missing_bytes == 1 * GiB
    with pytest.raises(PlanError, match="replicas must be"):  # a bad request evicts nothing
        place_evicting(model(10), cluster, models, replicas=0, settings=BARE)
