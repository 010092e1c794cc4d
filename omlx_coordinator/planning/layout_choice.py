"""Which layout serves a model: a pipeline of layer ranges, one tensor-parallel stage, a
pipeline of tensor-parallel stages, or the fastest of those and one node, predicted.

`--parallel` (per model in --models-config: `parallel = "..."`): "pipeline" plans layer ranges
(omlx_coordinator/planning/planner.py); "tensor" makes every node a rank of one tensor-parallel stage
(omlx_coordinator/planning/tensor_plan.py); "tensor-pipeline" cuts the nodes into runs of
neighbours, each a tensor-parallel stage of a pipeline
(omlx_coordinator/planning/tensor_pipeline_plan.py); "auto" predicts each candidate's batch-1 decode rate, a
single stream's tokens a second, and takes the fastest:

- one node: the fastest node that holds the whole model; a token streams every weight once;
- pipeline: at batch 1 the stages run one after the other (micro-batches only help several
  streams), so a token takes the sum of the stages' times, each with its link's latency;
- tensor: each rank streams its share at once, then the all-reduces (tensor_plan.py);
- tensor x pipeline (3 nodes or more): its stages one after the other, each its ranks' share
  and the all-reduces over its own links (tensor_pipeline_plan.py).

A tie goes to the candidate with fewer nodes. The plan's explanation lists every candidate's
prediction and why it lost, e.g. that a tensor-parallel stage's all-reduces over a slow link
cost more than the halved weight reads save. The predictions come from the nodes' measured
speeds and links (NodeSpec): nothing is measured here. Pure: no MLX, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_coordinator.planning.planner import GB, NodeSpec, Plan, PlanError, make_plan
from omlx_coordinator.planning.tensor_pipeline_plan import (
    PARALLEL as TENSOR_PIPELINE,
    make_tensor_pipeline_plan,
)
from omlx_coordinator.planning.tensor_plan import (
    allreduce_ms,
    collectives_per_token,
    gather_ms,
    make_tensor_plan,
    rank_stream_bytes,
)
from omlx_shared.parallel_modes import PARALLEL


@dataclass(frozen=True)
class Candidate:
    name: str  # "one node (mac1)", "pipeline x2", "tensor x2"
    plan: Plan | None  # None: it cannot serve the model
    tok_s: float  # predicted batch-1 decode tokens a second (0 when it cannot serve)
    why: str  # the prediction's terms, or why it cannot serve


def _one_node(layout: ModelLayout, nodes: list[NodeSpec], settings: dict) -> Candidate:
    fitting = []
    for nd in nodes:
        try:
            fitting.append((make_plan(layout, [nd], **settings), nd))
        except PlanError:
            pass
    if not fitting:
        return Candidate("one node", None, 0.0, "no node holds the whole model")
    plan, nd = max(fitting, key=lambda p: 1 / p[0].bottleneck_ms)
    ms, fixed = plan.bottleneck_ms, layout.num_layers * nd.layer_ms
    return Candidate(f"one node ({nd.name})", plan, 1e3 / ms,
                     f"{(ms - fixed) * nd.speed / 1e3:.3f} GB streamed a token at "
                     f"{nd.speed:g} GB/s" + (f", {layout.num_layers} layers at {nd.layer_ms:g} "
                                             f"ms" if fixed else "") + f": {ms:.2f} ms")


def _pipeline(layout: ModelLayout, nodes: list[NodeSpec], settings: dict) -> Candidate:
    try:
        plan = make_plan(layout, nodes, **settings)
    except PlanError as e:
        return Candidate("pipeline", None, 0.0, str(e).splitlines()[0])
    ms = sum(s.est_ms for s in plan.stages)
    return Candidate(f"pipeline x{len(plan.stages)}", plan, 1e3 / ms,
                     "stages one after another at batch 1: "
                     + " + ".join(f"{s.est_ms:.2f}" for s in plan.stages)
                     + f" ms (each with its link) = {ms:.2f} ms")


def _tensor(layout: ModelLayout, nodes: list[NodeSpec], settings: dict) -> Candidate:
    try:
        plan = make_tensor_plan(layout, nodes, **settings)
    except PlanError as e:
        return Candidate(f"tensor x{len(nodes)}", None, 0.0, str(e).splitlines()[0])
    n = len(nodes)
    per = allreduce_ms(nodes, layout.hidden_size * 4)
    comm = collectives_per_token(layout) * per + gather_ms(layout, nodes)
    fixed = " with its layers' fixed costs" if any(nd.layer_ms for nd in nodes) else ""
    gather = "" if layout.tied_embeddings else " and the head's all_gather"
    return Candidate(f"tensor x{n}", plan, 1e3 / plan.bottleneck_ms,
                     f"each rank streams {rank_stream_bytes(layout, n) / GB:.3f} GB "
                     f"({plan.bottleneck_ms - comm:.2f} ms on the slowest{fixed}), then "
                     f"{collectives_per_token(layout)} all-reduces at {per:.3f} ms each{gather} "
                     f"({comm:.2f} ms) = {plan.bottleneck_ms:.2f} ms")


def _tensor_pipeline(layout: ModelLayout, nodes: list[NodeSpec], settings: dict) -> Candidate:
    try:
        plan = make_tensor_pipeline_plan(layout, nodes, **settings)
    except PlanError as e:
        return Candidate("tensor x pipeline", None, 0.0, str(e).splitlines()[0])
    starts = [sum(plan.stage_ranks[:s]) for s in range(len(plan.stage_ranks))]
    times = [plan.stages[r].est_ms for r in starts]
    ms = sum(times)
    return Candidate(plan.layout_name, plan, 1e3 / ms,
                     "stages one after another at batch 1, each its ranks' share and the "
                     "all-reduces over its own links: "
                     + " + ".join(f"{t:.2f}" for t in times) + f" ms = {ms:.2f} ms")


def candidates(layout: ModelLayout, nodes: list[NodeSpec], os_reserve_bytes: int = 8 << 30,
               context_tokens: int = 4096, max_sequences: int = 8) -> list[Candidate]:
    """Every layout `auto` weighs over `nodes`, with its predicted batch-1 decode rate."""
    settings = dict(os_reserve_bytes=os_reserve_bytes, context_tokens=context_tokens,
                    max_sequences=max_sequences)
    out = [_one_node(layout, nodes, settings)]
    if len(nodes) > 1:
        pipe = _pipeline(layout, nodes, settings)
        if pipe.plan is None or len(pipe.plan.stages) > 1:  # one stage is the one-node plan
            out.append(pipe)
        out.append(_tensor(layout, nodes, settings))
    if len(nodes) > 2:
        out.append(_tensor_pipeline(layout, nodes, settings))
    return out


def choose(found: list[Candidate]) -> Candidate | None:
    """The fastest candidate that can serve (None: none can); on a tie, the one with fewer
    nodes."""
    serving = [c for c in found if c.plan is not None]
    return max(serving, key=lambda c: (round(c.tok_s, 9), -len(c.plan.stages)), default=None)


def _explain(found: list[Candidate], best: Candidate) -> list[str]:
    lines = [f"Layout (--parallel auto): {best.name}, {best.tok_s:.2f} tok/s predicted at "
             f"batch 1. Candidates:"]
    for c in found:
        rate = f"{c.tok_s:.2f} tok/s" if c.plan is not None else "cannot serve"
        lines.append(f"  {c.name}: {rate}: {c.why}" + ("  <- chosen" if c is best else ""))
    refused = next((c for c in found if c.name.startswith("tensor x")
                    and c.name != "tensor x pipeline" and c.plan is None), None)
    if refused is not None:
        lines.append(f"Tensor parallel not chosen: {refused.why}")
    tensor = next((c for c in found if c.plan is not None and c.plan.parallel == "tensor"),
                  None)
    if tensor is not None and tensor is not best:
        n = len(tensor.plan.stages)
        lines.append(f"Tensor parallel not chosen: its {tensor.why.split(', then ')[-1].split(' = ')[0]} "
                     f"cost more than reading 1/{n} of the weights a rank saves.")
    return lines


def plan_layout(layout: ModelLayout, nodes: list[NodeSpec], parallel: str = "pipeline",
                os_reserve_bytes: int = 8 << 30, context_tokens: int = 4096,
                max_sequences: int = 8, split: list[int] | None = None) -> Plan:
    """The plan of `layout` over `nodes` for `parallel` ("auto", "pipeline", "tensor",
    "tensor-pipeline"); a user's `split` is always a pipeline. Raises PlanError as the planners
    do."""
    if parallel not in PARALLEL:
        raise PlanError(f"parallel must be one of {', '.join(PARALLEL)}, not {parallel!r}")
    settings = dict(os_reserve_bytes=os_reserve_bytes, context_tokens=context_tokens,
                    max_sequences=max_sequences)
    if parallel in ("tensor", TENSOR_PIPELINE) and split is not None:
        raise PlanError("a --split lays out a pipeline of layer ranges; drop it for "
                        f"--parallel {parallel}")
    if parallel == TENSOR_PIPELINE and len(nodes) < 3:
        # Too few nodes to chain (the survivors of a lost node, the first to join): one
        # tensor-parallel stage, or one node, until more come.
        plan = plan_layout(layout, nodes, "tensor", **settings)
        return replace(plan, explanation=[*plan.explanation, (
            f"--parallel {TENSOR_PIPELINE}: {len(nodes)} node(s) make no pipeline of "
            f"tensor-parallel stages (3 or more do); laid out as above until more join.")])
    if parallel == TENSOR_PIPELINE:
        return make_tensor_pipeline_plan(layout, nodes, **settings)
    if parallel == "pipeline" or split is not None:
        return make_plan(layout, nodes, split=split, **settings)
    if parallel == "tensor" and len(nodes) == 1:
        # The one node left (the first to join, the survivor of a lost rank) serves alone
        # until another comes, as a pipeline's first node does.
        plan = make_plan(layout, nodes, **settings)
        return replace(plan, explanation=[*plan.explanation, (
            f"--parallel tensor: {nodes[0].name} serves the whole model alone until a second "
            f"node joins (a tensor-parallel stage needs 2 or more).")])
    if parallel == "tensor":
        return make_tensor_plan(layout, nodes, **settings)
    found = candidates(layout, nodes, **settings)
    best = choose(found)
    if best is None:  # the pipeline's error says what is missing where (eviction reads it)
        return make_plan(layout, nodes, **settings)
    return replace(best.plan, explanation=[*best.plan.explanation, *_explain(found, best)])
