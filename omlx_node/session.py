"""The worker's side of a Session call (proto ShardWorker.Session): many sequences over one call.

The gateway runs every sequence it sends a worker through one Session. The engine hands each
step's events of all of them to the session's outbox as one list (`sequence.Outbox`), and the
call's handler thread sends them as one SessionEvents message. A call per sequence costs
a message, a handler thread's wake-up and the gRPC server's completion work per token, each under
the GIL that the engine thread builds its steps with; where a device computes a step faster than
Python builds it (small models on a GPU) that GIL time was the engine's: at many streams of a
small model the streaming threads held the GIL longer than the engine did (commit 9d97cf4).

Where the engine's steps come faster than the session's stream interval (a small model on a
fast device), the handler holds them and sends the steps of one interval as one message: fewer
messages, fewer wake-ups of the handler and gRPC's threads in the worker, fewer events for the
gateway to read and stream (less gateway CPU a token: bench/stream_interval.py,
bench/results/stream-interval-1b-h200.md). A sequence's first token and its end are never held
(`Outbox.urgent`): a client waits for those.

While its sequences have nothing to send (a long prompt being prefilled), the handler sends an
empty message every POLL_SECONDS that the engine completed a step since the last one: the
gateway takes a worker that sends nothing past --stall-timeout for a wedged plan, and a prefill
that advances is not one.

Requests are read on a thread of their own while the handler writes. A sequence's events read
as a call of its own would stream it (`fill_chunk`); a request that cannot run, and a sequence
the node failed under ("lost"), end with the status such a call would end with. When the
call ends, for whatever reason, every sequence of the session still running is cancelled.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc

from omlx_node.batcher import Engine
from omlx_node.sampling import SamplingParams
from omlx_node.sequence import Finish, Outbox, SeqRequest, Sequence
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

# A handler re-checks its call this often while its sequences have no news.
POLL_SECONDS = 1.0
# At most this many steps' events go in one message: a handler that falls behind (its client
# reads slowly) catches up in several, each well under gRPC's 4 MiB message limit (64 rows with
# 20 top logprobs each are ~13 KB a step).
STEPS_A_MESSAGE = 32


def seq_request(request: pb.GenerateRequest) -> SeqRequest:
    """The engine's request for a GenerateRequest."""
    s = request.sampling
    return SeqRequest(
        request_id=request.request_id,
        prompt=list(request.prompt_tokens),
        max_tokens=request.max_tokens,
        sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p if s.top_p > 0 else 1.0,
                                top_k=s.top_k, min_p=s.min_p,
                                seed=s.seed if s.has_seed else None,
                                presence_penalty=s.presence_penalty,
                                frequency_penalty=s.frequency_penalty,
                                repetition_penalty=s.repetition_penalty,
                                logprobs=request.top_logprobs if request.logprobs else None),
        stop_token_ids=frozenset(request.stop_token_ids),
        grammar=request.grammar,
        resumed_tokens=request.resumed_tokens,
        prediction=tuple(request.prediction_tokens),
    )


def fill_chunk(chunk: pb.TokenChunk, seq: Sequence, tokens: list[int], finish: Finish | None,
               first: bool) -> pb.TokenChunk:
    """Fills in (and returns) what a sequence's stream says about `tokens` (and `finish`, its
    end, unless the node failed under it: "lost" ends the call with UNAVAILABLE instead);
    `first`: the sequence's first chunk, which says how long its prompt is and how much of it
    was cached. In place: a session's message holds its chunks, which are not copied."""
    chunk.tokens.extend(tokens)
    if seq.req.sampling.logprobs is not None:
        # The engine puts a token's logprob before the token itself.
        chunk.logprobs.extend(
            pb.TokenLogprob(logprob=lp.logprob, top_ids=lp.top_ids, top_logprobs=lp.top_logprobs)
            for lp in (seq.logprobs.popleft() for _ in tokens))
    if first:
        chunk.prompt_tokens = len(seq.req.prompt)
        chunk.cached_tokens = seq.cached
    if finish is not None and finish.reason != "lost":
        chunk.finish_reason = finish.reason
        chunk.error = finish.error
    if seq.req.prediction:
        # OpenAI's counts so far, on every chunk (a stop string ends a stream before its last
        # one): each prediction token is either accepted or rejected, the ones no draft
        # reached too. A part of it drafted twice (a repeated line) counts once.
        accepted = min(seq.spec.predicted_accepted, len(seq.req.prediction))
        chunk.accepted_prediction_tokens = accepted
        chunk.rejected_prediction_tokens = len(seq.req.prediction) - accepted
    return chunk


