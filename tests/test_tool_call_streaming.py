"""Tool-call arguments stream as they are generated (issue 38, part 5).

Unit tests of streamed_json.py and of ToolCallStream's streaming mode (text split anywhere:
inside the markers, the escapes, the numbers); every mlx-lm tool-call family, streamed or not,
gives calls whose argument pieces add up to the whole-call parse's arguments; each API's route,
its generation scripted token by token in-process, sends the first argument delta before the
model has written the call's end; and against a live server the official SDKs accumulate a
forced call streamed in several deltas into the same object as the non-streamed reply.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from omlx_coordinator.api import anthropic as anthropic_api
from omlx_coordinator.api import openai as openai_api
from omlx_coordinator.api import responses as responses_api
from omlx_coordinator.http.gateway import create_app
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_coordinator.request.events import Delta, Done, KeepAlive
from omlx_coordinator.text.streamed_json import JsonStream
from omlx_coordinator.text.tool_calls import (
    STREAMED_FAMILIES,
    CallArguments,
    CallEnd,
    CallStart,
    Item,
    ToolCallFormat,
    ToolCallStream,
    _parser_module,
)
from tests.conftest import Server, start_server
from tests.tiny_models import serving, tiny_qwen

# ---- streamed_json.py ---------------------------------------------------------------------------

TRICKY = [
    '{"a":1,"b":[1,2.50,{"c":"x\\u00e9\\n\\"y"}],"d":true,"e":null,"f":-0,"g":1E5}',
    # Surrogates: a pair is one character, a lone one stays alone, as json.loads has them.
    '{"h":"\\ud83d\\ude00 \\ud83d x \\udc00 \\ud83d\\ud83d\\ude00 \\ud83d\\n","i":{},"j":[]}',
    '{ "content" : "line 1\\nline 2\\t\\u0001 </tool_call \\/ \\\\ é😀" , "n" : [ 1 , -2.5e-3 ] }',
    '{"nan": NaN, "inf": -Infinity, "big": 1e400, "deep": {"a": {"b": [[[{}]]]}}}',
    "{}",
]


def _random_splits(text: str, rng: random.Random) -> Iterator[str]:
    i = 0
    while i < len(text):
        k = rng.randint(1, 6)
        yield text[i:i + k]
        i += k


@pytest.mark.parametrize("text", TRICKY)
def test_json_stream_writes_what_json_dumps_writes(text: str) -> None:
    want = json.dumps(json.loads(text), ensure_ascii=False)
    rng = random.Random(text)
    for splits in [list(text)] + [list(_random_splits(text, rng)) for _ in range(200)]:
        js = JsonStream()
        got = "".join(p.text for part in splits for p in js.feed(part))
        assert js.done and got == want, splits


def test_json_stream_members() -> None:
    js = JsonStream()
    pieces = [p for ch in '{"name": "f", "arguments": {"a": [1, "x"]}, "id": 7} tail'
              for p in js.feed(ch)]
    assert js.done
    by_member: dict = {}
    for p in pieces:
        by_member.setdefault(p.member, []).append(p.text)
    assert "".join(by_member["name"]) == '"f"'
    assert "".join(by_member["arguments"]) == '{"a": [1, "x"]}'
    assert "".join(by_member["id"]) == "7"
    assert [p.member for p in pieces if p.end] == ["name", "arguments", "id"]


@pytest.mark.parametrize("bad", ['{"a":01}', '{"a" 1}', '{"a":1,}', '{"a":"\\x"}',
                                 '{"a":"\n"}', '{"a":[1}', '{"a":tru}', '{"a":"\\u12g4"}'])
def test_json_stream_refuses_what_json_loads_refuses(bad: str) -> None:
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad)
    js = JsonStream()
    with pytest.raises(ValueError):
        for ch in bad + "}":
            js.feed(ch)


def test_json_stream_holds_only_what_may_change() -> None:
    js = JsonStream()
    assert "".join(p.text for p in js.feed('{"n": 12')) == '{"n": '  # the number may go on
    assert "".join(p.text for p in js.feed('3, "s": "ab\\u00')) == '123, "s": "ab'
    assert "".join(p.text for p in js.feed("e9\\ud83d")) == "é"  # a pair may follow
    assert "".join(p.text for p in js.feed("\\ude00")) == "😀"


# ---- tool_calls.py: the streaming mode -----------------------------------------------------------


def _fmt(family: str) -> ToolCallFormat:
    module = _parser_module(family)
    return ToolCallFormat(family, module.tool_call_start, module.tool_call_end,
                          module.parse_tool_call)


def _calls(items: list[Item]) -> list[tuple[str, str, int]]:
    """(name, arguments, how many pieces) of each call; checks the items' order and that each
    call's pieces add up to its arguments."""
    calls, start, pieces = [], None, []
    for item in items:
        if isinstance(item, CallStart):
            assert start is None
            start, pieces = item, []
        elif isinstance(item, CallArguments):
            assert start is not None
            pieces.append(item.text)
        elif isinstance(item, CallEnd):
            assert start is not None and item.call.id == start.id
            assert item.call.name == start.name and "".join(pieces) == item.call.arguments
            calls.append((start.name, item.call.arguments, len(pieces)))
            start = None
    assert start is None
    return calls


