"""The OpenAI API: /v1/models, /v1/chat/completions and /v1/completions over the generation
core. Requests become token ids and GenerationRequests (one per choice); core events become
OpenAI objects and chunks: text, tool calls (tool_calls.py), logprobs.

Tools: the chat template gets the request's tools, except with tool_choice "none", where it
gets none (so the model is not prompted to call them; such a turn's prompt differs from the
turns with tools, and the prefix cache serves less of it) and the output is not parsed.
tool_choice "required" forces one or more calls (one with parallel_tool_calls false), a named
function exactly one call of it, through a grammar (constraints.py); "auto" parses whatever
calls the model writes. parallel_tool_calls false ends the generation after the first call.
A streamed reply sends a call's arguments as the model writes them, where its family allows
(tool_calls.py); a whole reply parses each call whole.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from omlx_coordinator.api.common import (
    ClosingStream,
    Primed,
    Silence,
    collect_unless_gone,
    encode_chat,
    sse,
)
from omlx_coordinator.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    _Common,
)
from omlx_coordinator.api.tool_setup import setup_tools
from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import account_of, admit, usable
from omlx_coordinator.models.lifecycle import ModelManager
from omlx_coordinator.models.served_model import ServedModel
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
from omlx_coordinator.text.tool_calls import (
    CallArguments,
    CallStart,
    Item,
    ToolCall,
    ToolCallFormat,
    ToolCallStream,
)
from omlx_shared.token_ids import outside_vocabulary
from proto import omlx_pb2 as pb

log = logging.getLogger(__name__)


def _usage(dones: list[Done]) -> dict:
    """The prompt counts once (choice 0's, whose prefill the others share), completions add."""
    prompt, completion = dones[0].prompt_tokens, sum(d.completion_tokens for d in dones)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion,
             "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": dones[0].cached_tokens}}
    if dones[0].accepted_prediction_tokens is not None:  # a prediction was sent
        usage["completion_tokens_details"] = {
            "accepted_prediction_tokens": sum(d.accepted_prediction_tokens for d in dones),
            "rejected_prediction_tokens": sum(d.rejected_prediction_tokens for d in dones)}
    return usage


@dataclass
class _Output:
    """How a request's output is read back: tool calls, logprobs."""

    tool_format: ToolCallFormat | None = None  # parse tool calls in this markup
    tools: list[dict] | None = None
    # parallel_tool_calls false: the call's end marker is a stop string (the parser takes the
    # call without it), and whatever follows a first call is dropped (Mistral has no end)
    single_call: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    stream_calls: bool = False  # a streamed reply: calls' arguments go out as they come


