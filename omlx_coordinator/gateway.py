"""OpenAI-compatible HTTP gateway (FastAPI): /v1/models, /v1/chat/completions, /v1/completions,
/health and /metrics.

The gateway tokenizes, forwards token ids to the head node over gRPC and turns the streamed token
ids back into text. Every wait is bounded: a gRPC deadline per request, keep-alive comments while
a stream waits for its first token, and a client that disconnects cancels its sequence.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from omlx_coordinator.cluster import Cluster, NoCapacity
from omlx_coordinator.metrics import GatewayMetrics
from omlx_coordinator.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
)
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


@dataclass
class KeepAlive:
    pass


@dataclass
class Done:
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens the prefix cache served


# ---- generation core ---------------------------------------------------------------------------


def _check_model(cluster: Cluster, body: _Common) -> None:
    if body.model != cluster.model_id:
        raise APIError(404, f"model {body.model!r} is not served here; available: "
                            f"{cluster.model_id!r} (GET /v1/models)", param="model",
                       code="model_not_found")
    if cluster.capacity_error and not cluster.ready:
        raise APIError(503, f"the model cannot be served now: {cluster.capacity_error}",
                       type="server_error", code="no_capacity")
    if cluster.epoch == 0:  # still starting; once serving, a recovery only pauses requests
        raise APIError(503, f"the model is not ready yet ({cluster.status}); retry shortly",
                       type="server_error", code="model_not_ready")


def _token_budget(cluster: Cluster, prompt: list[int], limit: int | None,
                  settings: GatewaySettings, prompt_param: str = "messages",
                  limit_param: str = "max_tokens") -> int:
    ctx = cluster.max_context
    if ctx and len(prompt) >= ctx:
        raise APIError(400, f"the prompt has {len(prompt)} tokens but the model's context is "
                            f"{ctx} tokens; shorten the prompt", param=prompt_param,
                       code="context_length_exceeded")
    room = ctx - len(prompt) if ctx else settings.default_max_tokens
    if limit is None:
        return min(room, settings.default_max_tokens)
    if limit > room:
        raise APIError(400, f"{limit_param} is {limit} but only {room} tokens fit in the model's "
                            f"context of {ctx} after the {len(prompt)}-token prompt",
                       param=limit_param, code="context_length_exceeded")
    return limit


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


def _lost(item) -> str | None:
    """Why `item` means the node was lost (so the request can run again), else None."""
    if item is None:
        return "the stream ended without finishing"
    if isinstance(item, grpc.aio.AioRpcError):
        return f"{item.code().name}: {item.details()}" if item.code() in RETRIABLE else None
    if isinstance(item, Exception):
        return str(item)
    if item.finish_reason == "aborted":
        return item.error or "the worker shut down"
    return None


async def generate(cluster: Cluster, metrics: GatewayMetrics, settings: GatewaySettings,
                   prompt: list[int], body: _Common, max_tokens: int) -> AsyncIterator:
    """Yields Delta, KeepAlive (while waiting) and finally Done; raises APIError on failure.

    If the pipeline loses a node mid-request, the request waits for the cluster's new plan and
    goes on there: the prompt plus the tokens already streamed are prefilled again and
    generation continues, so the client sees a pause, not an error (and greedy output is the
    same as without the failure)."""
    sampling = pb.SamplingParams(temperature=body.temperature, top_p=body.top_p,
                                 top_k=body.top_k, min_p=body.min_p)
    if body.seed is not None:
        sampling.has_seed, sampling.seed = True, body.seed
    stop_ids = [] if body.ignore_eos else sorted(cluster.tokenizer.eos_token_ids)
    detok = cluster.tokenizer.detokenizer(prompt)
    stops = StopMatcher(body.stop)
    started = last = time.perf_counter()
    deadline = time.monotonic() + settings.request_timeout
    generated: list[int] = []
    first, cached, attempts = True, 0, 0
    attempt: _Attempt | None = None
    lost_epoch = -1  # the plan a failed attempt ran on
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
                    stop_token_ids=stop_ids)
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
            if (why := _lost(item)) is not None:
                attempt.close()
                lost_epoch, attempt = attempt.epoch, None
                if attempts >= MAX_ATTEMPTS:
                    raise APIError(503, f"lost the node {attempts} times; last: {why}",
                                   type="server_error")
                log.warning("request lost its node (%s); resuming after %d tokens", why,
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
            text = ""
            for tok in item.tokens:
                text += detok.add(tok)
            generated += item.tokens
            metrics.generated_tokens.inc(len(item.tokens))
            if item.finish_reason:
                text += detok.flush()
            out, hit = stops.feed(text)
            if hit:
                if out:
                    yield Delta(out)
                yield Done("stop", len(prompt), len(generated), cached)
                return
            if item.finish_reason == "error":
                raise APIError(500, f"generation failed on the node: {item.error}",
                               type="server_error")
            if item.finish_reason == "cancelled":
                raise APIError(503, "the node cancelled this request", type="server_error")
            out += stops.flush() if item.finish_reason else ""
            if out:
                yield Delta(out)
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


# ---- OpenAI response shapes ----------------------------------------------------------------------


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _Shape:
    """Builds chat or text completion objects and chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, text: str, done: Done) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": done.finish_reason, "logprobs": None}
            return {**self._base("chat.completion"), "choices": [choice], "usage": _usage(done)}
        choice = {"index": 0, "text": text, "finish_reason": done.finish_reason, "logprobs": None}
        return {**self._base("text_completion"), "choices": [choice], "usage": _usage(done)}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else (
                {"content": text} if text is not None else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, done: Done) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": _usage(done)}


