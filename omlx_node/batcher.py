"""Continuous batching: the engine that owns a stage's KV caches and every sequence's lifecycle.

`Engine` holds what every head of a pipeline does whatever the pipeline's length: take requests
and cancellations from other threads through a queue, prefill prompts in chunks, stream sampled
tokens out, finish sequences. `Batcher` is the engine of a one-stage pipeline (single-Mac mode);
`omlx_node.pipeline.PipelineHead` the one of a longer pipeline.

Each iteration runs at most one decode step for the running batch and then at most one prefill
chunk over the oldest waiting sequences: `prefill_chunk` tokens while nobody decodes, and while
others do, as many as take about one decode step's time (`omlx_node.step_pace`), so a decoding
stream keeps about half its rate however long the prompts that arrive (docs/scheduling.md).
A sequence's prompt, all but its last token, is prefilled into its own KV cache, merged into
the batch's left-padded `BatchKVCache`, and its last prompt token becomes its first decode
input, exactly as mlx-lm's BatchGenerator does, so greedy outputs match mlx-lm's
single-sequence generation. Where every layer keeps a plain KVCache, the pieces of a chunk share
forward passes (`StageState.prefill_rows`): pieces that start at one offset and run as many
tokens (prompts of one length arriving together) unpadded, so each row computes what it would
alone; and where a pass has a fixed cost (a GPU: every weight read and every kernel launched
once whatever its tokens), pieces of other offsets and lengths too, padded as mlx-lm's
BatchGenerator pads a batch's prompts, while the padding costs less than the passes it saves.
Agents' turns arrive together with different histories and suffixes: one pass for them all.

Decoding overlaps Python with compute: step n+1 is built and scheduled before step n's tokens are
read. The way to a first token overlaps as well. A prompt's last chunk is left computing while
the first decode step is built. When every row's token is its first, the tokens are read and
streamed before the next step is built. On a GPU, building a small batch's step takes longer
than computing it, and a first token would otherwise wait for one or two such builds.

A constrained row (a grammar, omlx_node.constraints) cannot have its next token scheduled before
its last one is on the host: its matcher must take that token and fill the mask the next one is
sampled under. So while any row of the batch is constrained, a decode step starts the device on
its logits first and does that CPU work meanwhile; the other rows' tokens stay bit-identical.

A failure is isolated where it can be: one that a sequence explains (its sampler, penalties,
grammar matcher or parameters raise) ends that sequence alone, with its own error, while the
other rows' tokens stay what they would have been. A step that fails for a reason no sequence
explains fails every sequence once, with a message that names none of them (one client's
parameters never reach another), and the engine starts again from a clean state: no KV, and
mx.random's key as it was before the step (see omlx_node.sampling).

All MLX work happens on the engine thread (the one calling `run` or `step`); other threads talk
to it only through `submit`, `cancel` and `stop`, which put messages on a queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import mlx.core as mx

from omlx_node.constraints import GrammarMatcher, Grammars, Verdict, advance_rows
from omlx_node.draft_model import draft_for
from omlx_node.fuller_steps import SHARE, gather_window, wait_left
from omlx_node.kv_cache import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.prefill_order import priority, waits_for_ahead
from omlx_node.sampling import (
    MAX_TOP_LOGPROBS,
    Logprob,
    RowSampler,
    SamplingParams,
    make_sampler,
    random_key,
    restore_random_key,
    sample_batch,
    sample_rows,
    unpack_logprobs,
)
from omlx_node.sequence import Finish, Outbox, SeqRequest, Sequence
from omlx_node.speculation import Speculator, verify_rows
from omlx_node.stage import StageRunner
from omlx_node.stage_state import StageState
from omlx_node.step_pace import StepPace
from omlx_node.wait_parts import charge, split
from omlx_shared.speculative_modes import check_mode, draft_path
from omlx_shared.token_ids import outside_vocabulary

log = logging.getLogger(__name__)


def advance_each(rows: list[tuple[GrammarMatcher, int]]) -> list[tuple[Verdict, str]]:
    """`advance_rows`, with a matcher that raises failing its own row only (an ERROR verdict)."""
    out = []
    for matcher, token in rows:
        try:
            out += advance_rows([(matcher, token)])
        except Exception as e:  # llguidance's or the matcher's: this row's grammar alone
            out.append((Verdict.ERROR, f"the grammar's matcher failed: {type(e).__name__}: {e}"))
    return out


def device_prefill_chunk() -> int:
    """The prefill chunk for this process's device. On a GPU 2048 tokens, mlx-lm's own prefill
    step: each chunk pays its own launch and sync overhead, so smaller chunks delay a long
    prompt's first token, while a 2048-token chunk, the most a decode step then waits, stays
    short (bench/results/ttft-h200.md). On a CPU a chunk is compute-bound at any size and 2048
    tokens of even a small model take seconds, which running streams would wait."""
    return 512 if mx.default_device() == mx.cpu else 2048


class Engine:
    """What every pipeline head does: requests in, prompt chunks scheduled, tokens out."""

    failure_reason = "error"  # how sequences end when a step fails for no sequence's fault
    failure_message = ("the node failed a step for a reason no request explains (logged on the "
                       "node); it was restarted clean")

    def __init__(self, stage: StageRunner, metrics: NodeMetrics, prefill_chunk: int | None,
                 max_batch: int, vocab_size: int, prefix_cache: PrefixCache | None = None,
                 grammars: Grammars | None = None):
        """`prefill_chunk`: prompt tokens per step (None: `device_prefill_chunk()`);
        `grammars`: compiles the grammars of constrained requests (None: refuses them)."""
        self.stage = stage
        self.grammars = grammars
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk or device_prefill_chunk()
        # How much of a prompt an iteration prefills while others decode (step_pace.py).
        self.pace = StepPace()
        # How long new requests wait for others on a stage that streams layers, as a share of
        # a pass over them (fuller_steps.py).
        self.gather_share = SHARE
        # Which waiting prompt goes first: the oldest, or (True) the one with the least left to
        # prefill, aged (prefill_order.py). Oldest first measured as well or better on the agent
        # benchmark (docs/scheduling.md); the other is kept for that comparison.
        self.shortest_first = False
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.state = StageState(stage, metrics.profile, prefix_cache, defer_stores=True)
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._stop = threading.Event()
        self._stores_due: list[int] = []  # prompts kept at the next step (`_emit_step`)
        # Events bound for shared outboxes, handed over together (`_deliver`), and the
        # outboxes (ids) whose events this step include a first token or an end.
        self._outgoing: dict[int, tuple[Outbox, list[tuple[Sequence, int | Finish]]]] = {}
        self._urgent: set[int] = set()
        # What the worker's Health says: False from a failed step until the engine is clean.
        self.ready, self.status = True, "ready"
        self.speculator: Speculator | None = None  # `_speculate` sets it
        # When the last iteration ended (0: none yet): a prefill chunk, a decode step or an
        # idle wait. A step that does not return (a pipeline whose data plane is cut) leaves
        # it behind.
        self.stepped_at = 0.0

    def _speculate(self, mode: str, max_rows: int | None = None,
                   costs: dict[int, float] | None = None) -> None:
        """Turns speculative decoding on in `mode` (omlx_node.speculation's: "off", "ngram",
        "auto", "draft=PATH", whose draft model is the one the load loaded, else loaded here:
        draft_model.draft_for) where every layer's cache can
        be trimmed to a row's accepted tokens. `max_rows`: the most rows a drafting step holds
        (None: as the cost curve says); `costs`: that curve by positions, measured here unless
        given."""
        if not self.stage.trimmable:
            return
        path = draft_path(check_mode(mode))
        draft = draft_for(path, self.stage) if path else None
        self.speculator = Speculator(
            mode, self.stage, self.metrics, max_batch=self.max_batch, costs=costs,
            max_rows=max_rows,
            drafter=draft.proposer if draft else None,
            draft_share=draft.nbytes() / self.stage.nbytes() if draft else 0.0)

    def _feed_proposers(self, plan: list[tuple[Sequence, int, int]]) -> None:
        """Gives the sequences of a prefill chunk their proposers, which take the prompt as far
        as it is prefilled: a draft model computes it alongside, so its first draft waits for
        none of it (not while the batch is to be too large to speculate: it may never draft)."""
        if (self.speculator is None
                or len(self.running_seqs()) + len(self._waiting) > self.speculator.max_rows):
            return
        for seq, start, n in plan:
            self._give_proposer(seq)
            if seq.proposer is not None:
                seq.proposer.feed(seq.to_prefill[:start + n])

    def _give_proposer(self, seq: Sequence) -> None:
        """A sequence's proposer, once it decodes (or prefills, `_feed_proposers`), while
        speculation is on."""
        if self.speculator is not None and seq.proposer is None:
            seq.proposer = self.speculator.proposer(seq.req.prediction)

    def _draft(self, seq: Sequence, params: SamplingParams, constrained: bool) -> list[int]:
        """A decoding row's draft for its next step (its input, the last token it was given,
        is in `seq.fed` already)."""
        return self.speculator.draft(seq.proposer, seq.spec, params, constrained, seq.fed,
                                     seq.sampled, seq.req.max_tokens - seq.generated - 1)

    # ---- API for other threads -------------------------------------------------------------

    def stop(self) -> None:
        """Makes `run` return (from any thread)."""
        self._stop.set()
        self._inbox.put(("wake", None))

    def validate(self, req: SeqRequest) -> None:
        """Raises ValueError with a message for the client if the request cannot run."""
        if not req.prompt:
            raise ValueError("the prompt is empty: send at least one token")
        if req.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {req.max_tokens}")
        if bad := outside_vocabulary(req.prompt, self.vocab_size):
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        limit = self.stage.info.max_context
        if limit and len(req.prompt) + req.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(req.prompt)} tokens) plus max_tokens ({req.max_tokens}) exceeds "
                f"the model's context of {limit} tokens"
            )
        k = req.sampling.logprobs
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {k}")
        if req.sampling.repetition_penalty < 0:
            raise ValueError("repetition_penalty must not be negative, got "
                             f"{req.sampling.repetition_penalty}")
        if req.grammar and not 0 <= req.resumed_tokens < len(req.prompt):
            raise ValueError(f"resumed_tokens ({req.resumed_tokens}) must be less than the "
                             f"prompt's {len(req.prompt)} tokens")
        if req.grammar and self.grammars is None:
            raise ValueError("this node does not apply grammars")

    def submit(self, req: SeqRequest, outbox: Outbox | None = None) -> Sequence:
        """Queues a request (from any thread); raises ValueError if it cannot run. `outbox`:
        where its events go (None: the sequence's own `events`)."""
        self.validate(req)
        matcher = None
        if req.grammar:
            # Compiled on the caller's thread (llguidance drops the GIL): a bad grammar is
            # refused before it queues, and the engine thread never waits for a compile.
            matcher = self.grammars.matcher(req.grammar, req.resumed)
            if matcher.error:
                raise ValueError(f"the grammar cannot be used: {matcher.error}")
        seq = Sequence(req, matcher, outbox)
        self._inbox.put(("submit", seq))
        return seq

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))

    @property
    def running(self) -> int:
        return len(self.running_seqs())

    @property
    def waiting(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

    @property
    def idle(self) -> bool:
        return not self.running_seqs() and not self._waiting and self._inbox.empty()

    # ---- engine thread ---------------------------------------------------------------------

    def run(self) -> None:
        """The engine loop, until `stop`. Run it on the process's main thread: MLX work on a
        Python thread that later exits can abort the interpreter at shutdown (seen with mlx 0.32)."""
        while not self._stop.is_set():
            self.step(block=True)
        self._drain_inbox(0.0)  # requests that came during the last step end too
        # "aborted": the sequence did nothing wrong; the coordinator may run it again elsewhere.
        self._finish_all(Finish("aborted", "the node is shutting down"))
        self._deliver()
        mx.synchronize()

    def step(self, block: bool = False) -> None:
        """One iteration: new requests and cancellations, then the subclass's work. `block`
        waits (bounded) for work when there is none, or for more requests to start with the
        waiting ones (fuller_steps.py)."""
        self._drain_inbox(self._nap() if block else 0.0)
        key = random_key()
        try:
            self._work()
        except Exception as e:  # a failed step must not take the node down
            if self.failure_reason == "lost":
                # A pipeline's step fails when a peer stage goes: expected, and one line says
                # it (the traceback stays at debug level, for a step that fails otherwise).
                log.error("a pipeline step failed: %s (a stage was lost?); this worker stops",
                          str(e).splitlines()[0] if str(e) else type(e).__name__)
                log.debug("the failed step", exc_info=True)
            else:
                log.exception("engine step failed")
            self.ready, self.status = False, "recovering from a failed step"
            restore_random_key(key)
            # The exception's text may quote one request's parameters: it stays in the log.
            self._finish_all(Finish(self.failure_reason, self.failure_message))
            self._recover()
        self._deliver()
        self.stepped_at = time.monotonic()
        self.state.give_back_if_idle()
        self.metrics.running.set(self.running)
        self.metrics.waiting.set(len(self._waiting))
        self.metrics.iteration_done(self.state)

    def _work(self) -> None:
        raise NotImplementedError

    def running_seqs(self) -> list[Sequence]:
        raise NotImplementedError

    def _recover(self) -> None:
        """After a failed step, whose sequences are finished: gets to a clean state and sets
        `ready` again, or stops the engine (the worker then exits) if it cannot."""
        raise NotImplementedError

    def _nap(self) -> float:
        """Seconds the engine may wait on its inbox before this iteration's work."""
        if self.idle:
            return 0.5
        return 0.0 if self.running_seqs() else self._gather_left(self.max_batch)

    def _gather_left(self, room: int) -> float:
        """Seconds the waiting requests, none started yet, still wait for others to start
        with them on a stage that streams layers (fuller_steps.py); 0: they start now."""
        if not self._waiting or any(s.prefill_started for s in self._waiting):
            return 0.0
        window = gather_window(self.stage.streamed_seconds, self.gather_share)
        return wait_left(window, time.perf_counter(),
                         min(s.submitted for s in self._waiting), len(self._waiting), room)

    def _drain_inbox(self, timeout: float) -> None:
        """New requests and cancellations; waits up to `timeout` seconds for the first."""
        try:
            msg = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = msg
            if kind == "submit":
                self._waiting.append(arg)
                self.metrics.requests.inc()
                self.metrics.prompt_tokens.inc(len(arg.req.prompt))
            elif kind == "cancel":
                self._cancel(arg)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, request_id: str) -> None:
        for seq in list(self._waiting):
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                self._dropped_while_waiting(seq)
                self._finish(seq, Finish("cancelled"))
        for seq in self.running_seqs():
            if seq.request_id == request_id:
                seq.cancelled = True  # dropped from its batch at its next step

    def _dropped_while_waiting(self, seq: Sequence) -> None:
        self.state.free([seq.sid])

    def _take_prefill(self, room: int) -> list[tuple[Sequence, int, int]]:
        """Plans one prefill chunk: (sequence, start, n) pieces of at most the pace's budget
        (`prefill_chunk` tokens while nobody decodes) in all, in `_in_order`'s order, for at
        most `room` new sequences."""
        if self._gather_left(room) > 0:
            return []
        order, plan = self._in_order(), []
        # The first prompt's cached prefix is looked up before the budget: a short remainder
        # runs at once, where the pace would save up for a pass worth its fixed cost.
        left = len(order[0].to_prefill) - order[0].prefilled if self._looked_up(order[0]) else 0
        budget = self.pace.budget(self.prefill_chunk, bool(self.running_seqs()), left)
        for seq in order:
            if budget <= 0 or len(plan) >= room or self._waits_for(seq, plan) \
                    or not self._looked_up(seq):
                break
            left = len(seq.to_prefill) - seq.prefilled
            n = min(budget, left)
            cache = self.state.prefix_cache
            if cache is not None and self.stage.has_windows and n < left:
                # Ends on a block boundary where it can: a sliding-window layer holds a block
                # whole only right after the chunk that completes it (see StageState.prefill).
                aligned = n - (seq.prefilled + n) % cache.block_size
                n = aligned if aligned > 0 else n
            plan.append((seq, seq.prefilled, n))
            if not seq.prefill_started:
                seq.prefill_started = time.perf_counter()
                self.metrics.queue_seconds.observe(seq.prefill_started - seq.submitted)
            budget -= max(n, 1)
        return plan

    def _charge_waits(self, waiting: list[Sequence], t0: float, seconds: float, decoded: bool,
                      plan: list[tuple[Sequence, int, int]]) -> None:
        """Charges an iteration that began at `t0` and took `seconds` (a decode step if
        `decoded`, then `plan`'s prefill) to the prompts that waited through it (`waiting`:
        those without a first token when it began); one whose first token came in its decode
        step waited for that step up to its token, and for nothing after it."""
        prefilled = sum(n for _, _, n in plan)
        step, prefill = split(seconds, self.pace.decode_s, decoded, prefilled)
        own: dict[Sequence, int] = {}
        for seq, _, n in plan:
            own[seq] = own.get(seq, 0) + n
        for seq in waiting:
            if not seq.generated:
                charge(seq.wait, step, prefill, own.get(seq, 0), prefilled)
                continue
            charge(seq.wait, min(step, seq.first_token_time - t0), 0.0, 0, prefilled)
            self.metrics.waited(seq.wait.parts())
            log.debug("request %s: first token after %.3f s; %s", seq.request_id,
                      seq.first_token_time - seq.submitted,
                      ", ".join(f"{k} {v:.3f} s" for k, v in seq.wait.parts().items()))

    def _in_order(self) -> list[Sequence]:
        """The waiting sequences in the order their prefill goes (prefill_order.py)."""
        if not self.shortest_first or len(self._waiting) < 2:
            return list(self._waiting)
        now, cache = time.perf_counter(), self.state.prefix_cache
        for seq in self._waiting:
            if not seq.looked_up and seq.held < 0:
                seq.held = cache.lookup(seq.to_prefill, restoring=False) if cache else 0
        return sorted(self._waiting, key=lambda s: priority(
            len(s.to_prefill) - (s.prefilled if s.looked_up else s.held),
            now - s.submitted, self.pace.token_s))

    def _waits_for(self, seq: Sequence, plan: list[tuple[Sequence, int, int]]) -> bool:
        """Whether `seq`, not looked up yet, is better started after the prompts planned ahead of
        it are kept (prefill_order.py)."""
        cache = self.state.prefix_cache
        return cache is not None and not seq.looked_up and waits_for_ahead(
            seq.to_prefill, [(p.to_prefill, p.cached) for p, _, _ in plan], cache.block_size)

    def _looked_up(self, seq: Sequence) -> bool:
        """Whether `seq`'s cached prefix is known (and restored), so its prefill may start."""
        if not seq.looked_up:
            seq.cached = seq.prefilled = self.state.lookup(seq.sid, seq.to_prefill)
            seq.looked_up = True
        return True

    def _emit(self, seq: Sequence, tok: int, now: float, logprob: Logprob | None,
              verdict: tuple[Verdict, str]) -> Finish | None:
        """Streams one sampled token; returns the sequence's Finish if it is done. `verdict`:
        what the token did to the sequence's grammar, and the matcher's error."""
        seq.sampled.append(tok)
        grammar, error = verdict
        if grammar == Verdict.ERROR:
            return Finish("error", f"grammar: {error}")
        if grammar == Verdict.END or tok in seq.req.stop_token_ids:
            return Finish("stop")
        if logprob is not None:
            seq.logprobs.append(logprob)
        self._put(seq, tok)
        if seq.generated == 0:
            seq.first_token_time = now
            self.metrics.ttft.observe(now - seq.submitted)
            self.metrics.prefill_seconds.observe(now - seq.prefill_started)
        else:
            self.metrics.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        seq.generated += 1
        if grammar == Verdict.LAST:
            return Finish("stop")
        return Finish("length") if seq.generated >= seq.req.max_tokens else None

    def _emit_step(self, seqs: list[Sequence], tokens: list[int],
                   logprobs: dict[Sequence, Logprob] | None = None,
                   verdicts: dict[Sequence, tuple[Verdict, str]] | None = None,
                   failed: dict[Sequence, str] | None = None) -> list[int]:
        """Hands out one decode step's tokens, with the logprobs and grammar verdicts of the
        rows that have them; a row in `failed` could not sample its token and ends with that
        error instead. Returns the indices of the rows that go on."""
        now = time.perf_counter()
        keep, emitted, firsts, ended = [], 0, [], []
        logprobs, verdicts, failed = logprobs or {}, verdicts or {}, failed or {}
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            if seq.cancelled:
                self._finish(seq, Finish("cancelled"))
                continue
            if seq in failed:
                log.warning("request %s failed alone: %s", seq.request_id, failed[seq])
                self._finish(seq, Finish("error", failed[seq]))
                continue
            if seq.input_is_prompt:
                seq.input_is_prompt = False
                keep.append(i)
                continue
            if seq.generated == 0:
                firsts.append(seq.sid)
            finish = self._emit(seq, tok, now, logprobs.get(seq),
                                verdicts.get(seq, (Verdict.GO, "")))
            emitted += 1
            if finish:
                self._finish(seq, finish, store=False)
                ended.append(seq.sid)
            else:
                keep.append(i)
        self._deliver()
        if firsts:
            # A first token is what a client waits longest for: the thread that streams it gets
            # the GIL now. Otherwise it waits for the engine's next blocking call, and where the
            # device never makes the engine wait (small models on a GPU) that is the
            # interpreter's switch interval, 5 ms. Later tokens keep that batching.
            time.sleep(0)
        # After the tokens are out: a prompt's deferred store cuts its blocks (device work),
        # and the copy to host follows on a thread. Both hold the GIL for milliseconds, which
        # the thread streaming a first token would wait for, so a prompt whose stream goes on
        # keeps its blocks a step later (one that starts alike takes them at once: `lookup`).
        self.state.flush_stores(self._stores_due + ended)
        self._stores_due = [s for s in firsts if s not in ended]
        self.metrics.tokens_generated(emitted)
        return keep

    def _emit_runs(self, rows: list[Sequence], runs: list[list[int]],
                   logprobs: list[list[Logprob] | None] | None = None,
                   verdicts: dict[Sequence, tuple[Verdict, str]] | None = None,
                   failed: dict[Sequence, str] | None = None) -> set[int]:
        """Hands out a verified step's tokens: each row's run (what stood of its draft, and
        maybe its own next token), one position at a time as steps of their own, so a stop or
        `max_tokens` inside a run ends the row there. `verdicts` and `failed` concern the
        runs' first tokens. Returns the indices of the rows that ended."""
        ended: set[int] = set()
        for j in range(max(map(len, runs), default=0)):
            now = [i for i, r in enumerate(runs) if len(r) > j and i not in ended]
            keep = self._emit_step([rows[i] for i in now], [runs[i][j] for i in now],
                                   {rows[i]: logprobs[i][j] for i in now
                                    if logprobs and logprobs[i]},
                                   verdicts if j == 0 else None, failed if j == 0 else None)
            ended |= set(now) - {now[k] for k in keep}
        return ended

    @staticmethod
    def _logprobs(rows: list[Sequence], ints: list[int]) -> dict[Sequence, Logprob]:
        """A step's logprob records (sampling.sample_batch) by sequence: `rows` are the rows
        the step sampled, in order; only those that asked have a record."""
        asking = [s for s in rows if s.req.sampling.logprobs is not None]
        return dict(zip(asking, unpack_logprobs(ints, [s.req.sampling.logprobs for s in asking])))

    def _finish(self, seq: Sequence, finish: Finish, store: bool = True) -> None:
        """`store`: keeps what it prefilled now (False: the caller does, once its Finish is
        out). Ended before its first token (a stop token, a cancel, a failure, a shutdown),
        its prefill is kept as it would have been then."""
        if store:
            self.state.flush_stores([seq.sid])
        seq.finished = True
        self._put(seq, finish)
        self.metrics.finished.labels(reason=finish.reason).inc()
        if seq.generated:
            self.metrics.decode_seconds.observe(time.perf_counter() - seq.first_token_time)

    def _put(self, seq: Sequence, event: int | Finish) -> None:
        if seq.outbox is None:
            seq.events.put(event)
            return
        key = id(seq.outbox)
        self._outgoing.setdefault(key, (seq.outbox, []))[1].append((seq, event))
        if seq.generated == 0 or isinstance(event, Finish):  # (counted once the token is out)
            self._urgent.add(key)

    def _deliver(self) -> None:
        """Hands the outboxes what this step gave their sequences, one list each."""
        for key, (outbox, events) in self._outgoing.items():
            outbox.put(events, urgent=key in self._urgent)
        self._outgoing.clear()
        self._urgent.clear()

    def _finish_all(self, finish: Finish) -> None:
        """Ends every sequence, waiting or running, the same way."""
        for seq in list(self._waiting) + self.running_seqs():
            self._finish(seq, finish)
        self._waiting.clear()


