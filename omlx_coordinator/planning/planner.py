"""The planner: a pure function of (model layout, nodes) -> plan of contiguous uneven layer shards.

No MLX, no I/O: the coordinator plans on any machine, and the tests check it against a
brute-force optimum on synthetic clusters.

Cost model (what a stage costs per decode step)
-----------------------------------------------
Decode is memory-bandwidth bound: each step streams every weight a stage holds through
matrix-vector products. So a stage's time is

    est_ms = compute_bytes / (speed * 1e9) * 1e3 + layers * layer_ms + link_ms

- `NodeSpec.speed` is the node's weight-streaming throughput in **GB/s** (1e9 bytes/s), as
  `omlx_node.calibrate.measure_speed() / 1e9` measures it. Left at the default 1.0 everywhere,
  the times are only relative (the explanation says so).
- compute_bytes = the bytes the stage's layers stream per step (a MoE layer's routed experts at
  their active share, `ModelLayout.stream_bytes`), plus norm + head on the last stage (the head
  matmul streams the whole lm_head, or the whole embedding when tied). The first stage's
  embedding is a row gather (a few rows per token), so it costs memory but no streaming time.
- `NodeSpec.layer_ms`: a layer's cost a step beyond its weight reads (its ops' dispatch, norms,
  attention), which a tensor rank's share does not shrink (`calibrate.measure_layer_ms`).
- `link_ms` is the one-way latency from that node to the next stage. Every stage of a multi-stage
  plan pays it (the last stage sends sampled tokens back to the head, the ring's wrap-around);
  a single-stage plan sends nothing and pays none.

Memory (what a stage must hold, which must fit in memory_bytes - os_reserve_bytes)
- its layers' weights, + the embedding on the first stage, + norm and head on the last stage.
  With tied embeddings the head *is* the embedding matrix, so a last stage that is not also the
  first holds a second copy of it; a single stage holds it once.
- KV cache for its layers: max_sequences sequences of context_tokens tokens, each layer at what
  its kind of cache holds (`ModelLayout.kv_bytes`: a full-attention layer every token, a
  sliding-window layer at most its window, a linear-attention layer a constant state).
- Activations and scratch buffers are small next to these and are covered by the OS reserve.
- Every shard worker on a node also keeps its prefix KV cache in RAM (`NodeSpec.cache_bytes`,
  the node's `--hot-cache-max-size`): a stage counts it beside its weights and KV, so a node's
  budget for weights and KV is memory_bytes - os_reserve_bytes - cache_bytes, and a second model
  on the same node pays its own worker's cache too.

Objective: minimise the bottleneck (slowest stage's est_ms), which bounds the pipeline's step
rate once micro-batches keep every stage busy. Among the splits that reach the optimal
bottleneck, take the one with the smallest sum of stage times (one sequence's per-token
latency). Both are solved exactly by dynamic programming over (node, first layer), O(n * L^2).

Nodes keep their given order (the ring order). A node may get zero layers only by being left
out of the plan entirely (the DP leaves out nodes that cannot hold a layer or whose link cost
would raise the bottleneck); every stage of a plan has at least one layer. order="search" also
searches the node order: an exact bitmask search over the bottleneck (up to 12 nodes), then the
same DP on the order found.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Literal, Sequence

from omlx_coordinator.planning.disk_layers import (
    DEFAULT_DISK_GBPS,
    STREAM_BUFFERS,
    disk_ms,
    streamed_layers,
)
from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_shared.progress import human_bytes

GiB = 1 << 30
GB = 1e9
MAX_SEARCH_NODES = 12
# Stage times within this relative distance of the optimum count as optimal (float noise).
_REL_TOL = 1e-9


class PlanError(ValueError):
    """No plan (or not the user's split) fits; the message says what is missing and where.

    missing_bytes: bytes missing overall (0 when the total suffices but no contiguous split
    does); missing_by_node: bytes each node would be short in the closest split.
    """

    def __init__(
        self, message: str, missing_bytes: int = 0, missing_by_node: dict[str, int] | None = None
    ):
        super().__init__(message)
        self.missing_bytes = missing_bytes
        self.missing_by_node = dict(missing_by_node or {})


@dataclass(frozen=True)
class NodeSpec:
    """One Mac as the planner sees it.

    memory_bytes: its total memory (the plan keeps os_reserve_bytes of it free).
    speed: weight-streaming throughput in GB/s (see the module docstring); 1.0 if uncalibrated.
    link_ms: one-way latency from this node to the next stage in the ring.
    link_gbps: bandwidth of that link in GB/s; 0: unknown (a message then costs its latency).
    cache_bytes: what each shard worker on it keeps for its prefix KV cache in RAM, beside the
    KV the plan reserves.
    weights_cap: the most bytes of weights it keeps in memory (`--weights-memory`); a stage
    past it keeps its last layers on disk (disk_layers.py). 0: no cap, every weight resident.
    disk_gbps: its SSD's sequential read speed, what streamed layers cost.
    dequantizes: its workers run on a CPU, which dequantizes a quantized model: a tensor split
    may cut quantization groups there (tensor_plan.py refuses one that would elsewhere).
    layer_ms: a layer's fixed cost a decode step (the module docstring's); 0.0: not measured.
    """

    name: str
    memory_bytes: int
    speed: float = 1.0
    link_ms: float = 0.0
    cache_bytes: int = 0
    weights_cap: int = 0
    disk_gbps: float = DEFAULT_DISK_GBPS
    link_gbps: float = 0.0
    dequantizes: bool = False
    layer_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ",= \t\n"):
            raise ValueError(f"bad node name {self.name!r}: non-empty, no spaces, ',' or '='")
        if self.memory_bytes < 0 or self.cache_bytes < 0:
            raise ValueError(f"node {self.name}: memory_bytes and cache_bytes must be >= 0")
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise ValueError(f"node {self.name}: speed must be a positive number (GB/s)")
        for key in ("link_ms", "layer_ms", "link_gbps"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise ValueError(f"node {self.name}: {key} must be >= 0")
        if self.weights_cap < 0 or not (math.isfinite(self.disk_gbps) and self.disk_gbps > 0):
            raise ValueError(f"node {self.name}: weights_cap must be >= 0 and disk_gbps > 0")


@dataclass(frozen=True)
class Stage:
    """Layers [layer_start, layer_end) on `node`. weight_bytes includes the embedding (first
    stage) and norm + head (last stage); cache_bytes is its worker's prefix cache in RAM;
    memory_budget is the node's memory less the OS reserve; est_ms includes the node's link_ms
    (see module doc). streamed_layers: the range's last layers kept on disk and read at each
    step (weight_bytes counts only what is held: the others and the one being read)."""

    node: str
    layer_start: int
    layer_end: int
    weight_bytes: int
    kv_bytes: int
    memory_budget: int
    est_ms: float
    cache_bytes: int = 0
    streamed_layers: int = 0

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.cache_bytes


@dataclass(frozen=True)
class Plan:
    model_id: str
    stages: tuple[Stage, ...]
    bottleneck_ms: float
    plan_hash: str
    explanation: list[str] = field(default_factory=list)
    # "pipeline": each stage a range of layers; "tensor": every stage is a rank of one
    # tensor-parallel stage holding a slice of every layer (omlx_coordinator/planning/tensor_plan.py);
    # "tensor-pipeline": runs of ranks, each a tensor-parallel stage of a pipeline
    # (omlx_coordinator/planning/tensor_pipeline_plan.py).
    parallel: str = "pipeline"

    @property
    def layout_name(self) -> str:
        """How `status` and `plan` name the layout, e.g. "tensor x2", "tensor x2 > tensor x2"
        (a pipeline of tensor-parallel stages)."""
        if self.parallel == "tensor-pipeline":
            return " > ".join(f"tensor x{k}" if k > 1 else "1 node" for k in self.stage_ranks)
        return f"{self.parallel} x{len(self.stages)}"

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """Each stage's rank count: in a pipeline of tensor-parallel stages, the runs of
        consecutive ranks that hold the same layers (a pipeline's ranges never repeat)."""
        if self.parallel == "tensor":
            return (len(self.stages),)
        sizes: list[int] = []
        for i, s in enumerate(self.stages):
            prev = self.stages[i - 1] if i else None
            if prev is not None and (prev.layer_start, prev.layer_end) == (
                    s.layer_start, s.layer_end):
                sizes[-1] += 1
            else:
                sizes.append(1)
        return tuple(sizes)

    @property
    def split(self) -> list[int]:
        return [s.num_layers for s in self.stages]

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.stages)), key=lambda s: self.stages[s].est_ms)

    def to_dict(self) -> dict:
        return {
            "model_id": self.model_id,
            "stages": [asdict(s) for s in self.stages],
            "bottleneck_ms": self.bottleneck_ms,
            "plan_hash": self.plan_hash,
            "explanation": list(self.explanation),
            "parallel": self.parallel,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of to_json; raises PlanError when the hash does not match the ranges."""
        d = json.loads(text)
        plan = cls(
            model_id=d["model_id"],
            stages=tuple(Stage(**s) for s in d["stages"]),
            bottleneck_ms=float(d["bottleneck_ms"]),
            plan_hash=d["plan_hash"],
            explanation=list(d.get("explanation", [])),
            parallel=d.get("parallel", "pipeline"),
        )
        expected = compute_plan_hash(
            plan.model_id, [(s.node, s.layer_start, s.layer_end) for s in plan.stages],
            plan.parallel)
        if expected != plan.plan_hash:
            raise PlanError(f"plan hash {plan.plan_hash} does not match its stages ({expected})")
        return plan


def compute_plan_hash(model_id: str, ranges: Sequence[tuple[str, int, int]],
                      parallel: str = "pipeline") -> str:
    """First 16 hex chars of sha256 over the canonical JSON
    {"model_id": ..., "stages": [[node, start, end], ...], "v": 1} (sorted keys, no spaces),
    with "parallel": "tensor" for a tensor-parallel plan (a pipeline's hash is as it was).

    It covers exactly what workers must agree on (which node runs which layers of which model);
    budgets, speeds and estimates are left out so a re-measured speed with the same ranges keeps
    the same hash. Every worker recomputes it and refuses a mismatch.
    """
    fields = {"model_id": model_id, "stages": [[n, int(a), int(b)] for n, a, b in ranges], "v": 1}
    if parallel != "pipeline":
        fields["parallel"] = parallel
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- cost model


class _Costs:
    """Memory and time of stage (node j, layers [i, k)) per the module docstring's model."""

    def __init__(
        self,
        layout: ModelLayout,
        nodes: Sequence[NodeSpec],
        os_reserve_bytes: int,
        context_tokens: int,
        max_sequences: int,
        unlimited_memory: bool = False,
    ):
        self.layout = layout
        self.nodes = list(nodes)
        self.L = layout.num_layers
        self.prefix, self.stream_prefix, self.kv_prefix = [0], [0], [0]
        self.read_prefix = [0]  # what a batch-1 step reads of layers kept on disk
        for i, b in enumerate(layout.layer_bytes):
            self.prefix.append(self.prefix[-1] + b)
            self.stream_prefix.append(self.stream_prefix[-1] + layout.stream_bytes(i))
            self.read_prefix.append(self.read_prefix[-1] + layout.read_bytes(i))
            self.kv_prefix.append(
                self.kv_prefix[-1] + layout.kv_bytes(i, context_tokens) * max_sequences)
        # What one full-attention layer reserves, for the explanation.
        self.kv_layer = layout.kv_bytes_per_token_per_layer * context_tokens * max_sequences
        # What a stage's weights and KV may take of each node.
        self.os_reserve_bytes = os_reserve_bytes
        self.budgets = [n.memory_bytes - os_reserve_bytes - n.cache_bytes for n in nodes]
        self.limits = [math.inf if unlimited_memory else b for b in self.budgets]
        # The head matmul streams lm_head, or the embedding when tied.
        self.head_compute = layout.embed_bytes if layout.tied_embeddings else layout.head_bytes
        self.largest_layer = max(layout.layer_bytes, default=0)
        # The split search asks each (node, range) many times: fits, held, ms, in every order.
        self._streamed: dict[tuple[int, int, int], int | None] = {}
        self._ms: dict[tuple[int, int, int], float] = {}

    def weights(self, i: int, k: int) -> int:
        lay = self.layout
        w = self.prefix[k] - self.prefix[i]
        if i == 0:
            w += lay.embed_bytes + lay.draft_bytes
        if k == self.L:
            w += lay.norm_bytes
            if not lay.tied_embeddings:
                w += lay.head_bytes
            elif i != 0:  # tied: a last stage that is not also first needs its own copy
                w += lay.embed_bytes
        return w

    def kv(self, i: int, k: int) -> int:
        return self.kv_prefix[k] - self.kv_prefix[i]

    def mem(self, i: int, k: int) -> int:
        return self.weights(i, k) + self.kv(i, k)

    def streamed(self, j: int, i: int, k: int) -> int | None:
        """Layers of [i, k) node j keeps on disk (0: none); None when the stage cannot fit."""
        if (j, i, k) not in self._streamed:
            cap = self.nodes[j].weights_cap
            room = self.limits[j] - self.kv(i, k)
            self._streamed[j, i, k] = streamed_layers(
                self.prefix, i, k, self.weights(i, k), min(room, cap) if cap else room,
                bool(cap), self.largest_layer)
        return self._streamed[j, i, k]

    def held(self, j: int, i: int, k: int) -> int:
        """Weights the stage keeps in memory: all, or the resident ones and streaming buffers."""
        n = self.streamed(j, i, k) or 0
        w = self.weights(i, k)
        return w - (self.prefix[k] - self.prefix[k - n]) + STREAM_BUFFERS * self.largest_layer \
            if n else w

    def fits(self, j: int, i: int, k: int) -> bool:
        return self.streamed(j, i, k) is not None

    def compute_bytes(self, i: int, k: int) -> int:
        """Bytes a decode step streams: layers, and norm + head on the last stage."""
        b = self.stream_prefix[k] - self.stream_prefix[i]
        if k == self.L:
            b += self.layout.norm_bytes + self.head_compute
        return b

    def compute_ms(self, j: int, i: int, k: int) -> float:
        ms = (self.compute_bytes(i, k) / (self.nodes[j].speed * GB) * 1e3
              + (k - i) * self.nodes[j].layer_ms)
        if n := self.streamed(j, i, k):
            ms += disk_ms(self.read_prefix[k] - self.read_prefix[k - n], self.nodes[j].disk_gbps)
        return ms

    def link(self, j: int, i: int, k: int) -> float:
        return 0.0 if (i == 0 and k == self.L) else self.nodes[j].link_ms

    def ms(self, j: int, i: int, k: int) -> float:
        if (j, i, k) not in self._ms:
            self._ms[j, i, k] = self.compute_ms(j, i, k) + self.link(j, i, k)
        return self._ms[j, i, k]


# A split as (node index, layer_start, layer_end) triples, in pipeline order.
_Ranges = list[tuple[int, int, int]]


def _best_in_order(c: _Costs, order: Sequence[int]) -> tuple[_Ranges, float] | None:
    """Exact minimum-bottleneck split over nodes in `order` (each skipped or given a non-empty
    contiguous range), ties broken by the smallest sum of stage times; None if nothing fits."""
    n, L = len(order), c.L
    inf = math.inf
    # Pass 1: best[jj][i] = min bottleneck covering layers [i, L) with nodes order[jj:].
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    best[n][L] = 0.0
    for jj in range(n - 1, -1, -1):
        j, row, nxt = order[jj], best[jj], best[jj + 1]
        row[:] = nxt  # leave node j out
        for i in range(L):
            for k in range(i + 1, L + 1):
                if not c.fits(j, i, k):
                    break  # memory only grows with k
                if nxt[k] == inf:
                    continue
                v = max(c.ms(j, i, k), nxt[k])
                if v < row[i]:
                    row[i] = v
    bottleneck = best[0][0]
    if bottleneck == inf:
        return None
    cap = bottleneck * (1 + _REL_TOL) + 1e-12
    # Pass 2: among splits whose every stage is <= the optimal bottleneck, the least total time.
    total = [[inf] * (L + 1) for _ in range(n + 1)]
    total[n][L] = 0.0
    choice: list[list[int]] = [[0] * (L + 1) for _ in range(n)]  # 0 = left out, else end layer
    for jj in range(n - 1, -1, -1):
        j, row, nxt = order[jj], total[jj], total[jj + 1]
        row[:] = nxt
        for i in range(L):
            for k in range(i + 1, L + 1):
                if not c.fits(j, i, k):
                    break
                t = c.ms(j, i, k)
                if t > cap or nxt[k] == inf:
                    continue
                if t + nxt[k] < row[i] - 1e-12:
                    row[i] = t + nxt[k]
                    choice[jj][i] = k
    ranges: _Ranges = []
    i = 0
    for jj in range(n):
        k = choice[jj][i]
        if k:
            ranges.append((order[jj], i, k))
            i = k
    assert i == L, "planner DP reconstruction did not cover every layer"
    return ranges, max(c.ms(j, a, b) for j, a, b in ranges)


def _search_order(c: _Costs) -> list[int] | None:
    """A node order reaching the smallest bottleneck over all orders (and subsets) of nodes.

    Binary search over the candidate bottlenecks (every feasible stage time); for a candidate B,
    reach[mask] is the furthest layer the nodes in `mask` can cover, each stage <= B. Greedy
    furthest-reach is exact because a stage starting later is never costlier (fewer bytes, no
    embedding), so a further position never loses.
    """
    n, L = len(c.nodes), c.L

    def furthest(j: int, i: int, b: float) -> int:
        """Largest k < L with stage [i, k) within budget and time b (i if none)."""
        lo, hi = i, L - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if c.fits(j, i, mid) and c.ms(j, i, mid) <= b:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def feasible(b: float) -> list[int] | None:
        reach = [-1] * (1 << n)
        parent: list[tuple[int, int]] = [(-1, -1)] * (1 << n)
        reach[0] = 0
        for mask in range(1 << n):
            i = reach[mask]
            if i < 0:
                continue
            for j in range(n):
                bit = 1 << j
                if mask & bit:
                    continue
                if c.fits(j, i, L) and c.ms(j, i, L) <= b:  # j can close the pipeline
                    order = [j]
                    m = mask
                    while m:
                        m, pj = parent[m]
                        order.append(pj)
                    return order[::-1]
                k = furthest(j, i, b)
                if k > i and k > reach[mask | bit]:
                    reach[mask | bit] = k
                    parent[mask | bit] = (mask, j)
        return None

    candidates = sorted(
        {
            c.ms(j, i, k)
            for j in range(n)
            for i in range(L)
            for k in range(i + 1, L + 1)
            if c.fits(j, i, k)
        }
    )
    if not candidates or feasible(candidates[-1]) is None:
        return None
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]) is not None:
            hi = mid
        else:
            lo = mid + 1
    used = feasible(candidates[lo])
    assert used is not None
    return used + [j for j in range(n) if j not in used]


