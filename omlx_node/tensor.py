"""A tensor-parallel stage: ranks that each hold a slice of every layer and compute in step.

Every rank loads the model split by heads and width (omlx_node/tensor_shard.py, in stage.py):
each layer's attention and MLP end in an all_sum over the group, so every rank must run the
same forward passes, on the same inputs, in the same order. Rank 0 runs the single-node engine
(`Batcher`: continuous batching, chunked prefill, sampling, constraints and logprobs) over a
`TensorState`, which tells the other ranks each operation on the KV state before it runs it;
every other rank runs a `TensorFollower`, which applies them to its own `StageState`. Each
rank's caches, prefix cache included, hold its own heads.

The steps are the pipeline's (`omlx_node.wire`), broadcast instead of passed down: rank 0's
header, payload and input token ids reach the others as an all_sum to which they add zeros
(exact in int32), over the group's own data plane. A step's message is its header followed by
TOKEN_INTS slots, which carry its input token ids when they fit (every decode step of up to 64
rows, a short prefill chunk): such a step costs one collective, not two, before the layers'
own. Every collective of a step then runs on every rank in one order, on the default stream the
layers' all_sums run on: rank 0 schedules each message's all_sum as soon as it is built, and
its forward pass reads its input from the broadcast.

    PREFILL target=sequence rows=R tokens=n, then int32[R, n]: the prompt chunk (R > 1: the
            payload lists the R sequences, `StageState.prefill_rows`)
    DECODE  rows > 0: a forward pass of micro-batch `target` over int32[rows, tokens];
            rows = 0: `keep_answers` then `update` (keep, admits, answers), as in the pipeline
    LOOKUP  each rank restores the prefix its prefix cache holds; an all_min over the group
            gives the prefix every rank holds, and each keeps that much (no TRIM step)
    FREE, IDLE, STOP as in the pipeline

An idle stage sleeps on the pipeline's doorbells: rank 0 rings rank 1, which rings rank 2.
Speculative decoding: rank 0 drafts and verifies as the single node's engine does; a step of
k+1 positions a row is a DECODE like any other, and the positions each row drops after it
reach the other ranks as a DECODE step of rows = 0 whose cuts they apply first. The cost curve
that decides it is measured by every rank at once (the sharded MLP's all_sums). A failed step leaves
the ranks disagreeing: rank 0 ends its sequences as "lost" and stops, as a pipeline's head does.
"""

from __future__ import annotations

import mlx.core as mx

from omlx_node import wire
from omlx_node.batcher import Batcher
from omlx_node.stage_state import StageState
from omlx_node.constraints import Grammars
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics, StageProfile
from omlx_node.sampling import SamplingParams
from omlx_node.stage import StageRunner


# Input token ids a step's message carries after its header; more go in a message of their own.
TOKEN_INTS = 64


def broadcast(x: mx.array, group) -> mx.array:
    """Rank 0's `x` on every rank (lazy): the others pass zeros of its shape."""
    return mx.distributed.all_sum(x.astype(mx.int32), group=group)


def agreed_prefix(held: int, group) -> int:
    """The longest prefix every rank holds, from each rank's own."""
    return int(mx.distributed.all_min(mx.array([held], dtype=mx.int32), group=group).item())


