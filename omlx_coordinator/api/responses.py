"""The OpenAI Responses API (POST /v1/responses), as Codex CLI and the `openai` SDK use it, over
the same generation core as the chat and messages routes.

Input items become the messages the model's chat template renders, as chat's do: `instructions`
and system/developer messages lead as one system message, a `function_call` joins the assistant
turn before it as a tool call, a `function_call_output` is a `tool` message; `reasoning` items
(a client echoes them back) are dropped. Tools, tool_choice and `text.format` go through chat's
setup (tool_setup.py: the same parsing and llguidance grammars). The output becomes `message`
and `function_call` items, streamed as the API's event sequence (every event numbered) or
returned as one response object. Errors take OpenAI's error shape, in a stream as a
`response.failed` event.

Choices where the API leaves room:
- `previous_response_id`: the stored conversation (response_store.py; instructions are not
  carried over, as the API says) comes before this input. `store: false` keeps nothing; an
  unknown or forgotten id is a 400 (`previous_response_not_found`, as OpenAI's).
- usage: `input_tokens` is the whole prompt, `cached_tokens` the part the prefix cache served;
  `reasoning_tokens` is 0 (reasoning, if a model writes any, is in the text).
- A reply cut by `max_output_tokens` (or the context) is `incomplete`, reason
  `max_output_tokens`, as OpenAI's.
- Built-in tools (file_search, code_interpreter, computer use, MCP...) and custom (free-form)
  tools are refused: they would run on OpenAI's servers, or need a grammar per tool. Web search
  is left out of the prompt instead (common.py `leaves_out`: Codex sends it by default).
  A `defer_loading` function is left out of the prompt and its calls still parsed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse, Response

from omlx_coordinator.api.common import (
    ClosingStream,
    Primed,
    Silence,
    collect_unless_gone,
    encode_chat,
    leaves_out,
    sse,
)
from omlx_coordinator.api.openai_schema import _arguments
from omlx_coordinator.api.response_store import ResponseStore, StoredResponse
from omlx_coordinator.api.responses_schema import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputText,
    MessageItem,
    NamedFunction,
    NamespaceTool,
    Other,
    OutputText,
    Part,
    Refusal,
    ResponsesRequest,
)
from omlx_coordinator.api.tool_setup import ToolSetup, setup_tools
from omlx_coordinator.errors import APIError
from omlx_coordinator.frontdoor.access import account_of, admit
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
from omlx_coordinator.text.tokenizer import ChatTokenizer
from omlx_coordinator.text.tool_calls import (
    CallArguments,
    CallStart,
    Item,
    ToolCall,
    ToolCallStream,
    call_input,
)

log = logging.getLogger(__name__)

PATH = "/v1/responses"
ENDPOINT = "responses"  # the metrics label

# Item types a client echoes back that carry nothing to render.
_DROPPED_ITEMS = {"reasoning"}


# ---- request -> chat template ------------------------------------------------------------------


def _part_text(part: Part, param: str, output: bool = False) -> str:
    if isinstance(part, InputText | OutputText):
        return part.text
    if isinstance(part, Refusal):
        return part.refusal
    what = "the tool output" if output else "the model"
    raise APIError(400, f"'{param}': {part.type!r} content is not supported: {what} here "
                        "reads text only", param=param)


def _content(content: str | list[Part], param: str, output: bool = False) -> str:
    if isinstance(content, str):
        return content
    return "".join(_part_text(p, f"{param}.{j}", output) for j, p in enumerate(content))


def _conversation(items: str | list, calls: dict[str, str]) -> list[dict]:
    """This request's input as chat-template messages. `calls` (call id -> function name, of
    the conversation so far) grows with the calls the input makes."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        at = f"input.{i}"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _content(item.content, f"{at}.content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name,
                                 "arguments": _arguments(item.arguments, f"{at}.arguments")}}
            calls[item.call_id] = item.name
            # Chat templates take one assistant turn with its text and every call it made.
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise APIError(400, f"'{at}.call_id': {item.call_id!r} answers no function_call "
                                    "of the conversation", param=f"{at}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "name": calls[item.call_id],
                        "content": _content(item.output, f"{at}.output", output=True)})
        elif item.type not in _DROPPED_ITEMS:
            raise APIError(400, f"'{at}': input items of type {item.type!r} are not supported "
                                "here (messages, function_call, function_call_output and "
                                "reasoning are)", param=at)
    return out


