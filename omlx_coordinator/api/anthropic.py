"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens), as Claude Code
and the `anthropic` SDK use it, over the same generation core as the OpenAI routes.

Requests become the OpenAI-like messages the model's chat template renders (a `tool_use` block
is an assistant `tool_calls` entry, a `tool_result` a `tool` message); the model's output
becomes `text` and `tool_use` content blocks (its tool-call markup parsed by tool_calls.py),
streamed as Anthropic's event sequence or returned as one message. Errors on these paths take
Anthropic's shape (`error_body`; gateway.py picks the shape by path).

Choices where the API leaves room:
- `max_tokens` is a cap: past the context's room it is cut to the room (Claude Code sends 32000).
- usage: `input_tokens` are the prompt tokens not read from the prefix cache,
  `cache_read_input_tokens` those read from it; the cache fills itself, so
  `cache_creation_input_tokens` is 0. The cache hit is known when generation ends, so
  message_start carries the whole prompt as input and message_delta the final split
  (message_delta usage is cumulative: the SDK and Claude Code take its counts).
- Server tools (web search, code execution...) are refused: they run on Anthropic's servers.
- Image, document and search-result blocks are refused (the model reads text); other block
  types we do not render (thinking, redacted_thinking, server_tool_use...) are dropped, and
  logged once per type.
- A `system` message inside the conversation stays one where the chat template renders it
  there; otherwise its text joins the neighbouring user turn.
- `tool_choice` `none` leaves the tools out of the prompt; `any` and `tool` force calls with a
  grammar (constraints.py), where the model's family allows it: one call of the named tool, or
  one or more of any; `disable_parallel_tool_use` ends generation after the first call.
