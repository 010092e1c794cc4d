"""The generation core: one request's tokens from the cluster's head node, as protocol-neutral
events (Delta, KeepAlive, Done) that every API adapter (api/openai.py, api/anthropic.py) renders.

It owns what every protocol needs the same way: the context budget, stop strings, incremental
detokenising, keep-alives while a stream waits, resuming a request lost with its node on the
next plan, cancellation (closing the generator cancels the node's sequence) and the metrics.
Every wait is bounded: a gRPC deadline per request and keep-alives while nothing arrives.

It reads as the steps of one request: a running slot of its model (priority.py), then
attempts, each on the replica its RequestLease (request_lease.py) routes it to, until its output
is done; an attempt lost with its node ends the lease's hold on that replica, and RetryState
(retry.py) decides whether the request runs again and where.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import Account, check
from omlx_coordinator.frontdoor.keys import KeyRing
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.models.priority import INTERACTIVE, PriorityGate
from omlx_coordinator.models.served_model import LOADED, UNLOADED, ServedModel
from omlx_coordinator.nodes.node_client import WorkerClient
from omlx_coordinator.request.events import Delta, Done, KeepAlive
from omlx_coordinator.request.internal_error import internal_error
from omlx_coordinator.request.request_lease import RequestLease
from omlx_coordinator.request.retry import Fail, RetryState, lost_by
from omlx_coordinator.request.stop_strings import StopMatcher
from omlx_coordinator.telemetry.metrics import GatewayMetrics
from omlx_coordinator.text.tokenizer import ChatPrompt
from omlx_shared.model_kinds import CHAT, EMBED, ENDPOINTS, RERANK, TRANSCRIBE
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

KIND_NAMES = {CHAT: "a chat model", EMBED: "an embedding model", RERANK: "a reranking model",
              TRANSCRIBE: "a speech-to-text model"}


@dataclass
class GatewaySettings:
    request_timeout: float = 900.0  # seconds a request may run in all
    keepalive_seconds: float = 5.0  # SSE comment interval while a stream waits
    default_max_tokens: int = 4096  # when the client sets no limit (capped by the context)
    keys: KeyRing = field(default_factory=KeyRing)  # what /v1 and /cluster take (none: open)
    protect_metrics: bool = False  # /metrics needs an admin key too


@dataclass
class GenerationRequest:
    """What every protocol asks of the engine, in its terms: token ids and sampling."""

    prompt: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    grammar: str = ""  # an llguidance grammar (constraints.py) the output must follow
    logprobs: bool = False
    top_logprobs: int = 0
    account: Account | None = None  # whose usage it counts as (access.py)
    prediction: list[int] = field(default_factory=list)  # OpenAI's predicted output, tokenized


async def check_servable(manager: ModelManager, name: str,
                         account: Account | None = None, kind: str = CHAT) -> ServedModel:
    """The model a request names; a 404 for one not served here (listing those that are), a
    400 for one of another `kind` than the endpoint serves (naming the endpoints it does), a
    403 or 429 for one the `account` may not use now (access.py), a 503 while it cannot be
    served (and, for an unloaded one, when it fits nowhere even with every unpinned model
    unloaded, naming the shortfall)."""
    model = manager.resolve(name)
    if model is None:
        names = ", ".join(repr(m.name) for m in manager.models)
        raise APIError(404, f"model {name!r} is not served here; available: {names} "
                            "(GET /v1/models)", param="model", code="model_not_found")
    if model.kind.kind != kind:
        raise APIError(400, f"model {model.name!r} is {KIND_NAMES[model.kind.kind]}: send "
                            f"its requests to {' or '.join(ENDPOINTS[model.kind.kind][:3])}",
                       param="model", code="wrong_model_kind")
    check(account, model)
    main = manager.replicas[model.name][0]
    if not manager.started:  # the first loads; afterwards a load or recovery only pauses
        status = main.status if manager.cluster.ready else manager.cluster.status
        raise APIError(503, f"the model is not ready yet ({status}); retry shortly",
                       type="server_error", code="model_not_ready")
    if model.state == UNLOADED and (short := await manager.shortfall(model)):
        raise APIError(503, f"the model {model.name} cannot be loaded: {short}",
                       type="server_error", code="no_capacity")
    # A loaded model left without capacity (its nodes lost); for an unloaded one, shortfall
    # above decides: an old load's failure must not refuse it once it fits again.
    if (model.state == LOADED and main.capacity_error
            and not any(d.ready for d in manager.replicas[model.name])):
        raise APIError(503, f"the model cannot be served now: {main.capacity_error}",
                       type="server_error", code="no_capacity")
    return model


def token_budget(model: ServedModel, prompt: list[int], limit: int | None,
                 settings: GatewaySettings, prompt_param: str = "messages") -> int:
    """How many tokens the request may generate: its limit, cut to the context's room. A limit
    is a cap, not a demand, in every API here: agents send one for the largest models they know
    (Claude Code and OpenCode 32,000), and a refusal failed each of their turns on a model with
    less room; a reply that fills the room ends with the length reason, as one at its limit."""
    ctx = model.max_context
    if ctx and len(prompt) >= ctx:
        raise APIError(400, f"the prompt has {len(prompt)} tokens but the model's context is "
                            f"{ctx} tokens; shorten the prompt", param=prompt_param,
                       code="context_length_exceeded")
    room = ctx - len(prompt) if ctx else settings.default_max_tokens
    if limit is None:
        return min(room, settings.default_max_tokens)
    return min(limit, room)


async def _slot(gate: PriorityGate, priority: str, deadline: float,
                settings: GatewaySettings) -> AsyncIterator[KeepAlive]:
    """Yields KeepAlive until the request holds one of its model's running slots
    (priority.py); a request that goes away or fails meanwhile holds none."""
    task = asyncio.ensure_future(gate.enter(priority))
    try:
        while not task.done():
            if time.monotonic() > deadline:
                raise APIError(504, f"the request ran past the server's time limit waiting for "
                                    f"one of the model's {gate.slots} running slots (its class: "
                                    f"{priority})", type="server_error", code="timeout")
            done, _ = await asyncio.wait({task}, timeout=min(settings.keepalive_seconds, 0.5))
            if not done:
                yield KeepAlive()
        task.result()
    except BaseException:
        if not task.done():
            task.cancel()  # enter() gives the slot on if it was granted as it was cancelled
        elif not task.cancelled() and task.exception() is None:
            gate.leave(priority)
        raise


class _Attempt:
    """One sequence on the head worker's session: its chunks, then its error if it fails,
    arrive in `queue` (the session's reader puts them there: no task of its own per request)."""

    def __init__(self, node: WorkerClient, request: pb.GenerateRequest, timeout: float):
        self.call = node.generate(request, timeout=timeout)
        self.queue = self.call.items
        self.backlog: deque = deque()  # taken from the queue, not handled yet
        self._getter: asyncio.Future | None = None

    async def next(self, timeout: float) -> pb.TokenChunk | grpc.aio.AioRpcError | None:
        """What arrives next, None when nothing does within `timeout` seconds."""
        if not self.backlog and self._getter is None:
            self.backlog.extend(_drain(self.queue))
        if self.backlog:
            return self.backlog.popleft()
        # Not asyncio.wait_for: on Python < 3.12 it swallows a cancellation that arrives
        # together with a token, and the cancelled request then runs to its end.
        if self._getter is None:
            self._getter = asyncio.ensure_future(self.queue.get())
        await asyncio.wait({self._getter}, timeout=timeout)
        if not self._getter.done():
            return None
        item, self._getter = self._getter.result(), None
        return item

    def joined(self, first: pb.TokenChunk) -> list[pb.TokenChunk]:
        """`first` and the chunks queued right behind it, to be handled as one: a gateway that
        falls behind its streams then detokenises, matches stops and renders once per run of
        chunks rather than once per token, and so catches up."""
        self.backlog.extend(_drain(self.queue))  # no get() is pending here: the order holds
        chunks = [first]
        while (self.backlog and not chunks[-1].finish_reason
               and isinstance(self.backlog[0], pb.TokenChunk)
               and self.backlog[0].finish_reason in _JOINABLE):
            chunks.append(self.backlog.popleft())
        return chunks

    def close(self) -> None:
        self.call.cancel()  # no-op when finished; otherwise the node frees the sequence at once
        if self._getter is not None:
            self._getter.cancel()


class _Output:
    """What the request generated and the client was sent: the chunks of every attempt become
    Deltas (detokenised, cut at a stop string) and, last, Done; the latency metrics."""

    def __init__(self, model: ServedModel, req: GenerationRequest, metrics: GatewayMetrics):
        self.prompt, self.metrics, self.tokenizer = req.prompt, metrics, model.tokenizer
        self.detok = model.tokenizer.detokenizer(req.prompt)
        self.stops = StopMatcher(req.stop)
        self.generated: list[int] = []
        self.text: list[str] = []  # what the generated tokens were detokenized to
        self.cached = 0
        self.predicted: tuple[int | None, int] = ((0, len(req.prediction)) if req.prediction
                                                  else (None, 0))
        self.first = True  # no token yet: the request still counts as waiting
        self.started = self.last = time.perf_counter()
        self.done = False
        metrics.waiting.inc()
        metrics.prompt_tokens.inc(len(req.prompt))

    def tokens(self) -> list[int]:
        """The prompt and what was generated: what an attempt runs on, and what is cached."""
        return self.prompt + self.generated

    def feed(self, chunks: list[pb.TokenChunk], first_attempt: bool
             ) -> list[Delta | Done]:
        """The events for a run of chunks; raises APIError for one the node ended badly."""
        tokens = [t for c in chunks for t in c.tokens]
        logprobs = [lp for c in chunks for lp in c.logprobs]
        item = chunks[-1]  # its finish_reason and error end the whole run of chunks
        if first_attempt:  # a resumed attempt's cache hit is of the tokens it generated
            self.cached = max(self.cached, *(c.cached_tokens for c in chunks))
        if self.predicted[0] is not None:  # the node's counts so far, on every chunk
            self.predicted = (item.accepted_prediction_tokens, item.rejected_prediction_tokens)
        self._timed(len(tokens))
        out, hit, taken = self.stops.feed_tokens(self.detok, tokens, bool(item.finish_reason))
        tokens, logprobs = tokens[:taken], logprobs[:taken]
        self.generated += tokens
        self.text.append(out)
        self.metrics.generated_tokens.inc(len(tokens))
        if hit:
            return self._end([Delta(out, tokens, logprobs)] if out or tokens else [],
                             "stop", self.stops.matched)
        if item.finish_reason == "error":
            raise _node_error(item.error)
        if item.finish_reason == "cancelled":
            raise APIError(503, "the node cancelled this request", type="server_error")
        if item.finish_reason:
            self.text.append(flushed := self.stops.flush())
            out += flushed
        events: list[Delta | Done] = [Delta(out, tokens, logprobs)] if out or tokens else []
        return self._end(events, item.finish_reason) if item.finish_reason else events

    def _timed(self, count: int) -> None:
        now = time.perf_counter()
        if count and self.first:
            self.metrics.waiting.dec()
            self.metrics.running.inc()
            self.metrics.ttft.observe(now - self.started)
            self.first = False
        elif count:
            self.metrics.itl.observe((now - self.last) / count)
        self.last = now

    def _end(self, events: list[Delta | Done], reason: str, stop: str | None = None
             ) -> list[Delta | Done]:
        self.done = True
        # The next turn re-sends this answer after this prompt: kept before the client hears of
        # the end. Not past a stop string, whose tokens spell more than the text kept.
        if stop is None and isinstance(self.prompt, ChatPrompt):
            self.tokenizer.keep_answer(self.prompt, "".join(self.text), self.generated)
        return [*events, Done(reason, len(self.prompt), len(self.generated), self.cached, stop,
                              *self.predicted)]

    def close(self) -> None:
        (self.metrics.waiting if self.first else self.metrics.running).dec()
        self.metrics.e2e.observe(time.perf_counter() - self.started)


def _sampling(model: ServedModel, req: GenerationRequest) -> pb.SamplingParams:
    # top_k over the whole vocabulary or more keeps every token: the same as off, and what
    # OpenAI-compatible servers (vLLM, llama.cpp) do, rather than a k mlx-lm cannot take.
    top_k = 0 if req.top_k >= model.vocab_size else req.top_k
    sampling = pb.SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                 top_k=top_k, min_p=req.min_p,
                                 presence_penalty=req.presence_penalty,
                                 frequency_penalty=req.frequency_penalty,
                                 repetition_penalty=req.repetition_penalty)
    if req.seed is not None:
        sampling.has_seed, sampling.seed = True, req.seed
    return sampling