class Batcher(Engine):
    """The engine of a one-stage pipeline (every layer on this node).

    Decoding overlaps Python with compute as mlx-lm's generate_step does: step n+1 is scheduled
    (async_eval) before the tokens of step n are read and streamed out."""

    MB = 0  # its single micro-batch

    def __init__(self, stage: StageRunner, metrics: NodeMetrics, prefill_chunk: int | None = None,
                 max_batch: int = 64, prefix_cache: PrefixCache | None = None,
                 grammars: Grammars | None = None, speculative: str = "auto",
                 speculative_rows: int | None = None):
        """`speculative`: omlx_node.speculation's mode ("off", "ngram", "auto", "draft=PATH":
        the draft model the load loaded, else loaded here); `speculative_rows`: the most rows
        a drafting step holds (None: measured)."""
        if not (stage.info.is_first and stage.info.is_last):
            raise ValueError("the single-node batcher needs a stage that holds every layer")
        super().__init__(stage, metrics, prefill_chunk, max_batch,
                         stage.embed_tokens.weight.shape[0], prefix_cache, grammars)
        self._batch: list[Sequence] = []
        self._samplers: list[RowSampler] = []
        self._y: mx.array | None = None  # next decode input of every row
        # The logprob records sampled with _y, and the rows they were sampled for (after a
        # speculative step: each row's record already).
        self._records: tuple[mx.array, list[Sequence]] | dict[Sequence, Logprob] | None = None
        # Rows whose token in _y is a stand-in's: their sampling failed, with this error.
        self._failed: dict[Sequence, str] = {}
        self._speculate(speculative, speculative_rows)

    def running_seqs(self) -> list[Sequence]:
        return self._batch

    def _recover(self) -> None:
        self._batch, self._samplers, self._y, self._records, self._failed = [], [], None, None, {}
        self.state = StageState(self.stage, self.state.profile, self.state.prefix_cache,
                                defer_stores=True)
        try:
            # What every step does, on a throwaway cache: proof that the engine computes again.
            logits = self.stage(mx.array([[0]]), self.stage.make_cache())[:, -1, :]
            mx.eval(sample_batch(logits, [RowSampler(SamplingParams(temperature=1.0))])[0])
        except Exception:
            log.exception("the engine cannot compute after a failed step: stopping")
            self.status = "failed: the engine cannot compute after a failed step"
            self.stop()
            return
        self.ready, self.status = True, "ready"

    def _work(self) -> None:
        t0, decoded, plan = time.perf_counter(), bool(self._batch), []
        waiting = [*self._waiting, *(s for s in self._batch if s.generated == 0)]
        if decoded:
            self._decode_step()
        if self._waiting and len(self._batch) < self.max_batch:
            plan = self._prefill_step()
        seconds = time.perf_counter() - t0
        self._charge_waits(waiting, t0, seconds, decoded, plan)
        self.pace.observe(seconds, decoded, sum(n for _, _, n in plan))

    def _prefill_step(self) -> list[tuple[Sequence, int, int]]:
        """Runs one prefill chunk; returns its plan."""
        plan = self._take_prefill(self.max_batch - len(self._batch))
        self._feed_proposers(plan)
        for group in self._prefill_groups(plan):
            if len(group) == 1:
                seq, start, n = group[0]
                x = mx.array([seq.to_prefill[start:start + n]])
                # A prompt's last chunk is left computing: the next step, its first, is built
                # meanwhile (on a GPU, where building a step's graph takes longer than a small
                # batch's compute, bench/results/ttft-h200.md).
                last = start + n == len(seq.to_prefill) and self.state.defer_stores
                self.state.prefill(seq.sid, x, wait=not last)
            else:
                lengths = [n for _, _, n in group]
                width = max(lengths)
                x = mx.array([seq.to_prefill[start:start + n] + [0] * (width - n)
                              for seq, start, n in group])
                self.state.prefill_rows([seq.sid for seq, _, _ in group], x,
                                        lengths if min(lengths) < width else None)
        ready = []
        for seq, _, n in plan:
            seq.prefilled += n
            if seq.prefilled == len(seq.to_prefill):
                # Not always the first one waiting: a chunk cut to a block boundary leaves
                # room for the next, and a one-token prompt has nothing to prefill.
                self._waiting.remove(seq)
                ready.append(seq)
        if ready:
            self.state.update(self.MB, None, [s.sid for s in ready])
            last = mx.array([s.req.prompt[-1] for s in ready])
            self._y = last if self._y is None else mx.concatenate([self._y, last])
            self._batch.extend(ready)
            for s in ready:
                self._give_proposer(s)
                # One whose sampler cannot be made rides a stand-in's until its error is out.
                sampler, error = make_sampler(s.req.sampling, s.req.penalty_context, s.matcher)
                self._samplers.append(sampler)
                if error:
                    self._failed[s] = f"sampling cannot start: {error}"
        return plan

    def _prefill_groups(self, plan: list[tuple[Sequence, int, int]]
                        ) -> list[list[tuple[Sequence, int, int]]]:
        """The plan's pieces with tokens to run, in forward passes, where the caches allow
        several in one (one weight read, one launch of every kernel for them all): pieces that
        start at one offset and run as many tokens, and, where a pass has a fixed cost (a GPU),
        pieces whose padding to the longest of their pass costs less than the pass it saves."""
        pieces = [piece for piece in plan if piece[2] > 0]
        if not self.state.batchable:
            return [[piece] for piece in pieces]
        fixed, per = self.pace.pass_s, self.pace.token_s
        groups: list[list[tuple[Sequence, int, int]]] = []
        for piece in sorted(pieces, key=lambda p: -p[2]):  # a group's first is its longest
            group = next((g for g in groups if g[0][1:] == piece[1:]
                          or (fixed > 0 and per * (g[0][2] - piece[2]) <= fixed)), None)
            if group is None:
                groups.append([piece])
            else:
                group.append(piece)
        return groups

    def _decode_step(self) -> None:
        """Schedules the next step, then streams the tokens of the one before while it
        computes. When every row's token is its first, they are streamed first: no stream runs
        to lose that overlap, and on a GPU building a small batch's step takes longer than
        computing it, which the first tokens would wait for."""
        if self._speculates():
            self._speculative_step()
            return
        if all(s.generated == 0 and not s.input_is_prompt for s in self._batch):
            y = self._y
            self._hand_out(y, self._records, self._failed, self._advance(y))
            self._records, self._failed = None, {}
            if self._batch:
                self._launch(self._y, advanced=True)
            return
        y, records, failed = self._y, self._records, self._failed
        verdicts = self._launch(y)
        self._hand_out(y, records, failed, verdicts)

    def _launch(self, y: mx.array, advanced: bool = False
                ) -> dict[Sequence, tuple[Verdict, str]] | None:
        """Builds and schedules the step that decodes `y` (every row's input) into the next
        `_y`; returns the grammar verdicts of `y`'s tokens unless already `advanced`."""
        logits = self.state.forward(self.MB, y[:, None])[:, -1, :]
        verdicts = None if advanced else self._advance(y, logits)
        self._y, new_records, errors = sample_rows(logits, self._samplers)
        self._failed = {self._batch[i]: f"sampling failed: {e}" for i, e in errors.items()}
        mx.async_eval(self._y, *([] if new_records is None else [new_records]))
        self._records = None if new_records is None else (new_records, list(self._batch))
        self.state.settle()  # a prompt's last chunk, which this step was built beside
        return verdicts

    def _advance(self, y: mx.array, computing: mx.array | None = None
                 ) -> dict[Sequence, tuple[Verdict, str]] | None:
        """The grammar verdicts of `y`'s tokens, each constrained row's matcher advanced (a row
        whose token in `y` is its prompt's last has none to take)."""
        constrained = [(seq, s.grammar) for seq, s in zip(self._batch, self._samplers)
                       if s.grammar is not None and not seq.input_is_prompt]
        if not constrained:
            return None
        if computing is not None:
            # The device computes the next step's logits while the matchers take `y` and (in
            # sample_batch) fill the masks its tokens are sampled under.
            mx.async_eval(computing)
        last = dict(zip(self._batch, y.tolist()))
        return dict(zip((seq for seq, _ in constrained),
                        advance_each([(g, last[seq]) for seq, g in constrained])))

    def _hand_out(self, y: mx.array,
                  records: tuple[mx.array, list[Sequence]] | dict[Sequence, Logprob] | None,
                  failed: dict[Sequence, str],
                  verdicts: dict[Sequence, tuple[Verdict, str]] | None) -> None:
        """Streams `y`'s tokens (with the logprob `records` sampled with them), then drops the
        rows that ended from the batch and from `_y`."""
        if isinstance(records, dict):  # a speculative step's, by sequence already
            logprobs = records
        else:
            logprobs = self._logprobs(records[1], records[0].tolist()) if records else None
        self._drop_ended(self._emit_step(self._batch, y.tolist(), logprobs, verdicts, failed))

    def _drop_ended(self, keep: list[int]) -> None:
        """Drops the rows not in `keep` (indices) from the batch, its caches and `_y`."""
        if len(keep) < len(self._batch):
            kept = set(keep)
            self.state.keep_answers(self.MB, {i: s.fed for i, s in enumerate(self._batch)
                                              if i not in kept})
            self.state.update(self.MB, keep, [])
            self._batch = [self._batch[i] for i in keep]
            self._samplers = [self._samplers[i] for i in keep]
            self._y = self._y[mx.array(keep)] if keep else None

    # ---- speculative decoding (omlx_node.speculation) --------------------------------------

    def _speculates(self) -> bool:
        """Whether this step verifies drafts: a row may draft, and the batch is small enough
        that a draft's extra positions cost less than the steps they save."""
        return self.speculator is not None and self.speculator.wanted(
            [s.spec for s in self._batch if s.proposer is not None], len(self._batch))

    def _speculative_step(self) -> None:
        """Streams `_y`'s tokens first (a draft follows them), then runs every row's input and
        its draft (if any) as one forward pass of 1 + the longest draft positions: a row's
        shorter draft is padded with filler, and positions past what stands, filler included,
        are trimmed from the caches before anything is kept of them. The tokens that stood
        stream now; each row's next token becomes `_y`, streamed at the next step as always."""
        y = self._y
        self._hand_out(y, self._records, self._failed, self._advance(y))
        self._records, self._failed = None, {}
        if not self._batch:
            return
        rows, inputs = list(self._batch), self._y.tolist()
        drafts = [self._draft(s, sampler.params, sampler.grammar is not None)
                  for s, sampler in zip(rows, self._samplers)]
        if not any(drafts):
            self._launch(self._y, advanced=True)
            return
        width = 1 + max(map(len, drafts))
        x = mx.array([[t, *d] + [t] * (width - 1 - len(d)) for t, d in zip(inputs, drafts)])
        logits = self.state.forward(self.MB, x)
        self.state.settle()  # a prompt's last chunk, which this step was built beside
        verdicts, failed = verify_rows(logits, drafts, self._samplers)
        self.state.trim_rows(self.MB, [width - 1 - len(v.accepted) for v in verdicts])
        for s, d, v in zip(rows, drafts, verdicts):
            if d:
                self.speculator.counted(s.proposer, s.spec, len(d), len(v.accepted))
        ended = self._emit_runs(rows, [v.accepted for v in verdicts],
                                [v.logprobs for v in verdicts])
        self._y = mx.array([v.token for v in verdicts])
        self._records = {s: v.logprobs[-1] for s, v in zip(rows, verdicts) if v.logprobs}
        self._failed = {rows[i]: f"sampling failed: {e}" for i, e in failed.items()}
        self._drop_ended([i for i in range(len(rows)) if i not in ended])
