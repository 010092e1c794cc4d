"""The rebalancer: moves layers off nodes that measure slow, or short of memory, while serving.

Two halves. `decide` (omlx_coordinator/planning/rebalance_policy.py) is pure: the readings of every
stage's counters (`Reading`), the active plan, the model's layout and each node's memory budget
in; whether to move, to which plan, and why (with its numbers) out. `Rebalancer` here is the I/O
around it: it reads the counters, either by
scraping each stage's /metrics (the addresses `Cluster.nodes` lists) or from a Prometheus
server's query API, calls `decide`, and applies a move through `Deployment.apply_plan`, the re-plan
path a node loss takes (weights of new ranges sent first, in-flight requests resumed, prefix
blocks of kept layers reused).

Speeds. A stage's real time per decode step is the mean of its timed decode steps
(`omlx_node_stage_compute_seconds{kind="decode"}`: sum / count between two readings, so the
reading's own timing does not matter). The planner costs a stage as the bytes it streams over
the node's speed; dividing the stage's bytes in that model by the measured time gives the
node's speed in the planner's own units (GB/s of weights under the current load, overheads
included), so the planner's prediction for the current split is what was measured, and its
best split over those speeds is comparable to it. Only the intervals between two readings
with requests on the model count: the wall time of one in which the load ended is idle time,
not steps, and a node remembered at a speed so measured is planned below what it does. A
stage that streams layers from its disk
(`--weights-memory`) spends part of its step reading them: the planner's read time for them
(their bytes at the node's measured disk speed) is taken off its measured time before its
speed is derived, and the splits it is compared with are planned with each node's cap and disk,
read time included, so a streaming stage is not mistaken for a slow one, nor given layers its
cap cannot hold. The same for a pipeline's head that drafts tokens (speculative decoding):
its drafting time (`omlx_node_stage_draft_seconds_total`) is taken off its step before its
speed is derived, and added to the head of every split it is compared with. A node with no stage in the plan keeps the
speed it was last measured at; one never measured is planned at its calibrated speed scaled as
the measured nodes' are (measured / calibrated), so units do not mix. In mode auto the
model's re-plans after a loss or a join split by these speeds too (recorded in the model's
`MeasuredSpeeds`, omlx_coordinator/planning/measured_speeds.py): a node lost for its slowness, or
restarted, comes back with the share it was measured for.

When to move (every rule is hysteresis against oscillation):
- imbalance: the best split's bottleneck beats the measured one by more than `threshold`, in
  each third of the last `window` seconds of this plan (a spike or noise in one, or an idle
  one, holds), the last move is older than `cooldown`, and going
  back to the plan just left must promise twice the threshold;
- layout (`--parallel auto` only): a layout whose measured batch-1 token time misses the
  planner's prediction by more than `threshold` (a link slower under load than when it was
  probed at join, nodes slower than calibrated) is predicted again with what was measured, as
  are the other layouts (a tensor stage's all-reduces at the time its steps took beyond its
  weight reads); the best layout of another kind (tensor for a pipeline, a pipeline or one node
  for a tensor stage) is proposed when it beats the measured time by more than `threshold`, in
  each third of the window, past the cooldown, and going back to the plan just left must
  promise twice the threshold;
- memory pressure: a stage whose machine reports pressure (PRESSURE_LEVELS) or whose footprint
  reached FOOTPRINT_SHARE of its budget in every reading of the last `pressure_window` seconds
  sheds layers: its budget becomes SHED_SHARE of what its range holds, and the planner splits
  the rest by speed. It ignores the threshold and the cooldown (swapping is worse than a
  pause), not the settling time after a move; the lowered budget stays (the node does not take
  the layers back) until the node joins again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import httpx
from prometheus_client.parser import text_string_to_metric_families

from omlx_coordinator.planning.planner import Plan
from omlx_coordinator.planning.rebalance_policy import (
    Decision,
    NodeState,
    Policy,
    Reading,
    StageReading,
    decide,
)

if TYPE_CHECKING:  # the manager imports nothing from here; only the I/O half needs it
    from omlx_coordinator.models.lifecycle import ModelManager
    from omlx_coordinator.telemetry.metrics import GatewayMetrics

log = logging.getLogger(__name__)

Mode = Literal["auto", "advise", "off"]
MODES: tuple[Mode, ...] = ("auto", "advise", "off")
COMPUTE = "omlx_node_stage_compute_seconds"
WAIT = "omlx_node_stage_receive_wait_seconds"
STEPS = "omlx_node_stage_steps_total"
DRAFT = "omlx_node_stage_draft_seconds_total"
FOOTPRINT = "omlx_node_process_footprint_bytes"
PRESSURE = "omlx_node_memory_pressure"
# The series read by kind (decode only) ...
DECODE_SERIES = (COMPUTE + "_sum", COMPUTE + "_count", WAIT + "_sum", WAIT + "_count", STEPS,
                 DRAFT)
# ... and the prefill one: the time of the wall clock that was no decode step's.
PREFILL = COMPUTE + "_sum"
PREFILL_KEY = "prefill"  # where parsing keeps it beside the decode series


@dataclass(frozen=True)
class RebalanceSettings:
    """`--rebalance MODE`: auto moves, advise only logs and shows what it would do, off reads
    nothing. `prometheus_url`: read the stages from that Prometheus, not by scraping them."""

    mode: Mode = "auto"
    policy: Policy = Policy()
    prometheus_url: str | None = None


def parse_stage(text: str) -> tuple[str, StageReading] | None:
    """(plan hash, reading) from one stage's /metrics text; None without its compute series."""
    values: dict[str, float] = {}
    labels: dict[str, str] = {}
    source = ""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in DECODE_SERIES and s.labels.get("kind") == "decode":
                values[s.name], labels = s.value, s.labels
            elif s.name == PREFILL and s.labels.get("kind") == "prefill":
                values[PREFILL_KEY] = s.value
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
        values.get(STEPS, 0.0), values.get(WAIT + "_sum", 0.0), values.get(WAIT + "_count", 0.0),
        values.get(DRAFT, 0.0), values.get(PREFILL_KEY, 0.0))