@dataclass(frozen=True)
class _Refusal:
    """A request of the session that did not start: the status it ends with."""

    request_id: str
    code: grpc.StatusCode
    details: str


class Session:
    """One Session call's sequences, at most `max_sequences` at once."""

    def __init__(self, engine: Engine, max_sequences: int, compiler: futures.Executor,
                 interval: float = 0.0):
        """`compiler` submits the requests that carry a grammar, whose compile may take long:
        the session's later requests are not held up behind it. `interval`: the least seconds
        between two messages, unless one is urgent (0: a message whenever there is news)."""
        self.engine, self.max_sequences, self.compiler = engine, max_sequences, compiler
        self.interval = interval
        self.outbox: Outbox = Outbox()
        self._lock = threading.Lock()
        self._live: dict[str, Sequence | None] = {}  # None: submitting (a grammar compiles)
        self._cancelled: set[str] = set()  # cancelled while submitting
        self._started: set[str] = set()  # sent their first chunk
        self._failed: set[str] = set()  # ended by a fault of their own, still in the engine
        self._closed = ""  # why the session takes no more requests ("": it takes them)

    def read(self, requests: Iterator[pb.SessionRequest]) -> None:
        """Takes the call's requests until it ends (the reader thread)."""
        try:
            for r in requests:
                kind = r.WhichOneof("kind")
                if kind == "generate":
                    self._take(r.generate)
                elif kind == "cancel":
                    self._cancel(r.cancel)
        except Exception as e:  # the call ended under the iterator: the handler sees it too
            log.debug("session: requests ended: %s", e)
        finally:
            self.outbox.put(None)

    def _take(self, request: pb.GenerateRequest) -> None:
        rid = request.request_id
        with self._lock:
            if self._closed:
                self.outbox.put(_Refusal(rid, grpc.StatusCode.UNAVAILABLE, self._closed))
                return
            if rid in self._live:
                self.outbox.put(_Refusal(rid, grpc.StatusCode.ALREADY_EXISTS,
                                         f"request id {rid} is running in this session"))
                return
            if len(self._live) >= self.max_sequences:
                self.outbox.put(_Refusal(
                    rid, grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"this worker runs at most {self.max_sequences} sequences a session"))
                return
            self._live[rid] = None
        if request.grammar:
            self.compiler.submit(self._submit, request)
        else:
            self._submit(request)

    def _submit(self, request: pb.GenerateRequest) -> None:
        rid = request.request_id
        with self._lock:
            dropped = rid in self._cancelled or bool(self._closed)
            if dropped:
                self._cancelled.discard(rid)
                self._live.pop(rid, None)
        if dropped:
            # Cancelled (or its session ended) while its grammar waited for the compiler: the
            # compile, seconds for a large schema, would hold up the requests queued behind it.
            # The gateway reads nothing more of a cancelled sequence.
            return
        try:
            seq = self.engine.submit(seq_request(request), self.outbox)
        except ValueError as e:
            self._refuse(rid, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            return
        except Exception as e:  # not the request's own fault: UNKNOWN, as gRPC's own
            log.exception("session: submitting request %s failed", rid)
            self._refuse(rid, grpc.StatusCode.UNKNOWN,
                         f"the worker could not take the request: {type(e).__name__}: {e}")
            return
        with self._lock:
            cancelled = rid in self._cancelled or bool(self._closed)
            self._cancelled.discard(rid)
            if rid in self._live:
                self._live[rid] = seq
        if cancelled:
            self.engine.cancel(rid)

    def _refuse(self, rid: str, code: grpc.StatusCode, details: str) -> None:
        with self._lock:
            self._live.pop(rid, None)
            self._cancelled.discard(rid)
        self.outbox.put(_Refusal(rid, code, details))

    def _cancel(self, rid: str) -> None:
        with self._lock:
            if rid not in self._live:
                return
            if self._live[rid] is None:
                self._cancelled.add(rid)
                return
        self.engine.cancel(rid)

    def close(self, why: str) -> None:
        """Takes no more requests (a later one is told `why`), cancels every sequence of the
        session that has not ended, and ends the handler once what its outbox holds is out."""
        with self._lock:
            self._closed = self._closed or why
            live = [rid for rid, seq in self._live.items() if seq is not None]
        for rid in live:
            self.engine.cancel(rid)
        self.outbox.put(None)

    def messages(self, context: grpc.ServicerContext) -> Iterator[pb.SessionEvents]:
        """The call's responses: one message for everything that happened since the last one,
        until the call or its requests end."""
        sent, behind = 0.0, False  # when the last message went; whether it left news behind
        while True:
            try:
                items = [self.outbox.get(timeout=POLL_SECONDS)]
            except queue.Empty:
                if not context.is_active():
                    return
                if self._live and self.engine.stepped_at > sent:  # progress, nothing to say
                    yield pb.SessionEvents()
                    sent = time.monotonic()
                continue
            hold = sent + self.interval - time.monotonic()
            if hold > 0 and not behind and items[0] is not None:
                self.outbox.urgent.wait(hold)
            # Before taking the items: an urgent one put later sets it again.
            self.outbox.urgent.clear()
            while len(items) < STEPS_A_MESSAGE and items[-1] is not None:
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            ended = items[-1] is None
            behind = len(items) == STEPS_A_MESSAGE
            message = self._events([i for i in items if i is not None])
            if message.events:
                yield message
                sent = time.monotonic()
            if ended:
                return

    def _events(self, items: list) -> pb.SessionEvents:
        message = pb.SessionEvents()
        news: dict[str, tuple[Sequence, list[int], list[Finish]]] = {}
        for item in items:
            if isinstance(item, _Refusal):
                message.events.add(request_id=item.request_id, status_code=item.code.value[0],
                                   status_details=item.details)
                continue
            for seq, event in item:
                _, tokens, finish = news.setdefault(seq.request_id, (seq, [], []))
                if isinstance(event, Finish):
                    finish.append(event)
                else:
                    tokens.append(event)
        for rid, (seq, tokens, finish) in news.items():
            if rid in self._failed:  # what its sequence did after its event failed
                if finish:
                    self._failed.discard(rid)
                continue
            end = finish[0] if finish else None
            event = message.events.add(request_id=rid)
            try:
                fill_chunk(event.chunk, seq, tokens, end, rid not in self._started)
            except Exception as e:  # one sequence's fault must not end every other's call
                log.exception("session: the event of request %s failed; ending it alone", rid)
                event.Clear()
                event.request_id = rid
                event.chunk.finish_reason, event.chunk.error = "error", f"its event failed: {e!r}"
                if end is None:  # still running: its later events are dropped
                    self._failed.add(rid)
                    self.engine.cancel(rid)
                end = Finish("error", str(e))
            self._started.add(rid)
            if end is not None:
                if end.reason == "lost":
                    # The node failed under the sequence: it ends UNAVAILABLE, as a lost call,
                    # so the coordinator tells it from a clean stop ("aborted").
                    event.status_code = grpc.StatusCode.UNAVAILABLE.value[0]
                    event.status_details = end.error
                with self._lock:
                    self._live.pop(rid, None)
                self._started.discard(rid)
        return message