class _Choice:
    """One choice's output, from core events to OpenAI's pieces: it keeps the whole (for a
    non-streamed reply) and returns each event's stream deltas."""

    def __init__(self, index: int, chat: bool, tok: ChatTokenizer, out: _Output):
        self.index, self.chat, self.tok, self.out = index, chat, tok, out
        self.tools = (ToolCallStream(out.tool_format, out.tools, out.stream_calls)
                      if out.tool_format else None)
        self.texts: list[str] = []
        # With tools, whitespace waits for more text: what a model writes around its calls
        # ("\n" between two) is no message, streamed or not.
        self.blank = ""
        self.calls: list[ToolCall] = []  # the calls ended; an open one's index is their count
        self.chat_logprobs: list[dict] = []
        self.text_logprobs: dict[str, list] = {"tokens": [], "token_logprobs": [],
                                               "top_logprobs": [], "text_offset": []}
        self.offset = 0  # completions' text_offset: characters so far
        # Counts them from the tokens' bytes: a multi-byte character split over tokens is one.
        self._chars = codecs.getincrementaldecoder("utf-8")("replace")
        self.done: Done | None = None

    def delta(self, ev: Delta) -> list[dict]:
        pieces = self.tools.feed(ev.text) if self.tools else ([ev.text] if ev.text else [])
        return self._pieces(pieces, self._logprobs(ev))

    def finish(self, done: Done) -> list[dict]:
        deltas = self._pieces(self.tools.flush() if self.tools else [], None)
        if self.blank and not self.calls:
            blank, self.blank = self.blank, ""
            deltas += self._pieces([blank], None, final=True)
        reason = done.finish_reason
        self.done = replace(done, finish_reason="tool_calls" if self.calls and reason == "stop"
                            else reason)
        return deltas

    def _pieces(self, pieces: list[Item], logprobs: dict | None,
                final: bool = False) -> list[dict]:
        deltas: list[dict] = []
        for piece in pieces:
            if self.out.single_call and self.calls:
                break  # parallel_tool_calls false: nothing after the first call
            if isinstance(piece, str):
                if self.tools and not final and not piece.strip():
                    self.blank += piece
                    continue
                piece, self.blank = self.blank + piece, ""
                self.texts.append(piece)
                deltas.append({"content": piece} if self.chat else {"text": piece})
            elif isinstance(piece, CallStart):
                deltas.append({"tool_calls": [{"index": len(self.calls), "id": piece.id,
                                               "type": "function",
                                               "function": {"name": piece.name,
                                                            "arguments": ""}}]})
            elif isinstance(piece, CallArguments):
                deltas.append({"tool_calls": [{"index": len(self.calls),
                                               "function": {"arguments": piece.text}}]})
            else:
                self.calls.append(piece.call)
        if logprobs is not None:
            if not deltas:  # tokens whose text is held back still bring their logprobs
                deltas.append({} if self.chat else {"text": ""})
            deltas[0]["logprobs"] = logprobs
        return deltas

    def _logprobs(self, ev: Delta) -> dict | None:
        if not self.out.logprobs or not ev.tokens:
            return None
        if self.chat:
            content = [self._chat_entry(t, lp) for t, lp in zip(ev.tokens, ev.logprobs)]
            self.chat_logprobs += content
            return {"content": content, "refusal": None}
        part: dict[str, list] = {k: [] for k in self.text_logprobs}
        for t, lp in zip(ev.tokens, ev.logprobs):
            token = self._spelling(t)
            top = {self._spelling(i): l
                   for i, l in zip(lp.top_ids[: self.out.top_logprobs], lp.top_logprobs)}
            top.setdefault(token, lp.logprob)  # OpenAI: the sampled token is always there
            part["tokens"].append(token)
            part["token_logprobs"].append(lp.logprob)
            part["top_logprobs"].append(top)
            part["text_offset"].append(self.offset)
            self.offset += len(self._chars.decode(self.tok.token_bytes(t)))
        for key, values in part.items():
            self.text_logprobs[key] += values
        return part

    def _chat_entry(self, token_id: int, lp: pb.TokenLogprob) -> dict:
        top = [self._token(i, l) for i, l in zip(lp.top_ids[: self.out.top_logprobs],
                                                  lp.top_logprobs)]
        return {**self._token(token_id, lp.logprob), "top_logprobs": top}

    def _token(self, token_id: int, logprob: float) -> dict:
        return {"token": self._spelling(token_id), "logprob": logprob,
                "bytes": list(self.tok.token_bytes(token_id))}

    def _spelling(self, token_id: int) -> str:
        """A token as logprobs name it: its text, or where it holds part of a character, its
        bytes as OpenAI spells them ("bytes:\\xe6\\x97"), so no two tokens share a name."""
        raw = self.tok.token_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def full(self, echo: str) -> dict:
        """The choice of a non-streamed reply."""
        assert self.done is not None
        text = "".join(self.texts)
        if self.chat:
            message: dict = {"role": "assistant", "content": (text or None) if self.calls else text}
            if self.calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name,
                                                       "arguments": c.arguments}}
                                         for c in self.calls]
            logprobs = ({"content": self.chat_logprobs, "refusal": None}
                        if self.out.logprobs else None)
            return {"index": self.index, "message": message,
                    "finish_reason": self.done.finish_reason, "logprobs": logprobs}
        return {"index": self.index, "text": echo + text,
                "finish_reason": self.done.finish_reason,
                "logprobs": self.text_logprobs if self.out.logprobs else None}


