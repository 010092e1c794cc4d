"""When the rebalancer moves a pipeline's layers, and to which split: `decide`, a pure function.

The readings of every stage's counters (`Reading`), the active plan, the model's layout and each
node's memory budget in; whether to move, to which plan, and why (with its numbers) out. Three
rules, each its own function below, in the order they are asked: memory pressure
(`_pressure`), then imbalance (`_imbalance`), whose gain must be `_sustained` over the window
and wait out the cooldown; where the model's layout is the planner's to choose (`--parallel
auto`), the layout (`_relayout`) comes before imbalance and is the only rule of a tensor
layout. omlx_coordinator/telemetry/rebalancer.py reads the counters and applies what
this decides; its docstring says how speeds are measured and why each rule holds.
"""

from __future__ import annotations

import functools
import itertools
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from omlx_coordinator.planning.disk_layers import DEFAULT_DISK_GBPS, disk_ms
from omlx_coordinator.planning.layout_choice import candidates
from omlx_coordinator.planning.links import MeasuredLinks, with_links
from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_coordinator.planning.planner import GB, NodeSpec, Plan, PlanError, make_plan
from omlx_coordinator.planning.tensor_plan import collectives_per_token, rank_stream_bytes

# Timed decode steps (one in 8 is timed) a stage needs in an interval for its mean to count.
MIN_STEPS = 2
FOOTPRINT_SHARE = 0.9
SHED_SHARE = 0.75
BACK_FACTOR = 2.0
# The window is judged in this many parts, each on its own: a slowdown must show in all of
# them (a spike, or noise, in one holds), while each part spans enough readings to average out
# the one-in-8 timing of single steps.
SUSTAIN_PARTS = 3
# What each memory_pressure source reads at the OS's "warning": Linux PSI, a tenth of the last
# 10 s with some task stalled on memory; macOS, under a quarter of memory available (the level
# where it starts compressing hard and swapping follows).
PRESSURE_LEVELS = {"psi_some_avg10": 0.10, "memorystatus_level": 0.75}
DEFAULT_PRESSURE_LEVEL = 0.10
# Memory does not bound a stage's cost: costing a split asks the planner with unlimited memory.
_UNLIMITED = 1 << 62
# The least of a streaming stage's measured step counted as compute: a disk that reads faster
# than measured at join (its pages still cached) must not make the compute look free.
MIN_COMPUTE_SHARE = 0.1


@dataclass(frozen=True)
class Policy:
    threshold: float = 0.15  # predicted bottleneck gain (a share) a move must beat
    window: float = 60.0  # seconds the gain must hold
    cooldown: float = 300.0  # seconds from one move to the next (imbalance)
    pressure_window: float = 10.0  # seconds memory pressure must hold

    def __post_init__(self) -> None:
        if not 0 < self.threshold < 1:
            raise ValueError(f"the rebalance threshold must be between 0 and 1, not "
                             f"{self.threshold}")
        if min(self.window, self.pressure_window) <= 0 or self.cooldown < 0:
            raise ValueError("the rebalance window must be > 0 s and the cooldown >= 0 s")


@dataclass(frozen=True)
class StageReading:
    """One stage's counters at one reading (cumulative, as the stage exports them)."""

    node: str
    decode_seconds: float  # omlx_node_stage_compute_seconds_sum{kind="decode"}
    decode_steps: float  # ..._count (the timed steps, one in 8)
    footprint_bytes: float | None = None
    pressure: float | None = None
    pressure_source: str = ""
    steps: float = 0.0  # omlx_node_stage_steps_total{kind="decode"}: every step
    wait_seconds: float = 0.0  # omlx_node_stage_receive_wait_seconds_sum{kind="decode"}
    wait_steps: float = 0.0  # ..._count
    draft_seconds: float = 0.0  # omlx_node_stage_draft_seconds_total{kind="decode"}
    prefill_seconds: float = 0.0  # omlx_node_stage_compute_seconds_sum{kind="prefill"}


