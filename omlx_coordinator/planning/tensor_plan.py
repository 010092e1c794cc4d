"""A tensor-parallel plan: every node a rank of one stage that holds a slice of every layer.

Pure, like the planner (omlx_coordinator/planning/planner.py), and with its cost model: a decode step
streams weights at each node's `speed`, and pays each layer's fixed cost (`NodeSpec.layer_ms`),
which a share does not shrink. At batch 1, every rank streams its share of each layer's
weights (attention split by heads and the MLP by its width: omlx_shared/tensor_split.py), the
final norm, and its 1/N of an untied head (split by vocabulary, omlx_node/tensor_shard.py; a
tied one is the embedding, whole on every rank), all ranks at once: the step takes the slowest
rank's time. A share is 1/N, or a little more on the ranks that get one head more where the
heads do not divide (and KV heads held twice); the largest one counts. Then come the
collectives: one all-reduce after each layer's attention and one after its MLP, the step's
broadcast from rank 0 (its header and input tokens in one message, omlx_node/tensor.py), each
a ring all_sum: 2(N-1) messages one after the other, each the link's latency plus its 1/N share
of the hidden state over the link's bandwidth; and a split head's all_gather of the logits:
N-1 messages, each a rank's share of them.

Memory per rank: its share of the layers' weights and of their KV (each rank keeps its own
heads'), the whole embedding and norm, its share of an untied head, and its worker's prefix
cache; rank 0 also the draft model, where one drafts (`ModelLayout.draft_bytes`, loaded there
alone).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from omlx_coordinator.planning.model_layout import ModelLayout
from omlx_coordinator.planning.planner import (
    GB,
    NodeSpec,
    Plan,
    PlanError,
    Stage,
    compute_plan_hash,
)
from omlx_shared.tensor_split import head_slice

# Bytes of one element of the hidden state an all-reduce carries (fp32: a CPU computes in it;
# a GPU's bf16 halves it, which only a slow link notices).
ACTIVATION_BYTES = 4


def collectives_per_token(layout: ModelLayout) -> int:
    """All_sums a decode step runs: two a layer, and rank 0's step (header and input tokens)."""
    return 2 * layout.num_layers + 1


def head_share(layout: ModelLayout, ranks: int) -> int:
    """Bytes of the head a rank holds and streams: 1/ranks of an untied one (rounded up to
    whole rows of the vocabulary, as tensor_shard.split_vocab pads), the embedding when tied."""
    if layout.tied_embeddings:
        return layout.embed_bytes
    return math.ceil(layout.head_bytes / ranks)


def gather_ms(layout: ModelLayout, nodes: Sequence[NodeSpec]) -> float:
    """A split head's all_gather of the logits (0 for a tied head, whole on every rank): N-1
    messages at the slowest link, each a rank's share of the vocabulary's fp32 logits."""
    if layout.tied_embeddings or len(nodes) < 2:
        return 0.0
    vocab = int(dict(layout.shape).get("vocab_size", 0))
    # A ring all_sum of `nbytes` is 2(N-1) messages of nbytes/N: half of it moves N-1 shares.
    return allreduce_ms(nodes, vocab * ACTIVATION_BYTES) / 2


def allreduce_ms(nodes: Sequence[NodeSpec], nbytes: int) -> float:
    """One ring all_sum of `nbytes` over `nodes`, at the slowest link's latency and bandwidth."""
    n = len(nodes)
    latency = max(nd.link_ms for nd in nodes)
    known = [nd.link_gbps for nd in nodes if nd.link_gbps > 0]
    transfer = (nbytes / n) / (min(known) * GB) * 1e3 if known else 0.0
    return 2 * (n - 1) * (latency + transfer)


def rank_stream_bytes(layout: ModelLayout, ranks: int) -> int:
    """What the busiest rank streams a decode step: its share of every layer, the norm and the
    head."""
    layers = sum(layout.stream_bytes(i) for i in range(layout.num_layers))
    return (math.ceil(layers * layout.tensor_share(ranks)[0]) + layout.norm_bytes
            + head_share(layout, ranks))


def rank_heads(plan: Plan, layout: ModelLayout) -> list[dict]:
    """Each rank of a tensor-parallel `plan`: its node and the attention heads it holds, the
    query heads [start, end) and the KV heads they read (as omlx_shared/tensor_split.py splits
    them, for mlx-lm's even shard() and the generic sharder alike); [] for a pipeline or a
    model whose config names no heads."""
    shape = dict(layout.shape)
    heads = shape.get("num_attention_heads")
    if plan.parallel != "tensor" or not isinstance(heads, int) or not heads:
        return []
    kv = shape.get("num_key_value_heads")
    kv = kv if isinstance(kv, int) and kv else heads
    ranks = len(plan.stages)
    out = []
    for rank, stage in enumerate(plan.stages):
        hs = head_slice(heads, kv, ranks, rank)
        out.append({"rank": rank, "node": stage.node, "q_heads": [hs.q_start, hs.q_end],
                    "kv_heads": list(hs.kv)})
    return out


