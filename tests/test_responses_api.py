"""The OpenAI Responses API (/v1/responses): the adapter through the gateway app with the
generation core replaced by a script (no model process: the prompt, grammar and events are what
is checked), the body Codex CLI sends replayed, the SDK's field set walked, and the official
`openai` SDK against a live server on a tiny random Qwen-style model."""

from __future__ import annotations

import asyncio
import json
import typing
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.responses import response_create_params

from omlx_coordinator.api import responses as adapter
from omlx_coordinator.api.response_store import ResponseStore, StoredResponse
from omlx_coordinator.api.responses_schema import ResponsesRequest
from omlx_coordinator.http.gateway import create_app
from omlx_coordinator.nodes.cluster import ClusterOptions
from omlx_coordinator.request.events import Delta, Done, KeepAlive
from omlx_coordinator.request.generation import GenerationRequest
from tests.conftest import Server, start_server
from tests.tiny_models import serving, tiny_qwen

DATA = Path(__file__).parent / "data"
CONTEXT = 2048
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


# ---- the adapter in the gateway app, generation scripted -----------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("models") / "tiny-qwen-responses"
    # Seed 6: its greedy replies are text (see test_anthropic_api.py).
    return tiny_qwen(dest, seed=6, context=CONTEXT)


class Scripted:
    """The gateway app whose generation core is replaced: each request gets the next script's
    events; the requests the core got are kept."""

    def __init__(self, model_dir: Path, monkeypatch: pytest.MonkeyPatch):
        self.manager = serving(model_dir, "m", ClusterOptions(nodes=0, os_reserve_bytes=0))
        self.served = self.manager.models[0]
        self.tok = self.served.tokenizer
        self.scripts: list[list] = []
        self.requests: list[GenerationRequest] = []

        async def servable(manager, name: str, account=None):
            return self.served

        async def generate(manager, model, metrics, settings, req: GenerationRequest):
            self.requests.append(req)
            for ev in self.scripts.pop(0):
                if isinstance(ev, Exception):
                    raise ev
                yield ev

        monkeypatch.setattr(adapter, "check_servable", servable)
        monkeypatch.setattr(adapter, "generate", generate)
        self.app = create_app(self.manager, start_cluster=False)

    def prompt(self, i: int = -1) -> str:
        """Request i's prompt as text (the template's special tokens left out)."""
        return self.tok.decode(self.requests[i].prompt)

    def post(self, body: dict, *events) -> httpx.Response:
        self.scripts.append(list(events) or [Delta("Hello there."), Done("stop", 20, 3, 16)])

        async def run() -> httpx.Response:
            transport = httpx.ASGITransport(app=self.app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
                return await http.post("/v1/responses", json={"model": "m", **body})
        return asyncio.run(run())


@pytest.fixture
def app(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Scripted:
    return Scripted(model_dir, monkeypatch)


def _events(r: httpx.Response) -> list[dict]:
    """The data of every SSE event, checked against its `event:` line."""
    out = []
    for block in r.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line
                     and not line.startswith(":"))
        if "data" in lines:
            data = json.loads(lines["data"])
            assert lines["event"] == data["type"]
            out.append(data)
    return out


def test_string_input(app: Scripted) -> None:
    r = app.post({"input": "What is the weather?", "temperature": 0.5, "top_p": 0.9,
                  "max_output_tokens": 40})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["id"].startswith("resp_") and body["model"] == "m"
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text"
    assert message["content"][0]["text"] == "Hello there."
    assert body["usage"] == {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 16},
                             "output_tokens": 3, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 23}
    req = app.requests[0]
    assert (req.temperature, req.top_p, req.max_tokens, req.grammar) == (0.5, 0.9, 40, "")
    assert req.prompt == app.tok.encode_chat([{"role": "user",
                                               "content": "What is the weather?"}])


