"""The rebalancer: moves layers off nodes that measure slow, or short of memory, while serving.

Two halves. `decide` is pure: the readings of every stage's counters (`Reading`), the active
plan, the model's layout and each node's memory budget in; whether to move, to which plan, and
why (with its numbers) out. `Rebalancer` is the I/O around it: it reads the counters, either by
scraping each stage's /metrics (the addresses `Cluster.nodes` lists) or from a Prometheus
server's query API, calls `decide`, and applies a move through `Cluster.apply_plan`, the re-plan
path a node loss takes (weights of new ranges sent first, in-flight requests resumed, prefix
blocks of kept layers reused).

Speeds. A stage's real time per decode step is the mean of its timed decode steps
(`omlx_node_stage_compute_seconds{kind="decode"}`: sum / count between two readings, so the
reading's own timing does not matter). The planner costs a stage as the bytes it streams over
the node's speed; dividing the stage's bytes in that model by the measured time gives the
node's speed in the planner's own units (GB/s of weights under the current load, overheads
included), so the planner's prediction for the current split is what was measured, and its
best split over those speeds is comparable to it. A stage that streams layers from its disk
(`--weights-memory`) spends part of its step reading them: the planner's read time for them
(their bytes at the node's measured disk speed) is taken off its measured time before its
speed is derived, and the splits it is compared with are planned with each node's cap and disk,
read time included, so a streaming stage is not mistaken for a slow one, nor given layers its
cap cannot hold. A node with no stage in the plan keeps the
speed it was last measured at; one never measured is planned at its calibrated speed scaled as
the measured nodes' are (measured / calibrated), so units do not mix. In mode auto the
model's re-plans after a loss or a join split by these speeds too (`Deployment.speed`): a node
lost for its slowness, or restarted, comes back with the share it was measured for.

When to move (every rule is hysteresis against oscillation):
- imbalance: the best split's bottleneck beats the measured one by more than `threshold`, in
  each third of the last `window` seconds of this plan (a spike or noise in one, or an idle
  one, holds), the last move is older than `cooldown`, and going
  back to the plan just left must promise twice the threshold;
- memory pressure: a stage whose machine reports pressure (PRESSURE_LEVELS) or whose footprint
  reached FOOTPRINT_SHARE of its budget in every reading of the last `pressure_window` seconds
  sheds layers: its budget becomes SHED_SHARE of what its range holds, and the planner splits
  the rest by speed. It ignores the threshold and the cooldown (swapping is worse than a
  pause), not the settling time after a move; the lowered budget stays (the node does not take
  the layers back) until the node joins again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from omlx_coordinator.disk_layers import DEFAULT_DISK_GBPS, disk_ms
from omlx_coordinator.model_layout import ModelLayout
from omlx_coordinator.planner import NodeSpec, Plan, PlanError, make_plan

if TYPE_CHECKING:  # the manager imports nothing from here; only the I/O half needs it
    from omlx_coordinator.lifecycle import ModelManager
    from omlx_coordinator.metrics import GatewayMetrics

log = logging.getLogger(__name__)

Mode = Literal["auto", "advise", "off"]
MODES: tuple[Mode, ...] = ("auto", "advise", "off")
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

COMPUTE = "omlx_node_stage_compute_seconds"
WAIT = "omlx_node_stage_receive_wait_seconds"
STEPS = "omlx_node_stage_steps_total"
FOOTPRINT = "omlx_node_process_footprint_bytes"
PRESSURE = "omlx_node_memory_pressure"
# The series read by kind (decode only).
DECODE_SERIES = (COMPUTE + "_sum", COMPUTE + "_count", WAIT + "_sum", WAIT + "_count", STEPS)


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
class RebalanceSettings:
    """`--rebalance MODE`: auto moves, advise only logs and shows what it would do, off reads
    nothing. `prometheus_url`: read the stages from that Prometheus, not by scraping them."""

    mode: Mode = "auto"
    policy: Policy = Policy()
    prometheus_url: str | None = None


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


@dataclass(frozen=True)
class Reading:
    at: float  # seconds, one clock for every reading
    plan_hash: str
    stages: tuple[StageReading, ...]


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
    reason: str  # why it moves: "imbalance" or "memory_pressure"; "" when it holds
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


# --------------------------------------------------------------------------- the pure half


def stage_bytes(layout: ModelLayout, plan: Plan) -> dict[str, float]:
    """Bytes each stage of `plan` streams per decode step in the planner's cost model: its
    estimate at 1 GB/s (ms at 1 GB/s = bytes / 1e6). Asking the planner keeps one cost model."""
    costed = make_plan(layout, [NodeSpec(s.node, _UNLIMITED) for s in plan.stages],
                       os_reserve_bytes=0, split=plan.split)
    return {s.node: s.est_ms * 1e6 for s in costed.stages}


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


def _compute_seconds(step: float, reading: float) -> float:
    """A stage's step time less its disk reads: what its speed is derived from."""
    return max(step - reading, MIN_COMPUTE_SHARE * step)


