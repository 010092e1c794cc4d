"""The OpenAI API: /v1/models, /v1/chat/completions and /v1/completions over the generation
core. Requests become token ids and a GenerationRequest; core events become OpenAI objects
and chunks."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omlx_coordinator.api.common import check_text, collect_unless_gone, sse
from omlx_coordinator.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
)
from omlx_coordinator.cluster import Cluster
from omlx_coordinator.errors import APIError
from omlx_coordinator.generation import (
    Delta,
    Done,
    GatewaySettings,
    GenerationRequest,
    KeepAlive,
    check_servable,
    generate,
    token_budget,
)
from omlx_coordinator.metrics import GatewayMetrics

log = logging.getLogger(__name__)


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


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
    max_tokens = token_budget(cluster, prompt, body.token_limit, settings,
                              "messages" if chat else "prompt", limit_param)
    shape = _Shape(chat, cluster.model_id)
    req = GenerationRequest(prompt=prompt, max_tokens=max_tokens, temperature=body.temperature,
                            top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                            seed=body.seed, stop=body.stop, ignore_eos=body.ignore_eos)
    events = generate(cluster, metrics, settings, req)

    if body.stream:
        async def stream() -> AsyncIterator[str]:
            outcome = "error"
            try:
                if chat:
                    yield sse(shape.chunk(None, role=True))
                elif echo:
                    yield sse(shape.chunk(echo))
                async for ev in events:
                    if isinstance(ev, KeepAlive):
                        yield ": keep-alive\n\n"
                    elif isinstance(ev, Delta):
                        if ev.text:
                            yield sse(shape.chunk(ev.text))
                    else:
                        yield sse(shape.chunk(None if chat else "", ev.finish_reason))
                        if body.include_usage:
                            yield sse(shape.usage_chunk(ev))
                        outcome = "ok"
            except APIError as e:
                # Headers are sent already: the error travels as an SSE event, as OpenAI does.
                yield sse(e.body())
            except Exception as e:
                log.exception("stream failed")
                yield sse(APIError(500, f"internal error: {e}", type="server_error").body())
            except asyncio.CancelledError:
                outcome = "disconnected"
                raise
            finally:
                metrics.requests.labels(endpoint, outcome).inc()
                await events.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect() -> JSONResponse:
        parts = [echo]
        async for ev in events:
            if isinstance(ev, Delta):
                parts.append(ev.text)
            elif isinstance(ev, Done):
                return JSONResponse(shape.full("".join(parts), ev))
        raise APIError(502, "the generation ended without a result", type="server_error")

    return await collect_unless_gone(request, collect, events, metrics, endpoint)


def add_routes(app: FastAPI, cluster: Cluster, metrics: GatewayMetrics,
               settings: GatewaySettings, keyed: list[Depends]) -> None:
    @app.get("/v1/models", dependencies=keyed)
    async def models() -> dict:
        return {"object": "list", "data": [{"id": cluster.model_id, "object": "model",
                                            "created": 0, "owned_by": "omlx-cluster"}]}

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check_servable(cluster, body.model)
        messages = [m.for_template() for m in body.messages]
        for i, m in enumerate(messages):
            if isinstance(m.get("content"), str):
                check_text(m["content"], f"messages.{i}.content")
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
        check_servable(cluster, body.model)
        if isinstance(body.prompt, str):
            check_text(body.prompt, "prompt")
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