def _run(fmt: ToolCallFormat, parts: list[str], stream: bool, tools=None) -> list[Item]:
    s = ToolCallStream(fmt, tools, stream=stream)
    return [item for part in parts for item in s.feed(part)] + s.flush()


CALL = ('<tool_call>\n{"name": "write", "arguments": {"path": "a.txt", "text": "x \\"q\\" '
        '\\u00e9\\ud83d\\ude00</b> </tool_cal\\n", "n": 1.50, "ok": true, "none": null}}\n'
        '</tool_call>')
MIXED = "Writing.\n" + CALL + "\n" + CALL.replace("write", "save") + " done <tool_c"


@pytest.mark.parametrize("cut", range(len(MIXED) + 1))
def test_streamed_calls_at_every_split_point(cut: int) -> None:
    fmt = _fmt("json_tools")
    whole = _run(fmt, [MIXED], stream=False)
    streamed = _run(fmt, [MIXED[:cut], MIXED[cut:]], stream=True)
    assert [(n, a) for n, a, _ in _calls(streamed)] == [(n, a) for n, a, _ in _calls(whole)]
    texts = "".join(x for x in streamed if isinstance(x, str))
    assert texts == "".join(x for x in whole if isinstance(x, str)) == "Writing.\n\n done <tool_c"


def test_arguments_go_out_with_the_token_that_carries_them() -> None:
    """Char by char: the call starts with the name's closing quote, its first argument byte
    goes out with the `{` that opens the arguments, and every later character goes out at
    once, but for what may still be markup or is not whole yet."""
    fmt = _fmt("json_tools")
    s = ToolCallStream(fmt, None, stream=True)
    outs = [s.feed(ch) for ch in CALL] + [s.flush()]
    at = {type(x).__name__: i for i, out in reversed(list(enumerate(outs))) for x in out}
    assert at["CallStart"] == CALL.index('"write"') + len('"write"') - 1
    assert at["CallArguments"] == CALL.index('{"path"')
    assert at["CallEnd"] == len(CALL) - 1  # the end marker's last character
    [(name, arguments, pieces)] = _calls([x for out in outs for x in out])
    assert name == "write" and pieces > 40
    assert json.loads(arguments)["text"] == 'x "q" é😀</b> </tool_cal\n'
    # After the first byte, a character waits only inside an escape, a number or a literal, a
    # possible end marker (`</tool_cal` in the string too, until its next character tells it
    # apart), or is whitespace between tokens, or the object's own closing brace.
    waits = r'\\u....\\u....|\\u....|\\.|1\.50|true|null|</tool_cal|</|(?<=[:,]) |\}\n</tool_call'
    spans = [m.span() for m in re.finditer(waits, CALL)]
    for i, out in enumerate(outs[:len(CALL)]):
        if i > at["CallArguments"] and not out:
            assert any(a <= i < b for a, b in spans), (i, CALL[i - 5:i + 5])


def test_a_streamed_call_that_breaks_off_ends_with_what_was_sent() -> None:
    fmt = _fmt("json_tools")
    cut = CALL[:CALL.index("</b>")]
    [(name, arguments, _)] = _calls(_run(fmt, list(cut), stream=True))
    assert name == "write" and arguments == '{"path": "a.txt", "text": "x \\"q\\" é😀'
    # Not JSON further on: the same; a whole-call reply gives the markup back as text.
    bad = CALL.replace('"n": 1.50', '"n": 01')
    [(_, arguments, _)] = _calls(_run(fmt, list(bad), stream=True))
    assert arguments.endswith('"n": ')
    assert _run(fmt, [bad], stream=False) == [bad]


