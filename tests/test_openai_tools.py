"""OpenAI tool calling, constrained decoding, logprobs and n > 1.

Pure unit tests (tool-call streaming at every split point, the grammars of constraints.py, the
coordinator staying free of MLX, an agent's follow-up turn extending its previous prompt) and
end-to-end tests against a live server on a tiny random Qwen-style model whose chat template
has Qwen's `<tool_call>` JSON markup, driven by the official `openai` SDK. A random model never
calls a tool by itself, so calls are forced (tool_choice "required" or named).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import httpx
import jsonschema
import llguidance
import llguidance.hf
import openai
import pydantic
import pytest
from transformers import AutoTokenizer

from omlx_coordinator.api.openai import _Choice, _Output
from omlx_coordinator.api.openai_schema import ChatCompletionRequest
from omlx_coordinator.errors import APIError
from omlx_coordinator.request.events import Delta, Done
from omlx_coordinator.text import constraints
from omlx_coordinator.text.tokenizer import ChatTokenizer
from omlx_coordinator.text.tool_calls import (
    CallEnd,
    CallStart,
    Item,
    ToolCallFormat,
    ToolCallStream,
)
from proto import omlx_pb2 as pb
from tests.conftest import Server, start_server
from tests.tiny_models import QWEN_VOCAB, build_tokenizer, qwen_tokenizer, tiny_qwen

slow = pytest.mark.slow  # the end-to-end tests


# Small, closed schemas: a random model under them finishes within a few tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, CLOCK]
CALL_TEXT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
             '</tool_call>')


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> ChatTokenizer:
    return ChatTokenizer(qwen_tokenizer(tmp_path_factory.mktemp("tok") / "qwen-tok"))


def _merged(items: list[Item]) -> list[str | tuple[str, dict]]:
    """Adjacent texts joined, calls as (name, arguments) (their ids are fresh each time)."""
    out: list = []
    for item in items:
        if isinstance(item, str):
            if out and isinstance(out[-1], str):
                out[-1] += item
            else:
                out.append(item)
        elif isinstance(item, CallEnd):
            out.append((item.call.name, json.loads(item.call.arguments)))
    return out


# ---- tool_calls.py ----------------------------------------------------------------------------


def test_format_is_inferred_and_cached(tok: ChatTokenizer) -> None:
    fmt = ToolCallFormat.for_tokenizer(tok)
    assert fmt is not None and fmt is ToolCallFormat.for_tokenizer(tok)
    assert (fmt.family, fmt.start, fmt.end) == ("json_tools", "<tool_call>", "</tool_call>")
    vocab = tok.tokenizer.get_added_vocab()
    assert (fmt.start_id, fmt.end_id) == (vocab["<tool_call>"], vocab["</tool_call>"])
    [call] = fmt.parse('\n{"name": "get_time", "arguments": {}}\n', TOOLS)
    assert (call.name, call.arguments) == ("get_time", "{}") and call.id.startswith("call_")
    with pytest.raises(ValueError):
        fmt.parse("\n{not json}\n", TOOLS)


def test_markup_survives_decoding(tok: ChatTokenizer) -> None:
    ids = tok.tokenizer.encode(CALL_TEXT + "<|im_end|>", add_special_tokens=False)
    assert tok.decode(ids) == CALL_TEXT  # the markers stay, the EOS goes


def test_special_token_markers_survive_decoding(tmp_path: Path) -> None:
    """Mistral's [TOOL_CALLS] is a special token: decoding keeps it (the parser needs it) and
    still drops the other special tokens."""
    build_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    hf.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    hf.chat_template = "{{ messages }}[TOOL_CALLS]"
    hf.save_pretrained(str(tmp_path))
    mistral = ChatTokenizer(tmp_path)
    assert mistral.tool_call_format.family == "mistral"
    text = '[TOOL_CALLS][{"name": "f", "arguments": {}}]'
    ids = mistral.tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    assert mistral.decode(ids) == text


MIXED = ('Let me look.\n' + CALL_TEXT + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
         '</tool_call> and <tool_c')
MIXED_PARSED = ["Let me look.\n", ("get_weather", {"city": "Paris", "days": 2}), "\n",
                ("get_time", {}), " and <tool_c"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("cut", range(len(MIXED) + 1))
def test_stream_at_every_split_point(tok: ChatTokenizer, cut: int, stream: bool) -> None:
    fmt = tok.tool_call_format
    s = ToolCallStream(fmt, TOOLS, stream)
    first = s.feed(MIXED[:cut])
    # Text before the first call goes out at once, but for a tail that may open a call.
    before = MIXED[:min(cut, MIXED.index("<tool_call>"))]
    held = next((k for k in range(len(fmt.start) - 1, 0, -1) if before.endswith(fmt.start[:k])),
                0)
    assert "".join(x for x in first if isinstance(x, str)).startswith(before[:len(before) - held])
    assert _merged(first + s.feed(MIXED[cut:]) + s.flush()) == MIXED_PARSED


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stream_char_by_char(tok: ChatTokenizer, stream: bool) -> None:
    s = ToolCallStream(tok.tool_call_format, TOOLS, stream)
    items = [x for ch in MIXED for x in s.feed(ch)] + s.flush()
    assert _merged(items) == MIXED_PARSED
    assert not any(isinstance(x, str) and "tool_call>" in x for x in items)  # no markup leaks


@pytest.mark.parametrize("text, expected", [
    # Markup that does not parse comes out as the text it is.
    ("a<tool_call>\n{not json}\n</tool_call>b", ["a<tool_call>\n{not json}\n</tool_call>b"]),
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',
     ['<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>']),
    # Cut off: parsed if what came is a whole call (a stop string can end it there)...
    ('x<tool_call>\n{"name": "get_time", "arguments": {}}', ["x", ("get_time", {})]),
    # ...text otherwise.
    ('<tool_call>\n{"name": "get_ti', ['<tool_call>\n{"name": "get_ti']),
    ("<tool_cal", ["<tool_cal"]),
    ("<tool_x <tool_call", ["<tool_x <tool_call"]),
    ("", []),
])
def test_stream_edge_cases(tok: ChatTokenizer, text: str, expected: list) -> None:
    s = ToolCallStream(tok.tool_call_format, TOOLS)
    assert _merged(s.feed(text) + s.flush()) == expected


def test_family_from_tokenizer_config_and_calls_without_end_marker() -> None:
    """tokenizer_config's tool_parser_type wins; Mistral's calls run to the end of the output
    and keep the model's own ids (its templates check them)."""
    hf = SimpleNamespace(chat_template="{{ messages }}",
                         init_kwargs={"tool_parser_type": "mistral"},
                         get_added_vocab=lambda: {"[TOOL_CALLS]": 9})
    fmt = ToolCallFormat.infer(hf)
    assert (fmt.family, fmt.start, fmt.end, fmt.start_id) == ("mistral", "[TOOL_CALLS]", "", 9)
    s = ToolCallStream(fmt, None)
    text = 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, "id": "abc123XYZ"}]'
    items = [x for ch in text for x in s.feed(ch)]
    assert items == list("Sure.")  # the call waits for the end of the output
    start, _, end = s.flush()
    assert isinstance(start, CallStart) and isinstance(end, CallEnd)
    call = end.call
    assert (call.id, call.name, json.loads(call.arguments)) == ("abc123XYZ", "f", {"a": 1})