@dataclass(frozen=True)
class Reading:
    at: float  # seconds, one clock for every reading
    plan_hash: str
    stages: tuple[StageReading, ...]
    # Requests were on the plan when it was read. Only an interval between two busy readings
    # measures: one in which the load ended (or began) counts idle wall time as step time, and
    # a node measured that way looks slower than it is to every later plan.
    busy: bool = True


@dataclass(frozen=True)
class NodeState:
    """A node the plan may use: the memory a plan may take of it now, its calibrated speed
    (GB/s), and the memory it has for the model (its footprint is held against this one, not
    against a budget lowered by shedding; 0: budget_bytes), what its shard worker keeps
    for its RAM prefix cache (NodeSpec.cache_bytes), its --weights-memory (0: none) and its
    disk's read speed (GB/s), which a stage streaming layers from it pays."""

    name: str
    budget_bytes: int
    speed: float = 1.0
    memory_bytes: int = 0
    cache_bytes: int = 0
    weights_cap: int = 0
    disk_gbps: float = DEFAULT_DISK_GBPS


@dataclass(frozen=True)
class Decision:
    move: bool
    reason: str  # why it moves: "imbalance", "memory_pressure" or "layout"; "" when it holds
    why: str
    speeds: dict[str, float] = field(default_factory=dict)  # GB/s each node is planned at
    measured: tuple[str, ...] = ()  # the nodes whose speed this window measured
    scale: float = 1.0  # measured / calibrated speed (median over the measured nodes)
    ms_per_layer: dict[str, float] = field(default_factory=dict)  # measured nodes
    current_bottleneck_s: float | None = None
    best_bottleneck_s: float | None = None
    current: Plan | None = None
    plan: Plan | None = None  # the best split for these speeds, even when holding
    budgets: dict[str, int] = field(default_factory=dict)

    @property
    def gain(self) -> float | None:
        """The predicted bottleneck's improvement, as a share of the current one."""
        if not self.current_bottleneck_s or self.best_bottleneck_s is None:
            return None
        return 1 - self.best_bottleneck_s / self.current_bottleneck_s

    def to_dict(self) -> dict:
        def ranges(p: Plan | None) -> list | None:
            return [[s.node, s.layer_start, s.layer_end] for s in p.stages] if p else None

        return {"move": self.move, "reason": self.reason or None, "why": self.why,
                "speeds_gbps": self.speeds, "measured": list(self.measured),
                "ms_per_layer": self.ms_per_layer,
                "current_bottleneck_seconds": self.current_bottleneck_s,
                "best_bottleneck_seconds": self.best_bottleneck_s, "gain": self.gain,
                "current": ranges(self.current), "proposed": ranges(self.plan),
                "proposed_plan_hash": self.plan.plan_hash if self.plan else None,
                "budgets": self.budgets}



def stage_bytes(layout: ModelLayout, plan: Plan) -> dict[str, float]:
    """Bytes each stage of `plan` streams per decode step in the planner's cost model: its
    estimate at 1 GB/s (ms at 1 GB/s = bytes / 1e6). Asking the planner keeps one cost model."""
    return dict(_stage_bytes(layout, tuple(s.node for s in plan.stages), tuple(plan.split)))


@functools.lru_cache(maxsize=64)  # every tick asks again for the same plan
def _stage_bytes(layout: ModelLayout, nodes: tuple[str, ...],
                 split: tuple[int, ...]) -> tuple[tuple[str, float], ...]:
    costed = make_plan(layout, [NodeSpec(n, _UNLIMITED) for n in nodes], os_reserve_bytes=0,
                       split=list(split))
    return tuple((s.node, s.est_ms * 1e6) for s in costed.stages)


def read_seconds(layout: ModelLayout, plan: Plan, nodes: Mapping[str, NodeState]
                 ) -> dict[str, float]:
    """Seconds each stage of `plan` spends a decode step reading its streamed layers, as the
    planner counts them (at batch 1, at its node's disk speed); 0 for a stage that streams
    none."""
    out = {}
    for s in plan.stages:
        read = sum(layout.read_bytes(i) for i in range(s.layer_end - s.streamed_layers,
                                                       s.layer_end))
        node = nodes.get(s.node)
        out[s.node] = disk_ms(read, node.disk_gbps if node else DEFAULT_DISK_GBPS) / 1e3
    return out