def _covering(readings: Sequence[Reading], now: float, span: float) -> list[Reading] | None:
    """The readings of the last `span` seconds, from the latest one at or before its start (so
    that the intervals cover it whole); None when the readings do not reach back that far."""
    base = [i for i, r in enumerate(readings) if r.at <= now - span]
    return list(readings[base[-1]:]) if base else None


# Per stage and interval: [seconds, compute seconds, timed steps, wait seconds, waited steps,
# steps], summed over intervals by _add.
_Delta = list[float]
_FIELDS = ("decode_seconds", "decode_steps", "wait_seconds", "wait_steps", "steps")


def _deltas(a: Reading, b: Reading) -> dict[str, _Delta] | None:
    """Each stage's counters between two readings; None when a counter went back (its worker
    restarted under the same plan)."""
    before = {s.node: s for s in a.stages}
    out = {}
    for s in b.stages:
        p = before.get(s.node)
        if p is None:
            return None
        d = [b.at - a.at, *(getattr(s, f) - getattr(p, f) for f in _FIELDS)]
        if min(d) < 0:
            return None
        out[s.node] = d
    return out


def _add(total: dict[str, _Delta], d: Mapping[str, _Delta]) -> None:
    for node, values in d.items():
        total[node] = [x + y for x, y in zip(total.get(node, [0.0] * 6), values)]


def _own_seconds(d: _Delta) -> float | None:
    """A stage's own time per decode step, or None with too few timed steps. Its timed compute
    misses what a loaded machine costs it outside its layers (Python, sends, a CPU quota's
    stalls), so: a step's period (every stage of a pipeline runs as many steps) less the wait
    for its input, which is what the slowest stage leaves the others; at least its compute."""
    seconds, compute, timed, wait, waited, steps = d
    if timed < MIN_STEPS or compute <= 0:
        return None
    own = compute / timed
    if steps > 0 and seconds > 0:
        own = max(own, seconds / steps - (wait / waited if waited else 0.0))
    return own


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


