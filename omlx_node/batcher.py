"""Continuous batching: the engine that owns a stage's KV caches and every sequence's lifecycle.

`Engine` holds what every head of a pipeline does whatever the pipeline's length: take requests
and cancellations from other threads through a queue, prefill prompts in chunks, stream sampled
tokens out, finish sequences. `Batcher` is the engine of a one-stage pipeline (single-Mac mode);
`omlx_node.pipeline.PipelineHead` the one of a longer pipeline.

Each iteration runs at most one decode step for the running batch and then at most one prefill
chunk (`prefill_chunk` tokens, over the oldest waiting sequences), so a long prompt delays the
running streams by one chunk, never by its whole length. A sequence's prompt, all but its last
token, is prefilled into its own KV cache, merged into the batch's left-padded `BatchKVCache`,
and its last prompt token becomes its first decode input, exactly as mlx-lm's BatchGenerator
does, so greedy outputs match mlx-lm's single-sequence generation.

All MLX work happens on the engine thread (the one calling `run` or `step`); other threads talk
to it only through `submit`, `cancel` and `stop`, which put messages on a queue.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from omlx_node.kv_tiers import PrefixCache
from omlx_node.metrics import NodeMetrics
from omlx_node.sampling import RowSampler, SamplingParams, sample_batch
from omlx_node.stage import StageRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeqRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class Finish:
    """The last event of a sequence's stream."""

    reason: str  # "stop", "length", "cancelled", "error" or "aborted" (the node went away)
    error: str = ""


_seq_ids = itertools.count(1)


class Sequence:
    """One request inside the engine. `events` yields ints (tokens) and then one Finish."""

    def __init__(self, req: SeqRequest):
        self.req = req
        self.sid = next(_seq_ids) & 0x7FFFFFFF  # int32 on the wire
        self.events: queue.Queue[int | Finish] = queue.Queue()
        self.prefilled = 0
        self.cached = 0  # prompt tokens restored from the prefix cache
        self.looked_up = False  # the prefix cache was asked (and answered)
        self.lookup_sent = False  # (pipeline head) the stages were asked
        self.generated = 0
        self.input_is_prompt = True  # its decode input is still the last prompt token
        self.cancelled = False
        self.finished = False  # its Finish is out; a pipeline drops its row at the next step
        self.submitted = time.perf_counter()
        self.last_token_time = 0.0

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def to_prefill(self) -> list[int]:
        return self.req.prompt[:-1]


class StageState:
    """The KV caches of one stage: one per prefilling sequence, one batch cache per micro-batch.

    Every stage of a pipeline applies the same operations in the same order, so the rows of a
    micro-batch line up across stages without ever being named on the wire after admission."""

    def __init__(self, stage: StageRunner, prefix_cache: PrefixCache | None = None):
        self.stage = stage
        self.prefix_cache = prefix_cache
        self.prefilling: dict[int, list[KVCache]] = {}
        self.caches: dict[int, list[BatchKVCache]] = {}
        self.rows: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}  # what each prefilling sequence will store

    def lookup(self, seq_id: int, tokens: list[int]) -> int:
        """Restores the longest prefix of `tokens` this stage holds; returns its length."""
        if self.prefix_cache is None:
            return 0
        self.tokens[seq_id] = tokens
        kv = self.prefix_cache.restore(tokens, self.prefix_cache.lookup(tokens))
        held = kv[0].offset
        if held:
            self.prefilling[seq_id] = kv
        return held

    def trim(self, seq_id: int, n: int) -> None:
        """Keeps only the first n restored tokens: the prefix every stage of the pipeline holds."""
        kv = self.prefilling.get(seq_id)
        if kv is None or kv[0].offset <= n:
            return
        if n == 0:
            del self.prefilling[seq_id]
            return
        for c in kv:
            c.trim(c.offset - n)

    def prefill(self, seq_id: int, x: mx.array) -> mx.array:
        """Runs a prompt chunk of one sequence; returns this stage's output (lazy)."""
        cache = self.prefilling.setdefault(seq_id, self.stage.make_cache())
        out = self.stage(x, cache, last_only=True)
        mx.eval([c.state for c in cache])
        return out

    def free(self, seq_ids: list[int]) -> None:
        for s in seq_ids:
            self.prefilling.pop(s, None)
            self.tokens.pop(s, None)

    def update(self, mb: int, keep: list[int] | None, admit: list[int]) -> None:
        """Drops the rows of micro-batch `mb` not in `keep`, then appends `admit`'s sequences.

        A micro-batch of one row keeps plain `KVCache`s: decoding through a one-row
        `BatchKVCache` (mask array, per-row offsets) measured ~30% slower on a GPU."""
        rows = self.rows.get(mb, [])
        caches = self.caches.get(mb)
        if keep is not None and len(keep) < len(rows):
            rows = [rows[i] for i in keep]
            if not rows:
                caches = None
            elif len(rows) == 1 and isinstance(caches[0], BatchKVCache):
                caches = [c.extract(keep[0]) for c in caches]
            else:
                idx = mx.array(keep)
                for c in caches:
                    c.filter(idx)
        if admit:
            # A one-token prompt has nothing to prefill: its cache starts empty here.
            new = [self.prefilling.pop(s, None) or self.stage.make_cache() for s in admit]
            if self.prefix_cache is not None:
                for sid, kv in zip(admit, new):
                    if sid in self.tokens:
                        self.prefix_cache.store(self.tokens.pop(sid), kv)
            if not rows and len(new) == 1:
                caches = new[0]
            elif rows and isinstance(caches[0], BatchKVCache):
                for c, m in zip(caches, (BatchKVCache.merge(list(l)) for l in zip(*new))):
                    c.extend(m)
            else:
                parts = [caches, *new] if rows else new
                caches = [BatchKVCache.merge(list(layer)) for layer in zip(*parts)]
            rows = rows + list(admit)
        if rows:
            self.caches[mb], self.rows[mb] = caches, rows
        else:
            self.caches.pop(mb, None)
            self.rows.pop(mb, None)

    def forward(self, mb: int, x: mx.array) -> mx.array:
        return self.stage(x, self.caches[mb])