def _compute_seconds(step: float, aside: float) -> float:
    """A stage's step time less what is not its layers' compute (`aside`: its disk reads and
    its drafting): what its speed is derived from."""
    return max(step - aside, MIN_COMPUTE_SHARE * step)


def _speeds(step_s: Mapping[str, float], nbytes: Mapping[str, float],
            reads: Mapping[str, float], head: str, drafting: float) -> dict[str, float]:
    """GB/s each stage's node ran at, in the planner's units: its bytes over its step time
    (`step_s`) less its disk reads and, on the `head`, its drafting."""
    return {n: nbytes[n] / _compute_seconds(t, reads[n] + (drafting if n == head else 0.0))
            / 1e9 for n, t in step_s.items()}


def _bottleneck(plan: Plan, stage_s: Mapping[str, float], drafting: float) -> float:
    """The slowest stage of `plan`, each taking `stage_s` seconds a step (layers and reads),
    its head `drafting` seconds more."""
    return max(stage_s[s.node] + (drafting if i == 0 else 0.0)
               for i, s in enumerate(plan.stages))


def _covering(readings: Sequence[Reading], now: float, span: float) -> list[Reading] | None:
    """The readings of the last `span` seconds, from the latest one at or before its start (so
    that the intervals cover it whole); None when the readings do not reach back that far."""
    base = [i for i, r in enumerate(readings) if r.at <= now - span]
    return list(readings[base[-1]:]) if base else None


def _pressured(s: StageReading, budget: int) -> str | None:
    """Why this reading says the stage is short of memory (`budget`: what its node has for the
    model), or None."""
    level = PRESSURE_LEVELS.get(s.pressure_source, DEFAULT_PRESSURE_LEVEL)
    if s.pressure is not None and s.pressure >= level:
        return f"{s.pressure_source or 'pressure'} {s.pressure:.2f} >= {level:.2f}"
    if s.footprint_bytes is not None and budget > 0 and s.footprint_bytes >= FOOTPRINT_SHARE * budget:
        return (f"footprint {s.footprint_bytes / 2**20:.0f} MiB >= {FOOTPRINT_SHARE:.0%} of "
                f"its {budget / 2**20:.0f} MiB budget")
    return None

@dataclass(frozen=True)
class Delta:
    """One stage's counters over an interval (or a sum of intervals)."""

    seconds: float = 0.0  # wall time
    compute: float = 0.0  # timed decode compute seconds
    timed: float = 0.0  # timed decode steps
    wait: float = 0.0  # seconds waiting for its input
    waited: float = 0.0  # steps that waited
    steps: float = 0.0  # every decode step
    draft: float = 0.0  # seconds drafting
    prefill: float = 0.0  # seconds the pipeline prefilled: every stage's prefill compute

    def __add__(self, other: Delta) -> Delta:
        return Delta(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(Delta)))

    def own_seconds(self) -> float | None:
        """The stage's own time per decode step, or None with too few timed steps. Its timed
        compute misses what a loaded machine costs it outside its layers (Python, sends, a CPU
        quota's stalls), so: a step's period (every stage of a pipeline runs as many steps)
        less the wait for its input, which is what the slowest stage leaves the others; at
        least its compute. The period is of the wall time less the pipeline's prefills: no
        decode step ran while a prompt chunk went through the stages, and right after a
        re-plan every request in flight is prefilled again (its prompt and what it had
        generated), which counted as decode time read the node as slow as the move's
        aftermath."""
        if self.timed < MIN_STEPS or self.compute <= 0:
            return None
        own = self.compute / self.timed
        decoding = self.seconds - self.prefill
        if self.steps > 0 and decoding > 0:
            own = max(own, decoding / self.steps - (self.wait / self.waited if self.waited else 0.0))
        return own

    def drafting(self) -> float:
        """Seconds a decode step spent drafting tokens (speculative decoding: a pipeline's
        head drafts for every row). The stage's own time holds them, but they are no part of
        its layers: its speed is derived without them, and they stay with whichever node heads
        a split the current one is compared with."""
        return self.draft / self.steps if self.steps > 0 else 0.0