def test_coordinator_imports_no_mlx(tok: ChatTokenizer) -> None:
    code = textwrap.dedent(f"""
        import sys
        import omlx_coordinator.text.constraints, omlx_coordinator.api.openai
        from omlx_coordinator.text.tokenizer import ChatTokenizer
        from omlx_coordinator.text.tool_calls import ToolCallStream, _parser_module
        fmt = ChatTokenizer({str(tok.tokenizer.name_or_path)!r}).tool_call_format
        s = ToolCallStream(fmt, None)
        assert len(s.feed({CALL_TEXT!r}) + s.flush()) == 3  # start, arguments, end
        for family in ("qwen3_coder", "mistral", "glm47", "laguna", "pythonic", "kimi_k2"):
            _parser_module(family)
        loaded = [m for m in sys.modules if m.split(".")[0] in ("mlx", "mlx_lm")]
        assert not loaded, loaded
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


def _replies(tok: ChatTokenizer, texts: list[str], single_call: bool = False
             ) -> tuple[list[dict], dict]:
    """(stream deltas, non-streamed choice) of the adapter for output arriving as `texts`."""
    out = _Output(tool_format=tok.tool_call_format, tools=TOOLS, single_call=single_call)
    choice = _Choice(0, True, tok, out)
    deltas = [d for t in texts for d in choice.delta(Delta(t))]
    deltas += choice.finish(Done("stop", 10, len(texts)))
    return deltas, choice.full("")


def test_reply_with_calls(tok: ChatTokenizer) -> None:
    second = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    text = "I will check.\n" + CALL_TEXT + "\n" + second + "\n"
    deltas, full = _replies(tok, [text[i:i + 7] for i in range(0, len(text), 7)])
    assert "".join(d.get("content", "") for d in deltas) == "I will check.\n"
    assert "content" not in deltas[-1]  # the whitespace after the last call is dropped
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [(c["index"], c.get("id") is not None, c["function"].get("name")) for c in calls] == [
        (0, True, "get_weather"), (0, False, None), (1, True, "get_time"), (1, False, None)]
    assert full["finish_reason"] == "tool_calls"
    assert full["message"]["content"] == "I will check.\n"
    assert [c["function"]["name"] for c in full["message"]["tool_calls"]] == ["get_weather",
                                                                           "get_time"]
    # Nothing but whitespace around the calls: no content; one call asked, one given.
    _, only = _replies(tok, ["\n" + CALL_TEXT, "\n" + second], single_call=True)
    assert only["message"]["content"] is None
    assert [c["function"]["name"] for c in only["message"]["tool_calls"]] == ["get_weather"]
    # Without calls, whitespace is text like any other.
    _, plain = _replies(tok, ["Hi", " ", "\n"])
    assert plain["message"] == {"role": "assistant", "content": "Hi \n"}
    assert plain["finish_reason"] == "stop"


# ---- constraints.py -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ll_tokenizer(tok: ChatTokenizer) -> llguidance.LLTokenizer:
    return llguidance.hf.from_tokenizer(tok.tokenizer)


def _accepts(ll_tokenizer, tok: ChatTokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes the canonical tokens of `text` and is then complete."""
    m = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
    ids = tok.tokenizer.encode(text, add_special_tokens=False)
    return m.consume_tokens(ids) and m.is_accepting() and not m.is_error()


def test_forced_call_grammar(tok: ChatTokenizer, ll_tokenizer) -> None:
    fmt = tok.tool_call_format
    one = constraints.grammar_for_tool_call(fmt, TOOLS, "get_weather")
    constraints.validate(one, "tool_choice")
    assert _accepts(ll_tokenizer, tok, one, CALL_TEXT)
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    for wrong in (time_call, CALL_TEXT.replace("Paris", "Oslo"), CALL_TEXT.replace("2", "9"),
                  CALL_TEXT.replace("\n</tool_call>", "")):
        assert not _accepts(ll_tokenizer, tok, one, wrong), wrong
    either = constraints.grammar_for_tool_call(fmt, TOOLS, None)
    assert _accepts(ll_tokenizer, tok, either, time_call)
    assert not _accepts(ll_tokenizer, tok, either, CALL_TEXT + "\n" + time_call)
    several = constraints.grammar_for_tool_call(fmt, TOOLS, None, parallel=True)
    assert _accepts(ll_tokenizer, tok, several, CALL_TEXT + "\n" + time_call)
    # What the grammar forces, the family's parser reads.
    s = ToolCallStream(fmt, TOOLS)
    assert _merged(s.feed(CALL_TEXT) + s.flush()) == [("get_weather", {"city": "Paris",
                                                                        "days": 2})]


def test_auto_grammars_constrain_the_calls_and_the_reply(tok: ChatTokenizer,
                                                         ll_tokenizer) -> None:
    """tool_choice auto with strict tools: free text, then calls whose arguments follow their
    schemas. With a response_format beside the tools: calls, or a reply in that format; the
    model can still call a tool (a reply grammar alone would leave it none)."""
    fmt = tok.tool_call_format
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    strict = constraints.grammar_for_tools_or_reply(fmt, TOOLS, True, None)
    constraints.validate(strict, "tools")
    for text in ("Sure, let me look.", "", CALL_TEXT, "Checking.\n" + CALL_TEXT,
                 CALL_TEXT + "\n" + time_call):
        assert _accepts(ll_tokenizer, tok, strict, text), text
    for wrong in (CALL_TEXT.replace("Paris", "Oslo"), "Here: " + CALL_TEXT.replace("2", "9"),
                  CALL_TEXT + " and more text"):
        assert not _accepts(ll_tokenizer, tok, strict, wrong), wrong
    single = constraints.grammar_for_tools_or_reply(fmt, TOOLS, False, None)
    assert not _accepts(ll_tokenizer, tok, single, CALL_TEXT + "\n" + time_call)

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = constraints.grammar_for_tools_or_reply(fmt, TOOLS, True, schema)
    constraints.validate(reply, "tools")
    for text in ('{"ok": true}', CALL_TEXT, CALL_TEXT + "\n" + time_call):
        assert _accepts(ll_tokenizer, tok, reply, text), text
    for wrong in ('{"ok": 1}', "Sure.", '{"ok": true}' + CALL_TEXT,
                  CALL_TEXT.replace("Paris", "Oslo")):
        assert not _accepts(ll_tokenizer, tok, reply, wrong), wrong
    assert _accepts(ll_tokenizer, tok, constraints.grammar_for_tools_or_reply(
        fmt, TOOLS, True, True), "[1, 2]")

    # A marker that is plain text cannot be told from free text: strict is refused there.
    plain = ToolCallFormat("json_tools", "<call>", "</call>", lambda t, tools: {})
    with pytest.raises(APIError) as e:
        constraints.grammar_for_tools_or_reply(plain, TOOLS, True, None)
    assert e.value.param == "tools" and "plain text" in e.value.message
    constraints.grammar_for_tools_or_reply(plain, TOOLS, True, schema)  # a reply is JSON: fine
    coder = ToolCallFormat("qwen3_coder", "<tool_call>", "</tool_call>", lambda t, tools: {})
    with pytest.raises(APIError) as e:
        constraints.grammar_for_tools_or_reply(coder, TOOLS, True, schema)
    assert e.value.param == "tools" and "qwen3_coder" in e.value.message


def test_forced_call_errors(tok: ChatTokenizer) -> None:
    fmt = tok.tool_call_format
    with pytest.raises(APIError) as e:
        constraints.grammar_for_tool_call(fmt, TOOLS, "nope")
    assert e.value.param == "tool_choice" and "nope" in e.value.message
    bad = {"type": "function", "function": {"name": "dedupe", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(APIError) as e:
        constraints.grammar_for_tool_call(fmt, [WEATHER, bad], None)
    assert e.value.param == "tools.1.function.parameters"
    assert "'dedupe'" in e.value.message and "uniqueItems" in e.value.message
    coder = ToolCallFormat("qwen3_coder", "<tool_call>", "</tool_call>", lambda t, tools: {})
    with pytest.raises(APIError) as e:
        constraints.grammar_for_tool_call(coder, TOOLS, None)
    assert e.value.status == 400 and "qwen3_coder" in e.value.message


def test_json_grammars(tok: ChatTokenizer, ll_tokenizer) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    g = constraints.grammar_for_json_schema(schema, "rf.schema")
    constraints.validate(g, "response_format")
    assert _accepts(ll_tokenizer, tok, g, '{"ok": true}')
    assert not _accepts(ll_tokenizer, tok, g, '{"ok": 1}')
    obj = constraints.grammar_for_json_schema({"type": "object"}, "rf.schema")
    assert _accepts(ll_tokenizer, tok, obj, '{"a": [1, "x"]}')
    assert not _accepts(ll_tokenizer, tok, obj, "[1]")
    with pytest.raises(APIError) as e:
        constraints.validate(constraints.grammar_for_json_schema({"type": "tuple"}, "rf.schema"),
                             "rf.schema")
    assert e.value.param == "rf.schema" and "tuple" in e.value.message


# ---- agent sessions keep their cache ----------------------------------------------------------


def test_follow_up_turn_extends_the_previous_prompt(tok: ChatTokenizer) -> None:
    """The next turn of an agent (its reply with tool_calls and content null, the tool's
    result, a new question) templates to the previous prompt plus more: the prefix cache
    serves the whole previous prompt."""
    first = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Weather in Paris?"}]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}
    follow = first + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
                      {"role": "user", "content": "And tomorrow?"}]

    def prompt(messages: list[dict]) -> list[int]:
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages,
                                                     "tools": TOOLS})
        return tok.encode_chat(body.template_messages(), body.tool_dicts)

    before, after = prompt(first), prompt(follow)
    assert after[:len(before)] == before and len(after) > len(before)
    text = tok.tokenizer.decode(after)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' \
           in text and "Sunny, 21 C" in text