def _closest_split(c: _Costs, order: Sequence[int]) -> _Ranges:
    """The split (in `order`) whose worst memory overflow (mem - budget) is smallest."""
    n, L = len(order), c.L
    inf = math.inf
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    best[n][L] = -inf
    choice = [[0] * (L + 1) for _ in range(n)]
    for jj in range(n - 1, -1, -1):
        j, row, nxt = order[jj], best[jj], best[jj + 1]
        row[:] = nxt
        for i in range(L):
            for k in range(i + 1, L + 1):
                if nxt[k] == inf:
                    continue
                v = max(c.mem(i, k) - c.budgets[j], nxt[k])
                if v < row[i]:
                    row[i] = v
                    choice[jj][i] = k
    ranges: _Ranges = []
    i = 0
    for jj in range(n):
        if k := choice[jj][i]:
            ranges.append((order[jj], i, k))
            i = k
    return ranges


def _ranges_of_split(split: Sequence[int], order: Sequence[int]) -> _Ranges:
    """[5, 0, 3] over nodes (a, b, c) -> a: [0, 5), c: [5, 8); a zero leaves the node out."""
    ranges, start = [], 0
    for j, count in zip(order, split):
        if count:
            ranges.append((j, start, start + count))
            start += count
    return ranges


def _overflows(c: _Costs, ranges: _Ranges) -> dict[str, int]:
    return {
        c.nodes[j].name: c.mem(a, b) - c.budgets[j]
        for j, a, b in ranges
        if c.mem(a, b) > c.budgets[j]
    }


