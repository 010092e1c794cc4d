"""A pipeline of tensor-parallel stages: the nodes, in ring order, cut into runs of neighbours,
each run a tensor-parallel stage holding a slice of every layer of its own range of layers
(e.g. two Mac Studios cabled over Thunderbolt as one stage, and a Mac mini across the switch
as the next). The node side is omlx_node/sub_group.py.

Pure, like the planner (omlx_coordinator/planning/planner.py), with the cost models of both: a
run of k ranks over layers [i, j) streams, on its slowest rank, its largest share of those
layers (omlx_shared/tensor_split.py), the norm and head where it is last, and each layer's fixed
cost (`NodeSpec.layer_ms`, its slowest rank's); then its collectives, each a hop over the run's
own links (the slowest of them): two all-reduces a layer (2 ranks swap
their parts at once: one hop; k > 2 pass a running sum up the run and back: 2(k - 1) hops), and
the step relayed from its first rank to the others (k - 1 hops); then its link to the next run.
Every rank of a run holds its share of the layers and of their KV, the embedding where the run
is first and the norm and head where it is last, whole; rank 0 (the first run's first node)
also the draft model, where one drafts (`ModelLayout.draft_bytes`).

Every cut of the nodes into runs with at least two runs and one of two or more ranks is tried
(2^(n-1) cuts: n is a handful of Macs); each cut's layers are split by the planner's own exact
search (fewest milliseconds at the slowest run, then in all), and the cut whose runs take the
fewest milliseconds one after another, a batch-1 token, wins. So runs form where the links are
fast: islands of Thunderbolt, with Ethernet between them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_coordinator.planning.planner import (
    GB,
    NodeSpec,
    Plan,
    PlanError,
    Stage,
    _best_in_order,
    compute_plan_hash,
    human_bytes,
)
from omlx_coordinator.planning.tensor_plan import ACTIVATION_BYTES

PARALLEL = "tensor-pipeline"


def cuts(n: int) -> Iterator[tuple[int, ...]]:
    """Every way to cut n nodes in order into runs that makes a pipeline of at least two stages
    with at least one tensor stage: the runs' sizes."""
    for mask in range(1 << (n - 1)):
        sizes, size = [], 1
        for i in range(n - 1):
            if mask >> i & 1:
                sizes.append(size)
                size = 1
            else:
                size += 1
        sizes.append(size)
        if len(sizes) > 1 and max(sizes) > 1:
            yield tuple(sizes)


def hop_ms(run: Sequence[NodeSpec], nbytes: int) -> float:
    """One message of `nbytes` between neighbours of `run`, over its slowest inner link."""
    inner = run[:-1]
    latency = max(nd.link_ms for nd in inner)
    known = [nd.link_gbps for nd in inner if nd.link_gbps > 0]
    return latency + (nbytes / (min(known) * GB) * 1e3 if known else 0.0)


def collective_hops(ranks: int, layers: int) -> int:
    """Hops a decode step takes inside a run of `ranks` over `layers` layers (see above)."""
    per_reduce = 1 if ranks == 2 else 2 * (ranks - 1)
    return 2 * layers * per_reduce + ranks - 1


class _RunCosts:
    """Memory and time of run j over layers [i, k), as `_best_in_order` reads a planner's
    costs (its "node" j is a run here)."""

    def __init__(self, layout: ModelLayout, runs: list[list[NodeSpec]], os_reserve_bytes: int,
                 context_tokens: int, max_sequences: int):
        self.layout, self.runs, self.L = layout, runs, layout.num_layers
        self.prefix, self.stream_prefix, self.kv_prefix = [0], [0], [0]
        for i, b in enumerate(layout.layer_bytes):
            self.prefix.append(self.prefix[-1] + b)
            self.stream_prefix.append(self.stream_prefix[-1] + layout.stream_bytes(i))
            self.kv_prefix.append(self.kv_prefix[-1]
                                  + layout.kv_bytes(i, context_tokens) * max_sequences)
        self.shares = [layout.tensor_share(len(r)) if len(r) > 1 else (1.0, 1.0) for r in runs]
        budgets = [[nd.memory_bytes - os_reserve_bytes - nd.cache_bytes for nd in r]
                   for r in runs]
        self.budgets = [min(b) for b in budgets]
        # What a run's first node holds beside the draft model, where the run is first.
        self.draft_budgets = [b[0] - layout.draft_bytes for b in budgets]
        self.head = layout.embed_bytes if layout.tied_embeddings else layout.head_bytes
        self.single = len(runs) == 1

    def weights(self, j: int, i: int, k: int) -> int:
        lay = self.layout
        w = math.ceil((self.prefix[k] - self.prefix[i]) * self.shares[j][0])
        if i == 0:
            w += lay.embed_bytes
        if k == self.L:
            w += lay.norm_bytes + (lay.head_bytes if not lay.tied_embeddings or i == 0
                                   else lay.embed_bytes)
        return w

    def kv(self, j: int, i: int, k: int) -> int:
        return math.ceil((self.kv_prefix[k] - self.kv_prefix[i]) * self.shares[j][1])

    def fits(self, j: int, i: int, k: int) -> bool:
        need = self.weights(j, i, k) + self.kv(j, i, k)
        return need <= self.budgets[j] and (i > 0 or need <= self.draft_budgets[j])

    def compute_ms(self, j: int, i: int, k: int) -> float:
        run = self.runs[j]
        b = math.ceil((self.stream_prefix[k] - self.stream_prefix[i]) * self.shares[j][0])
        if k == self.L:
            b += self.layout.norm_bytes + self.head
        return (b / (min(nd.speed for nd in run) * GB) * 1e3
                + (k - i) * max(nd.layer_ms for nd in run))

    def collectives_ms(self, j: int, i: int, k: int) -> float:
        run = self.runs[j]
        if len(run) == 1:
            return 0.0
        return collective_hops(len(run), k - i) * hop_ms(
            run, self.layout.hidden_size * ACTIVATION_BYTES)

    def link(self, j: int, i: int, k: int) -> float:
        return 0.0 if (i == 0 and k == self.L) else self.runs[j][-1].link_ms

    def ms(self, j: int, i: int, k: int) -> float:
        return self.compute_ms(j, i, k) + self.collectives_ms(j, i, k) + self.link(j, i, k)