# ---- end to end ---------------------------------------------------------------------------------

BLOCK = 16  # a small KV block, so the prefix cache serves short prompts


# Every live test runs on one node and again through a 2-stage pipeline, where the grammars and
# logprobs are the tail stage's work.
@pytest.fixture(scope="module", params=[1, 2], ids=["one node", "2-stage pipeline"])
def qwen_server(request, tmp_path_factory):
    dest = tmp_path_factory.mktemp("models") / "tiny-qwen-tools"
    tiny_qwen(dest, seed=1)
    # Room in the embedding for the two markup tokens added to the trained vocabulary.
    assert len(AutoTokenizer.from_pretrained(str(dest))) <= QWEN_VOCAB
    with start_server(dest, "--cache-block-size", str(BLOCK), "--nodes", str(request.param),
                      node_metrics=True, home=tmp_path_factory.mktemp("home")) as s:
        yield s


@pytest.fixture(scope="module")
def client(qwen_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=qwen_server.base_url, api_key="unused", max_retries=0,
                         timeout=120)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Constrained output: greedy, so a test sees the same output every run, and room for a call
# spelled out in this tiny vocabulary's short tokens.
FORCED = {"max_tokens": 200, "temperature": 0}


def _weather_args(arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


@slow
def test_forced_tool_call_round_trip(client: openai.OpenAI, qwen_server: Server) -> None:
    r = client.chat.completions.create(model=qwen_server.model_id, messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       **FORCED)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "get_time")
    if call.function.name == "get_weather":
        _weather_args(call.function.arguments)
    assert choice.message.content is None

    named = client.chat.completions.create(
        model=qwen_server.model_id, messages=ASK, tools=TOOLS, **FORCED,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [wcall] = named.choices[0].message.tool_calls
    assert wcall.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
    args = _weather_args(wcall.function.arguments)

    # The agent's next turn: its reply (content null) and the tool's result go back, as a
    # plain dict and as the SDK's own message object.
    reply = {"role": "assistant", "content": None,
             "tool_calls": [{"id": wcall.id, "type": "function",
                             "function": {"name": "get_weather",
                                          "arguments": wcall.function.arguments}}]}
    result = {"role": "tool", "tool_call_id": wcall.id, "content": f"Sunny in {args['city']}"}
    answers = [client.chat.completions.create(model=qwen_server.model_id, temperature=0,
                                              messages=ASK + [sent, result], tools=TOOLS,
                                              max_tokens=8)
               for sent in (reply, named.choices[0].message)]
    assert all(a.choices[0].finish_reason in ("stop", "length", "tool_calls") for a in answers)
    assert answers[0].usage.prompt_tokens == answers[1].usage.prompt_tokens
    assert answers[0].usage.prompt_tokens > named.usage.prompt_tokens
    # The follow-up's prompt starts with the first turn's: the prefix cache served it.
    cached = answers[0].usage.prompt_tokens_details.cached_tokens
    assert cached >= (named.usage.prompt_tokens // BLOCK - 1) * BLOCK, answers[0].usage


@slow
def test_tool_choice_none_keeps_tools_out(client: openai.OpenAI, qwen_server: Server) -> None:
    kw = dict(model=qwen_server.model_id, messages=ASK, max_tokens=2)
    with_tools = client.chat.completions.create(tools=TOOLS, **kw)
    without = client.chat.completions.create(tools=TOOLS, tool_choice="none", **kw)
    assert without.usage.prompt_tokens == client.chat.completions.create(**kw).usage.prompt_tokens
    assert without.usage.prompt_tokens < with_tools.usage.prompt_tokens
    assert without.choices[0].message.tool_calls is None


@slow
def test_streamed_tool_calls_reassemble(client: openai.OpenAI, qwen_server: Server) -> None:
    kw = dict(model=qwen_server.model_id, messages=ASK, tools=TOOLS, **FORCED,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _weather_args(call.function.arguments)

    # The raw chunks: a header (index, id, type, name, "") then the arguments.
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])
              if c.choices]
    assert deltas[0].index == 0 and deltas[0].id and deltas[0].type == "function"
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    _weather_args("".join(d.function.arguments for d in deltas))
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any("<tool_call>" in (c.choices[0].delta.content or "") for c in chunks)


