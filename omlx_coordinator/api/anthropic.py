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
- Server tools (code execution, computer use...) are refused: they run on Anthropic's servers,
  and so are the other features only they provide (MCP connectors, containers, compaction,
  threads, context edits other than clearing thinking) when a request gives them a value.
  Web search and web fetch are left out of the prompt instead (common.py `leaves_out`).
- A tool with `defer_loading` is left out of the prompt; a `tool_reference` in a tool result or
  a `tool_addition` in a system message renders its definition there, as one JSON line in
  <functions> (the encoding Claude Code's ToolSearch describes), so the prompt before it, and
  its cached prefix, stay the same. Calls of every declared tool are parsed, deferred or not.
- `output_config.format` (and the older top-level `output_format`) and `strict` tools are
  enforced by grammar, as OpenAI's response_format and strict tools are.
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
    Tool,
    ToolChangeBlock,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from omlx_coordinator.api.common import (
    ClosingStream,
    Primed,
    Silence,
    collect_unless_gone,
    leaves_out,
    sse,
)
from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import account_of, admit
from omlx_coordinator.models.admission import Overloaded
from omlx_coordinator.models.lifecycle import ModelManager
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
from omlx_coordinator.text.constraints import (
    grammar_for_json_schema,
    grammar_for_tool_call,
    grammar_for_tools_or_reply,
    validate,
)
from omlx_coordinator.text.tokenizer import ChatTokenizer
from omlx_coordinator.text.tool_calls import (
    CallArguments,
    CallStart,
    Item,
    ToolCallFormat,
    ToolCallStream,
    call_input,
)
from omlx_shared.outsider_logs import cut

log = logging.getLogger(__name__)

PATH = "/v1/messages"
OVERLOADED_STATUS = 529
ENDPOINT = "messages"  # the metrics label

# Anthropic's error type for each HTTP status (the SDK picks its exception class by status).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                402: "billing_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 504: "timeout_error", 529: "overloaded_error"}
# Content the model was meant to read: dropping it would answer without it.
_REFUSED_BLOCKS = {"image", "document", "search_result", "container_upload"}
_dropped_types: set[str] = set()  # block types already logged as dropped
_DROPPED_TYPES_TOLD = 32
_LATE_SYSTEM_PROBE = "omlx-late-system-probe"


def owns(path: str) -> bool:
    """Whether errors on `path` take Anthropic's shape."""
    return path == PATH or path.startswith(PATH + "/")


def error_status(exc: APIError) -> int:
    """The status Anthropic's API would answer with: a full queue is its 529 overloaded_error
    (429 there is a client's own rate limit), which its SDK retries after the Retry-After."""
    return OVERLOADED_STATUS if isinstance(exc, Overloaded) else exc.status


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
    # Clients name the types: the set of those told stays small, whatever they send.
    if block.type not in _dropped_types and len(_dropped_types) < _DROPPED_TYPES_TOLD:
        _dropped_types.add(block.type)
        log.info("dropping %s content blocks: nothing here renders them", cut(block.type))


class RequestTools:
    """The request's client tools: those declared in `tools` and those a system message's
    tool_addition defines inline, by name, in the OpenAI shape chat templates and constraints.py
    take; and which deferred ones the conversation has loaded so far."""

    def __init__(self, body: PromptBody):
        self.declared: list[Tool] = []
        for i, t in enumerate(body.tools or []):
            if isinstance(t, ServerTool) and leaves_out(t.type):
                continue
            if isinstance(t, ServerTool):
                raise APIError(400, f"'tools.{i}': {t.type!r} is a server tool (run by "
                                    "Anthropic's servers), not supported here: declare client "
                                    "tools with name, description and input_schema",
                               param=f"tools.{i}")
            if any(d.name == t.name for d in self.declared):
                raise APIError(400, f"'tools.{i}.name': the tool name {t.name!r} is used twice",
                               param=f"tools.{i}.name")
            self.declared.append(t)
        self.by_name: dict[str, Tool] = {t.name: t for t in self.declared}
        self.loaded: set[str] = set()

    def shown(self) -> list[dict]:
        """The tools the prompt declares up front (deferred ones wait to be loaded)."""
        return [_function(t) for t in self.declared if not t.defer_loading]

    def callable(self) -> list[dict]:
        """Every tool a call may name: the parser reads calls of deferred tools too."""
        return [_function(t) for t in self.by_name.values()]

    def offered(self) -> list[dict]:
        """The tools the model has been shown by the end of the prompt (tool_choice any)."""
        return [_function(t) for t in self.by_name.values()
                if not t.defer_loading or t.name in self.loaded]

    def load(self, name: str, param: str) -> str:
        """A deferred tool's definition, rendered where a reference or an addition loads it."""
        if name not in self.by_name:
            raise APIError(400, f"'{param}': the tool {name!r} is not among the request's tools",
                           param=param)
        self.loaded.add(name)
        return "<functions>\n<function>" + json.dumps(_function(self.by_name[name])["function"]) \
            + "</function>\n</functions>"

    def change(self, block: ToolChangeBlock, param: str) -> str:
        """A system message's tool addition or removal, as the text the model reads."""
        kind = block.tool.get("type")
        if kind == "tool_definition" and block.type == "tool_addition":
            try:
                tool = Tool.model_validate(block.tool.get("definition"))
            except ValueError as e:
                raise APIError(400, f"'{param}.tool.definition' is not a client tool: {e}",
                               param=f"{param}.tool.definition") from None
            self.by_name[tool.name] = tool.model_copy(update={"defer_loading": True})
            return self.load(tool.name, f"{param}.tool.definition")
        name = block.tool.get("tool_name")
        if kind != "tool_reference" or not isinstance(name, str):
            raise APIError(400, f"'{param}.tool': only references to the request's own tools "
                                "(and, for an addition, inline tool definitions) are supported "
                                "here; MCP toolsets are not", param=f"{param}.tool")
        if block.type == "tool_addition":
            return self.load(name, f"{param}.tool.tool_name")
        self.loaded.discard(name)
        return f"The tool {name} is no longer available."


def _function(t: Tool) -> dict:
    fn = {"name": t.name, "parameters": t.input_schema}
    if t.description is not None:
        fn["description"] = t.description
    if t.strict:
        fn["strict"] = True
    return {"type": "function", "function": fn}


def _system_text(blocks: list[Block], param: str, tools: RequestTools) -> str:
    """The text of a system turn: text, and the tool changes it makes."""
    parts = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            parts.append(b.text)
        elif isinstance(b, ToolChangeBlock):
            parts.append(tools.change(b, f"{param}.{j}"))
        elif isinstance(b, OtherBlock):
            _skip(b, f"{param}.{j}")
        else:
            raise APIError(400, f"'{param}.{j}': {b.type} blocks are not allowed here",
                           param=f"{param}.{j}")
    return "".join(parts)


def _result_text(block: ToolResultBlock, param: str, tools: RequestTools) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for k, part in enumerate(block.content):
            if isinstance(part, OtherBlock):
                _skip(part, f"{param}.content.{k}")
            elif isinstance(part, ToolReferenceBlock):
                parts.append(tools.load(part.tool_name, f"{param}.content.{k}.tool_name"))
            else:
                parts.append(part.text)
        text = "".join(parts)
    # Chat templates have no error flag: the model reads it in the text.
    return "Error: " + text if block.is_error else text


def _user_turn(blocks: list[Block], param: str, calls: dict[str, str], tools: RequestTools
               ) -> list[dict]:
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
                        "name": calls[b.tool_use_id], "content": _result_text(b, at, tools)})
        elif isinstance(b, ToolUseBlock):
            raise APIError(400, f"'{at}': tool_use blocks belong in assistant messages", param=at)
        elif isinstance(b, ToolChangeBlock):
            raise APIError(400, f"'{at}': {b.type} blocks belong in system messages", param=at)
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
        elif isinstance(b, (ToolResultBlock, ToolChangeBlock)):
            raise APIError(400, f"'{at}': {b.type} blocks do not belong in assistant messages",
                           param=at)
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