def _deltas(a: Reading, b: Reading) -> dict[str, Delta] | None:
    """Each stage's counters between two readings; None when a counter went back (its worker
    restarted under the same plan). Every stage's `prefill` is the pipeline's: each stage's
    prefill compute summed, as if no two stages overlapped on a chunk (at most what the
    pipeline spent prefilling; a stage's own time is at least its timed compute anyway)."""
    before = {s.node: s for s in a.stages}
    out = {}
    for s in b.stages:
        p = before.get(s.node)
        if p is None:
            return None
        d = Delta(b.at - a.at, s.decode_seconds - p.decode_seconds, s.decode_steps - p.decode_steps,
                  s.wait_seconds - p.wait_seconds, s.wait_steps - p.wait_steps, s.steps - p.steps,
                  s.draft_seconds - p.draft_seconds, s.prefill_seconds - p.prefill_seconds)
        if min(getattr(d, f.name) for f in fields(Delta)) < 0:
            return None
        out[s.node] = d
    prefill = sum(d.prefill for d in out.values())
    out = {node: replace(d, prefill=prefill) for node, d in out.items()}
    return out


def _summed(intervals: Sequence[Mapping[str, Delta] | None]) -> dict[str, Delta]:
    total: dict[str, Delta] = {}
    for d in intervals:
        for node, value in (d or {}).items():
            total[node] = total.get(node, Delta()) + value
    return total


@dataclass
class _Measured:
    """What this plan's readings say: the input every rule decides on."""

    plan: Plan
    ours: list[Reading]  # this plan's readings, in time order
    window: list[Reading] | None  # those covering the last `window` seconds, None if too few
    intervals: list[dict[str, Delta] | None]  # between consecutive readings of the window
    nbytes: dict[str, float]  # each stage's bytes a step in the planner's cost model
    reads: dict[str, float]  # seconds each stage reads its streamed layers a step
    drafting: float  # seconds the head drafts a step
    step_s: dict[str, float]  # measured seconds a step, per stage with enough steps
    speeds: dict[str, float]  # GB/s each node is planned at
    measured: tuple[str, ...]
    scale: float
    current_s: float | None  # the measured bottleneck, once every stage has a measurement

    def shown(self) -> dict:
        """The Decision fields every rule reports."""
        ranges = {s.node: s for s in self.plan.stages}
        return {"speeds": self.speeds, "measured": self.measured, "scale": self.scale,
                "ms_per_layer": {n: self.step_s[n] * 1e3 / ranges[n].num_layers
                                 for n in self.measured},
                "current_bottleneck_s": self.current_s, "current": self.plan}


def _measure(ours: list[Reading], plan: Plan, layout: ModelLayout, nodes: Sequence[NodeState],
             now: float, policy: Policy, remembered: Mapping[str, float] | None) -> _Measured:
    window = _covering(ours, now, policy.window)
    span = window or ours  # not a full window yet: what there is, to show and to apply by hand
    intervals = [_deltas(a, b) if a.busy and b.busy else {}
                 for a, b in itertools.pairwise(span)]
    nbytes = stage_bytes(layout, plan)
    reads = read_seconds(layout, plan, {n.name: n for n in nodes})
    summed = _summed(intervals)
    step_s = {node: t for node, d in summed.items() if (t := d.own_seconds()) is not None}
    head = plan.stages[0].node
    drafting = summed[head].drafting() if head in summed else 0.0
    speeds = _speeds(step_s, nbytes, reads, head, drafting)
    measured = tuple(s.node for s in plan.stages if s.node in speeds)
    calibrated = {n.name: n.speed for n in nodes}
    ratios = [speeds[n] / calibrated[n] for n in measured if n in calibrated]
    scale = statistics.median(ratios) if ratios else 1.0
    for n in nodes:  # the nodes without a measurement of this plan
        if n.name not in speeds:
            speeds[n.name] = (remembered or {}).get(n.name) or n.speed * scale
    held = {s.node for s in plan.stages}
    current_s = max(step_s.values()) if len(measured) == len(held) else None
    return _Measured(plan, ours, window, intervals, nbytes, reads, drafting, step_s, speeds,
                     measured, scale, current_s)