class Rebalancer:
    """Reads every stage's counters each `tick` seconds, decides, and (mode auto) moves. It
    balances the main model (the first --model): the one whose pipeline spans the nodes."""

    def __init__(self, manager: ModelManager, metrics: GatewayMetrics,
                 settings: RebalanceSettings):
        self.cluster, self.metrics, self.settings = manager.cluster, metrics, settings
        self.deployment = manager.main
        self.speeds = self.deployment.measured  # what its re-plans split by, in mode auto
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
                          relayout=self._relayout(), links=self.cluster.measured_links(),
                          policy=self.policy)
        self.remembered.update({n: decision.speeds[n] for n in decision.measured})
        if decision.measured and self.settings.mode == "auto":
            self.speeds.record(self.remembered, decision.scale)
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

    def _relayout(self) -> bool:
        """Whether the layout is the planner's to choose (`--parallel auto`), and so the
        rebalancer's to change; a layout the user named stays."""
        config = self.deployment.model.config
        return (config.parallel or self.cluster.options.parallel) == "auto"

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
        at, busy = time.time(), self.deployment.inflight > 0
        try:
            stages = await (self._query(plan) if self.prometheus_url else self._scrape(plan))
        except (httpx.HTTPError, ValueError, KeyError) as e:
            log.debug("rebalancer reading failed: %s", e)
            return None
        if set(stages) != {s.node for s in plan.stages}:
            return None
        return Reading(at, plan.plan_hash, tuple(stages[s.node] for s in plan.stages), busy)

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
            if name == PREFILL and m.get("kind") == "prefill":
                name = PREFILL_KEY
            elif name in DECODE_SERIES and m.get("kind") != "decode":
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