def template_messages(body: PromptBody, tok: ChatTokenizer, tools: RequestTools | None = None
                      ) -> list[dict]:
    """The conversation as the messages a Hugging Face chat template renders; `tools` learns
    which deferred tools it loads."""
    tools = tools or RequestTools(body)
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
            msgs.append({"role": "system", "content": _system_text(m.content, at, tools)})
        elif m.role == "assistant":
            msgs.append(_assistant_turn(m.content, at, calls))
        else:
            msgs.extend(_user_turn(m.content, at, calls, tools))
    if body.messages[-1].role == "assistant":
        raise APIError(400, "the last message is the assistant's: continuing a prefilled "
                            "assistant turn is not supported here", param="messages")
    if late_system and not _renders_late_system(tok):
        msgs = _merge_user_turns([dict(m, role="user") if m["role"] == "system" and k else m
                                  for k, m in enumerate(msgs)])
    return msgs


_SERVER_FEATURES = {
    "mcp_servers": "MCP connectors are run by Anthropic's servers: connect the MCP server in "
                   "your client and declare its tools as client tools",
    "container": "containers belong to server tools (code execution), which are not supported "
                 "here",
    "compaction": "server-side compaction is not supported here: summarize the conversation in "
                  "the client (Claude Code's /compact does)",
    "thread": "server-held conversations are not supported here: send the whole conversation "
              "in messages",
}