def test_instructions_and_developer_messages_lead_as_one_system_message(app: Scripted) -> None:
    r = app.post({"instructions": "Be terse.", "input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "Use tools."}]},
        {"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    assert app.requests[0].prompt == app.tok.encode_chat([
        {"role": "system", "content": "Be terse.\n\nUse tools."},
        {"role": "user", "content": "Hi"}])
    assert r.json()["instructions"] == "Be terse."


def test_function_call_round_trip(app: Scripted) -> None:
    """A client sends back the model's call (beside its reasoning item and text) and the tool's
    output: the template renders one assistant turn with the call, then the tool's answer."""
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Looking.", "annotations": []}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"}]
    messages = adapter._conversation(ResponsesRequest.model_validate(
        {"model": "m", "input": items}).input, {})
    assert messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "Sunny"}]
    r = app.post({"input": items, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    prompt = app.prompt()
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nSunny\n</tool_response>" in prompt

    orphan = app.post({"input": [{"type": "function_call_output", "call_id": "call_9",
                                  "output": "x"}]})
    assert orphan.status_code == 400
    assert orphan.json()["error"]["param"] == "input.0.call_id"


def test_tools_with_tool_choice_required(app: Scripted) -> None:
    namespaced = {"type": "namespace", "name": "geo", "description": "Places",
                  "tools": [{**WEATHER, "name": "find_city"}]}
    r = app.post({"input": "Weather?", "tools": [WEATHER, namespaced],
                  "tool_choice": "required", "parallel_tool_calls": False},
                 Delta(CALL), Done("stop", 30, 20))
    assert r.status_code == 200, r.text
    req = app.requests[0]
    assert req.grammar and "get_weather" in req.grammar and "find_city" in req.grammar
    assert req.stop == ["</tool_call>"]  # one call: its end marker ends generation
    [call] = r.json()["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call["call_id"].startswith("call_") and "namespace" not in call
    assert '"name": "find_city"' in app.prompt()  # a namespace's functions are shown

    r = app.post({"input": "Where?", "tools": [namespaced],
                  "tool_choice": {"type": "function", "name": "find_city"}},
                 Delta(CALL.replace("get_weather", "find_city")), Done("stop", 30, 20))
    assert r.json()["output"][0]["namespace"] == "geo"

    deferred = app.post({"input": "Hi", "tools": [WEATHER, {**WEATHER, "name": "hidden",
                                                             "defer_loading": True}]})
    assert deferred.status_code == 200, deferred.text
    assert "get_weather" in app.prompt() and "hidden" not in app.prompt()

    missing = app.post({"input": "Hi", "tool_choice": "required"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "tool_choice"


def test_text_format_json_schema(app: Scripted) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}},
              "required": ["answer"], "additionalProperties": False}
    r = app.post({"input": "Answer in JSON.", "text": {"format": {
        "type": "json_schema", "name": "answer", "schema": schema, "strict": True}}},
        Delta('{"answer": "yes"}'), Done("stop", 10, 6))
    assert r.status_code == 200, r.text
    assert '"answer"' in app.requests[0].grammar
    assert r.json()["text"]["format"]["name"] == "answer"
    assert json.loads(r.json()["output"][0]["content"][0]["text"]) == {"answer": "yes"}

    r = app.post({"input": "JSON", "text": {"format": {"type": "json_object"}}})
    assert r.status_code == 200 and app.requests[1].grammar

    bad = app.post({"input": "x", "text": {"format": {"type": "json_schema", "name": "b",
                                                      "schema": {"type": "frobnicate"}}}})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == "text.format.schema"


def test_streaming_event_order_and_sequence_numbers(app: Scripted) -> None:
    r = app.post({"input": "Weather?", "stream": True, "tools": [WEATHER]},
                 KeepAlive(), Delta("Let me "), Delta("look.\n"), Delta(CALL[:9]),
                 Delta(CALL[9:]), Delta("\n"), Done("length", 30, 20, 8))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.incomplete"]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[6]["text"] == "Let me look.\n"
    assert events[9]["item"]["arguments"] == "" and events[9]["output_index"] == 1
    assert json.loads(events[10]["delta"]) == {"city": "Paris"}
    last = events[-1]["response"]
    assert last["status"] == "incomplete"
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in last["output"]] == ["message", "function_call"]
    assert last["usage"]["input_tokens_details"]["cached_tokens"] == 8


def test_stream_error_is_response_failed(app: Scripted) -> None:
    from omlx_coordinator.errors import APIError

    r = app.post({"input": "Hi", "stream": True}, Delta("Hi"),
                 APIError(503, "the node is gone", type="server_error"))
    events = _events(r)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"] == {"code": "server_error",
                                               "message": "the node is gone"}

    # A failure of ours tells the client an id, not the exception's text.
    r = app.post({"input": "Hi", "stream": True}, RuntimeError("/secret/path exploded"))
    error = _events(r)[-1]["response"]["error"]
    assert error["code"] == "server_error" and "/secret/path" not in error["message"]
    assert "(id " in error["message"]


def test_previous_response_id_continues_a_stored_response(app: Scripted) -> None:
    first = app.post({"instructions": "Be terse.", "input": "My name is Ada."},
                     Delta("Noted."), Done("stop", 10, 2))
    second = app.post({"previous_response_id": first.json()["id"], "input": "My name?"})
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == first.json()["id"]
    # instructions are not carried over
    assert app.requests[1].prompt == app.tok.encode_chat([
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "My name?"}])

    # a streamed response is stored too, with its calls: the next turn answers them
    called = app.post({"input": "Weather?", "tools": [WEATHER], "stream": True},
                      Delta(CALL), Done("stop", 10, 20))
    done = _events(called)[-1]["response"]
    call_id = done["output"][0]["call_id"]
    answer = app.post({"previous_response_id": done["id"], "tools": [WEATHER], "input": [
        {"type": "function_call_output", "call_id": call_id, "output": "Sunny"}]})
    assert answer.status_code == 200, answer.text
    assert "<tool_response>\nSunny\n</tool_response>" in app.prompt()