# --------------------------------------------------------------------------- public API


def even_split(num_layers: int, num_nodes: int) -> list[int]:
    """mlx-lm pipeline's way: equal counts, the first nodes taking one extra layer."""
    base, extra = divmod(num_layers, num_nodes)
    return [base + (1 if s < extra else 0) for s in range(num_nodes)]


def ram_proportional_split(layout: ModelLayout, nodes: Sequence[NodeSpec]) -> list[int]:
    """exo's way: each node's layer count proportional to its memory, by rounding the cumulative
    memory fraction (so counts sum to num_layers; a small node may get 0 and be left out)."""
    total = sum(n.memory_bytes for n in nodes)
    if total <= 0:
        return even_split(layout.num_layers, len(nodes))
    counts, start, cum = [], 0, 0
    for node in nodes:
        cum += node.memory_bytes
        end = math.floor(cum / total * layout.num_layers + 0.5)
        counts.append(end - start)
        start = end
    return counts


def make_plan(
    layout: ModelLayout,
    nodes: list[NodeSpec],
    os_reserve_bytes: int = 8 << 30,
    context_tokens: int = 4096,
    max_sequences: int = 8,
    order: Literal["given", "search"] = "given",
    split: list[int] | None = None,
) -> Plan:
    """Plan contiguous layer ranges over `nodes` (see the module docstring for the model).

    split: a user-given layer count per node (in the given order, every entry >= 1, summing to
    num_layers); it is validated and explained instead of optimised.
    Raises PlanError when nothing (or the user's split) fits, saying how many bytes are missing.
    """
    if not nodes:
        raise PlanError("no nodes to plan over")
    names = [n.name for n in nodes]
    if dupes := sorted({x for x in names if names.count(x) > 1}):
        raise PlanError(f"node names must be unique; repeated: {', '.join(dupes)}")
    if context_tokens < 0 or max_sequences < 0 or os_reserve_bytes < 0:
        raise PlanError("context_tokens, max_sequences and os_reserve_bytes must be >= 0")
    if order not in ("given", "search"):
        raise PlanError(f"order must be 'given' or 'search', not {order!r}")
    c = _Costs(layout, nodes, os_reserve_bytes, context_tokens, max_sequences)
    given = list(range(len(nodes)))
    optimum = None  # (ranges, bottleneck) of the optimal split
    found: list[int] | None = None  # the node order the optimum was searched in

    if split is not None:
        if order == "search":
            raise PlanError("a user split follows the given node order; drop order='search'")
        _validate_split(c, split)
        ranges = _ranges_of_split(split, given)
        if over := _overflows(c, ranges):
            raise _memory_error(c, ranges, over, "the split " + _split_str(split))
        optimum = _best_in_order(c, given)
    else:
        if order == "search":
            if len(nodes) > MAX_SEARCH_NODES:
                raise PlanError(
                    f"order='search' handles up to {MAX_SEARCH_NODES} nodes "
                    f"({len(nodes)} given); use order='given'"
                )
            found = _search_order(c)
            optimum = _best_in_order(c, found) if found is not None else None
        else:
            found = given
            optimum = _best_in_order(c, given)
        if optimum is None:
            closest = _closest_split(c, given)
            raise _memory_error(c, closest, _overflows(c, closest), "the closest split")
        ranges = optimum[0]

    stages = tuple(
        Stage(
            node=c.nodes[j].name,
            layer_start=a,
            layer_end=b,
            weight_bytes=c.held(j, a, b),
            kv_bytes=c.kv(a, b),
            memory_budget=c.budgets[j] + c.nodes[j].cache_bytes,
            est_ms=c.ms(j, a, b),
            cache_bytes=c.nodes[j].cache_bytes,
            streamed_layers=c.streamed(j, a, b) or 0,
        )
        for j, a, b in ranges
    )
    bottleneck = max(s.est_ms for s in stages)
    plan_hash = compute_plan_hash(
        layout.model_id, [(s.node, s.layer_start, s.layer_end) for s in stages]
    )
    explanation = _explain(
        c, ranges, bottleneck, split, optimum, order, found or given, context_tokens, max_sequences
    )
    return Plan(layout.model_id, stages, bottleneck, plan_hash, explanation)