def decide(readings: Sequence[Reading], plan: Plan | None, layout: ModelLayout,
           nodes: Sequence[NodeState], now: float, *, last_move_at: float | None = None,
           left_plan_hash: str | None = None, remembered: Mapping[str, float] | None = None,
           policy: Policy = Policy()) -> Decision:
    """Whether to move from `plan` now, and to what (see the module docstring for the rules).

    readings: in time order (others than `plan`'s are ignored); nodes: the nodes a plan may use,
    in ring order; last_move_at: when the last move happened (the readings' clock);
    left_plan_hash: the plan that move left; remembered: the speeds (GB/s) nodes were measured
    at before, for those without a stage now."""
    if plan is None:
        return Decision(False, "", "no plan serves")
    if plan.parallel != "pipeline":
        # Every rank holds a slice of every layer: there are no layer ranges to move.
        return Decision(False, "", f"a {plan.layout_name} layout has no layer ranges to move")
    budgets = {n.name: n.budget_bytes for n in nodes}
    memory = {n.name: n.memory_bytes or n.budget_bytes for n in nodes}
    held = {s.node for s in plan.stages}
    ours = [r for r in readings if r.plan_hash == plan.plan_hash
            and {s.node for s in r.stages} == held]
    if len(ours) < 2:
        return Decision(False, "", "measuring: this plan has fewer than 2 readings yet",
                        current=plan, budgets=budgets)
    window = _covering(ours, now, policy.window)
    span = window or ours  # not a full window yet: what there is, to show and to apply by hand
    intervals = [_deltas(a, b) for a, b in itertools.pairwise(span)]
    totals: dict[str, _Delta] = {}
    for d in intervals:
        _add(totals, d or {})
    nbytes = stage_bytes(layout, plan)
    state = {n.name: n for n in nodes}
    reads = read_seconds(layout, plan, state)
    step_s = {node: t for node, d in totals.items() if (t := _own_seconds(d)) is not None}
    speeds = {node: nbytes[node] / _compute_seconds(t, reads[node]) / 1e9
              for node, t in step_s.items()}
    measured = tuple(s.node for s in plan.stages if s.node in speeds)
    calibrated = {n.name: n.speed for n in nodes}
    ratios = [speeds[n] / calibrated[n] for n in measured if n in calibrated]
    scale = statistics.median(ratios) if ratios else 1.0
    for n in nodes:  # the nodes without a measurement of this plan
        if n.name not in speeds:
            speeds[n.name] = (remembered or {}).get(n.name) or n.speed * scale
    ranges = {s.node: s for s in plan.stages}
    ms_per_layer = {n: step_s[n] * 1e3 / ranges[n].num_layers for n in measured}
    current_s = max(step_s.values()) if len(measured) == len(held) else None
    base = {"speeds": speeds, "measured": measured, "scale": scale, "ms_per_layer": ms_per_layer,
            "current_bottleneck_s": current_s, "current": plan}

    def best_plan(budget: Mapping[str, int]) -> Plan:
        return make_plan(layout, [NodeSpec(n.name, budget[n.name], speeds[n.name],
                                           cache_bytes=n.cache_bytes, weights_cap=n.weights_cap,
                                           disk_gbps=n.disk_gbps)
                                  for n in nodes], os_reserve_bytes=0)

    # Memory pressure first: it does not wait for the gain, only for the pressure to last.
    recent = _covering(ours, now, policy.pressure_window)
    if recent is not None:
        short = {}
        for s in plan.stages:
            whys = [_pressured(st, memory.get(s.node, 0))
                    for r in recent for st in r.stages if st.node == s.node]
            if whys and all(whys):
                short[s.node] = whys[-1]
        if short:
            said = "; ".join(f"{n}: {w}" for n, w in short.items())
            if len(short) == len(held):
                return Decision(False, "", f"every stage is short of memory ({said}): moving "
                                "layers cannot help", budgets=budgets, **base)
            if last_move_at is not None and now - last_move_at < policy.pressure_window:
                return Decision(False, "", f"memory pressure ({said}), but the last move was "
                                f"{now - last_move_at:.0f} s ago: settling", budgets=budgets,
                                **base)
            shed = {n: min(b, int(ranges[n].memory_bytes * SHED_SHARE)) if n in short else b
                    for n, b in budgets.items()}
            try:
                target = best_plan(shed)
            except PlanError as e:
                return Decision(False, "", f"memory pressure ({said}), but no split sheds "
                                f"layers: {str(e).splitlines()[0]}", budgets=budgets, **base)
            return Decision(True, "memory_pressure",
                            f"memory pressure ({said}): {', '.join(short)} shed to "
                            f"{_split(target)} from {_split(plan)}", plan=target,
                            best_bottleneck_s=target.bottleneck_ms / 1e3, budgets=shed, **base)

    if current_s is None:
        idle = ", ".join(n for n in held if n not in step_s)
        return Decision(False, "", f"measuring: too few decode steps on {idle}",
                        budgets=budgets, **base)
    try:
        target = best_plan(budgets)
    except PlanError as e:
        return Decision(False, "", f"no split fits: {str(e).splitlines()[0]}", budgets=budgets,
                        **base)
    best_s = target.bottleneck_ms / 1e3
    found = dict(base, plan=target, best_bottleneck_s=best_s, budgets=budgets)
    gain = 1 - best_s / current_s
    numbers = (f"bottleneck {current_s * 1e3:.2f} ms now, {best_s * 1e3:.2f} ms predicted for "
               f"{_split(target)} (from {_split(plan)}): {gain:+.0%}")
    if target.plan_hash == plan.plan_hash:
        return Decision(False, "", f"the current split is the best for the measured speeds "
                        f"({_split(plan)})", **found)
    threshold = policy.threshold * (BACK_FACTOR if target.plan_hash == left_plan_hash else 1)
    if window is None:
        return Decision(False, "", f"measuring: {now - ours[0].at:.0f} s of the "
                        f"{policy.window:.0f} s window; {numbers}", **found)
    # Sustained: each part of the window, costed on its own, predicts the gain.
    target_bytes = stage_bytes(layout, target)
    target_reads = read_seconds(layout, target, state)
    start = now - policy.window
    for k in range(SUSTAIN_PARTS):
        lo, hi = start + k * policy.window / SUSTAIN_PARTS, start + (k + 1) * policy.window / SUSTAIN_PARTS
        part: dict[str, _Delta] = {}
        for (_, b), d in zip(itertools.pairwise(window), intervals):
            if d is None:
                return Decision(False, "", f"not sustained: a counter restarted; {numbers}",
                                **found)
            if lo < b.at <= hi or (k == 0 and b.at <= lo):  # the base interval opens part 0
                _add(part, d)
        when = f"between {lo - now:+.0f} s and {hi - now:+.0f} s"
        own = {n: _own_seconds(part[n]) if n in part else None for n in held}
        if any(t is None for t in own.values()):
            return Decision(False, "", f"not sustained: too few decode steps {when}; {numbers}",
                            **found)
        at = dict(speeds)
        at.update({n: nbytes[n] / _compute_seconds(t, reads[n]) / 1e9 for n, t in own.items()})
        now_s = max(own.values())
        then_s = max(target_bytes[s.node] / at[s.node] / 1e9 + target_reads[s.node]
                     for s in target.stages)
        if 1 - then_s / now_s <= threshold:
            return Decision(False, "", f"not sustained: {1 - then_s / now_s:+.0%} {when} (needs "
                            f"> {threshold:.0%}); {numbers}", **found)
    if last_move_at is not None and now - last_move_at < policy.cooldown:
        return Decision(False, "", f"cooldown: the last move was {now - last_move_at:.0f} s ago "
                        f"(< {policy.cooldown:.0f} s); {numbers}", **found)
    return Decision(True, "imbalance", f"imbalance over {policy.window:.0f} s: {numbers}",
                    **found)