class Engine:
    """What every pipeline head does: requests in, prompt chunks scheduled, tokens out."""

    failure_reason = "error"  # how sequences end when a step fails

    def __init__(self, stage: StageRunner, metrics: NodeMetrics, prefill_chunk: int,
                 max_batch: int, vocab_size: int, prefix_cache: PrefixCache | None = None):
        self.stage = stage
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self.vocab_size = vocab_size
        self.state = StageState(stage, prefix_cache)
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._stop = threading.Event()
        self.generated_total = 0
        self.prompt_total = 0
        self.requests_total = 0
        self._rate = deque(maxlen=64)  # (time, tokens) of recent steps

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
        bad = [t for t in req.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        limit = self.stage.info.max_context
        if limit and len(req.prompt) + req.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(req.prompt)} tokens) plus max_tokens ({req.max_tokens}) exceeds "
                f"the model's context of {limit} tokens"
            )

    def submit(self, req: SeqRequest) -> Sequence:
        self.validate(req)
        seq = Sequence(req)
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

    def decode_rate(self) -> float:
        """Generated tokens per second over the recent steps."""
        if len(self._rate) < 2:
            return 0.0
        span = self._rate[-1][0] - self._rate[0][0]
        return sum(n for _, n in list(self._rate)[1:]) / span if span > 0 else 0.0

    # ---- engine thread ---------------------------------------------------------------------

    def run(self) -> None:
        """The engine loop, until `stop`. Run it on the process's main thread: MLX work on a
        Python thread that later exits can abort the interpreter at shutdown (seen with mlx 0.32)."""
        while not self._stop.is_set():
            self.step(block=True)
        # "aborted": the sequence did nothing wrong; the coordinator may run it again elsewhere.
        self._fail_all("the node is shutting down", reason="aborted")
        mx.synchronize()

    def step(self, block: bool = False) -> None:
        """One iteration: new requests and cancellations, then the subclass's work. `block`
        waits (bounded) for work when there is none."""
        self._drain_inbox(block=block and self.idle)
        try:
            self._work()
        except Exception as e:  # a failed step must not take the node down
            log.exception("engine step failed")
            self._fail_all(f"{type(e).__name__}: {e}", reason=self.failure_reason)
        self.metrics.running.set(self.running)
        self.metrics.waiting.set(len(self._waiting))

    def _work(self) -> None:
        raise NotImplementedError

    def running_seqs(self) -> list[Sequence]:
        raise NotImplementedError

    def _reset(self) -> None:
        """Forgets every running sequence and its KV (after a failure)."""
        raise NotImplementedError

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = msg
            if kind == "submit":
                self._waiting.append(arg)
                self.requests_total += 1
                self.prompt_total += len(arg.req.prompt)
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
        """Plans one prefill chunk: (sequence, start, n) pieces of at most `prefill_chunk`
        tokens in all, oldest sequences first, for at most `room` new sequences."""
        budget, plan = self.prefill_chunk, []
        for seq in self._waiting:
            if budget <= 0 or len(plan) >= room or not self._looked_up(seq):
                break
            n = min(budget, len(seq.to_prefill) - seq.prefilled)
            plan.append((seq, seq.prefilled, n))
            budget -= max(n, 1)
        return plan

    def _looked_up(self, seq: Sequence) -> bool:
        """Whether `seq`'s cached prefix is known (and restored), so its prefill may start."""
        if not seq.looked_up:
            seq.cached = seq.prefilled = self.state.lookup(seq.sid, seq.to_prefill)
            seq.looked_up = True
        return True

    def _emit(self, seq: Sequence, tok: int, now: float) -> str | None:
        """Streams one sampled token; returns a finish reason if the sequence is done."""
        if tok in seq.req.stop_token_ids:
            return "stop"
        seq.events.put(tok)
        if seq.generated == 0:
            self.metrics.ttft.observe(now - seq.submitted)
        else:
            self.metrics.itl.observe(now - seq.last_token_time)
        seq.last_token_time = now
        seq.generated += 1
        return "length" if seq.generated >= seq.req.max_tokens else None

    def _emit_step(self, seqs: list[Sequence], tokens: list[int]) -> list[int]:
        """Hands out one decode step's tokens; returns the indices of the rows that go on."""
        now = time.perf_counter()
        keep, emitted = [], 0
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            if seq.cancelled:
                self._finish(seq, Finish("cancelled"))
                continue
            if seq.input_is_prompt:
                seq.input_is_prompt = False
                keep.append(i)
                continue
            reason = self._emit(seq, tok, now)
            emitted += 1
            if reason:
                self._finish(seq, Finish(reason))
            else:
                keep.append(i)
        self._rate.append((now, emitted))
        self.generated_total += emitted
        self.metrics.generated_tokens.inc(emitted)
        return keep

    def _finish(self, seq: Sequence, finish: Finish) -> None:
        seq.finished = True
        seq.events.put(finish)
        self.metrics.finished.labels(reason=finish.reason).inc()

    def _fail_all(self, error: str, reason: str = "error") -> None:
        for seq in list(self._waiting) + self.running_seqs():
            self._finish(seq, Finish(reason, error))
        self._waiting.clear()
        self._reset()