async def _respond(request: Request, cluster: Cluster, metrics: GatewayMetrics,
                   settings: GatewaySettings, prompt: list[int], body: _Common, chat: bool,
                   endpoint: str, echo: str = "") -> Response:
    limit_param = ("max_completion_tokens" if getattr(body, "max_completion_tokens", None)
                   else "max_tokens")
    max_tokens = _token_budget(cluster, prompt, body.token_limit, settings,
                               "messages" if chat else "prompt", limit_param)
    shape = _Shape(chat, cluster.model_id)
    events = generate(cluster, metrics, settings, prompt, body, max_tokens)

    if body.stream:
        async def sse() -> AsyncIterator[str]:
            outcome = "error"
            try:
                if chat:
                    yield _sse(shape.chunk(None, role=True))
                elif echo:
                    yield _sse(shape.chunk(echo))
                async for ev in events:
                    if isinstance(ev, KeepAlive):
                        yield ": keep-alive\n\n"
                    elif isinstance(ev, Delta):
                        yield _sse(shape.chunk(ev.text))
                    else:
                        yield _sse(shape.chunk(None if chat else "", ev.finish_reason))
                        if body.include_usage:
                            yield _sse(shape.usage_chunk(ev))
                        outcome = "ok"
            except APIError as e:
                # Headers are sent already: the error travels as an SSE event, as OpenAI does.
                yield _sse(e.body())
            except Exception as e:
                log.exception("stream failed")
                yield _sse(APIError(500, f"internal error: {e}", type="server_error").body())
            except asyncio.CancelledError:
                outcome = "disconnected"
                raise
            finally:
                metrics.requests.labels(endpoint, outcome).inc()
                await events.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect() -> tuple[str, Done]:
        parts = [echo]
        async for ev in events:
            if isinstance(ev, Delta):
                parts.append(ev.text)
            elif isinstance(ev, Done):
                return "".join(parts), ev
        raise APIError(502, "the generation ended without a result", type="server_error")

    task = asyncio.create_task(collect())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                metrics.requests.labels(endpoint, "disconnected").inc()
                return Response(status_code=499)
        text, done = task.result()
    except APIError:
        metrics.requests.labels(endpoint, "error").inc()
        raise
    finally:
        if not task.done():
            task.cancel()
            # Let it unwind (that cancels the node's sequence): closing the generator while the
            # task still runs it raises RuntimeError.
            await asyncio.wait({task}, timeout=5.0)
        if task.done():
            await events.aclose()
    metrics.requests.labels(endpoint, "ok").inc()
    return JSONResponse(shape.full(text, done))


# ---- app -----------------------------------------------------------------------------------------


def _split_loc(loc: tuple) -> tuple[str | None, str | None, str]:
    """(field path, pydantic union member tag such as 'list[int]', path inside that member)."""
    field: list[str] = []
    tag, rest = None, []
    for i, p in enumerate(loc):
        if i == 0 and p == "body":
            continue
        if tag is None and isinstance(p, str) and ("[" in p or p in ("str", "int", "float",
                                                                     "bool", "none")):
            tag = p
            continue
        (rest if tag else field).append(str(p))
    return ".".join(field) or None, tag, ".".join(rest)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {e.get('ctx', {}).get('error', '')}", None
    msg = e.get("msg", "invalid value")
    field, tag, _ = _split_loc(tuple(e.get("loc", ())))
    if field is None:
        if e.get("type") == "missing":
            return "the request body is empty: send a JSON object", None
        return f"the request body must be a JSON object ({msg})", None
    if tag is None:
        return f"'{field}': {msg}", field
    # A union (e.g. prompt: string or token ids): say what each accepted form objected to.
    parts, seen = [], set()
    for x in errors:
        f, t, rest = _split_loc(tuple(x.get("loc", ())))
        if f == field and t and t not in seen:  # the first complaint of each form
            seen.add(t)
            parts.append(f"as {t}" + (f" (item {rest})" if rest else "") + f": {x.get('msg')}")
    return f"'{field}' has none of its accepted forms: " + "; ".join(parts), field


