"""The Anthropic Messages API (/v1/messages), as Claude Code and the official `anthropic` SDK use
it: the translation to the chat template and back (pure tests), and the SDK against a live
server on a tiny random Qwen-style model (Qwen's `<tool_call>` markup). A random model never
calls a tool by itself, so calls are forced with tool_choice."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import anthropic
import httpx
import pytest

from omlx_coordinator.api import anthropic as adapter
from omlx_coordinator.api.anthropic_schema import MessagesRequest
from omlx_coordinator.errors import APIError
from omlx_coordinator.request.events import Delta, Done, KeepAlive
from omlx_coordinator.telemetry.metrics import GatewayMetrics
from omlx_coordinator.text.tokenizer import ChatTokenizer
from omlx_coordinator.text.tool_calls import CallEnd, ToolCallStream
from tests.conftest import Server, start_server
from tests.tiny_models import build_tokenizer, qwen_tokenizer, tiny_qwen

KEY = "sk-ant-test"
CONTEXT = 2048
BLOCK = 16  # a small KV block, so the prefix cache serves short prompts
# A small, closed schema: a random model under it finishes a forced call within a few tokens.
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                            "required": ["city"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# The SDK no longer has sampling parameters; the API (and this server) still takes them.
GREEDY = {"temperature": 0}
slow = pytest.mark.slow


def _body(**kw) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **kw})


# ---- the translation, no server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> ChatTokenizer:
    return ChatTokenizer(qwen_tokenizer(tmp_path_factory.mktemp("tok") / "qwen-tok"))


def test_conversation_becomes_template_messages(tok: ChatTokenizer) -> None:
    body = _body(system=[{"type": "text", "text": "Be terse."},
                         {"type": "text", "text": "Use tools.", "cache_control":
                          {"type": "ephemeral"}}],
                 tools=[WEATHER],
                 messages=[
                     {"role": "user", "content": [{"type": "text", "text": "Weather "},
                                                  {"type": "text", "text": "in Paris?",
                                                   "cache_control": {"type": "ephemeral"}}]},
                     {"role": "assistant", "content": [
                         {"type": "thinking", "thinking": "hmm", "signature": "s"},
                         {"type": "text", "text": "Looking."},
                         {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                          "input": {"city": "Paris"}},
                         {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                          "input": {"city": "Rome"}}]},
                     {"role": "user", "content": [
                         {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                         {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                          "content": [{"type": "text", "text": "no data"}]},
                         {"type": "text", "text": "And tomorrow?"}]},
                     {"role": "system", "content": "Answer in French."}])
    assert adapter.template_messages(body, tok) == [
        {"role": "system", "content": "Be terse.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "name": "get_weather",
         "content": "Error: no data"},
        {"role": "user", "content": "And tomorrow?"},
        # Qwen's template renders a system turn anywhere: it stays one.
        {"role": "system", "content": "Answer in French."}]
    assert adapter.RequestTools(body).shown() == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": WEATHER["input_schema"]}}]
    assert adapter.encode_prompt(tok, _body(messages=ASK, tools=[WEATHER],
                                            tool_choice={"type": "none"}))[1] is None


# Mistral-like: system only first, roles alternate.
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system only first') }}{% endif %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}[assistant]")


def test_late_system_joins_the_user_turn_where_the_template_refuses_it(tmp_path: Path) -> None:
    """Claude Code sends a system message after the first user turn; a template that takes
    system only first gets its text in that user turn (and turns keep alternating)."""
    build_tokenizer(tmp_path, chat_template=STRICT_TEMPLATE)
    strict = ChatTokenizer(tmp_path)
    body = _body(system="S", messages=[{"role": "user", "content": "Hi"},
                                       {"role": "system", "content": "Agents: none."},
                                       {"role": "assistant", "content": "Hello"},
                                       {"role": "user", "content": "Bye"}])
    messages = adapter.template_messages(body, strict)
    assert messages == [{"role": "system", "content": "S"},
                        {"role": "user", "content": "Hi\n\nAgents: none."},
                        {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Bye"}]
    assert strict.encode_chat(messages)


def test_refused_and_dropped_blocks(tok: ChatTokenizer) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    cases = {
        "messages.0.content.1": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                             image]}],
        "messages.0.content.0.tool_use_id": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}],
        "messages.2.content.0.content.0": [*ASK, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t", "content": [image]}]}],
        "messages": [{"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Prefilled"}],
    }
    for param, messages in cases.items():
        with pytest.raises(APIError) as e:
            adapter.template_messages(_body(messages=messages), tok)
        assert e.value.status == 400 and e.value.param == param, (param, e.value.message)
    with pytest.raises(APIError) as e:
        adapter.RequestTools(_body(messages=ASK, tools=[
            WEATHER, {"type": "code_execution_20250825", "name": "code_execution"}]))
    assert e.value.param == "tools.1" and "server tool" in e.value.message
    # A search tool is one the model may leave unused: it is left out, not refused.
    searching = adapter.RequestTools(_body(messages=ASK, tools=[
        WEATHER, {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]))
    assert [t["function"]["name"] for t in searching.shown()] == ["get_weather"]
    # Block types nothing here renders are dropped: the turn's text is what is left.
    body = _body(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hi"}, {"type": "server_tool_use", "id": "srvtoolu_1",
                                         "name": "web_search", "input": {}}]}])
    assert adapter.template_messages(body, tok) == [{"role": "user", "content": "Hi"}]


def test_follow_up_turn_extends_the_previous_prompt(tok: ChatTokenizer) -> None:
    """An agent's next turn (the reply's tool_use, its tool_result, a new question) templates
    to the previous prompt, the reply as the model wrote it under the forced-call grammar, and
    more: the prefix cache serves all of the previous turn."""
    first = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "system", "content": "Tools: get_weather."}]
    call = {"type": "tool_use", "id": "call_1", "name": "get_weather",
            "input": {"city": "Paris"}}
    follow = first + [{"role": "assistant", "content": [call]},
                      {"role": "user", "content": [{"type": "tool_result",
                                                    "tool_use_id": "call_1",
                                                    "content": "Sunny"}]}]

    def prompt(messages: list[dict]) -> list[int]:
        body = _body(system="Be terse.", tools=[WEATHER], messages=messages)
        return adapter.encode_prompt(tok, body)[0]

    before, after = prompt(first), prompt(follow)
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert after[:len(before)] == before
    assert tok.tokenizer.decode(after[len(before):]).startswith(written)


def test_a_text_block_sent_back_with_its_citations(tok: ChatTokenizer) -> None:
    """The SDK sends an earlier reply's text blocks back as it got them, `"citations": null`
    included (a reply from Anthropic's API may hold real ones): the model reads the text."""
    said = {"type": "text", "text": "It is sunny."}
    cited = [{"type": "char_location", "cited_text": "sunny", "document_index": 0,
              "document_title": None, "start_char_index": 0, "end_char_index": 5}]

    def prompt(block: dict) -> list[int]:
        body = _body(messages=[{"role": "user", "content": "Weather?"},
                               {"role": "assistant", "content": [block]},
                               {"role": "user", "content": "Thanks."}])
        return adapter.encode_prompt(tok, body)[0]

    assert prompt({**said, "citations": None}) == prompt({**said, "citations": cited}) == \
        prompt(said)


CLAUDE_CODE_BODY = Path(__file__).parent / "data" / "claude_code_2.1.332_messages.json"


def test_the_newest_claude_codes_body_is_accepted_and_its_deferred_tool_left_out(
        tok: ChatTokenizer) -> None:
    """Claude Code 2.1.332's first request, as recorded (thinking.display, defer_loading,
    context_management, output_config, a mid-conversation system message): accepted, and the
    deferred tool's definition is not in the prompt, while the others are."""
    body = MessagesRequest.model_validate(json.loads(CLAUDE_CODE_BODY.read_text()))
    prompt, tools = adapter.encode_prompt(tok, body)
    text = tok.tokenizer.decode(prompt)
    assert "DeferredToolPlaceholder" not in text
    assert '"name": "ToolSearch"' in text and '"name": "Write"' in text
    # Its calls would still be read: every declared tool is callable.
    assert "DeferredToolPlaceholder" in [t["function"]["name"] for t in tools.callable()]


def _deferred(**kw) -> MessagesRequest:
    lazy = {**WEATHER, "name": "get_forecast", "defer_loading": True}
    return _body(tools=[WEATHER, lazy], **kw)


def test_a_tool_reference_loads_a_deferred_tool_where_it_stands(tok: ChatTokenizer) -> None:
    """A tool search's result names a deferred tool: its definition is rendered in that result,
    so the prompt before it (what the prefix cache holds) does not change."""
    search = {"type": "tool_use", "id": "toolu_s", "name": "get_weather", "input": {"city": "x"}}
    first = [*ASK, {"role": "assistant", "content": [search]}]
    found = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s",
                                          "content": [{"type": "tool_reference",
                                                       "tool_name": "get_forecast"}]}]}
    before = adapter.encode_prompt(tok, _deferred(messages=[*first, {
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s",
                                     "content": "none"}]}]))[0]
    body = _deferred(messages=[*first, found])
    after, tools = adapter.encode_prompt(tok, body)
    shared = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    assert "get_forecast" not in tok.tokenizer.decode(after[:shared])
    assert '<function>{"name": "get_forecast"' in tok.tokenizer.decode(after[shared:])
    # Loaded, it is among the tools tool_choice "any" may force.
    assert [t["function"]["name"] for t in tools.offered()] == ["get_weather", "get_forecast"]
    with pytest.raises(APIError) as e:
        adapter.encode_prompt(tok, _deferred(messages=[*first, {
            "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_s",
                                         "content": [{"type": "tool_reference",
                                                      "tool_name": "nope"}]}]}]))
    assert e.value.param == "messages.2.content.0.content.0.tool_name", e.value.message