def _validate_split(c: _Costs, split: Sequence[int]) -> None:
    n, L = len(c.nodes), c.L
    names = [nd.name for nd in c.nodes]
    if len(split) != n:
        raise PlanError(
            f"the split {_split_str(split)} has {len(split)} entries but there are {n} nodes "
            f"({', '.join(names)}): give one layer count per node, in order"
        )
    for name, count in zip(names, split):
        if not isinstance(count, int) or isinstance(count, bool):
            raise PlanError(
                f"the split entry for {name} is {count!r}, not a whole number of layers"
            )
        if count < 0:
            raise PlanError(f"the split gives {name} {count} layers; counts must be positive")
        if count == 0:
            raise PlanError(
                f"the split gives {name} no layers (an empty stage); every stage needs at least "
                f"one layer: leave {name} out of the node list instead"
            )
    if sum(split) != L:
        raise PlanError(
            f"the split {_split_str(split)} covers {sum(split)} layers but {c.layout.model_id} "
            f"has {L}"
        )


def _budget_str(c: _Costs, j: int) -> str:
    """Node j's budget, or, when its reserve and prefix cache take more than its memory, by how
    much (what a stage there is short of on top of its own need)."""
    if c.budgets[j] >= 0:
        return f"budget {human_bytes(c.budgets[j])}"
    nd = c.nodes[j]
    # Only what takes memory is named: a 0 B reserve is no reason.
    taken = [part for size, part in (
        (c.os_reserve_bytes, f"the {human_bytes(c.os_reserve_bytes)} OS reserve"),
        (nd.cache_bytes, f"the {human_bytes(nd.cache_bytes)} prefix cache")) if size]
    return (f"no room: {' and '.join(taken)} take{'s' if len(taken) == 1 else ''} "
            f"{human_bytes(-c.budgets[j])} more than the node's {human_bytes(nd.memory_bytes)}")