def _check_text(text: str, param: str) -> None:
    """JSON may carry lone UTF-16 surrogates that no tokenizer accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"'{param}' is not valid Unicode: it holds a lone surrogate "
                            f"{text[e.start]!r} at character {e.start}", param=param) from None


def create_app(cluster: Cluster, settings: GatewaySettings | None = None,
               start_cluster: bool = True,
               on_start_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The gateway app; its lifespan starts `cluster` and calls `on_start_failure(reason)` if
    the model cannot be served at all."""
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics(cluster.weight_counters)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        task = None

        def started(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None and on_start_failure:
                on_start_failure(cluster.status)

        if start_cluster:
            task = asyncio.create_task(cluster.start())
            task.add_done_callback(started)
        try:
            yield
        finally:
            if task is not None and not task.done():
                task.cancel()
            await cluster.stop()

    app = FastAPI(title="omlx-cluster", version="0.1.0", lifespan=lifespan)
    app.state.cluster, app.state.metrics, app.state.settings = cluster, metrics, settings
    app.state.register_tasks = set()

    # A dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware hides client
    # disconnects from the endpoint, and a client that goes away must cancel its generation.
    # /health and /metrics stay open (load balancers, Prometheus); /cluster/register too: it
    # only makes the coordinator challenge that address with the cluster secret.
    async def require_api_key(request: Request) -> None:
        if not settings.api_keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or key.strip() not in settings.api_keys:
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' "
                                "with a key this server was started with",
                           code="invalid_api_key")

    keyed = [Depends(require_api_key)]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(APIError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no such endpoint: {request.method} {request.url.path} (the API is "
                        "under /v1: /v1/models, /v1/chat/completions, /v1/completions)",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return JSONResponse(APIError(exc.status_code, message).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok" if cluster.ready else cluster.status, "model": cluster.model_id,
                "nodes": cluster.nodes}
        return JSONResponse(body, status_code=200 if cluster.ready else 503)

    @app.post("/cluster/register")
    async def register(request: Request) -> JSONResponse:
        """A node that cannot use Bonjour (`join --coordinator`) announces its address."""
        try:
            address = str((await request.json())["address"])
            host, _, port = address.rpartition(":")
            if not host or not 0 < int(port) < 65536:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise APIError(400, "send {\"address\": \"HOST:PORT\"} of the node agent",
                           param="address")
        if any(n["address"] == address and n["alive"] for n in cluster.nodes):
            return JSONResponse({"status": "member"})
        task = asyncio.create_task(cluster.add_remote(address))
        app.state.register_tasks.add(task)
        task.add_done_callback(app.state.register_tasks.discard)
        return JSONResponse({"status": "admitting"}, status_code=202)

    @app.get("/cluster/status", dependencies=keyed)
    async def status() -> dict:
        plan = cluster.plan
        return {"model": cluster.model_id, "ready": cluster.ready, "status": cluster.status,
                "epoch": cluster.epoch, "capacity_error": cluster.capacity_error or None,
                "plan": plan.to_dict() if plan else None,
                "backend": ({"name": cluster.backend.backend, "reason": cluster.backend.reason}
                            if cluster.backend else None),
                "last_recovery": cluster.last_recovery, "nodes": cluster.nodes}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": cluster.model_id, "object": "model",
                                            "created": 0, "owned_by": "omlx-cluster"}]}

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(cluster, body)
        messages = [m.for_template() for m in body.messages]
        for i, m in enumerate(messages):
            if isinstance(m.get("content"), str):
                _check_text(m["content"], f"messages.{i}.content")
        try:
            prompt = await asyncio.to_thread(cluster.tokenizer.encode_chat, messages, body.tools)
        except APIError:
            raise
        except Exception as e:  # a template that rejects these messages (roles, order...)
            raise APIError(400, f"the chat template rejected the messages: {e}",
                           param="messages") from e
        return await _respond(request, cluster, metrics, settings, prompt, body, True, "chat")

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(cluster, body)
        if isinstance(body.prompt, str):
            _check_text(body.prompt, "prompt")
            prompt = await asyncio.to_thread(cluster.tokenizer.encode, body.prompt)
        else:
            prompt = list(body.prompt)
            bad = [t for t in prompt if not 0 <= t < cluster.vocab_size]
            if bad:
                raise APIError(400, f"prompt token ids {bad[:5]} are outside the model's "
                                    f"vocabulary [0, {cluster.vocab_size})", param="prompt")
        if not prompt:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        echo = ""
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else cluster.tokenizer.decode(prompt)
        return await _respond(request, cluster, metrics, settings, prompt, body, False,
                              "completions", echo=echo)

    return app