def _head(layout: ModelLayout, ranks: int) -> str:
    return "the head (tied)" if layout.tied_embeddings else f"1/{ranks} of the head"


def _share(share: float, ranks: int) -> str:
    return f"1/{ranks}" if share * ranks <= 1 + 1e-9 else f"up to {share:.0%} (an uneven split)"


def make_tensor_plan(layout: ModelLayout, nodes: list[NodeSpec], os_reserve_bytes: int = 8 << 30,
                     context_tokens: int = 4096, max_sequences: int = 8) -> Plan:
    """Every node of `nodes` a rank of one tensor-parallel stage, in the given (ring) order.
    Raises PlanError when the model cannot be split over that many ranks (saying why) or a
    rank's share does not fit its node."""
    n = len(nodes)
    if n < 2:
        raise PlanError(f"tensor parallelism splits {layout.model_id} over at least 2 nodes; "
                        f"{n} can serve it. Use --parallel pipeline (or auto) on one node")
    if why := layout.tensor_refusal(n):
        raise PlanError(f"{layout.model_id} cannot run tensor-parallel over {n} nodes: {why}")
    kept = [nd.name for nd in nodes if not nd.dequantizes]
    if kept and (why := layout.group_cut(n)):
        raise PlanError(f"{layout.model_id} cannot run tensor-parallel over {n} nodes: {why} "
                        f"({', '.join(kept)} keep{'s' if len(kept) == 1 else ''} the weights "
                        f"quantized)")
    L = layout.num_layers
    # The largest rank's share, which an uneven split of heads or width makes more than 1/n.
    share, kv_share = layout.tensor_share(n)
    weights = (math.ceil(sum(layout.layer_bytes) * share) + layout.embed_bytes
               + layout.norm_bytes + (0 if layout.tied_embeddings else head_share(layout, n)))
    kv = math.ceil(sum(layout.kv_bytes(i, context_tokens) for i in range(L)) * max_sequences
                   * kv_share)
    comm = collectives_per_token(layout) * allreduce_ms(
        nodes, layout.hidden_size * ACTIVATION_BYTES) + gather_ms(layout, nodes)
    stream = rank_stream_bytes(layout, n)
    stages, short = [], {}
    for r, nd in enumerate(nodes):
        budget = nd.memory_bytes - os_reserve_bytes - nd.cache_bytes
        held = weights + (layout.draft_bytes if r == 0 else 0)
        if held + kv > budget:
            short[nd.name] = held + kv - budget
        stages.append(Stage(node=nd.name, layer_start=0, layer_end=L, weight_bytes=held,
                            kv_bytes=kv, memory_budget=budget + nd.cache_bytes,
                            est_ms=stream / (nd.speed * GB) * 1e3 + L * nd.layer_ms + comm,
                            cache_bytes=nd.cache_bytes))
    if short:
        raise PlanError(
            f"{layout.model_id} does not fit tensor-parallel over {n} nodes: each rank holds "
            f"{(weights + kv) / GB:.2f} GB ({_share(share, n)} of the layers and KV, the whole "
            f"embedding, {_head(layout, n)}"
            + (f"; rank 0 also the draft model, {layout.draft_bytes / GB:.2f} GB"
               if layout.draft_bytes else "")
            + "); short: " + ", ".join(f"{k} by {v / GB:.2f} GB" for k, v in short.items()),
            missing_bytes=sum(short.values()), missing_by_node=short)
    bottleneck = max(s.est_ms for s in stages)
    plan_hash = compute_plan_hash(layout.model_id, [(nd.name, 0, L) for nd in nodes], "tensor")
    explanation = [
        f"Tensor parallel over {n} nodes ({', '.join(nd.name for nd in nodes)}): each rank "
        f"holds {_share(share, n)} of every layer (attention by heads, MLP by width), the whole "
        f"embedding and {_head(layout, n)}, {(weights + kv) / GB:.2f} GB with its KV"
        + (f"; rank 0 also the draft model, {layout.draft_bytes / GB:.2f} GB."
           if layout.draft_bytes else "."),
        f"A token: each rank streams {stream / GB:.3f} GB"
        + (f" and pays {L} layers' fixed costs" if any(nd.layer_ms for nd in nodes) else "")
        + f", then {collectives_per_token(layout)} all-reduces"
        + ("" if layout.tied_embeddings else " and the head's all_gather")
        + f" ({comm:.2f} ms); the slowest rank takes {bottleneck:.3f} ms.",
    ]
    return Plan(layout.model_id, tuple(stages), bottleneck, plan_hash, explanation, "tensor")