class Verdict(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    sunny: bool


@slow
def test_response_format_json_schema(client: openai.OpenAI, qwen_server: Server) -> None:
    parsed = client.chat.completions.parse(model=qwen_server.model_id, messages=ASK,
                                           response_format=Verdict, **FORCED)
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(parsed.choices[0].message.parsed, Verdict)

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99},
                                               "tag": {"type": "string", "maxLength": 6}},
              "required": ["n", "tag"], "additionalProperties": False}
    for stream in (False, True):
        kw = dict(model=qwen_server.model_id, messages=ASK, **FORCED,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "count", "schema": schema,
                                                   "strict": True}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(stream=True, **kw) if c.choices)
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        jsonschema.validate(json.loads(text), schema)

    obj = client.chat.completions.create(model=qwen_server.model_id, messages=ASK,
                                         **FORCED, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # an object may run past a few tokens
        assert isinstance(json.loads(obj.choices[0].message.content), dict)

    # Beside tools the model chooses, and a reply that calls none is in the format; strict
    # tools' calls follow their schemas. Either way the output is what was asked for.
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    for extra in ({"tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {
                      "name": "count", "schema": schema}}},
                  {"tools": strict}):
        m = client.chat.completions.create(model=qwen_server.model_id, messages=ASK,
                                           **FORCED, **extra).choices[0]
        assert m.finish_reason in ("stop", "tool_calls", "length")  # free text may run on
        for call in m.message.tool_calls or []:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments),
                                tool["function"]["parameters"])
        if m.finish_reason == "stop" and "response_format" in extra:
            jsonschema.validate(json.loads(m.message.content), schema)