def _memory_error(c: _Costs, ranges: _Ranges, over: dict[str, int], what: str) -> PlanError:
    """PlanError saying how many bytes are missing overall and per node."""
    lay, L = c.layout, c.L
    usable = [b for b in c.budgets if b > 0]
    weights = lay.total_weight_bytes
    if lay.tied_embeddings and len(usable) > 1:
        weights += lay.embed_bytes  # the last stage's copy of the tied head
    need = weights + c.kv(0, L)
    have = sum(usable)
    missing = max(0, need - have)
    lines = [
        f"{lay.model_id} does not fit: it needs {human_bytes(need)} ({need} bytes: weights {human_bytes(weights)} "
        f"+ KV {human_bytes(c.kv(0, L))}); the nodes offer {human_bytes(have)} after the OS reserve"
        + (" and their workers' prefix caches." if any(n.cache_bytes for n in c.nodes) else ".")
    ]
    if missing:
        lines.append(f"Missing overall: {human_bytes(missing)} ({missing} bytes).")
    else:
        lines.append(
            f"The total would suffice ({human_bytes(have - need)} spare), but no contiguous split fits: "
            f"layers are indivisible, the embedding sits on the first stage and norm + head on "
            f"the last."
        )
    lines.append(f"Per node, for {what}:")
    by_node = {nd.name: j for j, nd in enumerate(c.nodes)}
    placed = {c.nodes[j].name: (a, b) for j, a, b in ranges}
    for name, j in by_node.items():
        if name in placed:
            a, b = placed[name]
            short = over.get(name, 0)
            status = f"short {human_bytes(short)} ({short} bytes)" if short else "fits"
            lines.append(f"  {name}: layers [{a}, {b}) need {human_bytes(c.mem(a, b))}, "
                         f"{_budget_str(c, j)}: {status}")
        else:
            lines.append(f"  {name}: no layers ({_budget_str(c, j)})")
    lines.append(
        "Add memory or a node, reserve less KV (--context TOKENS, --sequences N), keep a "
        "smaller OS reserve (--os-reserve) or prefix cache (--hot-cache-max-size; a joined "
        "node's is its `join --hot-cache-max-size`), use a more quantized model, or stream "
        "the layers that do not fit from the SSD, slower: --weights-memory SIZE (on `serve`, "
        "or each `join`) below the memory left for weights."
    )
    return PlanError("\n".join(lines), missing_bytes=missing, missing_by_node=over)


