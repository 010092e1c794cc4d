"""The generation core: one request's tokens from the cluster's head node, as protocol-neutral
events (Delta, KeepAlive, Done) that every API adapter (api/openai.py, api/anthropic.py) renders.

It owns what every protocol needs the same way: the context budget, stop strings, incremental
detokenising, keep-alives while a stream waits, resuming a request lost with its node on the
next plan, cancellation (closing the generator cancels the node's sequence) and the metrics.
Every wait is bounded: a gRPC deadline per request and keep-alives while nothing arrives.

How an attempt ends says whose failure it was. finish_reason "error" is the request's own (its
sampler, its grammar): an error for the client, never run again. "aborted" is a worker that
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from omlx_coordinator.cluster import Cluster, NoCapacity
from omlx_coordinator.errors import APIError
from omlx_coordinator.metrics import GatewayMetrics
from omlx_coordinator.stop_strings import StopMatcher
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class GatewaySettings:
    request_timeout: float = 900.0  # seconds a request may run in all
    keepalive_seconds: float = 5.0  # SSE comment interval while a stream waits
    default_max_tokens: int = 4096  # when the client sets no limit (capped by the context)
    api_keys: frozenset[str] = frozenset()  # Bearer keys /v1 and /cluster require (none: open)


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


def check_servable(cluster: Cluster, model: str) -> None:
    """A 404 for a model not served here, a 503 while it cannot serve."""
    if model != cluster.model_id:
        raise APIError(404, f"model {model!r} is not served here; available: "
                            f"{cluster.model_id!r} (GET /v1/models)", param="model",
                       code="model_not_found")
    if cluster.capacity_error and not cluster.ready:
        raise APIError(503, f"the model cannot be served now: {cluster.capacity_error}",
                       type="server_error", code="no_capacity")
    if cluster.epoch == 0:  # still starting; once serving, a recovery only pauses requests
        raise APIError(503, f"the model is not ready yet ({cluster.status}); retry shortly",
                       type="server_error", code="model_not_ready")


def token_budget(cluster: Cluster, prompt: list[int], limit: int | None,
                 settings: GatewaySettings, prompt_param: str = "messages",
                 limit_param: str = "max_tokens", clamp: bool = False) -> int:
    """How many tokens the request may generate: its limit, refused past the context's room
    (or cut to the room with `clamp`: Anthropic's max_tokens is a cap, not a demand)."""
    ctx = cluster.max_context
    if ctx and len(prompt) >= ctx:
        raise APIError(400, f"the prompt has {len(prompt)} tokens but the model's context is "
                            f"{ctx} tokens; shorten the prompt", param=prompt_param,
                       code="context_length_exceeded")
    room = ctx - len(prompt) if ctx else settings.default_max_tokens
    if limit is None:
        return min(room, settings.default_max_tokens)
    if limit > room and not clamp:
        raise APIError(400, f"{limit_param} is {limit} but only {room} tokens fit in the model's "
                            f"context of {ctx} after the {len(prompt)}-token prompt",
                       param=limit_param, code="context_length_exceeded")
    return min(limit, room)


# A call that failed this way lost its node, not its request: run it again on the next plan.
RETRIABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
MAX_ATTEMPTS = 5
# How long a failed request waits for a new plan before trying the same one again.
REPLAN_WAIT_SECONDS = 5.0


class _Attempt:
    """One Generate call to the head worker, its chunks pumped into a queue."""

    def __init__(self, cluster: Cluster, request: pb.GenerateRequest, timeout: float):
        self.epoch = cluster.epoch
        self.call = cluster.node.generate(request, timeout=timeout)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.create_task(self._pump())

    async def _pump(self) -> None:
        try:
            async for chunk in self.call:
                self.queue.put_nowait(chunk)
            self.queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # keep the consumer from waiting forever
            self.queue.put_nowait(e)

    def close(self) -> None:
        self.call.cancel()  # no-op when finished; otherwise the node frees the sequence at once
        self.task.cancel()


@dataclass(frozen=True)
class _Lost:
    why: str
    broke: bool  # the node failed under the attempt (False: its worker stopped cleanly)


def _lost(item) -> _Lost | None:
    """How `item` lost the attempt (so the request can run again), else None."""
    if item is None:
        return _Lost("the stream ended without finishing", True)
    if isinstance(item, grpc.aio.AioRpcError):
        return (_Lost(f"{item.code().name}: {item.details()}", True)
                if item.code() in RETRIABLE else None)
    if isinstance(item, Exception):
        return _Lost(str(item), True)
    if item.finish_reason == "aborted":
        return _Lost(item.error or "the worker shut down", False)
    return None


async def generate(cluster: Cluster, metrics: GatewayMetrics, settings: GatewaySettings,
                   req: GenerationRequest) -> AsyncIterator[Delta | KeepAlive | Done]:
    """Yields Delta, KeepAlive (while waiting) and finally Done; raises APIError on failure.

    If the pipeline loses a node mid-request, the request waits for the cluster's new plan and
    goes on there: the prompt plus the tokens already streamed are prefilled again and
    generation continues, so the client sees a pause, not an error (and greedy output is the
    same as without the failure)."""
    prompt, max_tokens = req.prompt, req.max_tokens
    # top_k over the whole vocabulary or more keeps every token: the same as off, and what
    # OpenAI-compatible servers (vLLM, llama.cpp) do, rather than a k mlx-lm cannot take.
    top_k = 0 if req.top_k >= cluster.vocab_size else req.top_k
    sampling = pb.SamplingParams(temperature=req.temperature, top_p=req.top_p,
                                 top_k=top_k, min_p=req.min_p,
                                 presence_penalty=req.presence_penalty,
                                 frequency_penalty=req.frequency_penalty,
                                 repetition_penalty=req.repetition_penalty)
    if req.seed is not None:
        sampling.has_seed, sampling.seed = True, req.seed
    stop_ids = [] if req.ignore_eos else sorted(cluster.tokenizer.eos_token_ids)
    detok = cluster.tokenizer.detokenizer(prompt)
    stops = StopMatcher(req.stop)
    started = last = time.perf_counter()
    deadline = time.monotonic() + settings.request_timeout
    generated: list[int] = []
    first, cached, attempts = True, 0, 0
    attempt: _Attempt | None = None
    lost_epoch = -1  # the plan a failed attempt ran on
    broke_epoch: int | None = None  # the plan an attempt of it broke, the first time
    metrics.waiting.inc()
    metrics.prompt_tokens.inc(len(prompt))
    getter: asyncio.Future | None = None
    try:
        while True:
            if attempt is None:
                # Wait (with keep-alives) for a plan newer than the one that failed, for a
                # little while; then try whatever serves.
                waited = 0.0
                while not cluster.ready or (cluster.epoch == lost_epoch
                                            and waited < REPLAN_WAIT_SECONDS):
                    if time.monotonic() > deadline:
                        raise APIError(504, "the request ran past the server's time limit "
                                            f"while the cluster recovered ({cluster.status})",
                                       type="server_error", code="timeout")
                    try:
                        await cluster.wait_ready(min(settings.keepalive_seconds, 0.5))
                    except NoCapacity as e:
                        raise APIError(503, f"the model cannot be served now: {e}",
                                       type="server_error", code="no_capacity") from None
                    except asyncio.TimeoutError:
                        yield KeepAlive()
                    if cluster.ready and cluster.epoch == lost_epoch:
                        await asyncio.sleep(0.2)
                        waited += 0.2
                attempts += 1
                request = pb.GenerateRequest(
                    request_id=uuid.uuid4().hex, prompt_tokens=prompt + generated,
                    sampling=sampling, max_tokens=max_tokens - len(generated),
                    stop_token_ids=stop_ids, grammar=req.grammar, logprobs=req.logprobs,
                    top_logprobs=req.top_logprobs, resumed_tokens=len(generated))
                attempt = _Attempt(cluster, request, max(1.0, deadline - time.monotonic()))
            # Not asyncio.wait_for: on Python < 3.12 it swallows a cancellation that arrives
            # together with a token, and the cancelled request then runs to its end.
            if getter is None:
                getter = asyncio.ensure_future(attempt.queue.get())
            await asyncio.wait({getter}, timeout=settings.keepalive_seconds)
            if not getter.done():
                yield KeepAlive()
                continue
            item, getter = getter.result(), None
            if (lost := _lost(item)) is not None:
                attempt.close()
                if lost.broke and broke_epoch is not None and attempt.epoch > broke_epoch:
                    log.error("a request broke plan %d after plan %d; it is not run again: %s",
                              attempt.epoch, broke_epoch, lost.why)
                    raise APIError(500, "the node went down under this request on two plans, "
                                        "so it is not run again; last: " + lost.why,
                                   type="server_error", code="request_failed_node")
                if lost.broke and broke_epoch is None:
                    broke_epoch = attempt.epoch
                lost_epoch, attempt = attempt.epoch, None
                if attempts >= MAX_ATTEMPTS:
                    raise APIError(503, f"lost the node {attempts} times; last: {lost.why}",
                                   type="server_error")
                log.warning("request lost its node (%s); resuming after %d tokens", lost.why,
                            len(generated))
                continue
            if isinstance(item, grpc.aio.AioRpcError):
                raise _rpc_error(item)
            now = time.perf_counter()
            cached = max(cached, item.cached_tokens) if attempts == 1 else cached
            if item.tokens and first:
                metrics.waiting.dec()
                metrics.running.inc()
                metrics.ttft.observe(now - started)
                first = False
            elif item.tokens:
                metrics.itl.observe((now - last) / len(item.tokens))
            last = now
            text, tokens, logprobs = "", list(item.tokens), list(item.logprobs)
            for tok in item.tokens:
                text += detok.add(tok)
            generated += item.tokens
            metrics.generated_tokens.inc(len(item.tokens))
            if item.finish_reason:
                text += detok.flush()
            out, hit = stops.feed(text)
            if hit:
                if out or tokens:
                    yield Delta(out, tokens, logprobs)
                yield Done("stop", len(prompt), len(generated), cached, stops.matched)
                return
            if item.finish_reason == "error":
                raise APIError(500, f"generation failed on the node: {item.error}",
                               type="server_error")
            if item.finish_reason == "cancelled":
                raise APIError(503, "the node cancelled this request", type="server_error")
            out += stops.flush() if item.finish_reason else ""
            if out or tokens:
                yield Delta(out, tokens, logprobs)
            if item.finish_reason:
                yield Done(item.finish_reason, len(prompt), len(generated), cached)
                return
    finally:
        (metrics.waiting if first else metrics.running).dec()
        metrics.e2e.observe(time.perf_counter() - started)
        if attempt is not None:
            attempt.close()
        if getter is not None:
            getter.cancel()


def _rpc_error(e: grpc.aio.AioRpcError) -> APIError:
    code = e.code()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, e.details() or "invalid request")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return APIError(504, "the request ran past the server's time limit", type="server_error",
                        code="timeout")
    return APIError(503, f"the node is unavailable ({code.name}: {e.details()})",
                    type="server_error")