def _runs_of(nodes: Sequence[NodeSpec], sizes: Sequence[int]) -> list[list[NodeSpec]]:
    out, at = [], 0
    for size in sizes:
        out.append(list(nodes[at:at + size]))
        at += size
    return out


def _refusal(layout: ModelLayout, sizes: Sequence[int]) -> str:
    for k in sorted(set(sizes)):
        if k > 1 and (why := layout.tensor_refusal(k)):
            return why
    return ""


def make_tensor_pipeline_plan(layout: ModelLayout, nodes: list[NodeSpec],
                              os_reserve_bytes: int = 8 << 30, context_tokens: int = 4096,
                              max_sequences: int = 8) -> Plan:
    """The fastest pipeline of tensor-parallel stages over `nodes` (in ring order) at batch 1.
    Raises PlanError when none fits, or the model cannot be split over any run's ranks."""
    n = len(nodes)
    if n < 3:
        raise PlanError(f"a pipeline of tensor-parallel stages needs at least 3 nodes (a stage "
                        f"of 2 and one more), got {n}; use --parallel tensor or pipeline")
    best, refusals, short = None, [], []
    for sizes in cuts(n):
        if why := _refusal(layout, sizes):
            refusals.append(why)
            continue
        runs = _runs_of(nodes, sizes)
        c = _RunCosts(layout, runs, os_reserve_bytes, context_tokens, max_sequences)
        found = _best_in_order(c, range(len(runs)))
        if found is None or len(found[0]) < len(runs):
            short.append(sizes)
            continue  # (a run left out: another cut covers that plan)
        ranges = found[0]
        total = sum(c.ms(*r) for r in ranges)
        if best is None or total < best[0] - 1e-12:
            best = (total, sizes, c, ranges)
    if best is None:
        why = (refusals[0] if refusals and not short else
               "no cut of the nodes into tensor-parallel runs holds the model: each rank of a "
               "run holds its share of its layers and their KV, and the embedding or the head "
               "whole" + (f"; rank 0 also the draft model ({human_bytes(layout.draft_bytes)})"
                          if layout.draft_bytes else ""))
        raise PlanError(f"{layout.model_id} cannot run as a pipeline of tensor-parallel "
                        f"stages over {n} nodes: {why}")
    total, sizes, c, ranges = best
    stages = []
    for j, a, b in ranges:
        for r, nd in enumerate(c.runs[j]):
            draft = layout.draft_bytes if a == 0 and r == 0 else 0
            stages.append(Stage(node=nd.name, layer_start=a, layer_end=b,
                                weight_bytes=c.weights(j, a, b) + draft, kv_bytes=c.kv(j, a, b),
                                memory_budget=c.budgets[j] + nd.cache_bytes,
                                est_ms=c.ms(j, a, b), cache_bytes=nd.cache_bytes))
    bottleneck = max(s.est_ms for s in stages)
    plan_hash = compute_plan_hash(layout.model_id,
                                  [(s.node, s.layer_start, s.layer_end) for s in stages], PARALLEL)
    return Plan(layout.model_id, tuple(stages), bottleneck, plan_hash,
                _explain(c, ranges, total), PARALLEL)


def _explain(c: _RunCosts, ranges: list[tuple[int, int, int]], total: float) -> list[str]:
    lines = [f"Pipeline of {len(ranges)} tensor-parallel stages over "
             f"{sum(len(r) for r in c.runs)} nodes (the fastest cut of the nodes, in ring "
             f"order, into runs of neighbours):"]
    draft = c.layout.draft_bytes
    draft_note = f" (rank 0 also the draft model, {human_bytes(draft)})" if draft else ""
    for s, (j, a, b) in enumerate(ranges):
        run = c.runs[j]
        names = ", ".join(nd.name for nd in run)
        kind = f"tensor x{len(run)} over {names}" if len(run) > 1 else f"{names} alone"
        comm = (f" + {collective_hops(len(run), b - a)} hops inside the stage at "
                f"{hop_ms(run, c.layout.hidden_size * ACTIVATION_BYTES):.3f} ms "
                f"({c.collectives_ms(j, a, b):.2f} ms)" if len(run) > 1 else "")
        lines.append(
            f"  Stage {s}: {kind}, layers [{a}, {b}): each rank holds "
            f"{human_bytes(c.weights(j, a, b) + c.kv(j, a, b))} with its KV"
            f"{draft_note if a == 0 else ''}; est "
            f"{c.ms(j, a, b):.3f} ms = {c.compute_ms(j, a, b):.3f} ms streaming{comm} + "
            f"{c.link(j, a, b):g} ms link to the next stage")
    lines.append(f"A token at batch 1 goes through every stage: {total:.3f} ms "
                 f"({1e3 / total:.2f} tok/s).")
    return lines
