"""The rebalancer's layout rule (omlx_coordinator/planning/rebalance_policy.py's `_relayout`) as a
pure function of synthetic measurements: a layout that decodes slower than predicted moves to
another layout predicted faster with what was measured, tensor to one node and pipeline to
tensor; a layout that decodes as predicted holds, and going back to the plan just left needs
twice the threshold."""

from __future__ import annotations

from omlx_coordinator.planning.layout_choice import plan_layout
from omlx_coordinator.planning.links import link_key, with_links
from omlx_coordinator.planning.planner import GiB, NodeSpec, Plan, make_plan
from omlx_coordinator.planning.rebalance_policy import (
    NodeState,
    Policy,
    Reading,
    StageReading,
    decide,
)
from omlx_coordinator.planning.tensor_plan import make_tensor_plan
from omlx_shared.link_probe import LinkMeasurement
from tests.helpers.layouts import layout

LAYOUT = layout()  # a llama of 32 layers, 16 GiB of them
POLICY = Policy(threshold=0.15, window=30, cooldown=0)
STEPS = 50  # timed decode steps a stage runs between two readings
NOW = 60.0


def nodes(memory_gib: int) -> list[NodeState]:
    return [NodeState(f"n{i}", memory_gib * GiB, speed=400.0) for i in range(2)]


def links(latency_us: float) -> dict:
    return {link_key("n0", "n1"): LinkMeasurement(10.0, latency_us, 8 << 20)}


def specs(states: list[NodeState], latency_us: float, speed: float | None = None
          ) -> list[NodeSpec]:
    return with_links([NodeSpec(n.name, n.budget_bytes, speed or n.speed) for n in states],
                      links(latency_us))


def readings(plan: Plan, own: dict[str, float], then: dict[str, float] | None = None,
             tick: float = 2.0) -> list[Reading]:
    """A reading every `tick` s up to NOW, each stage `STEPS` timed steps of `own[node]` s
    between two, or of `then[node]` s in the last third of the window."""
    out, totals = [], {s.node: 0.0 for s in plan.stages}
    for k in range(int(NOW / tick) + 1):
        step = then if then is not None and k * tick > NOW - POLICY.window / 3 else own
        if k:
            totals = {n: v + step[n] * STEPS for n, v in totals.items()}
        out.append(Reading(k * tick, plan.plan_hash, tuple(
            StageReading(s.node, totals[s.node], STEPS * k) for s in plan.stages)))
    return out


def as_planned(plan: Plan, slower: float = 1.0) -> dict[str, float]:
    """Each stage's own step as the plan predicts it, `slower` times."""
    return {s.node: s.est_ms / 1e3 * slower for s in plan.stages}


def test_a_tensor_stage_over_a_link_slower_than_probed_moves_to_one_node():
    """exo #2070's shape: two fast Macs, a model that fits one, a link probed fast (20 us) whose
    all-reduces take 350 us each under load."""
    states = nodes(64)
    tensor = plan_layout(LAYOUT, specs(states, 20.0), "auto", os_reserve_bytes=0)
    assert tensor.layout_name == "tensor x2"
    slow = make_tensor_plan(LAYOUT, specs(states, 350.0), os_reserve_bytes=0)
    d = decide(readings(tensor, as_planned(slow)), tensor, LAYOUT, states, NOW, relayout=True,
               links=links(20.0), policy=POLICY)
    assert d.move and d.reason == "layout", d.why
    assert d.plan.layout_name == "pipeline x1" and d.plan.parallel == "pipeline"
    assert "tensor x2 decodes 14.68 tok/s at batch 1, 40.21 predicted" in d.why
    assert "one node (n0) predicted 22.58 tok/s with the measured speeds and links" in d.why
    # Measured as predicted, it holds; and a layout the user named never moves.
    held = decide(readings(tensor, as_planned(tensor)), tensor, LAYOUT, states, NOW,
                  relayout=True, links=links(20.0), policy=POLICY)
    assert not held.move and held.why.startswith("the layout decodes as predicted")
    # Slow in two thirds of the window only: not sustained.
    spike = decide(readings(tensor, as_planned(slow), then=as_planned(tensor)), tensor, LAYOUT,
                   states, NOW, relayout=True, links=links(20.0), policy=POLICY)
    assert not spike.move and spike.why.startswith("not sustained: 40.21 tok/s in part 3"), \
        spike.why
    named = decide(readings(tensor, as_planned(slow)), tensor, LAYOUT, states, NOW,
                   links=links(20.0), policy=POLICY)
    assert not named.move and "has no layer ranges to move" in named.why


def test_a_pipeline_of_nodes_slower_than_calibrated_moves_to_tensor():
    """A model too big for one node over a 200 us link: a pipeline is predicted faster at the
    calibrated 400 GB/s; measured at 100 GB/s, the weight reads tensor halves outweigh its
    all-reduces."""
    states = nodes(20)
    pipeline = plan_layout(LAYOUT, specs(states, 200.0), "auto", os_reserve_bytes=0)
    assert pipeline.layout_name == "pipeline x2"
    measured = make_plan(LAYOUT, specs(states, 200.0, speed=100.0), os_reserve_bytes=0,
                         split=pipeline.split)
    d = decide(readings(pipeline, as_planned(measured)), pipeline, LAYOUT, states, NOW,
               relayout=True, links=links(200.0), policy=POLICY)
    assert d.move and d.reason == "layout", d.why
    assert d.plan.layout_name == "tensor x2"
    assert set(d.measured) == {"n0", "n1"} and all(
        abs(d.speeds[n] - 100.0) < 2.0 for n in d.measured)  # the speeds it predicted with
    # As predicted in the last third of the window: no layout move (imbalance has its say).
    held = decide(readings(pipeline, as_planned(measured), then=as_planned(pipeline)), pipeline,
                  LAYOUT, states, NOW, relayout=True, links=links(200.0), policy=POLICY)
    assert not held.move, held.why


def test_going_back_to_the_plan_just_left_needs_twice_the_threshold():
    """Moved from one node to tensor, whose all-reduces then take 250 us each, not the 20 us
    probed: one node is predicted 21% faster than the tensor stage measures, past the threshold
    and short of twice it, so the way back holds (and no other way is open)."""
    states = nodes(64)
    tensor = plan_layout(LAYOUT, specs(states, 20.0), "auto", os_reserve_bytes=0)
    one = plan_layout(LAYOUT, specs(states[:1], 20.0), "auto", os_reserve_bytes=0)
    assert (tensor.layout_name, one.layout_name) == ("tensor x2", "pipeline x1")
    slow = make_tensor_plan(LAYOUT, specs(states, 250.0), os_reserve_bytes=0)
    at = readings(tensor, as_planned(slow))
    ahead = decide(at, tensor, LAYOUT, states, NOW, relayout=True, links=links(20.0),
                   policy=POLICY)
    assert ahead.move and ahead.plan.plan_hash == one.plan_hash, ahead.why
    assert 0.15 < ahead.gain < 0.30, ahead.gain
    back = decide(at, tensor, LAYOUT, states, NOW, relayout=True, links=links(20.0),
                  left_plan_hash=one.plan_hash, policy=POLICY)
    assert not back.move and back.why.endswith("(needs > 30% to go back to the plan just left)"), back.why
    # And the cooldown holds it as imbalance's does.
    cooling = decide(at, tensor, LAYOUT, states, NOW, relayout=True, links=links(20.0),
                     last_move_at=NOW - 10, policy=Policy(threshold=0.15, window=30,
                                                          cooldown=300))
    assert not cooling.move and cooling.why.startswith("cooldown"), cooling.why