def _explain(
    c: _Costs,
    ranges: _Ranges,
    bottleneck: float,
    split: Sequence[int] | None,
    optimum: tuple[_Ranges, float] | None,
    order: str,
    node_order: Sequence[int],
    context_tokens: int,
    max_sequences: int,
) -> list[str]:
    lay, nodes = c.layout, c.nodes
    out = [
        f"Model {lay.model_id}: {lay.num_layers} layers, {human_bytes(lay.total_weight_bytes)} of weights "
        f"(embedding {human_bytes(lay.embed_bytes)}, head "
        f"{'tied to the embedding' if lay.tied_embeddings else human_bytes(lay.head_bytes)}); KV reserved "
        f"for {context_tokens} tokens x {max_sequences} sequences = {human_bytes(c.kv(0, c.L))} ("
        + (f"{human_bytes(c.kv_layer)} per layer)." if not lay.layer_kv else
           f"{human_bytes(c.kv_layer)} per full-attention layer; sliding-window and linear-attention "
           f"layers hold less).")
    ]
    if lay.layer_stream_bytes:
        out.append(
            f"Mixture of experts: a decode step streams {human_bytes(c.compute_bytes(0, c.L))} of "
            f"{human_bytes(lay.total_weight_bytes)} (the routed experts at their active share), so stage "
            f"times follow the active bytes while memory holds every expert.")
    if split is not None:
        out.append(f"Split given by the user: {_split_str(split)}.")
    elif order == "search":
        out.append("Node order searched: " + " -> ".join(nodes[j].name for j, _, _ in ranges) + ".")
    worst = max(range(len(ranges)), key=lambda s: c.ms(*ranges[s]))
    for s, (j, a, b) in enumerate(ranges):
        nd = nodes[j]
        out.append(
            f"Stage {s}: {nd.name} layers [{a}, {b}) ({b - a}): weights {human_bytes(c.weights(a, b))}, "
            f"KV {human_bytes(c.kv(a, b))}"
            + (f", prefix cache {human_bytes(nd.cache_bytes)}" if nd.cache_bytes else "")
            + f", uses {human_bytes(c.mem(a, b) + nd.cache_bytes)} of "
            f"{human_bytes(max(c.budgets[j] + nd.cache_bytes, 0))} budget; "
            f"est {c.ms(j, a, b):.3f} ms = {c.compute_ms(j, a, b):.3f} ms at {nd.speed:g} GB/s "
            + (f"and {nd.layer_ms:g} ms a layer " if nd.layer_ms else "")
            + f"+ {c.link(j, a, b):g} ms link" + ("  <- bottleneck" if s == worst else "")
        )
        if n := c.streamed(j, a, b):
            disk = c.read_prefix[b] - c.read_prefix[b - n]
            whole = c.prefix[b] - c.prefix[b - n]
            share = (f"; at batch 1 only the routed experts of their {human_bytes(whole)} are "
                     f"read, a batch's rows route to more, up to all" if disk < whole else "")
            out.append(
                f"Layers [{b - n}, {b}) of {nd.name} stream from its SSD ({human_bytes(disk)} read each "
                f"step at {nd.disk_gbps:g} GB/s: {disk_ms(disk, nd.disk_gbps):.1f} ms a step, "
                f"shared by every row of a batch{share}): its --weights-memory "
                f"{human_bytes(nd.weights_cap)} holds the other {b - a - n} layers' "
                f"{human_bytes(c.held(j, a, b) - STREAM_BUFFERS * c.largest_layer)} and "
                f"{STREAM_BUFFERS} streamed layers' buffers.")
    used = {j for j, _, _ in ranges}
    for j, nd in enumerate(nodes):
        if j not in used:
            why = (
                "its memory is within the OS reserve and its prefix cache"
                if c.budgets[j] <= 0 and nd.cache_bytes
                else "its memory is within the OS reserve"
                if c.budgets[j] <= 0
                else "cannot hold a stage"
                if not any(c.fits(j, i, k) for i in range(c.L) for k in range(i + 1, c.L + 1))
                else "giving it layers would not lower the bottleneck"
            )
            out.append(f"Left out: {nd.name} ({why}).")

    j, a, b = ranges[worst]
    link = c.link(j, a, b)
    out.append(
        f"Bottleneck: stage {worst} ({nodes[j].name}) at {bottleneck:.3f} ms per step: it streams "
        f"{human_bytes(c.compute_bytes(a, b))} of weights at "
        f"{nodes[j].speed:g} GB/s" + (f" and pays a {link:g} ms link." if link else ".")
    )
    if split is not None:
        if optimum is not None:
            ratio = bottleneck / optimum[1] if optimum[1] > 0 else 1.0
            counts = {j: b - a for j, a, b in optimum[0]}
            out.append(
                f"The optimal split {_split_str([counts.get(j, 0) for j in range(len(c.nodes))])}"
                f" would reach {optimum[1]:.3f} ms "
                f"(this split is {ratio:.2f}x)."
            )
    else:
        # The same order with unlimited memory: if it does better, memory is what binds.
        free = _Costs(lay, nodes, 0, 0, 0, unlimited_memory=True)
        unconstrained = _best_in_order(free, node_order)
        if unconstrained and unconstrained[1] < bottleneck * (1 - 1e-6):
            tight = [
                nodes[jj].name for jj, aa, bb in ranges if c.mem(aa, bb) > 0.9 * c.budgets[jj]
            ]
            out.append(
                f"Why: memory binds. Without memory limits this order could reach "
                f"{unconstrained[1]:.3f} ms; the budgets of {', '.join(tight) or 'the nodes'} "
                f"keep layers off the faster stages. This is the exact optimum under those limits."
            )
        else:
            out.append(
                "Why: speeds, not memory, set it. This is the exact optimum over all contiguous "
                "splits in this order; layers are indivisible, so stages cannot be balanced more "
                "finely."
            )
    out.append(
        f"One sequence's per-token latency (sum of stages): "
        f"{sum(c.ms(*r) for r in ranges):.3f} ms; with micro-batches in flight the pipeline can "
        f"finish a step every {bottleneck:.3f} ms."
    )
    given = list(range(len(nodes)))
    for label, counts in (
        ("Even split", even_split(c.L, len(nodes))),
        ("RAM-proportional split (exo)", ram_proportional_split(lay, nodes)),
    ):
        rr = _ranges_of_split(counts, given)
        over = _overflows(c, rr)
        if over:
            worst_node = max(over, key=over.get)
            out.append(
                f"{label} {_split_str(counts)}: does not fit ({worst_node} over by "
                f"{human_bytes(over[worst_node])})."
            )
        else:
            other = max(c.ms(*r) for r in rr)
            ratio = other / bottleneck if bottleneck > 0 else 1.0
            out.append(
                f"{label} {_split_str(counts)}: bottleneck {other:.3f} ms "
                f"({ratio:.2f}x this plan)."
            )
    if all(nd.speed == 1.0 for nd in nodes) and all(nd.link_ms == 0 for nd in nodes):
        out.append("Speeds are not calibrated (all 1.0 GB/s): times are relative, not real.")
    return out


def _split_str(split: Sequence[int]) -> str:
    return "[" + ", ".join(str(x) for x in split) + "]"