- A final assistant message (prefill) is refused: the template would open a new turn after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from functools import lru_cache

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from omlx_coordinator.api.anthropic_schema import (
    Block,
    MessagesRequest,
    OtherBlock,
    PromptBody,
    ServerTool,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from omlx_coordinator.api.common import (
    ClosingStream,
    Primed,
    Silence,
    collect_unless_gone,
    sse,
)
from omlx_coordinator.constraints import grammar_for_tool_call, validate
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
from omlx_coordinator.internal_error import internal_error
from omlx_coordinator.lifecycle import ModelManager
from omlx_coordinator.metrics import GatewayMetrics
from omlx_coordinator.tokenizer import ChatTokenizer
from omlx_coordinator.tool_calls import ToolCall, ToolCallFormat, ToolCallStream

log = logging.getLogger(__name__)

PATH = "/v1/messages"
ENDPOINT = "messages"  # the metrics label

# Anthropic's error type for each HTTP status (the SDK picks its exception class by status).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                402: "billing_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error"}
# Content the model was meant to read: dropping it would answer without it.
_REFUSED_BLOCKS = {"image", "document", "search_result", "container_upload"}
_dropped_types: set[str] = set()  # block types already logged as dropped
_LATE_SYSTEM_PROBE = "omlx-late-system-probe"


def owns(path: str) -> bool:
    """Whether errors on `path` take Anthropic's shape."""
    return path == PATH or path.startswith(PATH + "/")


def error_body(status: int, message: str) -> dict:
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- request -> chat template ------------------------------------------------------------------


@lru_cache(maxsize=8)
def _renders_late_system(tok: ChatTokenizer) -> bool:
    """Whether the chat template renders a system message after the first turn (Qwen's do;
    Mistral's raise, Gemma's have no system role)."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "system", "content": _LATE_SYSTEM_PROBE}]
    try:
        return _LATE_SYSTEM_PROBE in tok.decode(tok.encode_chat(probe))
    except Exception:  # the template refused it
        return False


def _skip(block: OtherBlock, param: str) -> None:
    if block.type in _REFUSED_BLOCKS:
        raise APIError(400, f"'{param}': {block.type} blocks are not supported: the model served "
                            "here reads text only", param=param)
    if block.type not in _dropped_types:
        _dropped_types.add(block.type)
        log.info("dropping %s content blocks: nothing here renders them", block.type)


def _text(blocks: list[Block], param: str) -> str:
    """The text of blocks that may hold only text (system turns)."""
    parts = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            parts.append(b.text)
        elif isinstance(b, OtherBlock):
            _skip(b, f"{param}.{j}")
        else:
            raise APIError(400, f"'{param}.{j}': {b.type} blocks are not allowed here",
                           param=f"{param}.{j}")
    return "".join(parts)


def _result_text(block: ToolResultBlock, param: str) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for k, part in enumerate(block.content):
            if isinstance(part, OtherBlock):
                _skip(part, f"{param}.content.{k}")
            else:
                parts.append(part.text)
        text = "".join(parts)
    # Chat templates have no error flag: the model reads it in the text.
    return "Error: " + text if block.is_error else text


def _user_turn(blocks: list[Block], param: str, calls: dict[str, str]) -> list[dict]:
    """A user message: its tool results become `tool` messages, its text a user message."""
    out: list[dict] = []
    texts: list[str] = []

    def flush_text() -> None:
        if texts:
            out.append({"role": "user", "content": "".join(texts)})
            texts.clear()

    for j, b in enumerate(blocks):
        at = f"{param}.{j}"
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolResultBlock):
            if b.tool_use_id not in calls:
                raise APIError(400, f"'{at}.tool_use_id': {b.tool_use_id!r} answers no tool_use "
                                    "block of an earlier assistant message",
                               param=f"{at}.tool_use_id")
            flush_text()
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "name": calls[b.tool_use_id], "content": _result_text(b, at)})
        elif isinstance(b, ToolUseBlock):
            raise APIError(400, f"'{at}': tool_use blocks belong in assistant messages", param=at)
        else:
            _skip(b, at)
    flush_text()
    return out


def _assistant_turn(blocks: list[Block], param: str, calls: dict[str, str]) -> dict:
    texts: list[str] = []
    tool_calls = []
    for j, b in enumerate(blocks):
        at = f"{param}.{j}"
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            calls[b.id] = b.name
            # Templates render the arguments with `tojson`: a dict, not JSON text.
            tool_calls.append({"id": b.id, "type": "function",
                               "function": {"name": b.name, "arguments": b.input}})
        elif isinstance(b, ToolResultBlock):
            raise APIError(400, f"'{at}': tool_result blocks belong in user messages", param=at)
        else:
            _skip(b, at)
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    return msg


def _merge_user_turns(messages: list[dict]) -> list[dict]:
    out: list[dict] = []
    for m in messages:
        if out and m["role"] == out[-1]["role"] == "user":
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(m)
    return out


def template_messages(body: PromptBody, tok: ChatTokenizer) -> list[dict]:
    """The conversation as the messages a Hugging Face chat template renders."""
    msgs: list[dict] = []
    if body.system:
        # Separate system blocks are sections of one prompt (Claude Code splits it only to
        # place cache breakpoints).
        system = body.system if isinstance(body.system, str) else "\n".join(
            b.text for b in body.system)
        msgs.append({"role": "system", "content": system})
    calls: dict[str, str] = {}  # tool_use id -> tool name, of the assistant turns so far
    late_system = False
    for i, m in enumerate(body.messages):
        at = f"messages.{i}.content"
        if m.role == "system":
            late_system = late_system or bool(msgs)
            msgs.append({"role": "system", "content": _text(m.content, at)})
        elif m.role == "assistant":
            msgs.append(_assistant_turn(m.content, at, calls))
        else:
            msgs.extend(_user_turn(m.content, at, calls))
    if body.messages[-1].role == "assistant":
        raise APIError(400, "the last message is the assistant's: continuing a prefilled "
                            "assistant turn is not supported here", param="messages")
    if late_system and not _renders_late_system(tok):
        msgs = _merge_user_turns([dict(m, role="user") if m["role"] == "system" and k else m
                                  for k, m in enumerate(msgs)])
    return msgs


def template_tools(body: PromptBody) -> list[dict] | None:
    """The tools in the OpenAI shape chat templates (and constraints.py) take; None when the
    model is not to see any (no tools, or tool_choice none)."""
    if not body.tools or (body.tool_choice and body.tool_choice.type == "none"):
        return None
    tools, seen = [], set()
    for i, t in enumerate(body.tools):
        if isinstance(t, ServerTool):
            raise APIError(400, f"'tools.{i}': {t.type!r} is a server tool (run by Anthropic's "
                                "servers), not supported here: declare client tools with name, "
                                "description and input_schema", param=f"tools.{i}")
        if t.name in seen:
            raise APIError(400, f"'tools.{i}.name': the tool name {t.name!r} is used twice",
                           param=f"tools.{i}.name")
        seen.add(t.name)
        fn = {"name": t.name, "parameters": t.input_schema}
        if t.description is not None:
            fn["description"] = t.description
        tools.append({"type": "function", "function": fn})
    return tools


def _check_unsupported(body: PromptBody) -> None:
    for i, edit in enumerate(body.context_management.edits if body.context_management else []):
        # Clearing thinking is a no-op where no thinking blocks exist; other edits would make
        # the server rewrite the conversation.
        if not edit.type.startswith("clear_thinking_"):
            raise APIError(400, f"'context_management.edits.{i}.type': {edit.type!r} is not "
                                "supported here", param=f"context_management.edits.{i}.type")


def _encode(tok: ChatTokenizer, body: PromptBody) -> tuple[list[int], list[dict] | None]:
    """The prompt's token ids and the tools the model sees."""
    _check_unsupported(body)
    messages, tools = template_messages(body, tok), template_tools(body)
    try:
        return tok.encode_chat(messages, tools), tools
    except APIError:
        raise
    except Exception as e:  # a template that rejects these messages (roles, order...)
        raise APIError(400, f"the chat template rejected the messages: {e}",
                       param="messages") from e


# ---- model output -> content blocks -----------------------------------------------------------


def _usage(done: Done) -> dict:
    return {"input_tokens": done.prompt_tokens - done.cached_tokens,
            "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0,
            "output_tokens": done.completion_tokens}


class _Reply:
    """One assistant message: the model's output as content blocks, built alike for a stream
    (the events `feed` and `finish` return) and a whole reply (the message `finish` returns)."""

    def __init__(self, model: str, prompt_tokens: int, calls: ToolCallStream | None,
                 one_call: bool = False, call_end: str | None = None):
        self.id = "msg_" + uuid.uuid4().hex
        self.model, self.prompt_tokens = model, prompt_tokens
        self.calls = calls
        self.one_call = one_call  # disable_parallel_tool_use: nothing after a first call
        self.call_end = call_end  # the stop string we added to end that call
        self.content: list[dict] = []
        self.text_open = False  # the last block is text that may still grow
        # Whitespace outside any block (between or after tool calls) opens no block: Anthropic
        # refuses whitespace-only text blocks when a client sends them back.
        self.held = ""

    def _message(self, stop_reason: str | None, stop_sequence: str | None,
                 usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage}

    def start(self) -> dict:
        usage = {"input_tokens": self.prompt_tokens, "cache_read_input_tokens": 0,
                 "cache_creation_input_tokens": 0, "output_tokens": 0}
        return {"type": "message_start",
                "message": {**self._message(None, None, usage), "content": []}}

    def feed(self, text: str) -> list[dict]:
        """The stream events of more output."""
        return self._add(self.calls.feed(text) if self.calls else [text] if text else [])

    def finish(self, done: Done) -> tuple[list[dict], dict]:
        """The closing events and the whole message."""
        ours = self.call_end is not None and done.stop_sequence == self.call_end
        events = self._add(self.calls.flush() if self.calls else []) + self._close_text()
        if done.finish_reason == "length":
            reason, seq = "max_tokens", None
        elif done.stop_sequence is not None and not ours:
            reason, seq = "stop_sequence", done.stop_sequence
        elif any(b["type"] == "tool_use" for b in self.content):
            reason, seq = "tool_use", None
        else:
            reason, seq = "end_turn", None
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": seq},
                       "usage": _usage(done)})
        events.append({"type": "message_stop"})
        return events, self._message(reason, seq, _usage(done))

    def _close_text(self) -> list[dict]:
        if not self.text_open:
            return []
        self.text_open = False
        return [{"type": "content_block_stop", "index": len(self.content) - 1}]

    def _add(self, items: list[str | ToolCall]) -> list[dict]:
        events: list[dict] = []
        for item in items:
            if self.one_call and any(b["type"] == "tool_use" for b in self.content):
                break
            if isinstance(item, ToolCall):
                events += self._close_text()
                self.held = ""
                index = len(self.content)
                block = {"type": "tool_use", "id": item.id, "name": item.name, "input": {}}
                events += [
                    {"type": "content_block_start", "index": index, "content_block": dict(block)},
                    {"type": "content_block_delta", "index": index,
                     "delta": {"type": "input_json_delta", "partial_json": item.arguments}},
                    {"type": "content_block_stop", "index": index}]
                self.content.append({**block, "input": json.loads(item.arguments)})
                continue
            if not self.text_open:
                self.held += item
                if not self.held.strip():
                    continue
                item, self.held = self.held, ""
                self.content.append({"type": "text", "text": ""})
                self.text_open = True
                events.append({"type": "content_block_start", "index": len(self.content) - 1,
                               "content_block": {"type": "text", "text": ""}})
            self.content[-1]["text"] += item
            events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                           "delta": {"type": "text_delta", "text": item}})
        return events