def test_tool_additions_and_removals_in_a_system_message(tok: ChatTokenizer) -> None:
    add = {"type": "tool_addition", "tool": {"type": "tool_reference", "tool_name": "get_forecast"}}
    inline = {"type": "tool_addition", "tool": {"type": "tool_definition", "definition": {
        "name": "get_time", "input_schema": {"type": "object"}}}}
    remove = {"type": "tool_removal", "tool": {"type": "tool_reference", "tool_name": "get_weather"}}
    body = _deferred(messages=[*ASK, {"role": "system", "content": [add, inline, remove]}])
    messages = adapter.template_messages(body, tok)
    assert messages[-1]["role"] == "system"
    late = messages[-1]["content"]
    assert '"name": "get_forecast"' in late and '"name": "get_time"' in late
    assert late.endswith("The tool get_weather is no longer available.")
    prompt, tools = adapter.encode_prompt(tok, body)
    assert {t["function"]["name"] for t in tools.callable()} == {
        "get_weather", "get_forecast", "get_time"}
    mcp = {"type": "tool_addition", "tool": {"type": "mcp_toolset_reference",
                                             "mcp_server_name": "x"}}
    with pytest.raises(APIError) as e:
        adapter.template_messages(_deferred(messages=[*ASK, {"role": "system",
                                                             "content": [mcp]}]), tok)
    assert e.value.param == "messages.1.content.0.tool" and "MCP" in e.value.message