class Batcher(Engine):
    """The engine of a one-stage pipeline (every layer on this node).

    Decoding overlaps Python with compute as mlx-lm's generate_step does: step n+1 is scheduled
    (async_eval) before the tokens of step n are read and streamed out."""

    MB = 0  # its single micro-batch

    def __init__(self, stage: StageRunner, metrics: NodeMetrics, prefill_chunk: int = 512,
                 max_batch: int = 64, prefix_cache: PrefixCache | None = None):
        if not (stage.info.is_first and stage.info.is_last):
            raise ValueError("the single-node batcher needs a stage that holds every layer")
        super().__init__(stage, metrics, prefill_chunk, max_batch,
                         stage.embed_tokens.weight.shape[0], prefix_cache)
        self._batch: list[Sequence] = []
        self._samplers: list[RowSampler] = []
        self._y: mx.array | None = None  # next decode input of every row

    def running_seqs(self) -> list[Sequence]:
        return self._batch

    def _reset(self) -> None:
        self._batch, self._samplers, self._y = [], [], None
        self.state = StageState(self.stage, self.state.prefix_cache)

    def _work(self) -> None:
        if self._batch:
            self._decode_step()
        if self._waiting and len(self._batch) < self.max_batch:
            self._prefill_step()

    def _prefill_step(self) -> None:
        ready = []
        for seq, start, n in self._take_prefill(self.max_batch - len(self._batch)):
            if n > 0:
                self.state.prefill(seq.sid, mx.array([seq.to_prefill[start:start + n]]))
            seq.prefilled += n
            if seq.prefilled == len(seq.to_prefill):
                ready.append(self._waiting.popleft())
        if ready:
            self.state.update(self.MB, None, [s.sid for s in ready])
            last = mx.array([s.req.prompt[-1] for s in ready])
            self._y = last if self._y is None else mx.concatenate([self._y, last])
            self._batch.extend(ready)
            self._samplers.extend(RowSampler(s.req.sampling) for s in ready)

    def _decode_step(self) -> None:
        y = self._y
        logits = self.state.forward(self.MB, y[:, None])[:, -1, :]
        self._y = sample_batch(logits, self._samplers)
        mx.async_eval(self._y)
        keep = self._emit_step(self._batch, y.tolist())
        if len(keep) < len(self._batch):
            self.state.update(self.MB, keep, [])
            self._batch = [self._batch[i] for i in keep]
            self._samplers = [self._samplers[i] for i in keep]
            self._y = self._y[mx.array(keep)] if keep else None