def _best_plan(layout: ModelLayout, nodes: Sequence[NodeState], speeds: Mapping[str, float],
               budget: Mapping[str, int]) -> Plan:
    return make_plan(layout, [NodeSpec(n.name, budget[n.name], speeds[n.name],
                                       cache_bytes=n.cache_bytes, weights_cap=n.weights_cap,
                                       disk_gbps=n.disk_gbps) for n in nodes],
                     os_reserve_bytes=0)


def decide(readings: Sequence[Reading], plan: Plan | None, layout: ModelLayout,
           nodes: Sequence[NodeState], now: float, *, last_move_at: float | None = None,
           left_plan_hash: str | None = None, remembered: Mapping[str, float] | None = None,
           relayout: bool = False, links: MeasuredLinks | None = None,
           policy: Policy = Policy()) -> Decision:
    """Whether to move from `plan` now, and to what (see rebalancer.py's docstring for the
    rules).

    readings: in time order (others than `plan`'s are ignored); nodes: the nodes a plan may use,
    in ring order; last_move_at: when the last move happened (the readings' clock);
    left_plan_hash: the plan that move left; remembered: the speeds (GB/s) nodes were measured
    at before, for those without a stage now; relayout: the layout is the planner's to choose
    (`--parallel auto`), and may move; links: the links measured at join."""
    if plan is None:
        return Decision(False, "", "no plan serves")
    if plan.parallel != "pipeline" and not relayout:
        # Every rank holds a slice of every layer: there are no layer ranges to move.
        return Decision(False, "", f"a {plan.layout_name} layout has no layer ranges to move")
    budgets = {n.name: n.budget_bytes for n in nodes}
    held = {s.node for s in plan.stages}
    ours = [r for r in readings if r.plan_hash == plan.plan_hash
            and {s.node for s in r.stages} == held]
    if len(ours) < 2:
        return Decision(False, "", "measuring: this plan has fewer than 2 readings yet",
                        current=plan, budgets=budgets)
    if plan.parallel != "pipeline":
        speeds = {n.name: (remembered or {}).get(n.name) or n.speed for n in nodes}
        return _relayout(ours, plan, layout, nodes, {"speeds": speeds}, now, last_move_at,
                         left_plan_hash, links or {}, policy)
    m = _measure(ours, plan, layout, nodes, now, policy, remembered)
    pressed = _pressure(m, layout, nodes, now, last_move_at, policy)
    if pressed is not None:
        return pressed
    if relayout:
        moved = _relayout(ours, plan, layout, nodes, m.shown(), now, last_move_at,
                          left_plan_hash, links or {}, policy)
        if moved.move:
            return moved
    return _imbalance(m, layout, nodes, now, last_move_at, left_plan_hash, policy)


def _own(part: Mapping[str, Delta], plan: Plan) -> dict[str, float | None]:
    """Each stage's own seconds a decode step over `part` (None: too few steps)."""
    return {s.node: part[s.node].own_seconds() if s.node in part else None for s in plan.stages}


def _batch1_seconds(plan: Plan, own: Mapping[str, float]) -> float:
    """A token's time at batch 1: a pipeline's stages one after another, a tensor stage's
    ranks at once (each step's all-reduces inside every rank's step)."""
    times = [own[s.node] for s in plan.stages]
    return max(times) if plan.parallel == "tensor" else sum(times)


def _predicted_seconds(plan: Plan) -> float:
    """The planner's batch-1 token time for `plan` (layout_choice.py's candidates')."""
    return _batch1_seconds(plan, {s.node: s.est_ms / 1e3 for s in plan.stages})