def test_a_deferred_tools_call_is_parsed(tok: ChatTokenizer) -> None:
    tools = adapter.RequestTools(_deferred(messages=ASK))
    stream = ToolCallStream(tok.tool_call_format, tools.callable())
    out = stream.feed('<tool_call>\n{"name": "get_forecast", "arguments": {"city": "Rome"}}\n'
                      '</tool_call>') + stream.flush()
    [call] = [c.call for c in out if isinstance(c, CallEnd)]
    assert call.name == "get_forecast" and json.loads(call.arguments) == {"city": "Rome"}


@pytest.mark.parametrize("field, value", [
    ("mcp_servers", [{"type": "url", "url": "https://mcp.example", "name": "x"}]),
    ("container", "container_1"), ("compaction", {"type": "auto"}),
    ("thread", {"type": "create"})])
def test_server_side_features_are_refused_by_name(tok: ChatTokenizer, field: str,
                                                  value: object) -> None:
    with pytest.raises(APIError) as e:
        adapter.encode_prompt(tok, _body(messages=ASK, **{field: value}))
    assert e.value.status == 400 and e.value.param == field, e.value.message
    # Given no value, they are nothing to refuse.
    assert adapter.encode_prompt(tok, _body(messages=ASK, **{field: None}))[0]


def test_output_format_and_strict_tools_constrain_the_output(tok: ChatTokenizer) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    for fields in ({"output_config": {"format": {"type": "json_schema", "schema": schema}}},
                   {"output_format": {"type": "json_schema", "schema": schema}}):
        body = _body(messages=ASK, **fields)
        fmt, grammar = adapter._tool_use(tok, body, adapter.encode_prompt(tok, body)[1])
        assert fmt is None and '"ok"' in grammar
    body = _body(messages=ASK, tools=[{**WEATHER, "strict": True}])
    fmt, grammar = adapter._tool_use(tok, body, adapter.encode_prompt(tok, body)[1])
    assert fmt is not None and "Paris" in grammar
    assert adapter._tool_use(tok, _body(messages=ASK, tools=[WEATHER]),
                             adapter.RequestTools(_body(messages=ASK, tools=[WEATHER])))[1] == ""