def test_store_false_then_previous_response_id_is_a_clear_error(app: Scripted) -> None:
    first = app.post({"input": "Hi", "store": False})
    assert first.json()["store"] is False
    r = app.post({"previous_response_id": first.json()["id"], "input": "Again"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id" and "store false" in error["message"]


def test_the_store_forgets_the_least_recently_used() -> None:
    store = ResponseStore(capacity=2)
    for name in "abc":
        store.put(name, StoredResponse(({"role": "user", "content": name},)))
        store.get("a")  # used again: kept
    assert len(store) == 2 and store.get("a") and store.get("b") is None and store.get("c")


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "frobnicate": 1}, "frobnicate", "not supported"),
    ({"input": []}, "input", "empty"),
    ({"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, "input.0.content.0", "text only"),
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input.0", "computer_call"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools.0", "built-in tool"),
    ({"input": "x", "tools": [{"type": "custom", "name": "patch"}]}, "tools.0", "custom"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"input": "x", "background": True}, "background", "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "Conversations"),
    ({"input": "x", "temperature": 3}, "temperature", "2"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "logprobs"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input.0.arguments", "JSON"),
])
def test_bad_input_is_a_400_in_the_error_shape(app: Scripted, body: dict, param: str,
                                               words: str) -> None:
    r = app.post(body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert words in error["message"], error


def test_codex_body_replayed(app: Scripted) -> None:
    """What Codex CLI sends (tests/data/codex_responses_body.json, recorded from the live run
    of tests/test_codex.py) passes: developer messages, function and namespace tools,
    reasoning/include/prompt_cache_key/client_metadata, store false."""
    body = json.loads((DATA / "codex_responses_body.json").read_text())
    body.pop("model")
    app.served.max_context = 65536  # ~30k tokens in the tests' small vocabulary
    r = app.post(body)
    assert r.status_code == 200, r.text
    assert [e["type"] for e in _events(r)][-1] == "response.completed"
    prompt = app.prompt()
    assert prompt.startswith("system\nYou are a coding agent running in the Codex")
    assert '"name": "exec_command"' in prompt and '"name": "spawn_agent"' in prompt


def _fields(typed_dict: type) -> set[str]:
    return set(typing.get_type_hints(typed_dict, include_extras=True))


def test_every_field_the_sdk_defines_is_known() -> None:
    """An SDK upgrade that adds a request field fails here before a client's request does:
    decide it (implement, accept without effect, or refuse) in responses_schema.py."""
    sdk = (_fields(response_create_params.ResponseCreateParamsStreaming)
           | _fields(response_create_params.ResponseCreateParamsNonStreaming))
    known = set(ResponsesRequest.model_fields)
    assert sdk - known == set(), f"fields the SDK defines that the adapter does not know: " \
                                 f"{sorted(sdk - known)}"


# ---- the official SDK against a live server ------------------------------------------------------


@pytest.fixture(scope="module")
def live(model_dir: Path, tmp_path_factory):
    # A small KV block, so the prefix cache serves short prompts.
    with start_server(model_dir, "--api-key", "sk-resp", "--cache-block-size", "16",
                      home=tmp_path_factory.mktemp("home"), keepalive=0.05) as s:
        yield s


@pytest.fixture(scope="module")
def client(live: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="sk-resp", max_retries=0,
                         timeout=120)


@pytest.mark.slow
def test_sdk_create_and_continue(client: openai.OpenAI, live: Server) -> None:
    first = client.responses.create(model=live.model_id, input="Hello", max_output_tokens=8,
                                    temperature=0, instructions="Be terse.")
    assert first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.input_tokens > 0 and first.usage.output_tokens >= 1
    # Instructions are not carried over: a client sends them again.
    second = client.responses.create(model=live.model_id, input="Again", max_output_tokens=8,
                                     temperature=0, previous_response_id=first.id,
                                     instructions="Be terse.")
    # The stored turn is the prefix of the next: the prefix cache serves it.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0

    forced = client.responses.create(
        model=live.model_id, input="Weather in Paris?", tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
        temperature=0)
    [call] = [i for i in forced.output if i.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")

    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=live.model_id, input="x", previous_response_id="resp_no")
    assert e.value.code == "previous_response_not_found"
    assert "Traceback" not in live.log_tail(300)


@pytest.mark.slow
def test_sdk_stream(client: openai.OpenAI, live: Server) -> None:
    with client.responses.stream(model=live.model_id, input="Hello", max_output_tokens=12,
                                 temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response() if kinds[-1] == "response.completed" else None
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    if final is not None:
        assert final.output_text
    log = live.log_tail(300)
    assert '"POST /v1/responses HTTP/1.1" 200' in log
