"""The Ollama API (/api/*), as Ollama's clients use it: the official `ollama` Python SDK against a
live server on a tiny random Qwen-style model (Qwen's `<tool_call>` markup), greedy output checked
against the OpenAI endpoint's and mlx-lm's; the routes that need no node in process; the reply's
tool calls without a server (a random model never calls a tool by itself, and this API has no
tool_choice to force one)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from ollama import _types as sdk

from omlx_coordinator.api import ollama as adapter
from omlx_coordinator.api import ollama_schema as schema
from omlx_coordinator.api.ollama_models import _details
from omlx_coordinator.api.tool_setup import ToolSetup
from omlx_coordinator.errors import APIError
from omlx_coordinator.models.model_config import ModelConfig
from omlx_coordinator.models.served_model import ServedModel
from omlx_coordinator.request.events import Delta, Done, KeepAlive
from omlx_coordinator.telemetry.metrics import GatewayMetrics
from tests.conftest import Server, start_server
from tests.helpers.reference import mlx_lm_greedy
from tests.in_process_gateway import app_for, ask
from tests.tiny_models import tiny_qwen

KEY = "sk-ollama-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 2048
GREEDY = {"temperature": 0, "num_predict": 24}
WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "The weather in a city",
                        "parameters": {"type": "object",
                                       "properties": {"city": {"type": "string"}},
                                       "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
slow = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("models") / "tiny-qwen-ollama"
    return tiny_qwen(dest, seed=6, context=CONTEXT)


# ---- no server ------------------------------------------------------------------------------


def _fields(cls) -> set[str]:
    return {f.alias or name for name, f in cls.model_fields.items()}


@pytest.mark.parametrize("theirs, ours", [
    (sdk.ChatRequest, schema.ChatRequest), (sdk.GenerateRequest, schema.GenerateRequest),
    (sdk.Options, schema.Options), (sdk.Message, schema.Message),
    (sdk.Message.ToolCall, schema.ToolCall),
    (sdk.Message.ToolCall.Function, schema.ToolCallFunction),
    (sdk.ShowRequest, schema.ShowRequest)])
def test_every_field_the_sdk_defines_is_declared(theirs, ours) -> None:
    # An SDK upgrade that adds a field fails here before a client meets a 400.
    assert _fields(theirs) <= _fields(ours), _fields(theirs) - _fields(ours)


def test_unknown_fields_and_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="nope"):
        schema.ChatRequest.model_validate({"model": "m", "nope": 1})
    with pytest.raises(ValueError, match="num_gpus"):
        schema.ChatRequest.model_validate({"model": "m", "options": {"num_gpus": 1}})
    with pytest.raises(ValueError, match="images are not supported"):
        schema.ChatRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "hi", "images": ["aGk="]}]})
    with pytest.raises(ValueError, match="Mirostat"):
        schema.Options.model_validate({"mirostat": 2})
    with pytest.raises(ValueError, match="at most 16 stop strings"):
        schema.Options.model_validate({"stop": [str(i) for i in range(17)]})
    with pytest.raises(ValueError, match="last 20 tokens"):
        schema.Options.model_validate({"repeat_penalty": 1.1, "repeat_last_n": 64})
    # Accepted without effect, and neutral values of the refused ones.
    schema.Options.model_validate({"num_ctx": 8192, "num_gpu": 99, "mirostat": 0, "tfs_z": 1.0,
                                   "repeat_last_n": 64})
    assert schema.GenerateRequest.model_validate({"model": "m"}).stream is True


@pytest.mark.parametrize("given, seconds", [
    (300, 300.0), ("300", 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("1.5s", 1.5),
    ("250ms", 0.25), (0, 0.0), ("0", 0.0), (-1, float("inf")), ("-1", float("inf")),
    ("-5m", float("inf"))])
def test_keep_alive_durations(given, seconds: float) -> None:
    assert schema.keep_alive_seconds(given) == seconds


@pytest.mark.parametrize("bad", ["soon", "5 minutes", "", "m5"])
def test_bad_keep_alive(bad: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        schema.keep_alive_seconds(bad)


def test_tool_calls_come_whole_with_arguments_as_objects(qwen_path: Path) -> None:
    served = ServedModel(ModelConfig("m", str(qwen_path)), qwen_path)
    tok = served.tokenizer
    setup = ToolSetup([WEATHER], tok.tool_call_format, [WEATHER], False, "")
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    reply = adapter._Reply(served, True, setup, [1, 2, 3], 0, time.perf_counter_ns(), False)
    chunks = [reply.feed(Delta(piece, [5])) for piece in ["Let me look.\n", call[:12],
                                                           call[12:], "\n", call]]
    closing, whole = reply.finish(Done("stop", 3, 5))
    streamed = [c for c in chunks + closing if c]
    assert streamed[0]["message"] == {"role": "assistant", "content": "Let me look.\n"}
    calls = [c["message"]["tool_calls"] for c in streamed if "tool_calls" in c["message"]]
    assert [[c["function"] for c in cs] for cs in calls] == [
        [{"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}],
        [{"index": 1, "name": "get_weather", "arguments": {"city": "Paris"}}]]
    assert whole["message"]["content"] == "Let me look.\n\n"
    assert len(whole["message"]["tool_calls"]) == 2 and whole["done"] is True
    assert streamed[-1]["done"] and streamed[-1]["done_reason"] == "stop"
    assert "context" not in whole  # a chat's reply has none
    # What the SDK makes of it.
    parsed = sdk.ChatResponse(**whole)
    assert parsed.message.tool_calls[0].function.arguments == {"city": "Paris"}


def test_stream_lines_keep_alives_and_errors(qwen_path: Path) -> None:
    served = ServedModel(ModelConfig("m", str(qwen_path)), qwen_path)

    async def events(error: Exception):
        yield KeepAlive()
        yield Delta("Hi", [5])
        raise error

    async def run(error: Exception) -> list[dict]:
        reply = adapter._Reply(served, False, ToolSetup(None, None, None, False, ""), [1], 0,
                               time.perf_counter_ns(), True)
        return [json.loads(line) for chunk in [c async for c in adapter._stream(
            reply, events(error), GatewayMetrics(), "ollama_generate", 5.0)]
            for line in chunk.splitlines()]

    for error, said in ((APIError(503, "the node is gone"), "the node is gone"),
                        (RuntimeError("bug"), "internal error")):
        lines = asyncio.run(run(error))
        assert [line.get("response") for line in lines[:2]] == ["", "Hi"]  # keep-alive, text
        assert set(lines[2]) == {"error"} and said in lines[2]["error"]


def test_tool_messages_answer_calls_by_name() -> None:
    body = schema.ChatRequest.model_validate({"model": "m", "messages": [
        *ASK, {"role": "assistant", "tool_calls": [
            {"function": {"name": "a", "arguments": {}}},
            {"id": "own", "function": {"name": "b", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_name": "b", "content": "B"},
        {"role": "tool", "content": "A"}]})
    msgs = adapter.chat_messages(body)
    assert msgs[1]["tool_calls"][1] == {"id": "own", "type": "function",
                                        "function": {"name": "b", "arguments": {"x": 1}}}
    assert [(m["tool_call_id"], m.get("name")) for m in msgs[2:]] == [("own", "b"),
                                                                     ("call_1_0", None)]
    prefill = schema.ChatRequest.model_validate({"model": "m", "messages": [
        *ASK, {"role": "assistant", "content": "It is"}]})
    with pytest.raises(APIError, match="prefilled"):
        adapter.chat_messages(prefill)
    with pytest.raises(ValueError, match="num_predict must be at least 1"):
        schema.Options.model_validate({"num_predict": 0})

def test_model_details_name_the_weights_as_ollama_does() -> None:
    assert _details({"model_type": "llama", "quantization": {"bits": 4, "group_size": 64}}) \
        == {"parent_model": "", "format": "safetensors", "family": "llama",
            "families": ["llama"], "parameter_size": "", "quantization_level": "Q4"}
    assert _details({"model_type": "qwen3", "torch_dtype": "bfloat16"})[
        "quantization_level"] == "BF16"

def test_routes_without_a_node(qwen_path: Path) -> None:
    app = app_for(qwen_path, frozenset({KEY}))
    assert ask(app, "GET", "/").text == "Ollama is running"
    assert ask(app, "HEAD", "/").status_code == 200
    assert ask(app, "GET", "/", headers={"accept": "application/json"}).json()["ollama_api"] \
        == "/api"
    r = ask(app, "GET", "/api/tags")
    assert r.status_code == 401 and "API key" in r.json()["error"]
    tags = ask(app, "GET", "/api/tags", headers=AUTH).json()
    assert [m["name"] for m in tags["models"]] == ["m"]
    assert tags["models"][0]["details"]["family"] == "qwen2"
    assert ask(app, "GET", "/api/ps", headers=AUTH).json() == {"models": []}
    show = ask(app, "POST", "/api/show", headers=AUTH, json={"model": "m:latest"}).json()
    assert show["capabilities"] == ["completion", "tools"]
    assert show["model_info"]["qwen2.context_length"] == CONTEXT
    assert "<tool_call>" in show["template"]
    r = ask(app, "POST", "/api/show", headers=AUTH, json={})
    assert r.status_code == 400 and r.json() == {"error": "'model': name the model to show"}
    assert ask(app, "GET", "/api/version", headers=AUTH).json()["version"]
    # Errors in Ollama's shape: unknown model (listing the served ones), bad body, the store.
    r = ask(app, "POST", "/api/chat", headers=AUTH, json={"model": "llama3", "messages": ASK})
    assert r.status_code == 404 and "'m'" in r.json()["error"] and set(r.json()) == {"error"}
    # curl -d sends no JSON content type; Ollama's clients and examples rely on it anyway.
    r = ask(app, "POST", "/api/chat", headers=AUTH,
            content=json.dumps({"model": "m", "options": {"temperature": "hot"}}))
    assert r.status_code == 400 and "options.temperature" in r.json()["error"]
    r = ask(app, "POST", "/api/generate", headers=AUTH, content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = ask(app, "POST", "/api/create", headers=AUTH, json={"model": "x"})
    assert r.status_code == 501 and "--model NAME=PATH" in r.json()["error"]
    r = ask(app, "DELETE", "/api/delete", headers=AUTH, json={"model": "m"})
    assert r.status_code == 501 and "models unload" in r.json()["error"]
    assert ask(app, "POST", "/api/pull", headers=AUTH, json={"model": "m"}).json() == \
        {"status": "success"}
    assert ask(app, "POST", "/api/pull", headers=AUTH, json={"model": "x"}).status_code == 501
    r = ask(app, "POST", "/api/embed", headers=AUTH, json={"model": "m", "input": "hi"})
    assert r.status_code == 400 and "is a chat model" in r.json()["error"]


# ---- a live server, through the SDK ----------------------------------------------------------


@pytest.fixture(scope="module")
def server(qwen_path: Path, tmp_path_factory):
    with start_server(qwen_path, "--api-key", KEY, home=tmp_path_factory.mktemp("home"),
                      keepalive=0.01) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


@pytest.fixture(scope="module")
def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _openai_chat(oai: openai.OpenAI, server: Server, messages: list[dict], **kw):
    return oai.chat.completions.create(model=server.model_id, messages=messages, max_tokens=24,
                                       temperature=0, **kw)


@slow
def test_chat_equals_the_openai_endpoint(client: ollama.Client, oai: openai.OpenAI,
                                         server: Server) -> None:
    whole = client.chat(model=server.model_id, messages=ASK, options=GREEDY)
    ref = _openai_chat(oai, server, ASK)
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.message.content == ref.choices[0].message.content
    assert whole.done and whole.done_reason == ("length" if ref.choices[0].finish_reason
                                                == "length" else "stop")
    assert whole.prompt_eval_count == ref.usage.prompt_tokens
    assert whole.eval_count == ref.usage.completion_tokens
    assert whole.total_duration >= whole.prompt_eval_duration + whole.eval_duration > 0
    parts = list(client.chat(model=server.model_id, messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count
    # ":latest", as Ollama's clients name models.
    again = client.chat(model=server.model_id + ":latest", messages=ASK, options=GREEDY)
    assert again.message.content == whole.message.content


@slow
def test_generate_equals_mlx_lm(client: ollama.Client, server: Server, qwen_path: Path) -> None:
    first = client.generate(model=server.model_id, prompt="The capital of France is", raw=True,
                            options=GREEDY)
    prompt = first.context[:first.prompt_eval_count]
    generated = first.context[first.prompt_eval_count:]
    assert len(generated) == first.eval_count
    # context carries on: the next generate starts where this one ended.
    second = client.generate(model=server.model_id, prompt=" and", raw=True,
                             context=first.context, options=GREEDY)
    assert second.context[:len(first.context)] == first.context
    ref = mlx_lm_greedy(qwen_path, [prompt, second.context[:second.prompt_eval_count]], 24)
    assert generated == ref[0][:len(generated)]
    assert second.context[second.prompt_eval_count:] == ref[1][:second.eval_count]
    # options.stop: the reply ends before the first stop string, and says so.
    cut = first.response[len(first.response) // 2:][:3]
    stopped = client.generate(model=server.model_id, prompt="The capital of France is",
                              raw=True, options={**GREEDY, "stop": [cut]})
    assert cut.strip() and stopped.done_reason == "stop"
    assert stopped.response == first.response[:first.response.index(cut)]
    scored = client.generate(model=server.model_id, prompt="The capital of France is", raw=True,
                             options=GREEDY, logprobs=True, top_logprobs=2)
    assert scored.response == first.response and len(scored.logprobs) == scored.eval_count
    for lp in scored.logprobs:  # greedy: each token is its position's most likely one
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob)
    streamed = list(client.generate(model=server.model_id, prompt="The capital of France is",
                                    raw=True, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == first.response
    assert streamed[-1].context == first.context
    # Not raw: the prompt is one user turn of the chat template, as a chat with it.
    templated = client.generate(model=server.model_id, prompt=ASK[0]["content"],
                                system="Be terse.", options=GREEDY)
    chat = client.chat(model=server.model_id, options=GREEDY,
                       messages=[{"role": "system", "content": "Be terse."}, *ASK])
    assert templated.response == chat.message.content


@slow
def test_tool_round_trip_renders_as_openai_does(client: ollama.Client, oai: openai.OpenAI,
                                                server: Server) -> None:
    args = {"city": "Paris"}
    conversation = [*ASK, {"role": "assistant", "content": "",
                           "tool_calls": [{"function": {"name": "get_weather",
                                                        "arguments": args}}]},
                    {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 C"}]
    whole = client.chat(model=server.model_id, messages=conversation, tools=[WEATHER],
                        options=GREEDY)
    ref = _openai_chat(oai, server, [
        *ASK, {"role": "assistant", "content": None,
               "tool_calls": [{"id": "call_1", "type": "function",
                               "function": {"name": "get_weather",
                                            "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}],
        tools=[WEATHER])
    assert whole.prompt_eval_count == ref.usage.prompt_tokens
    assert whole.message.content == (ref.choices[0].message.content or "")


@slow
def test_format_json_and_schema(client: ollama.Client, server: Server) -> None:
    r = client.chat(model=server.model_id, messages=ASK, format="json",
                    options={"temperature": 0, "num_predict": 200})
    assert isinstance(json.loads(r.message.content), dict)
    shape = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}},
             "required": ["city"], "additionalProperties": False}
    r = client.generate(model=server.model_id, prompt="Where?", format=shape,
                        options={"temperature": 0, "num_predict": 200})
    assert json.loads(r.response) == {"city": "Paris"}


@slow
def test_models_routes_and_keep_alive(client: ollama.Client, server: Server) -> None:
    assert [m.model for m in client.list().models] == [server.model_id]
    info = client.show(server.model_id)
    assert "tools" in info.capabilities and info.modelinfo["qwen2.context_length"] == CONTEXT
    client.chat(model=server.model_id, messages=ASK, options=GREEDY, keep_alive="1h")
    running = client.ps().models
    assert [m.model for m in running] == [server.model_id]
    left = (running[0].expires_at.timestamp() - time.time())
    assert 3500 < left <= 3600
    # keep_alive 0: unloaded once its request is done.
    client.chat(model=server.model_id, messages=ASK, options=GREEDY, keep_alive=0)
    deadline = time.monotonic() + 15
    while client.ps().models and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.ps().models == []
    # The next request loads it again, and says how long that took; a load request alone.
    again = client.chat(model=server.model_id, messages=ASK, options=GREEDY)
    assert again.load_duration > 0 and again.message.content
    assert client.generate(model=server.model_id, keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
    assert client.generate(model=server.model_id).done_reason == "load"
    assert [m.model for m in client.ps().models] == [server.model_id]


@slow
def test_streams_by_default_as_ndjson(server: Server) -> None:
    # As curl sends it: no content type, no "stream" (Ollama streams unless told not to).
    with httpx.stream("POST", server.url + "/api/generate", headers=AUTH, timeout=60,
                      content=json.dumps({"model": server.model_id, "prompt": "Hi",
                                          "options": GREEDY})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines()]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    last = lines[-1]
    assert last["done_reason"] in ("stop", "length") and last["eval_count"] >= 1
    assert {"total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration",
            "eval_duration", "context", "created_at", "model"} <= set(last)

@slow
def test_errors_through_the_sdk(client: ollama.Client, server: Server) -> None:
    client.chat(model=server.model_id, messages=ASK, options=GREEDY)  # one "ok" to count
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=ASK)
    assert e.value.status_code == 404 and repr(server.model_id) in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=server.model_id, messages=ASK, options={"top_p": 2})
    assert e.value.status_code == 400 and "options.top_p" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=server.url, timeout=30).list()
    assert e.value.status_code == 401
    # A keep_alive that is no duration: a 400 naming it, before anything streams.
    r = httpx.post(server.url + "/api/chat", headers=AUTH, timeout=60,
                   json={"model": server.model_id, "messages": ASK, "keep_alive": "soon"})
    assert r.status_code == 400 and "keep_alive" in r.json()["error"]
    # Counted as the other APIs' requests are, under their own endpoint labels.
    counts = server.metrics()
    assert counts['omlx_requests_total{endpoint="ollama_chat",outcome="unknown_model"}'] >= 1
    assert counts['omlx_requests_total{endpoint="ollama_chat",outcome="rejected"}'] >= 2
    assert counts['omlx_requests_total{endpoint="ollama_chat",outcome="ok"}'] >= 1

