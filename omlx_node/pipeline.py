"""A pipeline of stages over mx.distributed: the head's engine and every other stage's loop.

Rank 0 (the head) embeds, schedules and streams tokens; rank r runs layers of stage r; the tail
applies the head of the model, samples and sends token ids back to rank 0 over the ring's
wrap-around link. The wire format is in `omlx_node.wire`.

Micro-batch pipelining: the running sequences are spread over K micro-batches and the head keeps
up to K decode steps in flight, so while the tail computes micro-batch 0 the head already computes
micro-batch 1. K = 1 is the lockstep pipeline (exo, mlx-lm's `pipeline()`).

How many micro-batches pay off depends on the device: K micro-batches of R/K rows beat one of R
rows by up to cost(R) / cost(R/K), which is ~1 where a step is weight-bandwidth bound (a GPU at
tens of rows: two half batches cost twice one batch) and ~K where it is compute bound. By default
the head measures that curve at start-up (`omlx_node.calibrate.row_costs` on one of its layers)
and splits into as many micro-batches, up to one per stage, as the rows in flight make worth it;
an explicit `--micro-batches K` always splits into K.

No stage's Python sits between two device steps. The head builds and sends a micro-batch's next
step as soon as its tokens are due, with those tokens still in flight (a lazy receive feeds the
embedding), and streams them out afterwards, as mlx-lm's generate_step overlaps its next step;
a row whose sequence turned out finished rides along one step more and is dropped at the next.
Every other stage receives the hidden states lazily, so its graph is built before they land.
When the head has nothing in flight it says so with an IDLE step, and every stage sleeps on a
doorbell until the next step (`omlx_node.wire`): an idle pipeline costs no CPU.

Speculative decoding (omlx_node.speculation): the head drafts (prompt lookup, a prediction, a
draft model on its node), and a step of a micro-batch that drafts carries 1 + its longest draft
positions a row (rows without a draft carry filler); the tail verifies each row as the single
node's engine does and answers its run of tokens, and the next step's header says how many
positions each row drops, which every stage trims before anything else. Around such a step the
head reads the tokens before it builds the next one: a draft follows them.

A row whose sampling fails on the tail (`omlx_node.sampling.sample_rows`) is reported in the
tail's answer and ends alone, with its own error. Anything else that fails a step leaves the
stages disagreeing on their state: the head ends its sequences as "lost" and its worker exits,
for the coordinator to re-plan. A clean stop (SIGTERM) drains the answers owed and sends STOP, and
every stage exits 0; a stage ignores its own SIGTERM and waits for that STOP (worker.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from omlx_node import wire
from omlx_node.batcher import Engine, advance_each
from omlx_node.calibrate import step_cost
from omlx_node.constraints import Grammars, Verdict
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import (
    RowSampler,
    logprob_ints,
    make_sampler,
    pack_logprobs,
    sample_rows,
    unpack_logprobs,
)
from omlx_node.sequence import Finish, Sequence
from omlx_node.speculation import verify_rows
from omlx_node.stage import StageRunner
from omlx_node.stage_state import StageState

log = logging.getLogger(__name__)


def hidden_dtype(stage: StageRunner) -> mx.Dtype:
    return getattr(mx, stage.info.dtype)


# Each micro-batch beyond the first costs host work and a hop per step: ask this much gain each.
MICRO_BATCH_PENALTY = 0.25
# Queued sequences looked up beyond the room the batch has now: their lookups' round trips
# through the pipeline are done by the time a slot frees.
LOOKUP_AHEAD = 2


def micro_batches_worth(costs: dict[int, float], rows: int, k_max: int) -> int:
    """How many micro-batches (1..k_max) to spread `rows` over: the k with the best
    cost(rows) / cost(rows / k), each micro-batch beyond the first discounted by
    MICRO_BATCH_PENALTY."""
    if k_max <= 1 or len(costs) < 2 or rows < 2:
        return 1
    whole = step_cost(costs, rows)

    def gain(k: int) -> float:
        return whole / step_cost(costs, -(-rows // k)) / (1 + MICRO_BATCH_PENALTY * (k - 1))

    return max(range(1, min(k_max, rows) + 1), key=lambda k: (gain(k), -k))


@dataclass
class MicroBatch:
    mb: int
    seqs: list[Sequence] = field(default_factory=list)  # the rows of its last step, in order
    pending: list[Sequence] = field(default_factory=list)  # prefilled, join at the next launch
    in_flight: bool = False
    width: int = 1  # positions a row of its last step: 1 + its longest draft
    drafts: list[list[int]] = field(default_factory=list)  # its last step's, by row


class PipelineHead(Engine):
    """The engine of rank 0 when the pipeline has more than one stage."""

    # A failed step here means a lost peer, or stages that no longer agree: the sequences may
    # run again on a new plan, which the coordinator makes once this worker has exited.
    failure_reason = "lost"
    failure_message = "the pipeline failed a step (a stage was lost); this worker stops"

    def __init__(self, stage: StageRunner, metrics: NodeMetrics, group, plan: int,
                 doorbell: wire.Doorbell, micro_batches: int, prefill_chunk: int = 512,
                 max_batch: int = 64, prefix_cache: PrefixCache | None = None,
                 row_costs: dict[int, float] | None = None, grammars: Grammars | None = None,
                 speculative: str = "off", speculative_rows: int | None = None,
                 relay: bool = False, spec_costs: dict[int, float] | None = None):
        """`doorbell`: rank 1's, rung when a step follows an IDLE one. Up to `micro_batches` in
        flight; with `row_costs` (the measured cost of a step by rows) only as many as pay off
        for the rows in flight, else always all of them. `grammars` checks constrained requests
        at submit; the tail applies them. `speculative`, `speculative_rows`: as the
        single-node engine's; the drafts are made here (a draft model's too) and verified on
        the tail. `relay`: rank 1 is a rank of this tensor-parallel stage
        (omlx_node/sub_group.py): it gets each step's input token ids, not this rank's output,
        and computes beside it. `spec_costs`: the drafts' cost curve by positions, which such
        a stage's ranks measure together (speculation.collective_position_costs); None: this
        rank measures it alone."""
        super().__init__(stage, metrics, prefill_chunk, max_batch,
                         stage.embed_tokens.weight.shape[0], prefix_cache, grammars)
        self.group, self.plan, self.doorbell = group, plan, doorbell
        self.relay = relay
        self.tail = group.size() - 1
        self.mbs = [MicroBatch(i) for i in range(max(1, micro_batches))]
        self.row_costs = row_costs
        # Answers the tail owes rank 0, in the order their steps were sent: a micro-batch's
        # tokens, or the prefix every stage holds for a sequence (LOOKUP).
        self._replies: deque[MicroBatch | Sequence] = deque()
        self._step_no = 0
        self.broken = False
        # The pace (step_pace.py) on a pipeline: its steps are asynchronous, so a decode step
        # is the time between two micro-batches' tokens coming back with no prefill between,
        # and an iteration that may prefill is one per tokens come back while rows decode.
        self._decoded_at = 0.0  # when tokens last came back (0: nobody decoded since)
        self._prefilled = False  # a prefill chunk went out since then
        self._stepped = False  # tokens came back since the last prefill was planned
        self._speculate(speculative, speculative_rows, spec_costs)

    def running_seqs(self) -> list[Sequence]:
        return [s for m in self.mbs for s in (*m.seqs, *m.pending) if not s.finished]

    def _recover(self) -> None:
        # After a failed step the stages may disagree on their state: this plan cannot go on.
        self.broken = True
        self.status = "failed: the pipeline lost a stage; this worker stops"
        self.stop()

    def _send(self, step: wire.Step, hidden: mx.array | None) -> None:
        step.step = self._step_no
        self._step_no += 1
        wire.send_rung(step, hidden, self.plan, 1, self.group, self.doorbell)

    @property
    def idle(self) -> bool:
        # An answer still owed is work: read at once, so that the pipeline can go to sleep.
        return super().idle and not self._replies

    def _dropped_while_waiting(self, seq: Sequence) -> None:
        self.state.free([seq.sid])
        self._send(wire.Step(wire.FREE, freed=[seq.sid]), None)

    def _work(self) -> None:
        for m in self.mbs:
            if not m.in_flight and m.pending:
                self._launch(m, None)
        room = self.max_batch - len(self.running_seqs())
        if self.state.prefix_cache is not None:
            # Every stage holds a looked-up sequence's restored KV until it runs: only the ones
            # that may start soon are looked up (a burst of queued agent turns sharing a long
            # cached prompt would otherwise hold one copy of it each, on every stage). They
            # are the ones first in the prefill's order, which waits for their answers.
            for seq in itertools.islice(self._in_order(), max(room, 0) + LOOKUP_AHEAD):
                if not seq.lookup_sent:
                    self._send_lookup(seq)
        if self._waiting and room > 0 and (self._stepped or not self.running_seqs()):
            self._stepped = False
            self._prefill_step(room)
        if self._replies:
            reply = self._replies.popleft()
            if isinstance(reply, MicroBatch):
                self._collect(reply)
                self._tokens_back()
            else:
                self._collect_lookup(reply)
        if self.idle and not self.doorbell.asleep:
            # Nothing in flight: the other stages may stop waiting on the data plane, which
            # spins a core per posted receive.
            self._send(wire.Step(wire.IDLE), None)

    def _tokens_back(self) -> None:
        """A micro-batch's tokens came back: one decode step for the pace, timed unless a
        prefill chunk ran since the last tokens (or nobody decoded until now)."""
        now = time.perf_counter()
        if self._decoded_at and not self._prefilled:
            self.pace.decode_step(now - self._decoded_at)
        self._decoded_at = now if self.running_seqs() else 0.0
        self._prefilled, self._stepped = False, True

    def _looked_up(self, seq: Sequence) -> bool:
        if self.state.prefix_cache is None:
            seq.looked_up = True
        return seq.looked_up

    def _send_lookup(self, seq: Sequence) -> None:
        """Asks every stage for the prefix it holds; the answer comes back with the replies."""
        held = self.state.lookup(seq.sid, seq.to_prefill)
        self._send(wire.Step(wire.LOOKUP, target=seq.sid, held=held, prompt=seq.to_prefill),
                   None)
        seq.lookup_sent = True
        self._replies.append(seq)

    def _collect_lookup(self, seq: Sequence) -> None:
        held = wire.recv_tokens(1, self.tail, self.group)[0]
        self.state.trim(seq.sid, held)
        self._send(wire.Step(wire.TRIM, target=seq.sid, held=held), None)
        seq.cached = seq.prefilled = held
        seq.looked_up = True

    def _prefill_step(self, room: int) -> None:
        plan = self._take_prefill(room)
        self._feed_proposers(plan)
        decoding, seconds, tokens = bool(self.running_seqs()), 0.0, 0
        for seq, start, n in plan:
            if n > 0:
                self._compute(wire.Step(wire.PREFILL, target=seq.sid, rows=1, tokens=n),
                              mx.array([seq.to_prefill[start:start + n]]),
                              lambda x, s=seq: self.state.prefill(s.sid, x))
                # Every stage runs the chunk; this one's time stands for each one's (a
                # balanced split), the time every decoding row waits for it.
                seconds, tokens = seconds + self.metrics.profile.prefill_s, tokens + n
            seq.prefilled += n
            if seq.prefilled == len(seq.to_prefill):
                # Not always the first one waiting: a chunk cut short at a block boundary
                # leaves budget for the next, and a one-token prompt has nothing to prefill.
                self._waiting.remove(seq)
                seq.input_is_prompt = False  # tokens come back for the step that ran it
                self._give_proposer(seq)
                min(self.mbs[:self._worth()],
                    key=lambda m: len(m.seqs) + len(m.pending)).pending.append(seq)
        if tokens:
            self.pace.prefill_pass(seconds, tokens, decoding)
            self._prefilled = True

    def _compute(self, step: wire.Step, x: mx.array, run) -> None:
        """Sends `step` with this rank's output of `run(x)`; with `relay`, with its input `x`
        first (the ranks of the stage compute it together: `run` waits on their parts)."""
        if not self.relay:
            self._send(step, run(x))
            return
        self._send(step, x)
        mx.async_eval(run(x))

    def _worth(self) -> int:
        """Micro-batches worth using for the sequences running and waiting now."""
        if self.row_costs is None:
            return len(self.mbs)
        rows = len(self.running_seqs()) + len(self._waiting)
        k = micro_batches_worth(self.row_costs, rows, len(self.mbs))
        self.metrics.micro_batches.set(k)
        return k

    def _launch(self, m: MicroBatch, tokens: mx.array | None, cuts: list[int] | None = None,
                drafting: bool = False) -> None:
        """Sends micro-batch m's next decode step: its rows not finished yet, whose inputs are
        `tokens`, their last step's output (lazy), then the sequences that join. `cuts`: the
        positions each row of the last step drops first (what a verified step ran past the
        tokens that stood); `drafting`: its rows draft (the tokens are on the host)."""
        live = [i for i, s in enumerate(m.seqs) if not s.finished]
        keep = None if len(live) == len(m.seqs) else live
        admits = [s for s in m.pending if not s.cancelled]
        for s in m.pending:
            if s.cancelled:
                self._dropped_while_waiting(s)
                self._finish(s, Finish("cancelled"))
        m.pending = []
        if cuts:
            self.state.trim_rows(m.mb, cuts)
        answers = ({i: s.fed for i, s in enumerate(m.seqs) if s.finished}
                   if self.state.prefix_cache is not None else {})
        self.state.keep_answers(m.mb, answers)
        self.state.update(m.mb, keep, [s.sid for s in admits])
        inputs = []
        if live:
            inputs.append(tokens if keep is None else tokens[mx.array(live)])
        if admits:
            inputs.append(mx.array([s.req.prompt[-1] for s in admits]))
        m.seqs = [m.seqs[i] for i in live] + admits
        x = mx.concatenate(inputs)[:, None] if m.seqs else None
        m.drafts = ([self._draft(s, s.req.sampling, bool(s.req.grammar)) for s in m.seqs]
                    if drafting else [])
        m.width = 1 + max(map(len, m.drafts), default=0)
        if m.width > 1:
            # A row's shorter draft is padded with filler: every row runs m.width positions,
            # and what runs past the tokens that stood is cut at the next step.
            x = mx.array([[t, *d] + [t] * (m.width - 1 - len(d))
                          for t, d in zip(x[:, 0].tolist(), m.drafts)])
        step = wire.Step(wire.DECODE, target=m.mb, rows=len(m.seqs), tokens=m.width, keep=keep,
                         cuts=cuts or [], drafts=m.drafts, answers=answers,
                         admits=[wire.Admit(s.sid, s.req.sampling, s.req.penalty_context,
                                            s.req.grammar, s.req.resumed) for s in admits])
        if m.seqs:
            self._compute(step, x, lambda x: self.state.forward(m.mb, x))
        else:
            self._send(step, None)
        m.in_flight = bool(m.seqs)
        if m.in_flight:
            self._replies.append(m)

    def _collect(self, m: MicroBatch) -> None:
        """Micro-batch m's tokens are due from the tail: its next step goes out first, fed by
        them while they are still in flight, then they are streamed out. Around a step that
        verifies drafts the tokens are read first: a draft follows them, and what the next
        step cuts depends on them."""
        drafting = self._speculates(m)
        if drafting or m.width > 1:
            self._collect_verified(m, drafting)
            return
        rows = m.seqs
        reply = self._recv_reply(rows)
        self._launch(m, reply[:len(rows)])
        # Always read: the receive must complete even when no row needed it.
        values = reply.tolist()
        verdicts, failed = self._recv_rest(rows, values[-1])
        logprobs = self._logprobs(rows, values[len(rows):-1])
        live = [i for i, s in enumerate(rows) if not s.finished]
        self._emit_step([rows[i] for i in live], [values[i] for i in live], logprobs, verdicts,
                        failed)

    def _speculates(self, m: MicroBatch) -> bool:
        """Whether micro-batch m's next step may verify drafts: a row may draft, and the
        micro-batch is small enough that a draft's extra positions cost less than the steps
        they save."""
        if self.speculator is None:
            return False
        rows = [s for s in (*m.seqs, *m.pending) if not s.finished]
        return self.speculator.wanted([s.spec for s in rows if s.proposer is not None],
                                      len(rows))

    def _collect_verified(self, m: MicroBatch, drafting: bool) -> None:
        """`_collect` on the host: the tokens of m's last step (each row's run, when it
        verified drafts) are streamed out, then its next step is sent, with each row's cut and,
        when `drafting`, its draft."""
        rows = m.seqs
        logprobs: list[list | None] = [None] * len(rows)
        if m.width == 1:
            values = self.metrics.profile.receive(lambda: self._recv_reply(rows).tolist())
            runs = [[v] for v in values[:len(rows)]]
            verdicts, failed = self._recv_rest(rows, values[-1])
            found = self._logprobs(rows, values[len(rows):-1])
            logprobs = [[found[s]] if s in found else None for s in rows]
            cuts = None
        else:
            asking = [s for s in rows if s.req.sampling.logprobs is not None]
            ks = [s.req.sampling.logprobs for s in asking]
            runs, ints, n_failed = self.metrics.profile.receive(lambda: wire.recv_runs(
                len(rows), m.width, logprob_ints(ks) * m.width, self.tail, self.group))
            verdicts, failed = self._recv_rest(rows, n_failed)
            records = unpack_logprobs(ints, [k for k in ks for _ in range(m.width)])
            found = {s: records[a * m.width:(a + 1) * m.width] for a, s in enumerate(asking)}
            logprobs = [found.get(s) for s in rows]
            cuts = [m.width - len(r) for r in runs]
            for s, d, r in zip(rows, m.drafts, runs):
                if d:
                    self.speculator.counted(s.proposer, s.spec, len(d), len(r) - 1)
        last = mx.array([r[-1] for r in runs])
        self._emit_runs(rows, [[] if s.finished else r for s, r in zip(rows, runs)], logprobs,
                        verdicts, failed)
        self._launch(m, last, cuts, drafting)

    def _recv_reply(self, rows: list[Sequence]) -> mx.array:
        """The tail's answer to a step of `rows` (lazy): tokens, logprob records, failures."""
        ks = [s.req.sampling.logprobs for s in rows if s.req.sampling.logprobs is not None]
        return wire.recv_answer(len(rows), logprob_ints(ks), self.tail, self.group)

    def _recv_rest(self, rows: list[Sequence], n_failed: int
                   ) -> tuple[dict[Sequence, tuple[Verdict, str]], dict[Sequence, str]]:
        """What follows the tail's answer: the grammar verdicts on its tokens when rows are
        constrained, then the errors of the `n_failed` rows whose sampling failed."""
        constrained = [s for s in rows if s.req.grammar]
        verdicts = (dict(zip(constrained, wire.recv_verdicts(len(constrained), self.tail,
                                                             self.group)))
                    if constrained else {})
        failed = wire.recv_failures(n_failed, self.tail, self.group) if n_failed else {}
        return verdicts, {rows[i]: f"sampling failed: {e}" for i, e in failed.items()}

    def shutdown_pipeline(self) -> None:
        """Tells every other stage to exit (after the engine loop ended)."""
        if self.broken:
            return
        while self._replies:
            r = self._replies.popleft()
            if isinstance(r, MicroBatch) and r.width > 1:
                ks = [s.req.sampling.logprobs for s in r.seqs
                      if s.req.sampling.logprobs is not None]
                self._recv_rest(r.seqs, wire.recv_runs(len(r.seqs), r.width,
                                                       logprob_ints(ks) * r.width, self.tail,
                                                       self.group)[2])
            elif isinstance(r, MicroBatch):
                self._recv_rest(r.seqs, self._recv_reply(r.seqs).tolist()[-1])
            else:
                wire.recv_tokens(1, self.tail, self.group)
        self._send(wire.Step(wire.STOP), None)
        wire.flush()