class TensorState(StageState):
    """Rank 0's KV state: each operation is broadcast to the other ranks before it runs here."""

    def __init__(self, stage: StageRunner, profile: StageProfile,
                 prefix_cache: PrefixCache | None, group, plan: int, doorbell: wire.Doorbell):
        super().__init__(stage, profile, prefix_cache, defer_stores=True)
        self.group, self.plan, self.doorbell = group, plan, doorbell
        self._answers: dict[int, list[int]] = {}  # keep_answers', sent with the next update
        self._step_no = 0

    def send(self, step: wire.Step, tokens: mx.array | None = None) -> mx.array | None:
        """Broadcasts `step` and its input `tokens`; returns them as broadcast (lazy)."""
        step.step, self._step_no = self._step_no, self._step_no + 1
        if self.doorbell.asleep:
            self.doorbell.ring()
        header, payload = wire.encode_header(step, self.plan)
        inline = tokens is not None and tokens.size <= TOKEN_INTS
        parts = [mx.array(header, dtype=mx.int32)]
        if inline:
            parts.append(tokens.reshape(-1).astype(mx.int32))
        message = mx.concatenate(
            [*parts, mx.zeros((wire.HEADER_INTS + TOKEN_INTS - sum(p.size for p in parts),),
                              dtype=mx.int32)])
        # Scheduled now: a later step's collectives must not run before this one's.
        message = broadcast(message, self.group)
        mx.async_eval(message)
        if payload:
            mx.async_eval(broadcast(mx.array(payload), self.group))
        self.doorbell.asleep = step.op == wire.IDLE
        if tokens is None:
            return None
        if inline:
            return message[wire.HEADER_INTS:wire.HEADER_INTS + tokens.size].reshape(tokens.shape)
        return broadcast(tokens, self.group)

    def lookup(self, seq_id: int, tokens: list[int]) -> int:
        if self.prefix_cache is None:
            return 0
        self.send(wire.Step(wire.LOOKUP, target=seq_id, prompt=tokens))
        held = agreed_prefix(super().lookup(seq_id, tokens), self.group)
        self.trim(seq_id, held)
        return held

    def prefill(self, seq_id: int, x: mx.array, wait: bool = True) -> mx.array:
        x = self.send(wire.Step(wire.PREFILL, target=seq_id, rows=1, tokens=x.shape[1]), x)
        return super().prefill(seq_id, x, wait)

    def prefill_rows(self, seq_ids: list[int], x: mx.array,
                     lengths: list[int] | None = None) -> None:
        x = self.send(wire.Step(wire.PREFILL, target=seq_ids[0], rows=len(seq_ids),
                                tokens=x.shape[1], seqs=list(seq_ids),
                                lengths=list(lengths or [])), x)
        super().prefill_rows(seq_ids, x, lengths)

    def free(self, seq_ids: list[int]) -> None:
        self.send(wire.Step(wire.FREE, freed=list(seq_ids)))
        super().free(seq_ids)

    def keep_answers(self, mb: int, rows: dict[int, list[int]]) -> None:
        if self.prefix_cache is not None and self.batchable:
            self._answers = dict(rows)
        super().keep_answers(mb, rows)

    def update(self, mb: int, keep: list[int] | None, admit: list[int]) -> None:
        # The other ranks need only the admitted sequences' ids: they sample nothing.
        self.send(wire.Step(wire.DECODE, target=mb, keep=keep, answers=self._answers,
                            admits=[wire.Admit(s, SamplingParams()) for s in admit]))
        self._answers = {}
        super().update(mb, keep, admit)

    def trim_rows(self, mb: int, extra: list[int]) -> None:
        self.send(wire.Step(wire.DECODE, target=mb, cuts=list(extra)))
        super().trim_rows(mb, extra)

    def forward(self, mb: int, x: mx.array) -> mx.array:
        x = self.send(wire.Step(wire.DECODE, target=mb, rows=x.shape[0], tokens=x.shape[1]), x)
        return super().forward(mb, x)