def _reply(tok: ChatTokenizer, one_call: bool = False) -> adapter._Reply:
    tools = [{"type": "function", "function": {"name": "get_weather",
                                               "parameters": WEATHER["input_schema"]}}]
    return adapter._Reply("m", 10, ToolCallStream(tok.tool_call_format, tools), one_call)


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_reply_blocks_and_events(tok: ChatTokenizer) -> None:
    reply = _reply(tok)
    events = []
    for piece in ["\n", "Let me ", "look.\n", CALL[:9], CALL[9:], "\n", CALL, "\n  "]:
        events += reply.feed(piece)
    closing, message = reply.finish(Done("stop", 10, 30, 4))
    events += closing
    assert [b["type"] for b in message["content"]] == ["text", "tool_use", "tool_use"]
    assert message["content"][0]["text"] == "\nLet me look.\n"
    assert message["content"][1]["input"] == {"city": "Paris"}
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": 6, "cache_read_input_tokens": 4,
                                "cache_creation_input_tokens": 0, "output_tokens": 30}
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [("content_block_start", 0), ("content_block_delta", 0),
                     ("content_block_delta", 0), ("content_block_stop", 0),
                     ("content_block_start", 1), ("content_block_delta", 1),
                     ("content_block_stop", 1),
                     ("content_block_start", 2), ("content_block_delta", 2),
                     ("content_block_stop", 2), ("message_delta", None), ("message_stop", None)]
    assert events[5]["delta"] == {"type": "input_json_delta",
                                  "partial_json": '{"city": "Paris"}'}
    assert events[4]["content_block"]["input"] == {}

    one = _reply(tok, one_call=True)
    one.feed(CALL + "\n" + CALL + "more text")
    _, message = one.finish(Done("stop", 10, 30))
    assert [b["type"] for b in message["content"]] == ["tool_use"]

    stopped = adapter._Reply("m", 10, None)
    stopped.feed("Hello")
    assert stopped.finish(Done("stop", 10, 3, 0, "END"))[1]["stop_reason"] == "stop_sequence"
    assert stopped.finish(Done("length", 10, 3))[1]["stop_reason"] == "max_tokens"


def test_stream_errors_are_error_events() -> None:
    async def events(error: Exception):
        yield KeepAlive()
        yield Delta("Hi")
        raise error

    async def run(error: Exception) -> list[str]:
        reply = adapter._Reply("m", 3, None)
        return [chunk async for chunk in adapter._stream(reply, events(error), GatewayMetrics(),
                                                         keepalive_seconds=5.0)]

    for error, kind in ((APIError(503, "the node is gone", type="server_error"),
                         "overloaded_error"), (RuntimeError("bug"), "api_error")):
        chunks = asyncio.run(run(error))
        names = [line for c in chunks for line in c.split("\n") if line.startswith("event: ")]
        assert names == ["event: message_start", "event: ping", "event: content_block_start",
                         "event: content_block_delta", "event: error"]
        body = json.loads(chunks[-1].split("data: ", 1)[1])
        assert body["type"] == "error" and body["error"]["type"] == kind


def test_error_types_follow_the_status() -> None:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
             502: "api_error", 503: "overloaded_error", 504: "timeout_error",
             405: "invalid_request_error"}
    for status, kind in kinds.items():
        assert adapter.error_body(status, "m") == {"type": "error", "error": {
            "type": kind, "message": "m"}}


# ---- end to end ---------------------------------------------------------------------------------