def _with_instructions(instructions: str | None, conversation: list[dict]) -> list[dict]:
    """The instructions and the system messages that open the conversation as one system
    message: chat templates render one, first."""
    lead = [instructions] if instructions else []
    k = 0
    while k < len(conversation) and conversation[k]["role"] == "system":
        lead.append(conversation[k]["content"])
        k += 1
    head = [{"role": "system", "content": "\n\n".join(lead)}] if lead else []
    return head + conversation[k:]


@dataclass(frozen=True)
class _Tools:
    tools: list[dict]  # every function, in chat's shape (for the parser and the grammars)
    deferred: frozenset[str]  # names left out of the prompt
    namespaces: dict[str, str]  # function name -> its namespace


def _tools(body: ResponsesRequest) -> _Tools:
    tools: list[dict] = []
    deferred: set[str] = set()
    namespaces: dict[str, str] = {}

    def add(t: FunctionTool, at: str, namespace: str | None) -> None:
        if any(x["function"]["name"] == t.name for x in tools):
            raise APIError(400, f"'{at}.name': the function name {t.name!r} is used twice",
                           param=f"{at}.name")
        fn = t.model_dump(include={"name", "description", "parameters", "strict"},
                          exclude_none=True)
        tools.append({"type": "function", "function": fn})
        if t.defer_loading:
            deferred.add(t.name)
        if namespace is not None:
            namespaces[t.name] = namespace

    for i, t in enumerate(body.tools or []):
        at = f"tools.{i}"
        if isinstance(t, FunctionTool):
            add(t, at, None)
        elif isinstance(t, NamespaceTool):
            for j, member in enumerate(t.tools):
                if isinstance(member, Other):
                    _refuse_tool(member, f"{at}.tools.{j}")
                add(member, f"{at}.tools.{j}", t.name)
        elif not leaves_out(t.type or ""):
            _refuse_tool(t, at)
    return _Tools(tools, frozenset(deferred), namespaces)


def _refuse_tool(tool: Other, at: str) -> None:
    if tool.type == "custom":
        why = ("custom (free-form) tools are not supported here: declare a function tool with "
               "JSON parameters")
    else:
        why = (f"{tool.type!r} is a built-in tool (run by OpenAI's servers), not supported "
               "here: declare function tools")
    raise APIError(400, f"'{at}': {why}", param=at)


def _mode(body: ResponsesRequest, tools: _Tools) -> tuple[str, str | None]:
    """(tool mode as tool_setup.py takes it, the named function)."""
    choice = body.tool_choice
    if isinstance(choice, NamedFunction):
        return "named", choice.name
    if isinstance(choice, Other):
        raise APIError(400, f"'tool_choice': {choice.type!r} is not supported here: use "
                            "\"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                            "\"name\": ...}", param="tool_choice")
    return choice or ("auto" if tools.tools else "none"), None


def _setup(body: ResponsesRequest, tok: ChatTokenizer, tools: _Tools) -> ToolSetup:
    fmt = body.text.format if body.text else None
    reply: dict | None = None
    what = None
    if fmt is not None and fmt.type == "json_object":
        reply = {"type": "object"}
    elif fmt is not None and fmt.type == "json_schema":
        reply, what = fmt.schema_, f"the text.format schema {fmt.name!r}"
    mode, name = _mode(body, tools)
    setup = setup_tools(tok, tools.tools or None, mode, name,
                        body.parallel_tool_calls is not False, reply, "text.format.schema",
                        what, schema_param="tools.{i}.parameters")
    if setup.template_tools and tools.deferred:
        shown = [t for t in setup.template_tools if t["function"]["name"] not in tools.deferred]
        setup = ToolSetup(shown or None, setup.fmt, setup.tools, setup.single_call,
                          setup.grammar)
    return setup


def _prompt(tok: ChatTokenizer, body: ResponsesRequest, previous: StoredResponse | None
            ) -> tuple[list[int], list[dict], ToolSetup, _Tools]:
    """(the prompt's token ids, the conversation to store, the tool setup, the tools)."""
    earlier = list(previous.messages) if previous else []
    calls = {c["id"]: c["function"]["name"] for m in earlier for c in m.get("tool_calls", [])}
    conversation = earlier + _conversation(body.input, calls)
    tools = _tools(body)
    setup = _setup(body, tok, tools)
    messages = _with_instructions(body.instructions, conversation)
    return encode_chat(tok, messages, setup.template_tools, "input"), conversation, setup, tools


# ---- model output -> items ----------------------------------------------------------------------


def _usage(done: Done) -> dict:
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