class _Shape:
    """Chat or text completion objects and chunks around the choices."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = model

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, choices: list[dict], dones: list[Done]) -> dict:
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._base(obj), "choices": choices, "usage": _usage(dones)}

    def chunk(self, index: int, delta: dict, finish_reason: str | None = None) -> dict:
        logprobs = delta.pop("logprobs", None)
        if self.chat:
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": logprobs}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": delta.get("text", ""), "finish_reason": finish_reason,
                  "logprobs": logprobs}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, dones: list[Done]) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": _usage(dones)}


# Events of a request's n choices merged and not yet read by its client.
_MERGED_EVENTS = 64


class _Choices:
    """The n generations of one request, their events merged as (choice index, event).

    Choice 0 starts first and the others once it has its first token: by then the node's
    prefix cache holds the prompt, so they share its prefill instead of computing it n times."""

    def __init__(self, make: Callable[[int], AsyncIterator], n: int):
        self.gens = [make(i) for i in range(n)]  # not started until pumped
        # Bounded: a client that reads nothing stops the pumps here, and each choice's unread
        # chunks then wait in its own bounded queue (worker_session.py), not in this one.
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=_MERGED_EVENTS)
        self.tasks: dict[int, asyncio.Task] = {}

    def prime(self) -> None:
        """Starts choice 0 now (common.Primed)."""
        self.gens[0] = Primed(self.gens[0])

    def _start(self, i: int) -> None:
        self.tasks[i] = asyncio.create_task(self._pump(i))

    async def _pump(self, i: int) -> None:
        try:
            async for ev in self.gens[i]:
                await self.queue.put((i, ev))
        except Exception as e:  # handed to the consumer, which raises it
            await self.queue.put((i, e))
            return
        await self.queue.put((i, None))

    async def merged(self) -> AsyncIterator[tuple[int, Delta | KeepAlive | Done]]:
        if len(self.gens) == 1:
            # Nothing to merge: no task and queue between the generation and its client,
            # which at many streams is a good part of the gateway's work per token.
            async for ev in self.gens[0]:
                yield 0, ev
            return
        self._start(0)
        live, waiting = set(range(len(self.gens))), True
        while live:
            i, ev = await self.queue.get()
            if isinstance(ev, Exception):
                raise ev
            if waiting and (ev is None or isinstance(ev, Done) or
                            (isinstance(ev, Delta) and ev.tokens)):
                waiting = False
                for k in range(1, len(self.gens)):
                    self._start(k)
            if ev is None or isinstance(ev, Done):
                live.discard(i)
            if ev is not None:
                yield i, ev

    async def aclose(self) -> None:
        """Ends every generation still running (their node sequences are cancelled)."""
        running = {t for t in self.tasks.values() if not t.done()}
        # All cancelled before the first await: a caller that is itself being cancelled (a
        # client gone mid-stream) may not get past it.
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=5.0)
        for i, gen in enumerate(self.gens):
            task = self.tasks.get(i)
            if task is None or task.done():  # closing a generator a task runs raises
                await gen.aclose()


async def _respond(request: Request, manager: ModelManager, model: ServedModel,
                   metrics: GatewayMetrics,
                   settings: GatewaySettings, prompt: list[int], body: _Common, chat: bool,
                   endpoint: str, output: _Output, grammar: str = "",
                   echo: str = "", prediction: list[int] | None = None) -> Response:
    """`prediction`: OpenAI's predicted output, tokenized (drafts for the node)."""
    prediction = prediction or []
    max_tokens = token_budget(model, prompt, body.token_limit, settings,
                              "messages" if chat else "prompt")
    shape = _Shape(chat, model.name)
    stop = body.stop
    if output.single_call and output.tool_format and output.tool_format.end:
        stop = stop + [output.tool_format.end]
    base = GenerationRequest(
        prompt=prompt, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=stop,
        ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        grammar=grammar, logprobs=output.logprobs, top_logprobs=output.top_logprobs,
        account=account_of(request.scope), prediction=prediction)

    def start(i: int) -> AsyncIterator:
        # Seeded choices differ from one another yet are each reproducible.
        seed = None if body.seed is None else body.seed + i
        return generate(manager, model, metrics, settings, replace(base, seed=seed))

    events = _Choices(start, body.n)
    choices = [_Choice(i, chat, model.tokenizer, output) for i in range(body.n)]

    async def chunks() -> AsyncIterator[list[tuple[int, dict, str | None]] | None]:
        """Each core event's stream chunks, as (choice index, delta, finish_reason); None for a
        keep-alive."""
        async for i, ev in events.merged():
            choice = choices[i]
            if isinstance(ev, KeepAlive):
                yield None
            elif isinstance(ev, Delta):
                yield [(i, d, None) for d in choice.delta(ev)]
            else:
                last = choice.finish(ev)
                yield [(i, d, None) for d in last] + [(i, {}, choice.done.finish_reason)]

    if body.stream:
        async def stream() -> AsyncIterator[str]:
            outcome = "error"
            try:
                for i in range(body.n):
                    if chat:
                        yield sse(shape.chunk(i, {"role": "assistant", "content": ""}))
                    elif echo:
                        yield sse(shape.chunk(i, {"text": echo}))
                silence = Silence(settings.keepalive_seconds)
                async for items in chunks():
                    if items:  # one write for all of an event's chunks
                        yield "".join(sse(shape.chunk(*item)) for item in items)
                        silence.wrote()
                    elif items is None or silence.overdue():
                        yield ": keep-alive\n\n"
                        silence.wrote()
                if body.include_usage:
                    yield sse(shape.usage_chunk([c.done for c in choices]))
                outcome = "ok"
            except APIError as e:
                # Headers are sent already: the error travels as an SSE event, as OpenAI does.
                yield sse(e.body())
            except Exception as e:
                yield sse(internal_error(log, "internal error", e).body())
            except asyncio.CancelledError:
                outcome = "disconnected"
                raise
            finally:
                metrics.requests.labels(endpoint, outcome).inc()
                await events.aclose()
            yield "data: [DONE]\n\n"

        events.prime()
        return ClosingStream(stream(), events, settings.request_timeout)

    async def collect() -> JSONResponse:
        async for _ in chunks():
            pass
        if any(c.done is None for c in choices):
            raise APIError(502, "the generation ended without a result", type="server_error")
        return JSONResponse(shape.full([c.full(echo) for c in choices],
                                       [c.done for c in choices]))

    return await collect_unless_gone(request, collect, events, metrics, endpoint)