# Every live test runs on one node and again through a 2-stage pipeline (the tail samples
# under the forced call's grammar).
@pytest.fixture(scope="module", params=[1, 2], ids=["one node", "2-stage pipeline"])
def qwen_server(request, tmp_path_factory):
    dest = tmp_path_factory.mktemp("models") / "tiny-qwen-anthropic"
    # Seed 6: its greedy replies are whitespace, then text (held whitespace opens no block).
    tiny_qwen(dest, seed=6, context=CONTEXT)
    # Keep-alives (pings) every 10 ms: a stream waiting for its prefill gets some.
    with start_server(dest, "--api-key", KEY, "--cache-block-size", str(BLOCK), "--nodes",
                      str(request.param), home=tmp_path_factory.mktemp("home"),
                      keepalive=0.01) as s:
        yield s


@pytest.fixture(scope="module")
def client(qwen_server: Server) -> anthropic.Anthropic:
    # No retries: a retried request would hide a failure.
    return anthropic.Anthropic(base_url=qwen_server.url, api_key=KEY, max_retries=0,
                               timeout=120)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


@slow
def test_message(client: anthropic.Anthropic, qwen_server: Server) -> None:
    m = client.messages.create(model=qwen_server.model_id, max_tokens=30, extra_body=GREEDY,
                               system="You are terse.", messages=ASK)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == qwen_server.model_id
    assert [b.type for b in m.content] == ["text"] and _text(m).strip()
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 30
    counted = client.messages.count_tokens(model=qwen_server.model_id, system="You are terse.",
                                           messages=ASK).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
    assert m.usage.cache_creation_input_tokens == 0

    # The same prompt again: the prefix cache serves it, and usage says so as Anthropic does.
    again = client.messages.create(model=qwen_server.model_id, max_tokens=30, extra_body=GREEDY,
                                   system="You are terse.", messages=ASK)
    assert again.usage.cache_read_input_tokens >= (counted // BLOCK - 1) * BLOCK > 0
    assert again.usage.input_tokens == counted - again.usage.cache_read_input_tokens
    assert _text(again) == _text(m)  # greedy


@slow
def test_stream_with_the_sdk_accumulator(client: anthropic.Anthropic,
                                         qwen_server: Server) -> None:
    kw = dict(model=qwen_server.model_id, max_tokens=30, extra_body=GREEDY, messages=ASK)
    with client.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == _text(final) == _text(client.messages.create(**kw))
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens >= 1
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        client.messages.count_tokens(model=qwen_server.model_id, messages=ASK).input_tokens

    # The raw event sequence, each with its `event:` line; pings while the prompt prefills.
    # Sampled: random tokens, so a text block, but a reply that ends at once or whose tokens
    # are all whitespace (held, it opens no block) has none (a CI run drew one): a few tries,
    # each a prompt of its own (a cached one prefills too fast for pings).
    for attempt in range(5):
        long_ask = [{"role": "user",
                     "content": f"Try {attempt}. " + "Hello world! How are you today? " * 60}]
        events = _raw_events(qwen_server, {"model": qwen_server.model_id, "max_tokens": 12,
                                           "messages": long_ask, "stream": True})
        names = [name for name, _ in events]
        assert all(name == data["type"] for name, data in events)
        assert "ping" in names
        names = [n for n in names if n != "ping"]
        assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
        if len(names) > 3:
            break
    assert names[1:-2] == ["content_block_start"] + ["content_block_delta"] * (
        len(names) - 5) + ["content_block_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 400
    delta = next(d for n, d in events if n == "message_delta")
    assert delta["usage"]["output_tokens"] >= 1 and delta["delta"]["stop_sequence"] is None


def _raw_events(server: Server, body: dict) -> list[tuple[str, dict]]:
    events, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120,
                      headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


@slow
def test_forced_tool_use_round_trip(client: anthropic.Anthropic, qwen_server: Server) -> None:
    model = qwen_server.model_id
    m = client.messages.create(model=model, max_tokens=80, messages=ASK, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use", m
    [call] = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id
    assert call.input in ({"city": "Paris"}, {"city": "Rome"})

    # The client runs the tool and sends the result back, with the SDK's own blocks.
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": f"Sunny in {call.input['city']}"}]}
    follow = [*ASK, {"role": "assistant", "content": m.content}, result]
    answer = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY,
                                    messages=follow, tools=[WEATHER])
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # The follow-up's prompt starts with the first turn's: the prefix cache served it.
    assert answer.usage.cache_read_input_tokens >= (m.usage.input_tokens // BLOCK - 1) * BLOCK
    assert answer.usage.cache_read_input_tokens > 0

    # Streamed: the SDK assembles the input from input_json_delta fragments.
    with client.messages.stream(model=model, max_tokens=80, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any",
                                             "disable_parallel_tool_use": True}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    [call] = final.content
    assert call.type == "tool_use" and call.input in ({"city": "Paris"}, {"city": "Rome"})


@slow
def test_count_tokens(client: anthropic.Anthropic, qwen_server: Server, tok) -> None:
    model = qwen_server.model_id
    plain = client.messages.count_tokens(model=model, messages=ASK).input_tokens
    expected = tok.encode_chat([{"role": "user", "content": ASK[0]["content"]}])
    assert plain == len(expected)
    with_tools = client.messages.count_tokens(model=model, messages=ASK, tools=[WEATHER])
    assert with_tools.input_tokens > plain
    none = client.messages.count_tokens(model=model, messages=ASK, tools=[WEATHER],
                                        tool_choice={"type": "none"})
    assert none.input_tokens == plain  # tool_choice none: the model does not see the tools


@slow
def test_stop_sequences(client: anthropic.Anthropic, qwen_server: Server) -> None:
    kw = dict(model=qwen_server.model_id, max_tokens=30, extra_body=GREEDY, messages=ASK)
    text = _text(client.messages.create(**kw))
    # Three characters the reply writes after some text: it stops before them.
    stop = next(text[i:i + 3] for i in range(len(text) - 3) if text[:i].strip())
    m = client.messages.create(**kw, stop_sequences=["never-written", stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert _text(m) == text[:text.find(stop)]
    with client.messages.stream(**kw, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


@slow
def test_max_tokens_past_the_context_is_a_cap(client: anthropic.Anthropic,
                                              qwen_server: Server) -> None:
    """Claude Code sends max_tokens 32000: the model's room is less, and that is what it gets."""
    long_ask = [{"role": "user", "content": "The capital of France is Paris. " * 180}]
    prompt = client.messages.count_tokens(model=qwen_server.model_id,
                                          messages=long_ask).input_tokens
    room = CONTEXT - prompt
    assert 0 < room < 400
    m = client.messages.create(model=qwen_server.model_id, max_tokens=32000, messages=long_ask)
    assert m.usage.output_tokens <= room
    assert m.stop_reason == "end_turn" or (m.stop_reason == "max_tokens"
                                           and m.usage.output_tokens == room)

    # A prompt past the context is refused in Anthropic's words, which agents act on.
    too_long = [{"role": "user", "content": "The capital of France is Paris. " * 400}]
    n = client.messages.count_tokens(model=qwen_server.model_id, messages=too_long).input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=qwen_server.model_id, max_tokens=10, messages=too_long)
    assert e.value.body["error"]["message"] == f"prompt is too long: {n} tokens > {CONTEXT} maximum"


@slow
def test_beta_route_headers_and_keys(qwen_server: Server, client: anthropic.Anthropic) -> None:
    # client.beta sends ?beta=true and anthropic-beta, as Claude Code does.
    m = client.beta.messages.create(model=qwen_server.model_id, max_tokens=4, messages=ASK,
                                    betas=["claude-code-20250219",
                                           "interleaved-thinking-2025-05-14"])
    assert m.usage.output_tokens >= 1
    assert client.beta.messages.count_tokens(model=qwen_server.model_id, messages=ASK,
                                             betas=["token-counting-2024-11-01"]).input_tokens
    # Authorization: Bearer works as well as x-api-key.
    bearer = anthropic.Anthropic(base_url=qwen_server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.create(model=qwen_server.model_id, max_tokens=2,
                                  messages=ASK).content is not None
    wrong = anthropic.Anthropic(base_url=qwen_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=qwen_server.model_id, max_tokens=2, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(qwen_server.url + "/v1/messages", json={}, timeout=10)
    assert r.status_code == 401 and r.json()["type"] == "error"
    # The OpenAI routes keep OpenAI's error shape.
    r = httpx.get(qwen_server.url + "/v1/models", headers={"x-api-key": "wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(qwen_server.url + "/v1/models", headers={"x-api-key": KEY},
                     timeout=10).status_code == 200


@slow
def test_claude_code_shaped_request(client: anthropic.Anthropic, qwen_server: Server) -> None:
    """The fields Claude Code sends (recorded from Claude Code 2.1; see test_claude_code.py)."""
    body = {
        "model": qwen_server.model_id, "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
                   {"type": "text", "text": "You are Claude Code.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>\n"},
                                         {"type": "text", "text": "Say hi",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Available agent types: none."}],
        "tools": [WEATHER],
        "metadata": {"user_id": '{"device_id":"d","session_id":"s"}'},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "temperature": 1, "top_p": 0.9, "top_k": 40, "service_tier": "auto",
    }
    events = _raw_events(qwen_server, body)
    assert events[-1][0] == "message_stop"


BAD = {  # name: (body fields over a valid body, words the message must contain)
    "unknown field": ({"frobnicate": 1}, ["frobnicate"]),
    "container": ({"container": "c1"}, ["container", "not supported"]),
    "mcp server": ({"mcp_servers": [{"type": "url", "url": "https://mcp.example",
                                     "name": "x"}]}, ["mcp_servers", "MCP"]),
    "output_config.format": ({"output_config": {"format": {"type": "json_schema"}}},
                             ["output_config.format"]),
    "missing max_tokens": ({"max_tokens": None}, ["max_tokens"]),
    "image block": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]},
        ["messages.0.content.0", "image"]),
    "unknown tool_use_id": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]},
        ["tool_use_id", "toolu_x"]),
    "malformed tool schema": ({"tools": [{"name": "f", "input_schema": {
        "type": "object", "properties": {"city": "string"}}}]}, ["tools.0.input_schema"]),
    "tool schema not an object": ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
                                  ["tools.0.input_schema", "object"]),
    "bad tool name": ({"tools": [{"name": "no spaces", "input_schema": {"type": "object"}}]},
                      ["tools.0.name"]),
    "server tool": ({"tools": [{"type": "code_execution_20250825", "name": "code_execution"}]},
                    ["tools.0", "server tool"]),
    "tool_choice names no tool": ({"tools": [WEATHER],
                                   "tool_choice": {"type": "tool", "name": "nope"}}, ["nope"]),
    "tool_choice any without tools": ({"tool_choice": {"type": "any"}}, ["tool_choice"]),
    "tool_choice tool without a name": ({"tools": [WEATHER], "tool_choice": {"type": "tool"}},
                                        ["tool_choice", "name"]),
    "prefill": ({"messages": [*ASK, {"role": "assistant", "content": "The"}]}, ["prefill"]),
    "clear tool uses": ({"context_management": {"edits": [
        {"type": "clear_tool_uses_20250919"}]}}, ["context_management.edits.0.type"]),
    "role": ({"messages": [{"role": "tool", "content": "x"}]}, ["messages.0.role"]),
    "content is a number": ({"messages": [{"role": "user", "content": 5}]},
                            ["messages.0.content", "string or a list"]),
    "temperature above 1": ({"temperature": 1.5}, ["temperature"]),
    "stop sequence too long": ({"stop_sequences": ["ok", "x" * 1025]},
                               ["stop_sequences.1", "1024"]),
}


@slow
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(qwen_server: Server, name: str) -> None:
    fields, words = BAD[name]
    body = {k: v for k, v in {"model": qwen_server.model_id, "max_tokens": 4, "messages": ASK,
                              **fields}.items() if v is not None}
    r = httpx.post(qwen_server.url + "/v1/messages?beta=true", json=body, timeout=30,
                   headers={"x-api-key": KEY})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    for word in words:
        assert word in err["error"]["message"], err


@slow
def test_sdk_exceptions_and_the_server_keeps_serving(client: anthropic.Anthropic,
                                                     qwen_server: Server) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-opus-4", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"
    assert "claude-opus-4" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=qwen_server.model_id, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "document", "source": {
                "type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert "document" in e.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=qwen_server.model_id, messages=[])
    with pytest.raises(anthropic.BadRequestError) as e:  # a stream refused before it starts
        with client.messages.stream(model=qwen_server.model_id, max_tokens=4, messages=ASK,
                                    extra_body={"mcp_servers": [
                                        {"type": "url", "url": "https://mcp.example",
                                         "name": "x"}]}) as stream:
            stream.get_final_message()
    assert "mcp_servers" in e.value.message
    # JSON may carry a lone surrogate, which no tokenizer takes.
    r = httpx.post(qwen_server.url + "/v1/messages", timeout=10,
                   headers={"x-api-key": KEY, "content-type": "application/json"},
                   content=json.dumps({"model": qwen_server.model_id, "max_tokens": 4,
                                       "messages": [{"role": "user", "content": "a\ud800"}]}))
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"]
    r = httpx.post(qwen_server.url + "/v1/messages/batches", headers={"x-api-key": KEY},
                   json={}, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(qwen_server.url + "/v1/messages", headers={"x-api-key": KEY}, timeout=10)
    assert r.status_code == 405 and r.json()["type"] == "error"

    # Blocks nothing here renders are dropped, and logged once per type.
    thinking = {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Let me think.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "abc"}, {"type": "text", "text": "Hello"}]}
    for _ in range(2):
        m = client.messages.create(model=qwen_server.model_id, max_tokens=4,
                                   messages=[*ASK, thinking, *ASK])
        assert m.usage.output_tokens >= 1
    log = qwen_server.log_tail(400)
    assert log.count("dropping thinking content blocks") == 1
    assert log.count("dropping redacted_thinking content blocks") == 1
    assert "Traceback" not in log


WRITE = {"name": "write_file", "description": "Writes a file",
         "input_schema": {"type": "object", "properties": {
             "content": {"type": "string", "minLength": 2500, "maxLength": 2500}},
             "required": ["content"], "additionalProperties": False}}


@pytest.mark.slow
def test_a_long_tool_call_streams(tmp_path: Path) -> None:
    """A long tool call (minutes for a large file at a Mac's speed) streams its arguments as the
    model writes them, from its name on: no stretch of the stream is silent for longer than the
    keep-alive interval (a proxy or a client's read timeout would drop it)."""
    dest = tmp_path / "tiny-qwen"
    tiny_qwen(dest, seed=6, context=4096)
    every = 0.3
    with start_server(dest, home=tmp_path / "home", keepalive=every) as server:
        def timeline(path: str, body: dict) -> list[tuple[float, str]]:
            out = []
            with httpx.stream("POST", server.url + path, json=body, timeout=300) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith(("event: ", ": keep-alive", "data: {")):
                        out.append((time.monotonic(), line))
            return out

        anth = timeline("/v1/messages", {
            "model": server.model_id, "max_tokens": 3000, "stream": True, "messages": ASK,
            "tools": [WRITE], "tool_choice": {"type": "tool", "name": "write_file"}})
        names = [line.removeprefix("event: ") for _, line in anth if line.startswith("event: ")]
        opened = names.index("content_block_start")
        deltas = names[opened + 1:-3]
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        # Many deltas, not one at the end: how many depends on how the server's stream interval
        # gathered the ~2,500 tokens (fewer, larger ones on a loaded machine).
        assert len(deltas) > 20 and set(deltas) <= {"content_block_delta", "ping"}
        pieces = [json.loads(line[6:])["delta"]["partial_json"] for _, line in anth
                  if '"input_json_delta"' in line]
        assert len(json.loads("".join(pieces))["content"]) == 2500
        gaps = [b[0] - a[0] for a, b in zip(anth, anth[1:])]
        assert max(gaps) < 3 * every, max(gaps)

        tool = {"type": "function", "function": {"name": "write_file",
                                                 "parameters": WRITE["input_schema"]}}
        oai = timeline("/v1/chat/completions", {
            "model": server.model_id, "max_tokens": 3000, "stream": True, "messages": ASK,
            "tools": [tool], "tool_choice": {"type": "function",
                                             "function": {"name": "write_file"}}})
        calls = [line for _, line in oai if '"tool_calls"' in line]
        assert len(calls) > 20
        gaps = [b[0] - a[0] for a, b in zip(oai, oai[1:])]
        assert max(gaps) < 3 * every, max(gaps)
