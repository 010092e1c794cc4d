"""The Ollama API's generation routes (POST /api/chat, /api/generate), as Ollama's clients use
them, over the same generation core as the OpenAI and Anthropic routes. Its model routes are
api/ollama_models.py; the request fields, and what each means here, api/ollama_schema.py.

A chat's messages go to the model's chat template as OpenAI chat's do (tool calls with their
arguments as objects, `tool_name` as the tool message's name, `thinking` as reasoning_content); a
generate's prompt is one user turn (after its `system`), or with `raw` the text as it is, and
`context` (the token ids a previous generate returned) goes before it. Tools, `format` ("json":
any JSON object; a schema) go through chat's setup (tool_setup.py: the same parsers and
llguidance grammars); there is no tool_choice in this API, so the model calls tools or not.

Replies stream as NDJSON (one JSON object a line) unless `stream` is false; the last has
`done: true`, `done_reason` ("stop" or "length"), and the timings in nanoseconds:
`total_duration` (the request's), `load_duration` (the model's load, when the request waited for
it), `prompt_eval_duration` (to the first token), `eval_duration` (from it); `prompt_eval_count`
is the whole prompt, cached or not (clients add it to `eval_count` to tell how full the context
is). Tool calls come whole, in one chunk each, as Ollama's do. A stream that has nothing to say
for the keep-alive interval sends a chunk with no text (NDJSON has no comments, and Ollama's SDK
parses every line). An error after the first line is an `{"error": ...}` line, as Ollama's.

keep_alive sets how long the model stays loaded once idle, as --ttl does (Ollama's clients send
it with every request): seconds, or a duration such as "5m"; negative keeps it loaded; 0 unloads
it once its requests are done. A request without one puts back the model's configured --ttl, as
Ollama's put back OLLAMA_KEEP_ALIVE. A pinned model stays loaded whatever a request says.
A request with no prompt (no messages) only loads the model, or with keep_alive 0 unloads it:
`done_reason` "load" or "unload", as Ollama answers.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import orjson
from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from omlx_coordinator.api.common import (
    ClosingStream,
    Primed,
    Silence,
    collect_unless_gone,
    encode_chat,
)
from omlx_coordinator.api.ollama_models import find, rfc3339
from omlx_coordinator.api.ollama_schema import (
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    ChatRequest,
    GenerateRequest,
    _Generation,
    keep_alive_seconds,
    validated,
)
from omlx_coordinator.api.tool_setup import ToolSetup, setup_tools
from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import Account, account_of, admit
from omlx_coordinator.models.lifecycle import ModelBusy, ModelManager
from omlx_coordinator.models.served_model import LOADED, ServedModel
from omlx_coordinator.nodes.cluster import NoCapacity
from omlx_coordinator.request.events import Delta, Done, KeepAlive
from omlx_coordinator.request.generation import (
    GatewaySettings,
    GenerationRequest,
    check_servable,
    generate,
    token_budget,
)
from omlx_coordinator.request.internal_error import internal_error
from omlx_coordinator.telemetry.metrics import GatewayMetrics
from omlx_coordinator.text.tokenizer import ChatTokenizer
from omlx_coordinator.text.tool_calls import CallEnd, Item, ToolCallStream, call_input
from omlx_shared.token_ids import outside_vocabulary
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)

PREFIX = "/api/"
ENDPOINTS = {"/api/chat": "ollama_chat", "/api/generate": "ollama_generate"}  # metrics labels
NDJSON = "application/x-ndjson"
# The idle limit of a model a request asked to unload (keep_alive 0): gone at the next check
# once its requests are done (lifecycle.py's TTL watch; 0 there means never).
UNLOAD_WHEN_IDLE = 1e-9
_NO_LIMIT = 1 << 31  # num_predict -1 / -2: as many tokens as the context holds


def owns(path: str) -> bool:
    """Whether errors on `path` take Ollama's shape."""
    return path.startswith(PREFIX)


def error_body(message: str) -> dict:
    return {"error": message}


def _now() -> str:
    return rfc3339(datetime.now(timezone.utc))


# ---- request -> prompt and sampling --------------------------------------------------------


