"""Several models on one cluster: where a model's replicas go, and which idle models make room.

Pure like the planner (no MLX, no I/O): every plan here is `planner.make_plan` over some of the
nodes, with each node's budget shrunk by what other models already hold there (`free_budgets`),
so the planner's cost model, memory rules and error messages apply unchanged.

Replicas
--------
A replica is one node or one pipeline; replicas of a model have disjoint node sets, and each
holds its own copy of the weights and its own KV reservation. `place_model(..., replicas=N)`:

- N = 1: make_plan over every node (exactly what a cluster serving one model does).
- N >= 2: carve N groups greedily: each the fewest remaining nodes that can hold the model, among
  those the one taking the least memory (best fit, so the nodes left can still hold the next
  replica), then the fastest; then each leftover node joins the replica whose bottleneck it
  lowers most (the planner's own reason to use a node), or stays free. Greedy: a partition into
  N groups that best fit misses can exist (the exact problem is bin packing).
- "auto": the candidates (the N = 1 plan, and for every k up to as many replicas as carving
  finds, its first k groups as carved and as grown) are scored by the total decode rate the
  planner's cost model predicts (`decode_rate`), and the best wins; ties go to fewer replicas
  (fewer copies of the weights), then fewer nodes. In that model a replica that fits on one node
  adds a whole batch of decode streams, so an office gets one replica per node that can hold
  the model, where one pipeline over the same nodes would decode a single batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Literal

from omlx_coordinator.planning.layout_choice import plan_layout
from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_coordinator.planning.planner import GiB, NodeSpec, Plan, PlanError

Replicas = int | Literal["auto"]
# Relative differences below this are float noise: neither a gain nor a better candidate.
_REL_TOL = 1e-9


@dataclass(frozen=True)
class PlanSettings:
    """What make_plan takes besides the layout and nodes; the same for every replica."""

    os_reserve_bytes: int = 8 << 30
    context_tokens: int = 4096
    max_sequences: int = 8
    parallel: str = "pipeline"  # omlx_coordinator/planning/layout_choice.py's layouts


@dataclass(frozen=True)
class LoadedModel:
    """A model the cluster holds, as eviction sees it.

    bytes_by_node: what its replicas hold on each node (`plan_bytes(*replicas)`).
    last_used: when a request last used it, on any clock where larger is later.
    in_flight: requests running on it or leases holding it; a model in use is never evicted.
    """

    model_id: str
    bytes_by_node: Mapping[str, int]
    last_used: float
    pinned: bool = False
    in_flight: int = 0

    @property
    def evictable(self) -> bool:
        return not self.pinned and self.in_flight == 0


class EvictionError(PlanError):
    """Even evicting every idle unpinned model does not make room; the message says how much is
    missing on which node and which pinned or busy models hold memory there."""


def free_budgets(nodes: Sequence[NodeSpec], held: Mapping[str, int]) -> list[NodeSpec]:
    """The nodes with `held[name]` bytes (what other models hold there) taken off their memory,
    in the same order. A node that cannot spare anything gets 0 (the planner leaves it out);
    entries for nodes not in `nodes` (a node that left) are ignored."""
    return [replace(n, memory_bytes=max(0, n.memory_bytes - held.get(n.name, 0))) for n in nodes]


def plan_bytes(*plans: Plan) -> dict[str, int]:
    """What the plans hold on each node (weights + KV reservation of their stages), summed:
    `plan_bytes(*replicas)` is a model's entry for another placement's `held`."""
    out: dict[str, int] = {}
    for plan in plans:
        for stage in plan.stages:
            out[stage.node] = out.get(stage.node, 0) + stage.memory_bytes
    return out


def held_by(loaded: Iterable[LoadedModel]) -> dict[str, int]:
    """What the models hold on each node, summed: the `held` for placing one more."""
    out: dict[str, int] = {}
    for model in loaded:
        for node, size in model.bytes_by_node.items():
            out[node] = out.get(node, 0) + size
    return out


def decode_rate(plan: Plan, settings: PlanSettings) -> float:
    """Decode tokens per second the planner's cost model predicts for one replica under load.

    The cost model is weight-bandwidth bound: a step costs the bytes it streams whatever the
    number of rows, so splitting a replica's rows into micro-batches gains nothing (the pipeline
    head then keeps one) and each of its max_sequences sequences gets a token per trip through
    the stages, the plan's per-token latency (sum of stage times, links included). N replicas
    that each fit on one node thus decode N batches at once where one pipeline over the same
    nodes decodes one, a little slower for its hops.
    """
    latency = sum(s.est_ms for s in plan.stages)
    return float("inf") if latency <= 0 else settings.max_sequences * 1e3 / latency


def place_model(
    layout: ModelLayout,
    nodes: Sequence[NodeSpec],
    held: Mapping[str, int],
    replicas: Replicas = 1,
    split: list[int] | None = None,
    settings: PlanSettings = PlanSettings(),
) -> list[Plan]:
    """The model's replicas (see the module docstring), each a Plan over the nodes' shared
    budgets: node memory minus `held` (other models), minus what earlier replicas take, minus
    the OS reserve. `split` (a user split over all nodes) allows one replica only.

    Raises PlanError naming the shortfall (in GiB) when the model, or its N-th replica, fits
    nowhere.
    """
    _check_request(replicas, split)
    free = free_budgets(nodes, held)
    whole = _plan(layout, free, settings, split)  # raises, naming the shortfall, if it fits nowhere
    if replicas == 1:
        return [whole]
    groups = _carve(layout, free, settings, limit=None if replicas == "auto" else replicas)
    if replicas == "auto":
        candidates = [[whole]]
        for k in range(1, len(groups) + 1):
            candidates += [groups[:k], _grow(layout, free, groups[:k], settings)]
        return _fastest(candidates, settings)
    if len(groups) < replicas:
        raise _short_error(layout, free, groups, replicas, settings)
    return _grow(layout, free, groups, settings)


def eviction_order(loaded: Sequence[LoadedModel], needed: Mapping[str, int]) -> list[str]:
    """The model ids to evict so that `needed[node]` more bytes are free on every node (for a
    placement fixed in advance: needed = its plan_bytes minus each node's free budget).

    Idle unpinned models go least recently used first, until the needs are met; then any of them
    the others' bytes make unnecessary is spared, most recently used first. Raises
    EvictionError when evicting every idle unpinned model is not enough.
    """

    def fits(victims: list[LoadedModel]) -> bool:
        freed = held_by(victims)
        return all(freed.get(node, 0) >= need for node, need in needed.items())

    victims = _lru_victims(loaded, fits)
    if victims is None:
        freed = held_by(m for m in loaded if m.evictable)
        short = {node: need - freed.get(node, 0) for node, need in needed.items()
                 if need > freed.get(node, 0)}
        lines = [f"  {node}: {_gib(b)} short" + _kept_there(loaded, node)
                 for node, b in short.items()]
        raise EvictionError(
            "not enough room even after evicting every idle unpinned model:\n" + "\n".join(lines),
            missing_bytes=sum(short.values()), missing_by_node=short)
    return [m.model_id for m in victims]


def place_evicting(
    layout: ModelLayout,
    nodes: Sequence[NodeSpec],
    loaded: Sequence[LoadedModel],
    replicas: Replicas = 1,
    split: list[int] | None = None,
    settings: PlanSettings = PlanSettings(),
) -> tuple[list[Plan], list[str]]:
    """place_model beside the `loaded` models (not including this one), evicting idle unpinned
    ones when it does not fit: (the replicas, the model ids to evict first, least recently used
    first). The same policy as eviction_order, with place_model as the test of "fits", so the
    placement may move to whichever nodes the evictions free.

    Raises EvictionError (with place_model's reason) when evicting every idle unpinned model is
    not enough; a bad `replicas` or `split` raises its PlanError at once.
    """

    _check_request(replicas, split)  # a bad request is no reason to evict anything

    def place(victims: list[LoadedModel]) -> list[Plan]:
        kept = [m for m in loaded if all(m is not v for v in victims)]
        return place_model(layout, nodes, held_by(kept), replicas, split, settings)

    def fits(victims: list[LoadedModel]) -> bool:
        try:
            place(victims)
        except PlanError:
            return False
        return True

    victims = _lru_victims(loaded, fits)
    if victims is None:
        idle = [m for m in loaded if m.evictable]
        try:
            place(idle)
        except PlanError as e:
            busy = [m for m in loaded if not m.evictable]
            raise EvictionError(
                f"{layout.model_id} does not fit even after evicting every idle unpinned model"
                f" ({', '.join(m.model_id for m in idle) or 'none'}); "
                f"pinned or in use: {_describe(busy)}.\n{e}",
                missing_bytes=e.missing_bytes, missing_by_node=e.missing_by_node) from e
        raise AssertionError("place_model fitted where it did not")
    return place(victims), [m.model_id for m in victims]


# --------------------------------------------------------------------------- helpers


def _check_request(replicas: Replicas, split: list[int] | None) -> None:
    if replicas != "auto" and (
        not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1
    ):
        raise PlanError(f"replicas must be a positive whole number or 'auto', not {replicas!r}")
    if split is not None and replicas != 1:
        raise PlanError("a user split lays out one pipeline over the given nodes: ask 1 replica")


def _plan(
    layout: ModelLayout, nodes: Sequence[NodeSpec], settings: PlanSettings,
    split: list[int] | None = None,
) -> Plan:
    return plan_layout(layout, list(nodes), settings.parallel,
                       os_reserve_bytes=settings.os_reserve_bytes,
                       context_tokens=settings.context_tokens,
                       max_sequences=settings.max_sequences, split=split)


def _least_need(layout: ModelLayout, settings: PlanSettings) -> int:
    """What any plan of the model holds at least: every weight once and every layer's KV."""
    kv = sum(layout.kv_bytes(i, settings.context_tokens) for i in range(layout.num_layers))
    return layout.total_weight_bytes + kv * settings.max_sequences


def _smallest_group(
    layout: ModelLayout, nodes: Sequence[NodeSpec], settings: PlanSettings
) -> Plan | None:
    """The plan over the fewest of `nodes` that holds the model; among those, the one whose
    nodes offer the least memory (best fit), then the most speed; None if none fits."""
    least = _least_need(layout, settings)
    budget = {n.name: max(0, n.memory_bytes - settings.os_reserve_bytes - n.cache_bytes)
              for n in nodes}
    largest = sorted(budget.values(), reverse=True)
    for size in range(1, len(nodes) + 1):
        if sum(largest[:size]) < least:
            continue  # not even the largest nodes could hold it: skip the planner
        groups = [g for g in combinations(nodes, size) if sum(budget[n.name] for n in g) >= least]
        # Stable sort: ring order among equals.
        groups.sort(key=lambda g: (sum(budget[n.name] for n in g), -sum(n.speed for n in g)))
        for group in groups:
            try:
                return _plan(layout, group, settings)
            except PlanError:
                continue  # enough bytes in all, but no contiguous split of them fits
    return None


def _carve(
    layout: ModelLayout, nodes: Sequence[NodeSpec], settings: PlanSettings, limit: int | None
) -> list[Plan]:
    """Up to `limit` (None: as many as fit) disjoint smallest groups, one after the other."""
    groups: list[Plan] = []
    left = list(nodes)
    while left and (limit is None or len(groups) < limit):
        plan = _smallest_group(layout, left, settings)
        if plan is None:
            break
        groups.append(plan)
        used = {s.node for s in plan.stages}
        left = [n for n in left if n.name not in used]
    return groups


def _grow(
    layout: ModelLayout, nodes: Sequence[NodeSpec], groups: list[Plan], settings: PlanSettings
) -> list[Plan]:
    """The groups, each leftover node joining (in ring order, re-planned by make_plan) the group
    whose bottleneck it lowers most; a node that lowers none stays free for other models."""
    plans = list(groups)
    members = [{s.node for s in p.stages} for p in plans]
    left = [n for n in nodes if all(n.name not in m for m in members)]
    tried: dict[tuple[int, str], Plan | None] = {}  # (group, node) -> the grown plan

    def grown(g: int, node: NodeSpec) -> Plan | None:
        if (g, node.name) not in tried:
            wider = [n for n in nodes if n.name in members[g] or n is node]
            try:
                tried[g, node.name] = _plan(layout, wider, settings)
            except PlanError:
                tried[g, node.name] = None
        return tried[g, node.name]

    while True:
        best: tuple[float, int, NodeSpec, Plan] | None = None
        for node in left:
            for g, plan in enumerate(plans):
                wider = grown(g, node)
                if wider is None:
                    continue
                gain = plan.bottleneck_ms - wider.bottleneck_ms
                if gain > plan.bottleneck_ms * _REL_TOL and (best is None or gain > best[0]):
                    best = (gain, g, node, wider)
        if best is None:
            return plans
        _, g, node, plans[g] = best
        members[g].add(node.name)
        left.remove(node)
        for other in left:  # group g changed: what its growth would give must be planned anew
            tried.pop((g, other.name), None)


def _fastest(candidates: list[list[Plan]], settings: PlanSettings) -> list[Plan]:
    """The candidate with the highest total decode rate; ties to the fewest replicas (fewer
    copies of the weights), then the fewest nodes (fewer hops, more left for other models)."""
    rates = [sum(decode_rate(p, settings) for p in c) for c in candidates]
    top = max(rates)
    tied = [c for c, r in zip(candidates, rates) if r >= top * (1 - _REL_TOL)]
    return min(tied, key=lambda c: (len(c), sum(len(p.stages) for p in c)))


def _short_error(
    layout: ModelLayout, free: Sequence[NodeSpec], groups: list[Plan], replicas: int,
    settings: PlanSettings,
) -> PlanError:
    used = {s.node for p in groups for s in p.stages}
    left = [n for n in free if n.name not in used]
    head = (f"{layout.model_id}: {len(groups)} of {replicas} replicas fit "
            f"(on {', '.join(_nodes_of(p) for p in groups)})")
    if not left:
        need = _least_need(layout, settings)
        return PlanError(f"{head}; no node is left for replica {len(groups) + 1}, which needs "
                         f"at least {_gib(need)}.", missing_bytes=need)
    try:
        _plan(layout, left, settings)
    except PlanError as e:
        return PlanError(f"{head}; replica {len(groups) + 1} does not fit on the nodes left "
                         f"({', '.join(n.name for n in left)}):\n{e}",
                         missing_bytes=e.missing_bytes, missing_by_node=e.missing_by_node)
    # Carving found no group among `left`, so the planner cannot fit it there either.
    raise AssertionError("a replica fits on the nodes left but carving missed it")


def _lru_victims(
    loaded: Sequence[LoadedModel], fits: Callable[[list[LoadedModel]], bool]
) -> list[LoadedModel] | None:
    """Idle unpinned models, least recently used first, until `fits(victims)`; then each victim
    the rest make unnecessary is spared, most recently used first. None if all are not enough."""
    order = sorted((m for m in loaded if m.evictable), key=lambda m: (m.last_used, m.model_id))
    victims: list[LoadedModel] = []
    for model in order:
        if fits(victims):
            break
        victims.append(model)
    else:
        if not fits(victims):
            return None
    for model in reversed(list(victims)):
        rest = [v for v in victims if v is not model]
        if fits(rest):
            victims = rest
    return victims


def _kept_there(loaded: Sequence[LoadedModel], node: str) -> str:
    there = [m for m in loaded if not m.evictable and m.bytes_by_node.get(node, 0) > 0]
    return f"; pinned or in use there: {_describe(there, node)}" if there else ""


def _describe(models: Sequence[LoadedModel], node: str | None = None) -> str:
    if not models:
        return "none"

    def one(m: LoadedModel) -> str:
        size = m.bytes_by_node.get(node, 0) if node else sum(m.bytes_by_node.values())
        why = "pinned" if m.pinned else f"{m.in_flight} in flight"
        return f"{m.model_id} ({_gib(size)}, {why})"

    return ", ".join(one(m) for m in models)


def _nodes_of(plan: Plan) -> str:
    return "+".join(s.node for s in plan.stages)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def pressure_victim(loaded: Sequence[LoadedModel], node: str) -> str | None:
    """The model to unload when `node`'s OS reports critical memory pressure: the least
    recently used idle unpinned one holding memory there (None: none may go)."""
    there = [m for m in loaded if m.evictable and m.bytes_by_node.get(node, 0) > 0]
    return min(there, key=lambda m: m.last_used).model_id if there else None