def _respecified(plan: Plan, layout: ModelLayout, nodes: Sequence[NodeState],
                 speeds: Mapping[str, float], measured_s: float,
                 links: MeasuredLinks) -> list[NodeSpec]:
    """The nodes as the planner sees them with what was measured: their speeds, the links
    probed at join, and a tensor stage's all-reduces as timed: what its slowest rank's step
    took beyond reading its weights, spread over its messages, is each message's latency at
    least (a link slower under load than when it was probed)."""
    specs = with_links([NodeSpec(n.name, n.budget_bytes, speeds[n.name],
                                 cache_bytes=n.cache_bytes, weights_cap=n.weights_cap,
                                 disk_gbps=n.disk_gbps) for n in nodes], links)
    ranks = len(plan.stages)
    if plan.parallel != "tensor" or ranks < 2:
        return specs
    reads = max(rank_stream_bytes(layout, ranks) / (speeds[s.node] * GB) for s in plan.stages)
    # Each all-reduce 2(N-1) messages, a split head's all_gather N-1 (tensor_plan.py).
    messages = (collectives_per_token(layout) * 2 + (not layout.tied_embeddings)) * (ranks - 1)
    floor_ms = max(0.0, measured_s - reads) / messages * 1e3
    return [replace(nd, link_ms=max(nd.link_ms, floor_ms)) for nd in specs]


def _relayout(ours: list[Reading], plan: Plan, layout: ModelLayout, nodes: Sequence[NodeState],
              shown: dict, now: float, last_move_at: float | None, left_plan_hash: str | None,
              links: MeasuredLinks, policy: Policy) -> Decision:
    """Whether another layout (tensor for a pipeline; a pipeline or one node for a tensor
    stage) should serve: the current one's measured batch-1 token time misses its prediction
    by more than the threshold, and the best other layout, predicted again with the measured
    speeds and links, beats the measured time by more than the threshold (twice that to go
    back to the plan just left), in each part of the window, past the cooldown. `shown`: the
    Decision fields of what was measured, its `speeds` those each node is predicted at."""
    budgets = {n.name: n.budget_bytes for n in nodes}
    base = dict(shown, current=plan, budgets=budgets)
    window = _covering(ours, now, policy.window)
    if window is None:
        return Decision(False, "", f"measuring the {plan.layout_name} layout: "
                        f"{now - ours[0].at:.0f} s of the {policy.window:.0f} s window", **base)
    intervals = [_deltas(a, b) for a, b in itertools.pairwise(window)]
    if any(d is None for d in intervals):
        return Decision(False, "", "not sustained: a counter restarted", **base)
    own = _own(_summed(intervals), plan)
    if idle := [n for n, t in own.items() if t is None]:
        return Decision(False, "", f"measuring: too few decode steps on {', '.join(idle)}",
                        **base)
    measured_s, predicted_s = _batch1_seconds(plan, own), _predicted_seconds(plan)
    base["current_bottleneck_s"] = measured_s
    numbers = (f"{plan.layout_name} decodes {1 / measured_s:.2f} tok/s at batch 1, "
               f"{1 / predicted_s:.2f} predicted")
    if 1 - predicted_s / measured_s <= policy.threshold:
        return Decision(False, "", f"the layout decodes as predicted: {numbers}", **base)
    specs = _respecified(plan, layout, nodes, shown["speeds"], measured_s, links)
    others = [c for c in candidates(layout, specs, os_reserve_bytes=0)
              if c.plan is not None and c.plan.parallel != plan.parallel]
    if not others:
        return Decision(False, "", f"{numbers}, and no other layout can serve", **base)
    best = max(others, key=lambda c: c.tok_s)
    best_s = 1 / best.tok_s
    threshold = policy.threshold * (BACK_FACTOR if best.plan.plan_hash == left_plan_hash else 1)
    found = dict(base, plan=best.plan, best_bottleneck_s=best_s)
    numbers += (f"; {best.name} predicted {best.tok_s:.2f} tok/s with the measured speeds and "
                f"links: {1 - best_s / measured_s:+.0%}")
    if 1 - best_s / measured_s <= threshold:
        back = " to go back to the plan just left" if threshold > policy.threshold else ""
        return Decision(False, "", f"{numbers} (needs > {threshold:.0%}{back})", **found)
    for k, part in enumerate(_parts(window, intervals, now, policy)):
        times = _own(part, plan)
        if any(t is None for t in times.values()):
            return Decision(False, "", f"not sustained: too few decode steps in part {k + 1} "
                            f"of the window; {numbers}", **found)
        part_s = _batch1_seconds(plan, times)
        if 1 - best_s / part_s <= threshold or 1 - predicted_s / part_s <= policy.threshold:
            return Decision(False, "", f"not sustained: {1 / part_s:.2f} tok/s in part {k + 1} "
                            f"of the window (needs > {threshold:.0%} gain); {numbers}", **found)
    if last_move_at is not None and now - last_move_at < policy.cooldown:
        return Decision(False, "", f"cooldown: the last move was {now - last_move_at:.0f} s ago "
                        f"(< {policy.cooldown:.0f} s); {numbers}", **found)
    return Decision(True, "layout", f"layout over {policy.window:.0f} s: {numbers}", **found)