def test_logprobs_of_tokens_that_split_a_character(tok: ChatTokenizer) -> None:
    """Tokens each holding part of a character ("é" is two here): chat gives each its own
    bytes, which joined are the text; completions spell such a token by its bytes (OpenAI's
    "bytes:\\xc3"), so two of them are two entries of top_logprobs, and text_offset counts
    characters of the text."""
    text = "né à ü"
    ids = tok.encode(text)
    assert sum(tok.token_string(i) == "\ufffd" for i in ids) == 6
    lps = [pb.TokenLogprob(logprob=-0.5, top_ids=[i, j], top_logprobs=[-0.5, -1.0])
           for i, j in zip(ids, ids[1:] + ids[:1])]
    chat = _Choice(0, True, tok, _Output(logprobs=True, top_logprobs=2))
    [delta] = chat.delta(Delta(text, ids, lps))
    entries = delta["logprobs"]["content"]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == text
    split = [e for e in entries if e["token"].startswith("bytes:")]
    assert len(split) == 6 and all(len(e["bytes"]) == 1 for e in split)
    assert all(e["token"] == bytes(e["bytes"]).decode() for e in entries if e not in split)

    plain = _Choice(0, False, tok, _Output(logprobs=True, top_logprobs=2))
    [delta] = plain.delta(Delta(text, ids, lps))
    logprobs = delta["logprobs"]
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])  # no two names alike
    assert "bytes:\\xc3" in logprobs["tokens"]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    # Each whole token starts where its text does in the completion.
    for token, at in zip(logprobs["tokens"], offsets):
        if not token.startswith("bytes:"):
            assert text[at:at + len(token)] == token, (token, at)