async def generate(manager: ModelManager, model: ServedModel, metrics: GatewayMetrics,
                   settings: GatewaySettings, req: GenerationRequest
                   ) -> AsyncIterator[Delta | KeepAlive | Done]:
    """Yields Delta, KeepAlive (while waiting) and finally Done; raises APIError on failure.

    An unloaded model is loaded first (the client sees keep-alives). The request holds a lease
    on its model from the replica it is given to its end, so that the model is not evicted
    under it. If the pipeline loses a node mid-request, the request goes on on another replica
    or the replica's new plan (retry.py says when): the prompt plus the tokens already streamed
    are prefilled again and generation continues, so the client sees a pause, not an error (and
    greedy output is the same as without the failure)."""
    deadline = time.monotonic() + settings.request_timeout
    sampling = _sampling(model, req)
    stop_ids = [] if req.ignore_eos else sorted(model.tokenizer.eos_token_ids)
    priority = req.account.priority if req.account is not None else INTERACTIVE
    output, retry = _Output(model, req, metrics), RetryState()
    slotted, failed = False, False
    try:
        async for ev in _slot(model.gate, priority, deadline, settings):
            yield ev
        slotted = True
        async with RequestLease(manager, model, deadline, settings.keepalive_seconds,
                                output.tokens) as lease:
            while True:  # one attempt a turn: RetryState ends them
                async for ev in lease.replica(retry.avoid):
                    yield ev
                request = pb.GenerateRequest(
                    request_id=uuid.uuid4().hex, prompt_tokens=output.tokens(),
                    sampling=sampling, max_tokens=req.max_tokens - len(output.generated),
                    stop_token_ids=stop_ids, grammar=req.grammar, logprobs=req.logprobs,
                    top_logprobs=req.top_logprobs, resumed_tokens=len(output.generated),
                    prediction_tokens=req.prediction)
                attempt = _Attempt(lease.deployment.node, request,
                                   max(1.0, deadline - time.monotonic()))
                lease.sent()
                try:
                    while not output.done:
                        item = await attempt.next(settings.keepalive_seconds)
                        if item is None:
                            yield KeepAlive()
                        elif (lost := lost_by(item)) is not None:
                            break
                        elif isinstance(item, grpc.aio.AioRpcError):
                            raise _rpc_error(item)
                        else:
                            for ev in output.feed(attempt.joined(item), retry.losses == 0):
                                yield ev
                finally:
                    attempt.close()
                if output.done:
                    return
                if isinstance(step := retry.on_lost(lease.lost(), lost), Fail):
                    log.error(step.log)
                    raise step.error
                log.warning("request lost its node (%s); resuming after %d tokens", lost.why,
                            len(output.generated))
    except Exception:
        failed = True
        raise
    finally:
        if slotted:
            model.gate.leave(priority)
        if req.account is not None:
            req.account.finished(model.name, len(req.prompt), output.cached,
                                 len(output.generated), failed)
        output.close()


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