def _pressure(m: _Measured, layout: ModelLayout, nodes: Sequence[NodeState], now: float,
              last_move_at: float | None, policy: Policy) -> Decision | None:
    """Memory pressure first: it does not wait for the gain, only for the pressure to last.
    None when no stage is short of memory for the whole pressure window."""
    recent = _covering(m.ours, now, policy.pressure_window)
    if recent is None:
        return None
    budgets = {n.name: n.budget_bytes for n in nodes}
    memory = {n.name: n.memory_bytes or n.budget_bytes for n in nodes}
    short = {}
    for s in m.plan.stages:
        whys = [_pressured(st, memory.get(s.node, 0))
                for r in recent for st in r.stages if st.node == s.node]
        if whys and all(whys):
            short[s.node] = whys[-1]
    if not short:
        return None
    said = "; ".join(f"{n}: {w}" for n, w in short.items())
    base = dict(m.shown(), budgets=budgets)
    if len(short) == len(m.plan.stages):
        return Decision(False, "", f"every stage is short of memory ({said}): moving "
                        "layers cannot help", **base)
    if last_move_at is not None and now - last_move_at < policy.pressure_window:
        return Decision(False, "", f"memory pressure ({said}), but the last move was "
                        f"{now - last_move_at:.0f} s ago: settling", **base)
    ranges = {s.node: s for s in m.plan.stages}
    shed = {n: min(b, int(ranges[n].memory_bytes * SHED_SHARE)) if n in short else b
            for n, b in budgets.items()}
    try:
        target = _best_plan(layout, nodes, m.speeds, shed)
    except PlanError as e:
        return Decision(False, "", f"memory pressure ({said}), but no split sheds "
                        f"layers: {str(e).splitlines()[0]}", **base)
    return Decision(True, "memory_pressure",
                    f"memory pressure ({said}): {', '.join(short)} shed to "
                    f"{_split(target)} from {_split(m.plan)}", plan=target,
                    best_bottleneck_s=target.bottleneck_ms / 1e3,
                    **dict(base, budgets=shed))