def chat_messages(body: ChatRequest) -> list[dict]:
    """The messages as chat templates take them (OpenAI chat's shape, arguments as objects).
    Ollama's clients name the tool that answered, not the call: a tool message without a
    tool_call_id answers the earliest unanswered call of that tool (templates such as
    Mistral's render the ids)."""
    if body.messages and body.messages[-1].role == "assistant":
        raise APIError(400, "the last message is the assistant's: continuing a prefilled "
                            "assistant turn is not supported here", param="messages")
    out = []
    unanswered: list[tuple[str, str]] = []  # (call id, tool name) of the last assistant turn
    for i, m in enumerate(body.messages):
        msg: dict = {"role": m.role, "content": m.content}
        if m.thinking is not None:
            msg["reasoning_content"] = m.thinking
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id or f"call_{i}_{j}", "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": c.function.arguments}}
                                 for j, c in enumerate(m.tool_calls)]
            unanswered = [(c["id"], c["function"]["name"]) for c in msg["tool_calls"]]
        if m.tool_name is not None:
            msg["name"] = m.tool_name
        if m.role == "tool":
            answered = m.tool_call_id or next(
                (cid for cid, name in unanswered if m.tool_name in (None, name)), None)
            unanswered = [u for u in unanswered if u[0] != answered]
            if answered is not None:
                msg["tool_call_id"] = answered
        out.append(msg)
    return out


def _reply_schema(body: _Generation) -> tuple[dict | None, str | None]:
    """The JSON Schema `format` asks for (None: free text) and what to call it in errors."""
    if not body.format:
        return None, None
    if body.format == "json":
        return {"type": "object"}, None
    return body.format, "the format schema"


def _setup(tok: ChatTokenizer, body: _Generation, tools: list[dict] | None) -> ToolSetup:
    schema, what = _reply_schema(body)
    return setup_tools(tok, tools, "auto" if tools else "none", None, True, schema, "format",
                       what)


def chat_prompt(tok: ChatTokenizer, body: ChatRequest) -> tuple[list[int], ToolSetup]:
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    setup = _setup(tok, body, tools)
    return encode_chat(tok, chat_messages(body), setup.template_tools), setup


def generate_prompt(tok: ChatTokenizer, body: GenerateRequest, vocab_size: int
                    ) -> tuple[list[int], ToolSetup]:
    if body.context and (bad := outside_vocabulary(body.context, vocab_size)):
        raise APIError(400, f"'context': token ids {bad[:5]} are outside the model's vocabulary "
                            f"[0, {vocab_size}): send the context a generate of this model "
                            "returned", param="context")
    setup = _setup(tok, body, None)
    if body.raw or not tok.has_chat_template:
        if body.system:
            raise APIError(400, "'system' needs the model's chat template, which "
                                + ("raw: true skips" if body.raw else "this model lacks")
                                + ": put the system text in the prompt", param="system")
        prompt = tok.encode(body.prompt)
    else:
        messages = ([{"role": "system", "content": body.system}] if body.system else []) + \
            [{"role": "user", "content": body.prompt}]
        prompt = encode_chat(tok, messages, None, "prompt")
    return list(body.context or []) + prompt, setup


def _sampling(body: _Generation, prompt: list[int], max_tokens: int, setup: ToolSetup,
              account: Account | None) -> GenerationRequest:
    o = body.opts
    # The first call's end marker is not a stop here: Ollama's replies may hold several calls.
    return GenerationRequest(
        prompt=prompt, max_tokens=max_tokens,
        temperature=DEFAULT_TEMPERATURE if o.temperature is None else o.temperature,
        top_p=DEFAULT_TOP_P if o.top_p is None else o.top_p,
        top_k=DEFAULT_TOP_K if o.top_k is None else o.top_k,
        min_p=o.min_p or 0.0, seed=o.seed if o.seed is not None and o.seed >= 0 else None,
        stop=list(o.stop or []), repetition_penalty=o.repeat_penalty or 1.0,
        presence_penalty=o.presence_penalty or 0.0,
        frequency_penalty=o.frequency_penalty or 0.0, grammar=setup.grammar,
        logprobs=body.logprobs, top_logprobs=body.top_logprobs or 0, account=account)


def _keep_alive(request: Request, body: _Generation) -> float | str | None:
    """The request's keep_alive where its key may load and unload (an admin's, or any on a
    gateway without keys); a user key's is ignored, as clients send one with every request."""
    account = account_of(request.scope)
    return body.keep_alive if account is None or account.admin else None


def _limit(body: _Generation) -> int | None:
    n = body.opts.num_predict
    return None if n is None else _NO_LIMIT if n < 0 else n


def apply_keep_alive(model: ServedModel, keep_alive: float | str | None) -> bool:
    """Sets the model's idle limit from a request's keep_alive (the module docstring); whether
    it asks for the model to be unloaded."""
    seconds = model.config.ttl_seconds if keep_alive is None else keep_alive_seconds(keep_alive)
    model.ttl_seconds = 0.0 if math.isinf(seconds) else seconds or UNLOAD_WHEN_IDLE
    return keep_alive is not None and seconds == 0