def _split(plan: Plan) -> str:
    return " ".join(f"{s.node}[{s.layer_start},{s.layer_end})" for s in plan.stages)


# --------------------------------------------------------------------------- the I/O half


def parse_stage(text: str) -> tuple[str, StageReading] | None:
    """(plan hash, reading) from one stage's /metrics text; None without its compute series."""
    values: dict[str, float] = {}
    labels: dict[str, str] = {}
    source = ""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in DECODE_SERIES and s.labels.get("kind") == "decode":
                values[s.name], labels = s.value, s.labels
            elif s.name in (FOOTPRINT, PRESSURE):
                values[s.name] = s.value
                source = s.labels.get("source", "") if s.name == PRESSURE else source
    return _stage(values, {**labels, "source": source})


def _stage(values: Mapping[str, float], labels: Mapping[str, str]) -> tuple[str, StageReading] | None:
    if COMPUTE + "_sum" not in values or "node" not in labels:
        return None
    return labels.get("plan", ""), StageReading(
        labels["node"], values[COMPUTE + "_sum"], values.get(COMPUTE + "_count", 0.0),
        values.get(FOOTPRINT), values.get(PRESSURE), labels.get("source", ""),
        values.get(STEPS, 0.0), values.get(WAIT + "_sum", 0.0), values.get(WAIT + "_count", 0.0))