class TensorHead(Batcher):
    """Rank 0 of a tensor-parallel stage: the single-node engine over a `TensorState`."""

    failure_reason = "lost"
    failure_message = "the tensor-parallel stage failed a step (a rank was lost); this worker stops"

    def __init__(self, stage: StageRunner, metrics: NodeMetrics, group, plan: int,
                 doorbell: wire.Doorbell, prefill_chunk: int | None, max_batch: int,
                 prefix_cache: PrefixCache | None, grammars: Grammars, speculative: str = "off",
                 speculative_rows: int | None = None, costs: dict[int, float] | None = None):
        """`speculative`, `speculative_rows`: as the single-node engine's; `costs`: the cost
        curve by positions that decides it, which every rank measured
        (speculation.collective_position_costs; None: speculation off)."""
        super().__init__(stage, metrics, prefill_chunk, max_batch, None, grammars, "off")
        self.state = TensorState(stage, metrics.profile, prefix_cache, group, plan, doorbell)
        self.broken = False
        if costs is not None:
            self._speculate(speculative, speculative_rows, costs)

    def _recover(self) -> None:
        # After a failed step the ranks may disagree on their state: this plan cannot go on.
        self.broken = True
        self.status = "failed: the tensor-parallel stage lost a rank; this worker stops"
        self.stop()

    def _work(self) -> None:
        super()._work()
        if self.idle and not self.state.doorbell.asleep:
            # The other ranks may stop waiting on the data plane, which spins a core.
            self.state.send(wire.Step(wire.IDLE))

    def shutdown_pipeline(self) -> None:
        """Tells every other rank to exit (after the engine loop ended)."""
        if not self.broken:
            self.state.send(wire.Step(wire.STOP))
        mx.synchronize()


class TensorFollower:
    """Every rank of a tensor-parallel stage but 0: applies rank 0's steps to its own state."""

    def __init__(self, stage: StageRunner, group, plan: int, prefix_cache: PrefixCache | None,
                 metrics: NodeMetrics, doorbells: tuple[wire.Doorbell, wire.Doorbell | None]):
        """`doorbells`: the one the previous rank rings after an IDLE step, and the next
        rank's (None on the last)."""
        self.state = StageState(stage, metrics.profile, prefix_cache, defer_stores=True)
        self.metrics = metrics
        self.group, self.plan = group, plan
        self.upstream, self.downstream = doorbells
        self.asleep = True  # until the first step

    def _receive(self, shape: tuple[int, ...]) -> mx.array:
        return broadcast(mx.zeros(shape, dtype=mx.int32), self.group)

    def run(self) -> None:
        while True:
            if self.asleep:
                self.upstream.wait()
                if self.downstream is not None:
                    self.downstream.ring()
            message = self._receive((wire.HEADER_INTS + TOKEN_INTS,))
            step, payload_len = wire.decode_header(message[:wire.HEADER_INTS].tolist(),
                                                   self.plan, "rank 0")
            if payload_len:
                step.load(self._receive((payload_len,)).tolist())
            self.asleep = step.op == wire.IDLE
            self.apply(step, message[wire.HEADER_INTS:])
            self.metrics.iteration_done(self.state)
            self.state.give_back_if_idle()
            if step.op == wire.STOP:
                return

    def _tokens(self, step: wire.Step, inline: mx.array) -> mx.array:
        """The step's input token ids: from its message's slots when they fit there."""
        n = step.rows * step.tokens
        if n <= TOKEN_INTS:
            return inline[:n].reshape(step.rows, step.tokens)
        return self._receive((step.rows, step.tokens))

    def apply(self, step: wire.Step, inline: mx.array) -> None:
        """`inline`: the TOKEN_INTS slots of the step's message."""
        state = self.state
        if step.op == wire.FREE:
            state.free(step.freed)
        elif step.op == wire.LOOKUP:
            state.trim(step.target, agreed_prefix(state.lookup(step.target, step.prompt),
                                                  self.group))
        elif step.op == wire.PREFILL:
            x = self._tokens(step, inline)
            if step.seqs:
                state.prefill_rows(step.seqs, x, step.lengths or None)
            else:
                state.prefill(step.target, x)
        elif step.op == wire.DECODE and step.rows:
            # Logits nobody reads, evaluated for the all_sums of every layer and the head's
            # all_gather (rank 0 needs this rank's share of each).
            mx.eval(state.forward(step.target, self._tokens(step, inline)))
        elif step.op == wire.DECODE:
            if step.cuts:  # what rank 0's verified step ran past the tokens that stood
                state.trim_rows(step.target, step.cuts)
            state.keep_answers(step.target, step.answers)
            state.update(step.target, step.keep, [a.seq_id for a in step.admits])
            if state.deferred:
                state.flush_admitted()