class StageLoop:
    """Every stage after the head: apply each step to this stage's KV state, compute, pass on."""

    def __init__(self, stage: StageRunner, group, plan: int, prefix_cache: PrefixCache | None,
                 grammars: Grammars, metrics: NodeMetrics,
                 doorbells: tuple[wire.Doorbell, wire.Doorbell | None], relay: bool = False):
        """`grammars`: the tail compiles every constrained sequence's grammar with it.
        `doorbells`: the one the previous stage rings after an IDLE step, and the next stage's
        (None on the tail). `relay`: the next rank is one of this rank's tensor-parallel stage
        (omlx_node/sub_group.py): it gets each step with this rank's input, and computes
        beside it; a rank of a tensor stage gets token ids where its stage is the first."""
        # Its prompts' stores wait for their first decode step here (flush_admitted), as the
        # head's wait for their first token: a later prefill chunk is not slowed by them.
        self.state = StageState(stage, metrics.profile, prefix_cache, defer_stores=True)
        self.metrics = metrics
        self.grammars = grammars
        self.group, self.plan = group, plan
        self.upstream, self.downstream = doorbells
        self.rank, size = group.rank(), group.size()
        self.is_tail = self.rank == size - 1
        self.relay = relay
        self.hidden_size = 0 if stage.info.is_first else stage.hidden_size
        self.dtype = mx.int32 if stage.info.is_first else hidden_dtype(stage)
        self.samplers: dict[int, RowSampler] = {}
        self.constrained: set[int] = set()  # sequences admitted with a grammar: they get verdicts
        self.unstarted: dict[int, str] = {}  # sequences whose sampler could not be made, and why

    def run(self) -> None:
        while True:
            step, hidden = wire.recv_rung(self.plan, self.rank - 1, self.group,
                                          self.hidden_size, self.dtype, self.upstream)
            if self.relay and hidden is not None:
                # Before this rank's part of the step, whose collectives its peer then joins.
                wire.send_rung(step, hidden, self.plan, self.rank + 1, self.group,
                               self.downstream)
            out = self.apply(step, hidden)
            if self.relay:
                if hidden is None:  # after it: a LOOKUP's prefix is lowered to this rank's
                    wire.send_rung(step, None, self.plan, self.rank + 1, self.group,
                                   self.downstream)
                elif out is not None:
                    mx.async_eval(out)
            elif self.is_tail:
                if out is not None:
                    wire.send_tokens(out, 0, self.group)
            else:
                wire.send_rung(step, out, self.plan, self.rank + 1, self.group, self.downstream)
            if self.state.deferred and step.op == wire.DECODE:
                self.state.flush_admitted()  # after the send too
            self.metrics.iteration_done(self.state)  # after the send: off the next stage's path
            self.state.give_back_if_idle()
            if step.op == wire.STOP:
                wire.flush()
                return

    def apply(self, step: wire.Step, hidden: mx.array | None) -> mx.array | None:
        """This stage's part of a step: hidden states for the next stage, the answer to a
        LOOKUP on the tail, or None (the tail answers a DECODE step itself)."""
        if step.op == wire.FREE:
            self.state.free(step.freed)
            return None
        if step.op == wire.LOOKUP:
            step.held = min(step.held, self.state.lookup(step.target, step.prompt))
            return mx.array([step.held], dtype=mx.int32) if self.is_tail else None
        if step.op == wire.TRIM:
            self.state.trim(step.target, step.held)
            return None
        if step.op == wire.PREFILL:
            out = self.state.prefill(step.target, hidden)
            return None if self.is_tail else out
        if step.op != wire.DECODE:
            return None
        before = self.state.rows.get(step.target, [])
        if step.cuts:
            self.state.trim_rows(step.target, step.cuts)
        self.state.keep_answers(step.target, step.answers)
        self.state.update(step.target, step.keep, [a.seq_id for a in step.admits])
        if self.is_tail:
            for a in step.admits:
                self._admit(a)
            for sid in set(before) - set(self.state.rows.get(step.target, [])):
                self.samplers.pop(sid, None)
                self.constrained.discard(sid)
                self.unstarted.pop(sid, None)
        if hidden is None:
            return None
        out = self.state.forward(step.target, hidden)
        if not self.is_tail:
            return out
        if step.tokens > 1:
            self._verify(step.target, out, step.drafts)
        else:
            self._answer(step.target, out[:, -1, :])
        return None

    def _admit(self, a: wire.Admit) -> None:
        """The tail's sampler for an admitted sequence; one that cannot be made is reported
        with the sequence's first answer (a stand-in holds its row until then)."""
        grammar = None
        if a.grammar:
            self.constrained.add(a.seq_id)
            grammar = self.grammars.matcher(a.grammar, a.resumed)  # its failure is its verdict
        self.samplers[a.seq_id], error = make_sampler(a.sampling, a.context, grammar)
        if error:
            self.unstarted[a.seq_id] = error

    def _answer(self, mb: int, logits: mx.array) -> None:
        """The tail's answer to a DECODE step (the wire module's reply): tokens, logprob records
        and the number of rows that failed as soon as they are computed, then the grammar
        verdicts, which need the tokens on the host, then the failed rows' errors. The matchers'
        masks for the next step are filled when it comes, while the device computes it."""
        rows = self.state.rows[mb]
        samplers = [self.samplers[s] for s in rows]
        tokens, records, errors = sample_rows(logits, samplers)
        failed = self._failed(rows, samplers, errors)
        wire.send_answer(tokens, records, len(failed), 0, self.group)
        self._answer_rest(rows, samplers, tokens, failed)

    def _verify(self, mb: int, logits: mx.array, drafts: list[list[int]]) -> None:
        """The tail's answer to a DECODE step that verifies drafts (logits (rows, w, V)): each
        row's run, as the single node's engine verifies it (omlx_node.speculation), with the
        logprob records of the rows that ask, then what `_answer` sends after its tokens."""
        rows = self.state.rows[mb]
        samplers = [self.samplers[s] for s in rows]
        verdicts, errors = verify_rows(logits, drafts, samplers)
        failed = self._failed(rows, samplers, errors)
        width = logits.shape[1]
        ks = [s.params.logprobs for s in samplers if s.params.logprobs is not None]
        records = []
        for v in verdicts:
            if v.logprobs is not None:  # a row that asks: `width` records, zeros past its run
                records += pack_logprobs(v.logprobs, max(ks))
                records += [0] * ((width - len(v.logprobs)) * (1 + 2 * max(ks)))
        wire.send_runs([[*v.accepted, v.token] for v in verdicts], width, records, len(failed),
                       0, self.group)
        self._answer_rest(rows, samplers, mx.array([v.token for v in verdicts]), failed)

    def _failed(self, rows: list[int], samplers: list[RowSampler], errors: dict[int, str]
                ) -> dict[int, str]:
        """The rows of a step that failed, by index: those whose sampler could not be made at
        admission, and those whose sampling just failed (`errors`)."""
        failed = {i: self.unstarted.pop(sid) for i, sid in enumerate(rows)
                  if sid in self.unstarted}
        for i, error in errors.items():
            self.samplers[rows[i]] = samplers[i]  # its stand-in, until the head drops the row
            failed[i] = error
        return failed

    def _answer_rest(self, rows: list[int], samplers: list[RowSampler], tokens: mx.array,
                     failed: dict[int, str]) -> None:
        """What follows a DECODE step's tokens: the constrained rows' verdicts on their
        `tokens` (one a row: its last), then the failed rows' errors."""
        constrained = [i for i, sid in enumerate(rows) if sid in self.constrained]
        if constrained:
            values = tokens.tolist()
            matchers = [(samplers[i].grammar, values[i]) for i in constrained]
            # A row riding a stand-in has no matcher left: the head reads its verdict as nothing.
            wire.send_verdicts([advance_each([(g, v)])[0] if g is not None else (Verdict.GO, "")
                                for g, v in matchers], 0, self.group)
        if failed:
            wire.send_failures(failed, 0, self.group)