class _Reply:
    """One response: the model's output as items, built alike for a stream (the events `feed`
    and `finish` return, numbered) and a whole reply (the response `finish` returns)."""

    def __init__(self, body: ResponsesRequest, model: str, setup: ToolSetup, tools: _Tools):
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.body, self.model, self.namespaces = body, model, tools.namespaces
        self.calls = (ToolCallStream(setup.fmt, setup.tools, bool(body.stream)) if setup.fmt
                      else None)
        self.single_call = setup.single_call
        self.output: list[dict] = []
        self.text_open = False  # the last item is a message whose text may still grow
        # With tools, whitespace outside a message waits: what a model writes around its calls
        # ("\n" between two) is no message.
        self.held = ""
        self.seq = 0

    def response(self, status: str, usage: dict | None = None,
                 error: dict | None = None) -> dict:
        b = self.body
        fmt = b.text.format if b.text and b.text.format else None
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": self.output, "error": error,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": b.instructions, "metadata": b.metadata or {},
            "max_output_tokens": b.max_output_tokens,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p,
            "tool_choice": (b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedFunction)
                            else b.tool_choice or "auto"),
            "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in b.tools or []],
            "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                                else {"type": "text"})},
            "store": b.store is not False, "truncation": b.truncation or "disabled",
            "reasoning": b.reasoning or {}, "service_tier": "default", "user": b.user,
            "usage": usage}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict]:
        return [self._event("response.created", response=self.response("in_progress")),
                self._event("response.in_progress", response=self.response("in_progress"))]

    def feed(self, text: str) -> list[dict]:
        return self._add(self.calls.feed(text) if self.calls else [text] if text else [])

    def finish(self, done: Done) -> tuple[list[dict], dict]:
        """The closing events and the whole response."""
        events = self._add(self.calls.flush() if self.calls else [])
        if self.held and not self.output:  # a reply of whitespace only is still a reply
            self.held, events = "", events + self._text(self.held)
        events += self._close_text()
        status = "incomplete" if done.finish_reason == "length" else "completed"
        whole = self.response(status, _usage(done))
        events.append(self._event(f"response.{status}", response=whole))
        return events, whole

    def failed(self, e: APIError) -> dict:
        code = e.code or ("server_error" if e.status >= 500 else "invalid_request_error")
        return self._event("response.failed", response=self.response(
            "failed", error={"code": code, "message": e.message}))

    def assistant_message(self) -> dict:
        """The output as the chat template's assistant turn (what a continuation renders)."""
        text = "".join(p["text"] for m in self.output if m["type"] == "message"
                       for p in m["content"])
        calls = [{"id": c["call_id"], "type": "function",
                  "function": {"name": c["name"], "arguments": call_input(c["arguments"])}}
                 for c in self.output if c["type"] == "function_call"]
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}

    def _close_text(self) -> list[dict]:
        if not self.text_open:
            return []
        self.text_open = False
        index = len(self.output) - 1
        item = self.output[index]
        item["status"] = "completed"
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.output_text.done", **where, text=part["text"],
                            logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _text(self, text: str) -> list[dict]:
        events = []
        if not self.text_open:
            self.text_open = True
            item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}
            self.output.append(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            where = {"output_index": len(self.output) - 1}
            events += [self._event("response.output_item.added", **where,
                                   item={**item, "content": []}),
                       self._event("response.content_part.added", **where, item_id=item["id"],
                                   content_index=0, part=dict(part))]
            item["content"].append(part)
        index = len(self.output) - 1
        item = self.output[index]
        item["content"][0]["text"] += text
        return events + [self._event("response.output_text.delta", item_id=item["id"],
                                     output_index=index, content_index=0, delta=text,
                                     logprobs=[])]

    def _call_start(self, start: CallStart) -> list[dict]:
        events = self._close_text()
        item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "status": "in_progress",
                "call_id": start.id, "name": start.name, "arguments": ""}
        if start.name in self.namespaces:
            item["namespace"] = self.namespaces[start.name]
        self.output.append(item)
        return events + [self._event("response.output_item.added",
                                     output_index=len(self.output) - 1, item=dict(item))]

    def _call_arguments(self, text: str) -> list[dict]:
        index = len(self.output) - 1
        return [self._event("response.function_call_arguments.delta",
                            item_id=self.output[index]["id"], output_index=index, delta=text)]

    def _call_end(self, call: ToolCall) -> list[dict]:
        index = len(self.output) - 1
        item = self.output[index]
        item.update(arguments=call.arguments, status="completed")
        return [self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=call.name, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _add(self, pieces: list[Item]) -> list[dict]:
        events: list[dict] = []
        for piece in pieces:
            if self.single_call and any(i["type"] == "function_call"
                                        and i["status"] == "completed" for i in self.output):
                break  # parallel_tool_calls false: nothing after the first call
            if isinstance(piece, CallStart):
                self.held = ""
                events += self._call_start(piece)
                continue
            if isinstance(piece, CallArguments):
                events += self._call_arguments(piece.text)
                continue
            if not isinstance(piece, str):  # the call's end
                events += self._call_end(piece.call)
                continue
            if self.calls and not self.text_open:
                self.held += piece
                if not self.held.strip():
                    continue
                piece, self.held = self.held, ""
            events += self._text(piece)
        return events


# ---- routes -------------------------------------------------------------------------------------


def add_routes(app: FastAPI, manager: ModelManager, metrics_of: dict[str, GatewayMetrics],
               settings: GatewaySettings, keyed: list[Depends],
               store: ResponseStore | None = None) -> None:
    """`metrics_of`: each model's, by name; `store`: the responses kept for
    previous_response_id (a fresh one by default)."""
    store = store if store is not None else ResponseStore()

    @app.post(PATH, dependencies=keyed)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        served = await check_servable(manager, body.model, account_of(request.scope))
        admit(request.scope, served)
        metrics, tok = metrics_of[served.name], served.tokenizer
        previous = None
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise APIError(400, f"previous response {body.previous_response_id!r} is not "
                                    "stored here: it was sent with store false, or forgotten "
                                    f"(the last {store.capacity} are kept, until a restart); "
                                    "send the whole conversation as input",
                               param="previous_response_id", code="previous_response_not_found")
        prompt, conversation, setup, tools = await asyncio.to_thread(_prompt, tok, body,
                                                                      previous)
        max_tokens = token_budget(served, prompt, body.max_output_tokens, settings, "input")
        fmt = setup.fmt
        # One call only: its end marker ends generation (the parser takes a call without it).
        stop = [fmt.end] if fmt and fmt.end and setup.single_call else []
        req = GenerationRequest(
            prompt=prompt, max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, stop=stop, grammar=setup.grammar,
            account=account_of(request.scope))
        reply = _Reply(body, served.name, setup, tools)
        events = generate(manager, served, metrics, settings, req)

        def keep() -> None:
            if body.store is not False:
                store.put(reply.id, StoredResponse(tuple(conversation)
                                                   + (reply.assistant_message(),)))

        if body.stream:
            events = Primed(events)
            return ClosingStream(_stream(reply, events, metrics, settings.keepalive_seconds,
                                         keep), events, settings.request_timeout)

        async def collect() -> JSONResponse:
            async for ev in events:
                if isinstance(ev, Delta):
                    reply.feed(ev.text)
                elif isinstance(ev, Done):
                    whole = reply.finish(ev)[1]
                    keep()
                    return JSONResponse(whole)
            raise APIError(502, "the generation ended without a result", type="server_error")

        return await collect_unless_gone(request, collect, events, metrics, ENDPOINT)


def _event(data: dict) -> str:
    return sse(data, event=data["type"])


async def _stream(reply: _Reply, events: AsyncIterator, metrics: GatewayMetrics,
                  keepalive_seconds: float, keep: Callable[[], None]) -> AsyncIterator[str]:
    outcome = "error"
    silence = Silence(keepalive_seconds)
    try:
        yield "".join(_event(e) for e in reply.start())
        async for ev in events:
            outs = ([] if isinstance(ev, KeepAlive) else
                    reply.feed(ev.text) if isinstance(ev, Delta) else reply.finish(ev)[0])
            if isinstance(ev, Done):
                keep()  # before the last event: a client's next request may name it at once
                outcome = "ok"
            if outs:
                yield "".join(_event(out) for out in outs)
                silence.wrote()
            elif isinstance(ev, KeepAlive) or silence.overdue():
                yield ": keep-alive\n\n"
                silence.wrote()
    except APIError as e:
        # Headers are sent already: the error ends the stream as the API's response.failed.
        yield _event(reply.failed(e))
    except Exception as e:
        yield _event(reply.failed(internal_error(log, "internal error", e)))
    except asyncio.CancelledError:
        outcome = "disconnected"
        raise
    finally:
        metrics.requests.labels(ENDPOINT, outcome).inc()
        await events.aclose()