def _check_unsupported(body: PromptBody) -> None:
    for field, why in _SERVER_FEATURES.items():
        if getattr(body, field):
            raise APIError(400, f"'{field}': {why}", param=field)
    for i, edit in enumerate(body.context_management.edits if body.context_management else []):
        # Clearing thinking is a no-op where no thinking blocks exist; other edits would make
        # the server rewrite the conversation.
        if not edit.type.startswith("clear_thinking_"):
            raise APIError(400, f"'context_management.edits.{i}.type': {edit.type!r} is not "
                                "supported here", param=f"context_management.edits.{i}.type")


def encode_prompt(tok: ChatTokenizer, body: PromptBody) -> tuple[list[int], RequestTools | None]:
    """The prompt's token ids and the request's tools (None when the model is not to see any:
    no tools, or tool_choice none)."""
    _check_unsupported(body)
    tools = RequestTools(body)
    messages = template_messages(body, tok, tools)
    if not tools.by_name or (body.tool_choice and body.tool_choice.type == "none"):
        tools = None
    try:
        return tok.encode_chat(messages, tools.shown() if tools else None), tools
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
        self.ended_a_call = False
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

    def _add(self, items: list[Item]) -> list[dict]:
        events: list[dict] = []
        for item in items:
            if self.one_call and self.ended_a_call:
                break
            if isinstance(item, CallStart):
                events += self._close_text()
                self.held = ""
                block = {"type": "tool_use", "id": item.id, "name": item.name, "input": {}}
                events.append({"type": "content_block_start", "index": len(self.content),
                               "content_block": dict(block)})
                self.content.append(block)
                continue
            if isinstance(item, CallArguments):
                events.append({"type": "content_block_delta", "index": len(self.content) - 1,
                               "delta": {"type": "input_json_delta", "partial_json": item.text}})
                continue
            if not isinstance(item, str):  # the call's end
                self.content[-1]["input"] = call_input(item.call.arguments)
                self.ended_a_call = True
                events.append({"type": "content_block_stop", "index": len(self.content) - 1})
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


def _reply_schema(body: MessagesRequest) -> tuple[dict | None, str]:
    """The JSON Schema a reply follows (output_config.format, or the older output_format) and
    its grammar, checked; (None, "") for free text."""
    fmt = (body.output_config.format if body.output_config else None) or body.output_format
    if fmt is None:
        return None, ""
    param = "output_config.format.schema" if body.output_config and body.output_config.format \
        else "output_format.schema"
    grammar = grammar_for_json_schema(fmt.schema_, param)
    validate(grammar, param, "the output format's schema")
    return fmt.schema_, grammar


def _tool_use(tok: ChatTokenizer, body: MessagesRequest, tools: RequestTools | None
              ) -> tuple[ToolCallFormat | None, str]:
    """(the markup to parse tool calls in, the grammar that constrains the output)."""
    choice = body.tool_choice
    forced = choice is not None and choice.type in ("any", "tool")
    if forced and not tools:
        raise APIError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    reply, reply_grammar = _reply_schema(body)
    if not tools:
        return None, reply_grammar
    fmt = ToolCallFormat.for_tokenizer(tok)
    if fmt is None:
        raise APIError(400, "this model cannot call tools: its chat template shows no "
                            "tool-call format mlx-lm knows", param="tools")
    parallel = not (choice and choice.disable_parallel_tool_use)
    if forced:
        # A named tool is called once; "any" may call several unless parallel use is disabled.
        grammar = grammar_for_tool_call(
            fmt, tools.callable() if choice.name else tools.offered(), choice.name,
            parallel=choice.type == "any" and parallel, schema_param="tools.{i}.input_schema")
        validate(grammar, "tool_choice")
        return fmt, grammar
    if reply is not None or any(t.strict for t in tools.by_name.values()):
        # The model may call a tool or reply: calls follow their schemas, a reply the format.
        grammar = grammar_for_tools_or_reply(fmt, tools.callable(), parallel, reply)
        validate(grammar, "tools")
        return fmt, grammar
    return fmt, ""


def add_routes(app: FastAPI, manager: ModelManager, metrics_of: dict[str, GatewayMetrics],
               settings: GatewaySettings, keyed: list[Depends]) -> None:
    """`metrics_of`: each model's, by name."""
    @app.post(PATH, dependencies=keyed)
    async def messages(body: MessagesRequest, request: Request) -> Response:
        served = await check_servable(manager, body.model, account_of(request.scope))
        admit(request.scope, served)
        metrics, tok = metrics_of[served.name], served.tokenizer
        prompt, tools = await asyncio.to_thread(encode_prompt, tok, body)
        try:
            max_tokens = token_budget(served, prompt, body.max_tokens, settings)
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
                                grammar=grammar, account=account_of(request.scope))
        reply = _Reply(served.name, len(prompt),
                       ToolCallStream(fmt, tools.callable(), body.stream)
                       if fmt and tools else None,
                       one_call, call_end)
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
        prompt, _ = await asyncio.to_thread(encode_prompt, served.tokenizer, body)
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
