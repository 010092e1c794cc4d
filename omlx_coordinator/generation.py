"""The generation core: one request's tokens from the cluster's head node, as protocol-neutral
events (Delta, KeepAlive, Done) that every API adapter (api/openai.py, api/anthropic.py) renders.

It owns what every protocol needs the same way: the context budget, stop strings, incremental
detokenising, keep-alives while a stream waits, resuming a request lost with its node on the
next plan, cancellation (closing the generator cancels the node's sequence) and the metrics.
Every wait is bounded: a gRPC deadline per request and keep-alives while nothing arrives.

How an attempt ends says whose failure it was. finish_reason "error" is the request's own (its
sampler, its grammar): an error for the client (a grammar's a 400, a sampler's a 500 whose
text stays in the log), never run again. "aborted" is a worker that
stopped cleanly (a new plan): run again, always. A call that breaks (the worker went down, or
its pipeline lost a stage: UNAVAILABLE and the like) may be a lost node or a request that brings
the node down; the first is run again on the next plan, and a request whose attempt breaks a
second plan, loaded after its first break, is refused with its own error: a "query of death"
must not take down plan after plan, and every request beside it each time.
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

from omlx_coordinator.access import Account, check
from omlx_coordinator.cluster import NoCapacity
from omlx_coordinator.deployment import Deployment
from omlx_coordinator.lifecycle import ModelManager
from omlx_coordinator.errors import APIError
from omlx_coordinator.internal_error import internal_error
from omlx_coordinator.keys import KeyRing
from omlx_coordinator.metrics import GatewayMetrics
from omlx_coordinator.priority import INTERACTIVE, PriorityGate
from omlx_coordinator.served_model import LOADED, UNLOADED, ServedModel
from omlx_coordinator.stop_strings import StopMatcher
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
class Delta:
    text: str
    tokens: list[int] = field(default_factory=list)  # the tokens that arrived with this text
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # one per token, if asked


@dataclass
class KeepAlive:
    pass


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    stop_sequence: str | None = None  # the stop string that ended it (finish_reason "stop")
    # With a prediction (None: none sent): its tokens that stood as drafts, and the rest.
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int = 0


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


# A call that failed this way lost its node, not its request: run it again on the next plan.
RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
MAX_ATTEMPTS = 5
# How long a failed request waits for a new plan before trying the same one again.
REPLAN_WAIT_SECONDS = 5.0


class _Attempt:
    """One sequence on the head worker's session: its chunks, then its error if it fails,
    arrive in `queue` (the session's reader puts them there: no task of its own per request)."""

    def __init__(self, deployment: Deployment, request: pb.GenerateRequest, timeout: float):
        self.deployment, self.epoch = deployment, deployment.epoch
        self.call = deployment.node.generate(request, timeout=timeout)
        self.queue = self.call.items
        self.backlog: deque = deque()  # taken from the queue, not handled yet
        self.open = True
        deployment.inflight += 1
        deployment.requests += 1

    def close(self) -> None:
        self.call.cancel()  # no-op when finished; otherwise the node frees the sequence at once
        if self.open:
            self.deployment.inflight -= 1
            self.open = False


@dataclass(frozen=True)
class _Lost:
    why: str
    broke: bool  # the node failed under the attempt (False: its worker stopped cleanly)


def _lost(item) -> _Lost | None:
    """How `item` lost the attempt (so the request can run again), else None."""
    if isinstance(item, grpc.aio.AioRpcError):
        return (_Lost(f"{item.code().name}: {item.details()}", True)
                if item.code() in RETRIABLE else None)
    if item.finish_reason == "aborted":
        return _Lost(item.error or "the worker shut down", False)
    return None


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


async def _replica(manager: ModelManager, model: ServedModel, tokens: list[int],
                   lost: tuple[Deployment, int] | None, deadline: float,
                   settings: GatewaySettings, leased: bool = False
                   ) -> AsyncIterator[KeepAlive | Deployment]:
    """Yields KeepAlive while `model` loads, recovers or drains, then (last) the replica to run
    `tokens` on: not the plan `lost` (a replica at an epoch) a request just lost, while another
    replica can take it or for a little while, waiting for that one's new plan. A request that
    holds a lease already (`leased`: resuming after a lost node) is not held back by a drain,
    which waits for that lease to end."""
    waited = 0.0
    while True:
        main = manager.replicas[model.name][0]
        if time.monotonic() > deadline:
            raise APIError(504, "the request ran past the server's time limit while the model "
                                f"loaded or the cluster recovered ({main.status})",
                           type="server_error", code="timeout")
        if model.state != LOADED:
            task = manager.load_task(model)
            done, _ = await asyncio.wait({task}, timeout=min(settings.keepalive_seconds, 0.5))
            if not done:
                yield KeepAlive()
            elif isinstance(e := task.exception(), NoCapacity):
                raise APIError(503, f"the model {model.name} cannot be loaded: {e}",
                               type="server_error", code="no_capacity")
            elif e is not None:
                raise APIError(503, f"loading the model {model.name} failed: {e}",
                               type="server_error", code="load_failed")
            continue
        d = manager.route(model, tokens, avoid=lost)
        if model.name in manager.draining and not leased:  # a load waits for it to go
            await asyncio.sleep(0.5)
            yield KeepAlive()
            continue
        if d.ready and not (lost == (d, d.epoch) and waited < REPLAN_WAIT_SECONDS):
            yield d
            return
        try:
            await d.wait_ready(min(settings.keepalive_seconds, 0.5))
        except NoCapacity as e:
            raise APIError(503, f"the model cannot be served now: {e}",
                           type="server_error", code="no_capacity") from None
        except asyncio.TimeoutError:
            yield KeepAlive()
        if d.ready and lost == (d, d.epoch):
            await asyncio.sleep(0.2)
            waited += 0.2


async def generate(manager: ModelManager, model: ServedModel, metrics: GatewayMetrics,
                   settings: GatewaySettings, req: GenerationRequest
                   ) -> AsyncIterator[Delta | KeepAlive | Done]:
    """Yields Delta, KeepAlive (while waiting) and finally Done; raises APIError on failure.

    An unloaded model is loaded first (the client sees keep-alives). The request holds a lease
    on its model from the replica it is given to its end, so that the model is not evicted
    under it. If the pipeline loses a node mid-request, the request goes on on another replica
    or the replica's new plan: the prompt plus the tokens already streamed are prefilled again
    and generation continues, so the client sees a pause, not an error (and greedy output is
    the same as without the failure)."""
    prompt, max_tokens = req.prompt, req.max_tokens
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
    stop_ids = [] if req.ignore_eos else sorted(model.tokenizer.eos_token_ids)
    detok = model.tokenizer.detokenizer(prompt)
    stops = StopMatcher(req.stop)
    started = last = time.perf_counter()
    deadline = time.monotonic() + settings.request_timeout
    generated: list[int] = []
    first, cached, attempts = True, 0, 0
    predicted: tuple[int | None, int] = (0, len(req.prediction)) if req.prediction else (None, 0)
    attempt: _Attempt | None = None
    lost_plan: tuple[Deployment, int] | None = None  # the plan (replica, epoch) an attempt lost
    broke: tuple[Deployment, int] | None = None  # the plan an attempt of it broke, first time
    leased, failed, slotted = False, False, False
    priority = req.account.priority if req.account is not None else INTERACTIVE
    metrics.waiting.inc()
    metrics.prompt_tokens.inc(len(prompt))
    getter: asyncio.Future | None = None
    try:
        async for ev in _slot(model.gate, priority, deadline, settings):
            yield ev
        slotted = True
        while True:
            if attempt is None:
                deployment = None
                async for ev in _replica(manager, model, prompt + generated, lost_plan, deadline,
                                         settings, leased):
                    if isinstance(ev, KeepAlive):
                        yield ev
                    else:
                        deployment = ev
                if not leased:  # no await since the replica was chosen: it is still loaded
                    model.acquire()
                    leased = True
                attempts += 1
                sent = prompt + generated
                request = pb.GenerateRequest(
                    request_id=uuid.uuid4().hex, prompt_tokens=sent,
                    sampling=sampling, max_tokens=max_tokens - len(generated),
                    stop_token_ids=stop_ids, grammar=req.grammar, logprobs=req.logprobs,
                    top_logprobs=req.top_logprobs, resumed_tokens=len(generated),
                    prediction_tokens=req.prediction)
                attempt = _Attempt(deployment, request, max(1.0, deadline - time.monotonic()))
                # Once the call is on its way (its send is queued first): hashing a long
                # prompt's blocks need not delay it.
                asyncio.get_running_loop().call_soon(manager.record, deployment, sent)
            if not attempt.backlog and getter is None:
                attempt.backlog.extend(_drain(attempt.queue))
            if attempt.backlog:
                item = attempt.backlog.popleft()
            else:
                # Not asyncio.wait_for: on Python < 3.12 it swallows a cancellation that
                # arrives together with a token, and the cancelled request then runs to its end.
                if getter is None:
                    getter = asyncio.ensure_future(attempt.queue.get())
                await asyncio.wait({getter}, timeout=settings.keepalive_seconds)
                if not getter.done():
                    yield KeepAlive()
                    continue
                item, getter = getter.result(), None
            if (lost := _lost(item)) is not None:
                attempt.close()
                if lost.broke and broke is not None and (attempt.deployment is not broke[0]
                                                         or attempt.epoch > broke[1]):
                    log.error("a request broke plan %d of %s after plan %d of %s; it is not "
                              "run again: %s", attempt.epoch, attempt.deployment.name,
                              broke[1], broke[0].name, lost.why)
                    raise APIError(500, "the node went down under this request on two plans, "
                                        "so it is not run again; last: " + lost.why,
                                   type="server_error", code="request_failed_node")
                if lost.broke and broke is None:
                    broke = (attempt.deployment, attempt.epoch)
                lost_plan, attempt = (attempt.deployment, attempt.epoch), None
                if attempts >= MAX_ATTEMPTS:
                    raise APIError(503, f"lost the node {attempts} times; last: {lost.why}",
                                   type="server_error")
                log.warning("request lost its node (%s); resuming after %d tokens", lost.why,
                            len(generated))
                continue
            if isinstance(item, grpc.aio.AioRpcError):
                raise _rpc_error(item)
            chunks = _joined(item, attempt)
            tokens = [t for c in chunks for t in c.tokens]
            logprobs = [lp for c in chunks for lp in c.logprobs]
            item = chunks[-1]  # its finish_reason and error end the whole run of chunks
            now = time.perf_counter()
            if attempts == 1:
                cached = max(cached, *(c.cached_tokens for c in chunks))
            if req.prediction:  # the node's counts so far, on every chunk
                predicted = (item.accepted_prediction_tokens, item.rejected_prediction_tokens)
            if tokens and first:
                metrics.waiting.dec()
                metrics.running.inc()
                metrics.ttft.observe(now - started)
                first = False
            elif tokens:
                metrics.itl.observe((now - last) / len(tokens))
            last = now
            out, hit, taken = stops.feed_tokens(detok, tokens, bool(item.finish_reason))
            tokens, logprobs = tokens[:taken], logprobs[:taken]
            generated += tokens
            metrics.generated_tokens.inc(len(tokens))
            if hit:
                if out or tokens:
                    yield Delta(out, tokens, logprobs)
                yield Done("stop", len(prompt), len(generated), cached, stops.matched, *predicted)
                return
            if item.finish_reason == "error":
                raise _node_error(item.error)
            if item.finish_reason == "cancelled":
                raise APIError(503, "the node cancelled this request", type="server_error")
            out += stops.flush() if item.finish_reason else ""
            if out or tokens:
                yield Delta(out, tokens, logprobs)
            if item.finish_reason:
                yield Done(item.finish_reason, len(prompt), len(generated), cached, None,
                           *predicted)
                return
    except Exception:
        failed = True
        raise
    finally:
        if slotted:
            model.gate.leave(priority)
        if req.account is not None:
            req.account.finished(model.name, len(prompt), cached, len(generated), failed)
        (metrics.waiting if first else metrics.running).dec()
        metrics.e2e.observe(time.perf_counter() - started)
        if attempt is not None:
            # What it generated is in that replica's cache now: a follow-up turn goes there.
            manager.record(attempt.deployment, prompt + generated)
            attempt.close()
        if getter is not None:
            getter.cancel()
        if leased:
            model.release()


def _drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


# A chunk ending so joins the chunks before it; one that aborts, fails or is cancelled is
# handled alone, as it always was (an aborted chunk's tokens are generated again, for one).
_JOINABLE = ("", "stop", "length")


def _joined(first: pb.TokenChunk, attempt: _Attempt) -> list[pb.TokenChunk]:
    """`first` and the chunks queued right behind it, to be handled as one: a gateway that
    falls behind its streams then detokenises, matches stops and renders once per run of
    chunks rather than once per token, and so catches up."""
    backlog = attempt.backlog
    backlog.extend(_drain(attempt.queue))  # no get() is pending here: the order holds
    chunks = [first]
    while (backlog and not chunks[-1].finish_reason and isinstance(backlog[0], pb.TokenChunk)
           and backlog[0].finish_reason in _JOINABLE):
        chunks.append(backlog.popleft())
    return chunks


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
