"""Continuous batcher: one engine thread that owns the stage and every sequence's KV cache.

Each loop iteration runs at most one decode step for the whole running batch and then at most one
prefill chunk (`prefill_chunk` tokens, over the oldest waiting sequences), so a long prompt delays
the running streams by one chunk, never by its whole length. Sequences join the running batch when their prompt (all but its
last token) is in their own KV cache: that cache is merged into the batch's left-padded
`BatchKVCache` and the last prompt token becomes the sequence's first decode input, exactly as
mlx-lm's BatchGenerator does, so greedy outputs match mlx-lm's single-sequence generation.

Decoding overlaps Python with compute as mlx-lm's generate_step does: step n+1 is scheduled
(async_eval) before the tokens of step n are read and streamed out.

All MLX work happens on the engine thread (the one calling `run` or `step`); other threads talk to
it only through `submit`, `cancel` and `stop`, which put messages on a queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

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

    reason: str  # "stop", "length", "cancelled" or "error"
    error: str = ""


class Sequence:
    """One request inside the batcher. `events` yields ints (tokens) and then one Finish."""

    def __init__(self, req: SeqRequest):
        self.req = req
        self.events: queue.Queue[int | Finish] = queue.Queue()
        self.sampler = RowSampler(req.sampling)
        self.cache: list | None = None  # own KV cache while prefilling
        self.prefilled = 0
        self.generated = 0
        self.input_is_prompt = True  # its decode input is still the last prompt token
        self.cancelled = False
        self.submitted = time.perf_counter()
        self.last_token_time = 0.0

    @property
    def request_id(self) -> str:
        return self.req.request_id


class Batcher:
    def __init__(
        self,
        stage: StageRunner,
        metrics: NodeMetrics,
        prefill_chunk: int = 512,
        max_batch: int = 64,
    ):
        if not (stage.info.is_first and stage.info.is_last):
            raise ValueError("the single-node batcher needs a stage that holds every layer")
        self.stage = stage
        self.metrics = metrics
        self.prefill_chunk = prefill_chunk
        self.max_batch = max_batch
        self.vocab_size = stage.embed_tokens.weight.shape[0]
        self._inbox: queue.Queue[tuple[str, object]] = queue.Queue()
        self._waiting: deque[Sequence] = deque()
        self._batch: list[Sequence] = []
        self._cache: list[BatchKVCache] | None = None
        self._y: mx.array | None = None  # next decode input of every row
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
        return len(self._batch)

    @property
    def waiting(self) -> int:
        return len(self._waiting) + self._inbox.qsize()

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
        self._fail_all("the node is shutting down")
        mx.synchronize()

    def step(self, block: bool = False) -> None:
        """One iteration: take new requests and cancellations, one decode step for the running
        batch, one prefill chunk for the oldest waiting sequences. `block` waits (bounded) for
        work when there is none."""
        self._drain_inbox(block=block and not self._batch and not self._waiting)
        try:
            if self._batch:
                self._decode_step()
            if self._waiting and len(self._batch) < self.max_batch:
                self._prefill_step()
        except Exception as e:  # a failed step must not take the node down
            log.exception("batch step failed")
            self._fail_all(f"{type(e).__name__}: {e}")
        self.metrics.running.set(len(self._batch))
        self.metrics.waiting.set(len(self._waiting))

    @property
    def idle(self) -> bool:
        return not self._batch and not self._waiting and self._inbox.empty()

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
                self._waiting.remove(seq)  # its private cache goes with it
                self._finish(seq, Finish("cancelled"))
        for seq in self._batch:
            if seq.request_id == request_id:
                seq.cancelled = True  # dropped from the batch at the next step

    def _prefill_step(self) -> None:
        """Prefills up to `prefill_chunk` prompt tokens, over as many waiting sequences as fit:
        many short prompts join the batch together, so it decodes at full width sooner."""
        budget, ready = self.prefill_chunk, []
        while self._waiting and budget > 0 and len(self._batch) + len(ready) < self.max_batch:
            seq = self._waiting[0]
            if seq.cache is None:
                seq.cache = self.stage.make_cache()
            todo = seq.req.prompt[:-1]
            n = min(budget, len(todo) - seq.prefilled)
            if n > 0:
                chunk = mx.array([todo[seq.prefilled : seq.prefilled + n]])
                self.stage(chunk, seq.cache, last_only=True)
                mx.eval([c.state for c in seq.cache])
                seq.prefilled += n
            budget -= max(n, 1)
            if seq.prefilled < len(todo):
                break
            ready.append(self._waiting.popleft())
        if ready:
            self._admit(ready)

    def _admit(self, seqs: list[Sequence]) -> None:
        """Moves prefilled sequences into the running batch, one cache merge per layer."""
        merged = [BatchKVCache.merge(list(layer)) for layer in zip(*(s.cache for s in seqs))]
        last = mx.array([s.req.prompt[-1] for s in seqs])
        for s in seqs:
            s.cache = None
        if not self._batch:
            self._cache, self._y = merged, last
        else:
            for c, m in zip(self._cache, merged):
                c.extend(m)
            self._y = mx.concatenate([self._y, last])
        self._batch.extend(seqs)

    def _decode_step(self) -> None:
        y = self._y
        logits = self.stage(y[:, None], self._cache)[:, -1, :]
        self._y = sample_batch(logits, [s.sampler for s in self._batch])
        mx.async_eval(self._y)
        tokens = y.tolist()

        now = time.perf_counter()
        keep, emitted = [], 0
        for i, (seq, tok) in enumerate(zip(self._batch, tokens)):
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
        if len(keep) < len(self._batch):
            self._filter(keep)

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

    def _filter(self, keep: list[int]) -> None:
        self._batch = [self._batch[i] for i in keep]
        if not keep:
            self._cache = self._y = None
            return
        idx = mx.array(keep)
        for c in self._cache:
            c.filter(idx)
        self._y = self._y[idx]

    def _finish(self, seq: Sequence, finish: Finish) -> None:
        seq.events.put(finish)
        self.metrics.finished.labels(reason=finish.reason).inc()

    def _fail_all(self, error: str) -> None:
        for seq in list(self._waiting) + self._batch:
            self._finish(seq, Finish("error", error))
        self._waiting.clear()
        self._batch = []
        self._cache = self._y = None