class Rebalancer:
    """Reads every stage's counters each `tick` seconds, decides, and (mode auto) moves. It
    balances the main model (the first --model): the one whose pipeline spans the nodes."""

    def __init__(self, manager: ModelManager, metrics: GatewayMetrics,
                 settings: RebalanceSettings):
        self.cluster, self.metrics, self.settings = manager.cluster, metrics, settings
        self.deployment = manager.main
        self.policy = policy = settings.policy
        self.prometheus_url = (settings.prometheus_url.rstrip("/") if settings.prometheus_url
                               else None)
        # Several readings per window, so that a spike is one interval among many.
        self.tick = max(1.0, min(5.0, policy.window / 6, policy.pressure_window / 3))
        self.readings: list[Reading] = []
        self.last: Decision | None = None
        self.last_move: dict | None = None
        self.last_move_at: float | None = None
        self.left_plan_hash: str | None = None
        self.remembered: dict[str, float] = {}
        self.memory: dict[str, int] = {}  # each node's budget before any shedding lowered it
        self._task: asyncio.Task | None = None
        self._http = httpx.AsyncClient(timeout=5.0)
        self._moving = asyncio.Lock()

    def start(self) -> None:
        if self.settings.mode != "off":
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self._http.aclose()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.tick)
            try:
                await self.step()
            except Exception:  # a bug here must not stop serving; it is logged each tick
                log.exception("rebalancer step failed")

    async def step(self) -> Decision | None:
        """One reading and one decision; in auto mode a move when it says so."""
        plan = self.deployment.plan
        if not self.deployment.ready or plan is None:
            return None
        reading = await self.read(plan)
        if reading is not None:
            keep = reading.at - max(self.policy.window, self.policy.pressure_window) - 3 * self.tick
            self.readings = [r for r in self.readings
                             if r.plan_hash == plan.plan_hash and r.at >= keep] + [reading]
        decision = self.decide()
        if decision.move and self.settings.mode == "auto":
            await self.apply(decision)
        return decision

    def decide(self) -> Decision:
        # What the model may hold on each node: other models' plans (and earlier shedding)
        # leave it less than the node's budget.
        nodes = [NodeState(m.name, self.deployment.room(m.name), m.speed,
                           self.memory.setdefault(m.name, m.budget_bytes), m.cache_bytes,
                           m.weights_cap, m.disk_speed)
                 for m in self.cluster.servable()]
        decision = decide(self.readings, self.deployment.plan, self.deployment.model.layout, nodes,
                          time.time(), last_move_at=self.last_move_at,
                          left_plan_hash=self.left_plan_hash, remembered=self.remembered,
                          policy=self.policy)
        self.remembered.update({n: decision.speeds[n] for n in decision.measured})
        if decision.measured and self.settings.mode == "auto":
            self.deployment.measured_speeds = dict(self.remembered)
            self.deployment.speed_scale = decision.scale
        if self.last is None or (decision.move, decision.why.split(":")[0]) != (
                self.last.move, self.last.why.split(":")[0]):
            log.info("rebalance %s: %s", "move" if decision.move else "hold", decision.why)
        else:
            log.debug("rebalance %s: %s", "move" if decision.move else "hold", decision.why)
        self.last = decision
        gauge = self.metrics.predicted_bottleneck
        for which, value in (("current", decision.current_bottleneck_s),
                             ("best", decision.best_bottleneck_s)):
            if value is not None:
                gauge.labels(which).set(value)
        return decision

    async def apply(self, decision: Decision, reason: str | None = None) -> bool:
        """Moves to `decision.plan` now; whether the cluster serves it afterwards."""
        assert decision.plan is not None and decision.current is not None
        reason = reason or decision.reason
        async with self._moving:
            if self.deployment.plan is not decision.current:
                return False  # the plan changed under this decision (a node was lost)
            log.warning("rebalancing (%s): %s", reason, decision.why)
            t0 = time.time()
            moved = await self.deployment.apply_plan(decision.plan, decision.budgets,
                                                     f"rebalance ({reason}): {decision.why}")
            self.metrics.rebalances.labels(reason).inc()
            self.last_move_at, self.left_plan_hash = time.time(), decision.current.plan_hash
            self.last_move = {"reason": reason, "at": t0, "seconds": time.time() - t0,
                              "moved": moved, "from": decision.current.split,
                              "to": decision.plan.split, "why": decision.why,
                              "current_bottleneck_seconds": decision.current_bottleneck_s,
                              "best_bottleneck_seconds": decision.best_bottleneck_s}
            self.readings = []
            return moved

    async def rebalance_now(self, dry_run: bool) -> dict:
        """What `omlx-cluster rebalance` shows; without dry_run the proposal is applied at once
        (past the threshold, the window and the cooldown)."""
        decision = self.decide()
        moved = None
        if not dry_run and decision.plan is not None and decision.current is not None:
            moved = (decision.plan.plan_hash != decision.current.plan_hash
                     and await self.apply(decision, "manual"))
        return self.report(decision, moved)

    def report(self, decision: Decision | None = None, moved: bool | None = None) -> dict:
        decision = decision or self.last
        return {"mode": self.settings.mode, "source": self.prometheus_url or "scrape",
                "policy": {"threshold": self.policy.threshold, "window": self.policy.window,
                           "cooldown": self.policy.cooldown,
                           "pressure_window": self.policy.pressure_window},
                "decision": decision.to_dict() if decision else None, "moved": moved,
                "last_move": self.last_move}

    def measured(self, node: str) -> dict:
        """What /cluster/status adds to a node: the speed it was measured at (GB/s), and its
        time per layer when it has a stage now."""
        d = self.last
        speed = d.speeds[node] if d and node in d.measured else self.remembered.get(node)
        return {"measured_speed_gbps": speed,
                "ms_per_layer": d.ms_per_layer.get(node) if d else None}

    async def read(self, plan: Plan) -> Reading | None:
        """Every stage of `plan` now, or None when one did not answer for it."""
        at = time.time()
        try:
            stages = await (self._query(plan) if self.prometheus_url else self._scrape(plan))
        except (httpx.HTTPError, ValueError, KeyError) as e:
            log.debug("rebalancer reading failed: %s", e)
            return None
        if set(stages) != {s.node for s in plan.stages}:
            return None
        return Reading(at, plan.plan_hash, tuple(stages[s.node] for s in plan.stages))

    async def _scrape(self, plan: Plan) -> dict[str, StageReading]:
        model = self.deployment.model.name
        endpoints = [w["metrics"] for n in self.cluster.nodes for w in n["workers"]
                     if w["model"] == model and w["metrics"]]
        # Only the series decide() reads, not the whole render. A lone node has nowhere to shed
        # layers to, so its memory (a walk of the worker's pages each reading) is left unread.
        memory = (FOOTPRINT, PRESSURE) if len(self.cluster.servable()) > 1 else ()
        names = {"name[]": [*DECODE_SERIES, *memory]}
        texts = await asyncio.gather(*(self._http.get(f"http://{e}/metrics", params=names)
                                       for e in endpoints))
        out = {}
        for r in texts:
            r.raise_for_status()
            parsed = parse_stage(r.text)
            if parsed is not None and parsed[0] == plan.plan_hash:
                out[parsed[1].node] = parsed[1]
        return out

    async def _query(self, plan: Plan) -> dict[str, StageReading]:
        """The same series from Prometheus's HTTP API, as of its last scrape of each stage."""
        names = "|".join((*DECODE_SERIES, FOOTPRINT, PRESSURE))
        r = await self._http.get(self.prometheus_url + "/api/v1/query", params={
            "query": f'{{__name__=~"{names}",plan="{plan.plan_hash}"}}'})
        r.raise_for_status()
        body = r.json()
        if body.get("status") != "success":
            raise ValueError(f"Prometheus: {body.get('error')}")
        values: dict[str, dict[str, float]] = {}
        labels: dict[str, dict[str, str]] = {}
        for series in body["data"]["result"]:
            m = series["metric"]
            name, node = m["__name__"], m.get("node", "")
            if name in DECODE_SERIES and m.get("kind") != "decode":
                continue
            values.setdefault(node, {})[name] = float(series["value"][1])
            labels.setdefault(node, {"node": node, "plan": m.get("plan", "")})
            if name == PRESSURE:
                labels[node]["source"] = m.get("source", "")
        out = {}
        for node, v in values.items():
            parsed = _stage(v, labels[node])
            if parsed is not None:
                out[node] = parsed[1]
        return out