@pytest.mark.parametrize("body, streams", [
    # The arguments before the name, or as JSON text: they come whole at the end.
    ('{"arguments": {"a": 1}, "name": "f"}', False),
    ('{"name": "f", "arguments": "{\\"a\\": 1}"}', False),
    ('{"name": "f"}', False),  # no arguments: {}
    ('[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', False),
    ('{"name": "f", "arguments": {"a": 1}}', True),
])
def test_json_bodies_that_cannot_stream_come_whole(body: str, streams: bool) -> None:
    fmt = _fmt("json_tools")
    text = f"<tool_call>\n{body}\n</tool_call>"
    streamed, whole = _calls(_run(fmt, list(text), stream=True)), _calls(_run(fmt, [text], False))
    assert [(n, a) for n, a, _ in streamed] == [(n, a) for n, a, _ in whole]
    assert (streamed[0][2] > 1) == streams


# One call of `write` in each family's markup; tools for the families that type by schema.
WRITE_TOOL = [{"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "n": {"type": "integer"}}}}}]
FAMILY_CALLS = {
    "json_tools": CALL,
    "qwen3_coder": "<tool_call>\n<function=write>\n<parameter=path>\na.txt\n</parameter>\n"
                   "<parameter=n>\n2\n</parameter>\n</function>\n</tool_call>",
    "glm47": "<tool_call>write<arg_key>path</arg_key><arg_value>a.txt</arg_value>"
             "<arg_key>n</arg_key><arg_value>2</arg_value></tool_call>",
    "laguna": "<tool_call>write<arg_key>path</arg_key><arg_value>a.txt</arg_value></tool_call>",
    "longcat": "<longcat_tool_call>write<longcat_arg_key>path</longcat_arg_key>"
               "<longcat_arg_value>a.txt</longcat_arg_value></longcat_tool_call>",
    "minimax_m2": '<minimax:tool_call><invoke name="write"><parameter name="path">a.txt'
                  "</parameter></invoke></minimax:tool_call>",
    "minicpm5": '<function name="write"><param name="path">a.txt</param></function>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.write:0"
               '<|tool_call_argument_begin|>{"path": "a.txt"}<|tool_call_end|>'
               "<|tool_calls_section_end|>",
    "kimi_k3": '<|open|>tools<|sep|><|open|>call tool="write" index="1"<|sep|>'
               '<|open|>argument key="path" type="string"<|sep|>a.txt<|close|>argument<|sep|>'
               "<|close|>call<|sep|><|close|>tools<|sep|>",
    "muse_spark": '<atem:function_calls><atem:invoke name="write"><atem:parameter name="path">'
                  "a.txt</atem:parameter></atem:invoke></atem:function_calls>",
    "mistral": '[TOOL_CALLS]write[ARGS]{"path": "a.txt", "n": 2}',
    "pythonic": '<|tool_call_start|>[write(path="a.txt", n=2)]<|tool_call_end|>',
    "gemma4": '<|tool_call>call:write{path:<|"|>a.txt<|"|>,n:2}<tool_call|>',
    "function_gemma": "<start_function_call>call:write{path:<escape>a.txt<escape>,n:2}"
                      "<end_function_call>",
}


def test_every_family_of_mlx_lm_is_covered() -> None:
    folder = Path(_parser_module("json_tools").__file__).parent
    assert {p.stem for p in folder.glob("*.py")} - {"__init__"} == set(FAMILY_CALLS)


@pytest.mark.parametrize("family", sorted(FAMILY_CALLS))
def test_every_family_streams_or_comes_whole_alike(family: str) -> None:
    fmt = _fmt(family)
    text = "Sure. " + FAMILY_CALLS[family]
    whole = _calls(_run(fmt, [text], stream=False, tools=WRITE_TOOL))
    [(name, arguments, _)] = whole
    assert name == "write" and json.loads(arguments)["path"] == "a.txt"
    rng = random.Random(family)
    for parts in [list(text)] + [list(_random_splits(text, rng)) for _ in range(20)]:
        streamed = _calls(_run(fmt, parts, stream=True, tools=WRITE_TOOL))
        assert [(n, a) for n, a, _ in streamed] == [(name, arguments)]
        assert (streamed[0][2] > 1) == (family in STREAMED_FAMILIES and len(parts) > 1)


# ---- each API's route, its generation scripted --------------------------------------------------

SCHEMA = {"type": "object", "properties": {
    "path": {"type": "string"}, "text": {"type": "string"}, "n": {"type": "number"},
    "ok": {"type": "boolean"}, "none": {"type": "null"}}}
ASK = [{"role": "user", "content": "Write the file."}]
# Forced calls: their grammar is built and checked, and they stream as any other.
ROUTES = {
    "chat": ("/v1/chat/completions", {
        "messages": ASK, "tool_choice": {"type": "function", "function": {"name": "write"}},
        "tools": [{"type": "function", "function": {"name": "write", "parameters": SCHEMA}}]}),
    "messages": ("/v1/messages", {
        "messages": ASK, "max_tokens": 500, "tool_choice": {"type": "tool", "name": "write"},
        "tools": [{"name": "write", "input_schema": SCHEMA}]}),
    "responses": ("/v1/responses", {
        "input": "Write the file.", "tool_choice": {"type": "function", "name": "write"},
        "tools": [{"type": "function", "name": "write", "parameters": SCHEMA}]}),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("models") / "tiny-qwen-streaming"
    # Seed 6 as in test_anthropic_api.py.
    return tiny_qwen(dest, seed=6)


class Scripted:
    """The gateway app, every route's generation core replaced by a script of token texts (a
    keep-alive halfway); `log` holds, in order, each token as the core hands it over
    ("generated") and each body chunk as the app sends it ("sent")."""

    def __init__(self, model_dir: Path, monkeypatch: pytest.MonkeyPatch, tokens: list[str]):
        manager = serving(model_dir, "m", ClusterOptions(nodes=0, os_reserve_bytes=0))
        served = manager.models[0]
        self.log: list[tuple[str, str]] = []

        async def servable(manager, name: str, account=None):
            return served

        async def generate(manager, model, metrics, settings, req):
            for i, token in enumerate(tokens):
                if i == len(tokens) // 2:
                    yield KeepAlive()
                self.log.append(("generated", token))
                yield Delta(token, [0])
            yield Done("stop", len(req.prompt), len(tokens))

        for module in (openai_api, anthropic_api, responses_api):
            monkeypatch.setattr(module, "check_servable", servable)
            monkeypatch.setattr(module, "generate", generate)
        self.app = create_app(manager, start_cluster=False)

    def post(self, path: str, body: dict) -> str:
        """The response body; the log gets its chunks as they are sent."""
        self.log.clear()
        data = json.dumps({"model": "m", **body}).encode()
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
                 "server": ("gw", 80), "headers": [(b"host", b"gw"),
                                                   (b"content-type", b"application/json"),
                                                   (b"content-length", str(len(data)).encode())]}
        asked = False

        async def receive() -> dict:
            nonlocal asked
            if not asked:
                asked = True
                return {"type": "http.request", "body": data, "more_body": False}
            await asyncio.Event().wait()  # the client stays until the reply ends

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                self.log.append(("sent", message["body"].decode()))

        asyncio.run(self.app(scope, receive, send))
        return "".join(text for kind, text in self.log if kind == "sent")


def _sse(chunk: str) -> list[dict | str]:
    """A chunk's events: their data, or the keep-alive they are."""
    out: list[dict | str] = []
    for block in chunk.split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if block.startswith(": keep-alive"):
            out.append("keep-alive")
        elif data and data[0] != "[DONE]":
            event = json.loads(data[0])
            out.append("keep-alive" if event.get("type") == "ping" else event)
    return out


def _argument_piece(api: str, event: dict | str) -> str | None:
    if not isinstance(event, dict):
        return None
    if api == "chat":
        calls = event["choices"][0]["delta"].get("tool_calls") if event.get("choices") else None
        return calls[0]["function"].get("arguments") or None if calls else None
    if api == "messages":
        delta = event.get("delta", {})
        return delta.get("partial_json") if delta.get("type") == "input_json_delta" else None
    return event.get("delta") if event["type"] == "response.function_call_arguments.delta" \
        else None


def _whole_arguments(api: str, reply: dict) -> dict:
    if api == "chat":
        return json.loads(reply["choices"][0]["message"]["tool_calls"][0]["function"]
                          ["arguments"])
    if api == "messages":
        return reply["content"][0]["input"]
    return json.loads(reply["output"][0]["arguments"])


@pytest.mark.parametrize("api", sorted(ROUTES))
def test_the_first_argument_delta_is_sent_before_the_call_ends(
        api: str, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = [CALL[i:i + 3] for i in range(0, len(CALL), 3)]
    app = Scripted(model_dir, monkeypatch, tokens)
    path, body = ROUTES[api]
    app.post(path, {**body, "stream": True})
    log = list(app.log)
    end_marker = next(i for i, (kind, text) in enumerate(log)
                      if kind == "generated" and "</" in text and i > len(log) // 2)
    pieces = [(i, piece) for i, (kind, text) in enumerate(log) if kind == "sent"
              for event in _sse(text) if (piece := _argument_piece(api, event))]
    assert pieces and pieces[0][0] < end_marker  # sent while the model still writes the call
    assert len(pieces) > 10
    # Keep-alives still go out where they fall, between two argument deltas.
    alive = [i for i, (kind, text) in enumerate(log) if kind == "sent"
             and "keep-alive" in _sse(text)]
    assert any(pieces[0][0] < i < pieces[-1][0] for i in alive)
    # The pieces add up to what the whole reply gives.
    whole = json.loads(app.post(path, {**body, "stream": False}))
    assert json.loads("".join(p for _, p in pieces)) == _whole_arguments(api, whole)
    assert _whole_arguments(api, whole)["text"] == 'x "q" é😀</b> </tool_cal\n'


# ---- the official SDKs against a live server ------------------------------------------------------

# A string of 60 to 80 characters: a random model under the grammar writes a call of many tokens.
NOTE = {"type": "object", "properties": {"note": {"type": "string", "minLength": 60,
                                                  "maxLength": 80}},
        "required": ["note"], "additionalProperties": False}


@pytest.fixture(scope="module")
def live(model_dir: Path, tmp_path_factory) -> Iterator[Server]:
    with start_server(model_dir, "--api-key", "sk-stream", home=tmp_path_factory.mktemp("home"),
                      keepalive=0.05) as s:
        yield s


@pytest.mark.slow
def test_sdks_accumulate_streamed_arguments_into_the_whole_reply(live: Server) -> None:
    model, greedy = live.model_id, {"temperature": 0, "max_tokens": 300}
    chat = openai.OpenAI(base_url=live.url + "/v1", api_key="sk-stream", max_retries=0,
                         timeout=120)
    kw = dict(model=model, messages=ASK, **greedy,
              tools=[{"type": "function", "function": {"name": "note", "parameters": NOTE}}],
              tool_choice={"type": "function", "function": {"name": "note"}})
    with chat.chat.completions.stream(**kw) as stream:
        deltas = sum(e.type == "tool_calls.function.arguments.delta" for e in stream)
        [streamed] = stream.get_final_completion().choices[0].message.tool_calls
    [whole] = chat.chat.completions.create(**kw).choices[0].message.tool_calls
    assert deltas > 1 and len(json.loads(whole.function.arguments)["note"]) >= 60
    assert (streamed.function.name, streamed.function.arguments) == (
        whole.function.name, whole.function.arguments)

    claude = anthropic.Anthropic(base_url=live.url, api_key="sk-stream", max_retries=0,
                                 timeout=120)
    # (The anthropic SDK's stream() takes no temperature argument: the body carries it.)
    kw = dict(model=model, messages=ASK, max_tokens=300, extra_body={"temperature": 0},
              tools=[{"name": "note", "input_schema": NOTE}],
              tool_choice={"type": "tool", "name": "note"})
    with claude.messages.stream(**kw) as stream:
        deltas = sum(e.type == "input_json" for e in stream)
        final = stream.get_final_message()
    whole_message = claude.messages.create(**kw)
    assert deltas > 1 and final.stop_reason == whole_message.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        (b.type, b.name, b.input) for b in whole_message.content]

    kw = dict(model=model, input="Write the file.", temperature=0, max_output_tokens=300,
              tools=[{"type": "function", "name": "note", "parameters": NOTE}],
              tool_choice={"type": "function", "name": "note"})
    with chat.responses.stream(**kw) as stream:
        deltas = sum(e.type == "response.function_call_arguments.delta" for e in stream)
        [streamed] = stream.get_final_response().output
    [whole] = chat.responses.create(**kw).output
    assert deltas > 1
    assert (streamed.name, streamed.arguments) == (whole.name, whole.arguments)
    assert "Traceback" not in live.log_tail(300)