# ---- model output -> Ollama's chunks ---------------------------------------------------------


class _Reply:
    """One reply's chunks (streamed) and the whole (not), with Ollama's timings."""

    def __init__(self, model: ServedModel, chat: bool, setup: ToolSetup, prompt: list[int],
                 top_logprobs: int, started: int, with_context: bool):
        self.model, self.chat, self.tok = model, chat, model.tokenizer
        self.calls = (ToolCallStream(setup.fmt, setup.tools) if setup.fmt and setup.tools
                      else None)
        self.top_logprobs = top_logprobs
        self.started, self.first = started, 0  # perf_counter_ns at the request, first token
        self.loaded = model.state == LOADED  # else the request waits for its load
        self.context = list(prompt) if with_context else None
        self.text: list[str] = []
        self.tool_calls: list[dict] = []
        self.logprobs: list[dict] = []

    def _chunk(self, text: str, calls: list[dict], logprobs: list[dict] | None) -> dict:
        out: dict = {"model": self.model.name, "created_at": _now()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if calls:
                out["message"]["tool_calls"] = calls
        else:
            out["response"] = text
        if logprobs is not None:
            out["logprobs"] = logprobs
        out["done"] = False
        return out

    def empty(self) -> dict:
        """A chunk with nothing in it: the stream's keep-alive."""
        return self._chunk("", [], None)

    def feed(self, ev: Delta) -> dict | None:
        """More output's chunk (None when it shows nothing yet)."""
        if ev.tokens and not self.first:
            self.first = time.perf_counter_ns()
        if self.context is not None:
            self.context += ev.tokens
        text, calls = self._take(self.calls.feed(ev.text) if self.calls else [ev.text])
        logprobs = self._logprobs(ev)
        if not text and not calls and not logprobs:
            return None
        return self._chunk(text, calls, logprobs or None)

    def _take(self, items: list[Item]) -> tuple[str, list[dict]]:
        texts, calls = [], []
        for item in items:
            if isinstance(item, str):
                texts.append(item)
            elif isinstance(item, CallEnd):  # whole calls: CallStart and arguments come with it
                c = item.call
                calls.append({"id": c.id, "function": {"index": len(self.tool_calls),
                                                       "name": c.name,
                                                       "arguments": call_input(c.arguments)}})
                self.tool_calls.append(calls[-1])
        self.text += texts
        return "".join(texts), calls

    def _logprobs(self, ev: Delta) -> list[dict]:
        out = [{**self._token(t, lp.logprob),
                "top_logprobs": [self._token(i, x) for i, x in
                                 zip(lp.top_ids[:self.top_logprobs], lp.top_logprobs)]}
               for t, lp in zip(ev.tokens, ev.logprobs)]
        self.logprobs += out
        return out

    def _token(self, token_id: int, logprob: float) -> dict:
        raw = self.tok.token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}

    def finish(self, done: Done) -> tuple[list[dict], dict]:
        """The stream's last chunks (held text or calls, then the final one) and the whole."""
        held = self.feed_items(self.calls.flush()) if self.calls else None
        end = time.perf_counter_ns()
        first = self.first or end
        load = 0 if self.loaded else int(self.model.load_seconds * 1e9)
        final = {**self._chunk("", [], None), "done": True,
                 "done_reason": "length" if done.finish_reason == "length" else "stop",
                 "total_duration": end - self.started, "load_duration": load,
                 "prompt_eval_count": done.prompt_tokens,
                 "prompt_eval_duration": max(0, first - self.started - load),
                 "eval_count": done.completion_tokens, "eval_duration": end - first}
        if self.context is not None:
            final["context"] = self.context
        text = "".join(self.text)
        whole = dict(final)
        if self.chat:
            # What a model writes around its calls ("\n" between two) is no message.
            content = "" if self.tool_calls and not text.strip() else text
            whole["message"] = {"role": "assistant", "content": content}
            if self.tool_calls:
                whole["message"]["tool_calls"] = self.tool_calls
        else:
            whole["response"] = text
        if self.logprobs:
            whole["logprobs"] = self.logprobs
        return ([held] if held else []) + [final], whole

    def feed_items(self, items: list[Item]) -> dict | None:
        text, calls = self._take(items)
        return self._chunk(text, calls, None) if text or calls else None


def _line(obj: dict) -> str:
    return orjson.dumps(obj).decode() + "\n"