@slow
def test_logprobs(client: openai.OpenAI, qwen_server: Server) -> None:
    kw = dict(model=qwen_server.model_id, messages=ASK, max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert b"".join(bytes(e.bytes) for e in content).decode() == r.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # Greedy: the sampled token is the likeliest.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True)
    streamed = [e for c in client.chat.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]

    t = client.completions.create(model=qwen_server.model_id, prompt="The capital of",
                                  max_tokens=5, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = t.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(tok in top and 1 <= len(top) <= 3 for tok, top in zip(lp.tokens, lp.top_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


@slow
def test_several_choices(client: openai.OpenAI, qwen_server: Server) -> None:
    r = client.chat.completions.create(model=qwen_server.model_id, messages=ASK, n=2,
                                       max_tokens=8, seed=5, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16
    again = client.chat.completions.create(model=qwen_server.model_id, messages=ASK, n=2,
                                           max_tokens=8, seed=5, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]

    # Choice 0 prefills the prompt; the others start after its first token, from the cache.
    before = qwen_server.node_metrics()
    shared = client.completions.create(model=qwen_server.model_id, n=3, max_tokens=2,
                                       prompt="A pipeline splits the layers. " * 8 + "Unique?")
    after = qwen_server.node_metrics()
    hits, misses = (after[k] - before[k] for k in ('omlx_node_kv_cache_hits_total{tier="ram"}',
                                                   "omlx_node_kv_cache_misses_total"))
    assert misses >= shared.usage.prompt_tokens // BLOCK - 1 > 0
    tail = (shared.usage.prompt_tokens - 1) % BLOCK > 0
    assert hits == 2 * (misses + tail), (hits, misses)  # every block (and the tail), twice

    texts: dict[int, str] = {}
    finished = set()
    for chunk in client.completions.create(model=qwen_server.model_id, prompt="Hello world",
                                           n=2, max_tokens=6, stream=True, temperature=0,
                                           presence_penalty=0.5, frequency_penalty=0.5,
                                           extra_body={"ignore_eos": True,
                                                       "repetition_penalty": 1.2}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and texts[0] == texts[1]  # greedy: the same twice


@slow
@pytest.mark.parametrize("stream", [True, False])
def test_closing_several_choices_cancels_them_all(qwen_server: Server, stream: bool) -> None:
    def cancelled() -> float:
        return qwen_server.node_metrics().get(
            'omlx_node_requests_finished_total{reason="cancelled"}', 0.0)

    def idle() -> bool:
        return qwen_server.node_metrics()["omlx_node_requests_processing"] == 0

    before = cancelled()
    body = {"model": qwen_server.model_id, "prompt": "Hello world", "n": 3, "max_tokens": 1900,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(timeout=30 if stream else 1) as h:
        if stream:
            with h.stream("POST", qwen_server.base_url + "/completions", json=body) as r:
                seen: set[int] = set()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        seen.update(c["index"] for c in json.loads(line[6:])["choices"]
                                    if c["text"])
                    if len(seen) == 3:
                        break  # every choice is running: leave mid-stream
        else:
            with pytest.raises(httpx.ReadTimeout):
                h.post(qwen_server.base_url + "/completions", json=body)
    deadline = time.monotonic() + 15
    while (cancelled() < before + 3 or not idle()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled() == before + 3 and idle()


@slow
def test_model_by_id(qwen_server: Server, client: openai.OpenAI) -> None:
    assert client.models.retrieve(qwen_server.model_id).id == qwen_server.model_id
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert qwen_server.model_id in e.value.message


def _nested(depth: int) -> dict:
    """An object schema `depth` objects deep."""
    schema: dict = {"type": "object", "properties": {}}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD = {
    "tool parameters not an object schema": (
        {"tools": [{"type": "function", "function": {"name": "f",
                                                     "parameters": {"type": "string"}}}]},
        "tools.0.function", ["'f'", "object"]),
    "tool name with spaces": (
        {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
        "tools.0.function.name", ["pattern"]),
    "forced tool whose schema cannot compile": (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}}}],
         "tool_choice": "required"},
        "tools.0.function.parameters", ["'f'"]),
    "tool message answering no call": (
        {"messages": ASK + [{"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
        "messages.1.tool_call_id", ["call_x"]),
    "malformed call arguments": (
        {"messages": ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
        "messages.1.tool_calls.0.function.arguments", ["json"]),
    "named tool not among the tools": (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice", ["nope"]),
    "response_format of an unknown type": (
        {"response_format": {"type": "yaml"}}, "response_format.type", ["json_schema"]),
    "response_format schema that cannot compile": (
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "x", "schema": {"type": "tuple"}}}},
        "response_format.json_schema.schema", ["tuple"]),
    "response_format schema nested past the engine's limit": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                    "schema": _nested(200)}}},
        "response_format.json_schema.schema", ["recursion"]),
    "top_logprobs 50": ({"logprobs": True, "top_logprobs": 50}, "top_logprobs", ["20"]),
    "stream_options without stream": ({"stream_options": {"include_usage": True}},
                                      "stream_options", ["stream: true"]),
    "n above the cap": ({"n": 9}, "n", ["8"]),
    "unknown field": ({"temprature": 0.5}, "temprature", []),
    "logit_bias": ({"logit_bias": {"5": 10}}, "logit_bias", ["not supported"]),
    "functions": ({"functions": [{"name": "f"}]}, "functions", ["tools"]),
}


@slow
@pytest.mark.parametrize("name", list(BAD))
def test_bad_input(qwen_server: Server, name: str) -> None:
    extra, param, words = BAD[name]
    body = {"model": qwen_server.model_id, "messages": ASK, "max_tokens": 4, **extra}
    r = httpx.post(qwen_server.base_url + "/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert all(w.lower() in err["message"].lower() for w in words), err
    ok = httpx.post(qwen_server.base_url + "/chat/completions", timeout=60, json={
        "model": qwen_server.model_id, "messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@slow
def test_metadata_fields_are_accepted(client: openai.OpenAI, qwen_server: Server) -> None:
    r = client.chat.completions.create(
        model=qwen_server.model_id, messages=ASK, max_tokens=2, user="u1", store=False,
        metadata={"k": "v"}, service_tier="auto", prompt_cache_key="agent-1",
        stream_options=None, modalities=["text"], logit_bias={})
    assert r.choices[0].message.content is not None


def test_an_echoed_reasoning_content_reaches_the_template() -> None:
    """Clients echo a reasoning model's `reasoning_content` back in the assistant turn: it is
    the chat template's to render (or drop), not an unknown field."""
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
        {"role": "user", "content": "again"}]})
    assert body.messages[1].for_template(1)["reasoning_content"] == "greet back"


def test_the_parsers_load_once_under_concurrent_first_use() -> None:
    """Prompts are formatted on worker threads: the first requests, arriving together, must
    never see mlx-lm's tokenizer_utils half-loaded (seen on a GPU: AttributeError)."""
    code = textwrap.dedent("""
        import threading
        from omlx_coordinator.text import tool_calls
        errors = []
        def use():
            try:
                tool_calls._tokenizer_utils.__wrapped__()._infer_tool_parser
                tool_calls._parser_module.__wrapped__("json_tools").parse_tool_call
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=use) for _ in range(16)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print(errors)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