def _tool_setup(body: ChatCompletionRequest, tok: ChatTokenizer
                ) -> tuple[list[dict] | None, _Output, str]:
    """(the tools for the chat template, how to read the output, the grammar)."""
    mode = body.tool_mode
    name = body.tool_choice.function.name if mode == "named" else None
    setup = setup_tools(tok, body.tool_dicts, mode, name, body.parallel_tool_calls,
                        *_reply_format(body))
    output = _Output(setup.fmt, setup.tools, setup.single_call, body.logprobs,
                     body.top_logprobs or 0, body.stream)
    return setup.template_tools, output, setup.grammar


def _reply_format(body: ChatCompletionRequest) -> tuple[dict | bool | None, str, str | None]:
    """The JSON Schema the reply follows (response_format; None for free text), where it is and
    what to call it in errors."""
    rf, param = body.response_format, "response_format.json_schema.schema"
    if rf is None or rf.type == "text":
        return None, param, None
    if rf.type == "json_object":
        return {"type": "object"}, param, None
    assert rf.json_schema is not None
    schema = True if rf.json_schema.schema_ is None else rf.json_schema.schema_
    return schema, param, f"the response_format schema {rf.json_schema.name!r}"


def add_routes(app: FastAPI, manager: ModelManager, metrics: dict[str, GatewayMetrics],
               settings: GatewaySettings, keyed: list[Depends]) -> None:
    """`metrics`: each model's, by name."""
    def model_card(model: ServedModel) -> dict:
        # OpenAI's fields, and what a client choosing a model wants to know besides.
        d = manager.describe(model)
        return {"object": "model", "created": 0, "owned_by": "omlx-cluster", **d,
                "replicas": len(d["replicas"]), "context_length": model.max_context or None}

    @app.get("/v1/models", dependencies=keyed)
    async def models(request: Request) -> dict:
        """The models served, those the key may use."""
        return {"object": "list",
                "data": [model_card(m) for m in usable(request.scope, manager.models)]}

    @app.get("/v1/models/{model_id:path}", dependencies=keyed)
    async def model(model_id: str) -> dict:
        found = manager.resolve(model_id)
        if found is None:
            names = ", ".join(repr(m.name) for m in manager.models)
            raise APIError(404, f"model {model_id!r} is not served here; available: {names}",
                           param="model", code="model_not_found")
        return model_card(found)

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        served = await check_servable(manager, body.model, account_of(request.scope))
        admit(request.scope, served, body.n)
        messages = body.template_messages()
        tools, output, grammar = await asyncio.to_thread(_tool_setup, body, served.tokenizer)
        prompt = await asyncio.to_thread(encode_chat, served.tokenizer, messages, tools)
        prediction = (await asyncio.to_thread(served.tokenizer.encode_text, body.prediction.text,
                                              "prediction") if body.prediction else None)
        return await _respond(request, manager, served, metrics[served.name], settings, prompt,
                              body, True, "chat", output, grammar, prediction=prediction)

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served = await check_servable(manager, body.model, account_of(request.scope))
        admit(request.scope, served, body.n)
        if isinstance(body.prompt, str):
            prompt = await asyncio.to_thread(served.tokenizer.encode, body.prompt)
        else:
            prompt = list(body.prompt)
            if bad := outside_vocabulary(prompt, served.vocab_size):
                raise APIError(400, f"prompt token ids {bad[:5]} are outside the model's "
                                    f"vocabulary [0, {served.vocab_size})", param="prompt")
        if not prompt:
            raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        echo = ""
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else served.tokenizer.decode(prompt)
        output = _Output(logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0)
        return await _respond(request, manager, served, metrics[served.name], settings, prompt,
                              body, False, "completions", output, echo=echo)