async def _stream(reply: _Reply, events: AsyncIterator, metrics: GatewayMetrics, endpoint: str,
                  keepalive_seconds: float) -> AsyncIterator[str]:
    outcome = "error"
    silence = Silence(keepalive_seconds)
    try:
        async for ev in events:
            if isinstance(ev, Delta):
                chunks = [c] if (c := reply.feed(ev)) else []
            elif isinstance(ev, Done):
                chunks = reply.finish(ev)[0]
                outcome = "ok"
            else:
                chunks = []
            if chunks:
                yield "".join(_line(c) for c in chunks)
                silence.wrote()
            elif isinstance(ev, KeepAlive) or silence.overdue():
                yield _line(reply.empty())
                silence.wrote()
    except APIError as e:
        # Headers are sent already: the error travels as a line of its own, as Ollama's does.
        yield _line(error_body(e.message))
    except Exception as e:
        yield _line(error_body(internal_error(log, "internal error", e).message))
    except asyncio.CancelledError:
        outcome = "disconnected"
        raise
    finally:
        metrics.requests.labels(endpoint, outcome).inc()
        await events.aclose()


# ---- routes --------------------------------------------------------------------------------


def add_routes(app: FastAPI, manager: ModelManager, metrics_of: dict[str, GatewayMetrics],
               settings: GatewaySettings, keyed: list[Depends]) -> None:
    """`metrics_of`: each model's, by name."""

    async def load_or_unload(served: ServedModel, chat: bool, unload: bool) -> JSONResponse:
        """A request with nothing to generate: Ollama's way to load or unload a model."""
        if unload:
            if not served.pinned:
                try:
                    await manager.unload_asked(served, 0.0, reason="keep_alive 0")
                except ModelBusy:  # unloaded when its requests end (UNLOAD_WHEN_IDLE)
                    pass
        else:
            try:
                await manager.load_task(served, pb.LOAD_PRELOAD)  # Ollama's preload
            except NoCapacity as e:
                raise APIError(503, f"the model {served.name} cannot be loaded: {e}",
                               type="server_error", code="no_capacity") from None
        out: dict = {"model": served.name, "created_at": _now()}
        if chat:
            out["message"] = {"role": "assistant", "content": ""}
        else:
            out["response"] = ""
        out.update(done=True, done_reason="unload" if unload else "load")
        return JSONResponse(out)

    async def respond(request: Request, served: ServedModel, body: _Generation, chat: bool,
                      prompt: list[int], setup: ToolSetup, started: int) -> Response:
        endpoint = ENDPOINTS["/api/chat" if chat else "/api/generate"]
        metrics = metrics_of[served.name]
        max_tokens = token_budget(served, prompt, _limit(body), settings,
                                  "messages" if chat else "prompt")
        reply = _Reply(served, chat, setup, prompt, body.top_logprobs or 0, started,
                       with_context=not chat)
        events = generate(manager, served, metrics, settings,
                          _sampling(body, prompt, max_tokens, setup,
                                    account_of(request.scope)))
        if body.stream:
            events = Primed(events)
            return ClosingStream(_stream(reply, events, metrics, endpoint,
                                         settings.keepalive_seconds),
                                 events, settings.request_timeout, media_type=NDJSON)

        async def collect() -> JSONResponse:
            async for ev in events:
                if isinstance(ev, Delta):
                    reply.feed(ev)
                elif isinstance(ev, Done):
                    return JSONResponse(reply.finish(ev)[1])
            raise APIError(502, "the generation ended without a result", type="server_error")

        return await collect_unless_gone(request, collect, events, metrics, endpoint)

    @app.post("/api/chat", dependencies=keyed)
    async def chat(request: Request) -> Response:
        started = time.perf_counter_ns()
        body = validated(ChatRequest, await request.json())
        served = await check_servable(manager, find(manager, body.model).name,
                                      account_of(request.scope))
        if not body.messages:
            return await load_or_unload(served, True,
                                        apply_keep_alive(served, _keep_alive(request, body)))
        admit(request.scope, served)
        prompt, setup = await asyncio.to_thread(chat_prompt, served.tokenizer, body)
        apply_keep_alive(served, _keep_alive(request, body))  # not by a request refused above
        return await respond(request, served, body, True, prompt, setup, started)

    @app.post("/api/generate", dependencies=keyed)
    async def generate_route(request: Request) -> Response:
        started = time.perf_counter_ns()
        body = validated(GenerateRequest, await request.json())
        served = await check_servable(manager, find(manager, body.model).name,
                                      account_of(request.scope))
        if not body.prompt and not body.context:
            return await load_or_unload(served, False,
                                        apply_keep_alive(served, _keep_alive(request, body)))
        admit(request.scope, served)
        prompt, setup = await asyncio.to_thread(generate_prompt, served.tokenizer, body,
                                                served.vocab_size)
        apply_keep_alive(served, _keep_alive(request, body))
        return await respond(request, served, body, False, prompt, setup, started)