# ---- routes -------------------------------------------------------------------------------------


def _tool_use(tok: ChatTokenizer, body: MessagesRequest, tools: list[dict] | None
              ) -> tuple[ToolCallFormat | None, str]:
    """(the markup to parse tool calls in, the grammar that forces one)."""
    choice = body.tool_choice
    forced = choice is not None and choice.type in ("any", "tool")
    if forced and not tools:
        raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if not tools:
        return None, ""
    fmt = ToolCallFormat.for_tokenizer(tok)
    if fmt is None:
        raise APIError(400, "this model cannot call tools: its chat template shows no "
                            "tool-call format mlx-lm knows", param="tools")
    if not forced:
        return fmt, ""
    # A named tool is called once; "any" may call several unless parallel use is disabled.
    grammar = grammar_for_tool_call(
        fmt, tools, choice.name,
        parallel=choice.type == "any" and not choice.disable_parallel_tool_use,
        schema_param="tools.{i}.input_schema")
    validate(grammar, "tool_choice")
    return fmt, grammar


def add_routes(app: FastAPI, manager: ModelManager, metrics_of: dict[str, GatewayMetrics],
               settings: GatewaySettings, keyed: list[Depends]) -> None:
    """`metrics_of`: each model's, by name."""
    @app.post(PATH, dependencies=keyed)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        served = await check_servable(manager, body.model)
        metrics, tok = metrics_of[served.name], served.tokenizer
        prompt, tools = await asyncio.to_thread(_encode, tok, body)
        try:
            max_tokens = token_budget(served, prompt, body.max_tokens, settings, clamp=True)
        except APIError as e:
            if e.code != "context_length_exceeded":
                raise
            # Anthropic's words: agents (Claude Code) read them to compact their conversation.
            raise APIError(400, f"prompt is too long: {len(prompt)} tokens > "
                                f"{served.max_context} maximum", param=e.param,
                           code=e.code) from None
        fmt, grammar = await asyncio.to_thread(_tool_use, tok, body, tools)
        one_call = bool(body.tool_choice and body.tool_choice.disable_parallel_tool_use)
        # One call only: its end marker ends generation (the parser takes a call without it).
        call_end = (fmt.end if fmt and fmt.end and one_call
                    and fmt.end not in body.stop_sequences else None)
        req = GenerationRequest(prompt=prompt, max_tokens=max_tokens,
                                temperature=body.temperature, top_p=body.top_p,
                                top_k=body.top_k,
                                stop=body.stop_sequences + ([call_end] if call_end else []),
                                grammar=grammar)
        reply = _Reply(served.name, len(prompt),
                       ToolCallStream(fmt, tools) if fmt else None, one_call, call_end)
        events = generate(manager, served, metrics, settings, req)

        if body.stream:
            events = Primed(events)
            return ClosingStream(_stream(reply, events, metrics, settings.keepalive_seconds),
                                 events, settings.request_timeout)

        async def collect() -> JSONResponse:
            async for ev in events:
                if isinstance(ev, Delta):
                    reply.feed(ev.text)
                elif isinstance(ev, Done):
                    return JSONResponse(reply.finish(ev)[1])
            raise APIError(502, "the generation ended without a result", type="server_error")

        return await collect_unless_gone(request, collect, events, metrics, ENDPOINT)

    @app.post(PATH + "/count_tokens", dependencies=keyed)
    async def count_tokens(body: PromptBody) -> dict:
        served = await check_servable(manager, body.model)
        prompt, _ = await asyncio.to_thread(_encode, served.tokenizer, body)
        return {"input_tokens": len(prompt)}


def _event(data: dict) -> str:
    return sse(data, event=data["type"])


async def _stream(reply: _Reply, events: AsyncIterator, metrics: GatewayMetrics,
                  keepalive_seconds: float) -> AsyncIterator[str]:
    outcome = "error"
    silence = Silence(keepalive_seconds)
    try:
        yield _event(reply.start())
        async for ev in events:
            outs = ([] if isinstance(ev, KeepAlive) else
                    reply.feed(ev.text) if isinstance(ev, Delta) else reply.finish(ev)[0])
            if outs:
                yield "".join(_event(out) for out in outs)
                silence.wrote()
            elif isinstance(ev, KeepAlive) or silence.overdue():
                yield _event({"type": "ping"})
                silence.wrote()
            if isinstance(ev, Done):
                outcome = "ok"
    except APIError as e:
        # Headers are sent already: the error travels as an `error` event, as Anthropic's does.
        yield _event(error_body(e.status, e.message))
    except Exception as e:
        yield _event(error_body(500, internal_error(log, "internal error", e).message))
    except asyncio.CancelledError:
        outcome = "disconnected"
        raise
    finally:
        metrics.requests.labels(ENDPOINT, outcome).inc()
        await events.aclose()