# A chunk ending so joins the chunks before it; one that aborts, fails or is cancelled is
# handled alone, as it always was (an aborted chunk's tokens are generated again, for one).
_JOINABLE = ("", "stop", "length")


# How a node's error starts when the request's grammar failed (proto/omlx.proto TokenChunk).
_GRAMMAR_FAILED = "grammar: "


def _node_error(error: str) -> APIError:
    """A sequence the node ended with `error`. A grammar that outgrows the engine's parser
    (a schema too ambiguous or too wide: "Current row has 3000 items; max is 2000") is the
    client's to simplify, a 400; anything else is an exception's text, which stays in the log."""
    if error.startswith(_GRAMMAR_FAILED):
        return APIError(400, "the output could not follow the grammar made from the request's "
                             "response_format or tool schemas: "
                             f"{error.removeprefix(_GRAMMAR_FAILED)}; simplify those schemas",
                        code="grammar_failed")
    return internal_error(log, "generation failed on the node", detail=error)


def _rpc_error(e: grpc.aio.AioRpcError) -> APIError:
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details() or "invalid request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "the request ran past the server's time limit", type="server_error",
                        code="timeout")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # a bound: the unread chunks', the node's
        return APIError(503, e.details(), type="server_error", code="resource_exhausted")
    return APIError(503, f"the node is unavailable ({code.name}: {e.details()})",
                    type="server_error")