def _imbalance(m: _Measured, layout: ModelLayout, nodes: Sequence[NodeState], now: float,
               last_move_at: float | None, left_plan_hash: str | None,
               policy: Policy) -> Decision:
    """Whether the best split for the measured speeds beats this one by enough, for long
    enough, and long enough after the last move."""
    budgets = {n.name: n.budget_bytes for n in nodes}
    base = dict(m.shown(), budgets=budgets)
    if m.current_s is None:
        idle = ", ".join(s.node for s in m.plan.stages if s.node not in m.step_s)
        return Decision(False, "", f"measuring: too few decode steps on {idle}", **base)
    try:
        target = _best_plan(layout, nodes, m.speeds, budgets)
    except PlanError as e:
        return Decision(False, "", f"no split fits: {str(e).splitlines()[0]}", **base)
    best_s = _bottleneck(target, {s.node: s.est_ms / 1e3 for s in target.stages}, m.drafting)
    found = dict(base, plan=target, best_bottleneck_s=best_s)
    gain = 1 - best_s / m.current_s
    numbers = (f"bottleneck {m.current_s * 1e3:.2f} ms now, {best_s * 1e3:.2f} ms predicted for "
               f"{_split(target)} (from {_split(m.plan)}): {gain:+.0%}")
    if target.plan_hash == m.plan.plan_hash:
        return Decision(False, "", f"the current split is the best for the measured speeds "
                        f"({_split(m.plan)})", **found)
    if m.window is None:
        return Decision(False, "", f"measuring: {now - m.ours[0].at:.0f} s of the "
                        f"{policy.window:.0f} s window; {numbers}", **found)
    threshold = policy.threshold * (BACK_FACTOR if target.plan_hash == left_plan_hash else 1)
    held = _sustained(m, layout, nodes, target, now, threshold, policy)
    if held is not None:
        return Decision(False, "", f"not sustained: {held}; {numbers}", **found)
    if last_move_at is not None and now - last_move_at < policy.cooldown:
        return Decision(False, "", f"cooldown: the last move was {now - last_move_at:.0f} s ago "
                        f"(< {policy.cooldown:.0f} s); {numbers}", **found)
    return Decision(True, "imbalance", f"imbalance over {policy.window:.0f} s: {numbers}",
                    **found)


def _sustained(m: _Measured, layout: ModelLayout, nodes: Sequence[NodeState], target: Plan,
               now: float, threshold: float, policy: Policy) -> str | None:
    """Each part of the window, costed on its own, must predict the gain: None when every part
    does, else why not."""
    assert m.window is not None
    target_bytes = stage_bytes(layout, target)
    target_reads = read_seconds(layout, target, {n.name: n for n in nodes})
    held = [s.node for s in m.plan.stages]
    if any(d is None for d in m.intervals):
        return "a counter restarted"
    for k, part in enumerate(_parts(m.window, m.intervals, now, policy)):
        lo = now - policy.window + k * policy.window / SUSTAIN_PARTS
        when = f"between {lo - now:+.0f} s and {lo + policy.window / SUSTAIN_PARTS - now:+.0f} s"
        own = {n: part[n].own_seconds() if n in part else None for n in held}
        if any(t is None for t in own.values()):
            return f"too few decode steps {when}"
        head = held[0]
        drafting = part[head].drafting()
        at = dict(m.speeds)
        at.update(_speeds(own, m.nbytes, m.reads, head, drafting))
        now_s = max(own.values())
        then_s = _bottleneck(target, {s.node: target_bytes[s.node] / at[s.node] / 1e9
                                      + target_reads[s.node] for s in target.stages}, drafting)
        if 1 - then_s / now_s <= threshold:
            return f"{1 - then_s / now_s:+.0%} {when} (needs > {threshold:.0%})"
    return None


def _parts(window: list[Reading], intervals: Sequence[Mapping[str, Delta]], now: float,
           policy: Policy) -> list[dict[str, Delta]]:
    """The window's intervals summed in SUSTAIN_PARTS parts of its time, each judged alone."""
    start = now - policy.window
    out = []
    for k in range(SUSTAIN_PARTS):
        lo = start + k * policy.window / SUSTAIN_PARTS
        hi = start + (k + 1) * policy.window / SUSTAIN_PARTS
        # The base interval opens part 0.
        out.append(_summed([d for (_, b), d in zip(itertools.pairwise(window), intervals)
                            if lo < b.at <= hi or (k == 0 and b.at <= lo)]))
    return out


def _split(plan: Plan) -> str:
    return " ".join(f"{s.node}[{s.layer_start},{s.layer_end})" for s in plan.stages)


