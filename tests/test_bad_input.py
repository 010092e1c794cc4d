"""Bad requests against a live server: every one is a 4xx with an OpenAI-style error object that
says what is wrong, never a 500, and the server keeps serving afterwards.

The model here has a context of 256 tokens, so context limits are cheap to reach.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import Server, start_server
from tests.tiny_models import build_model

pytestmark = pytest.mark.slow

CONTEXT = 256
MODEL = "small-ctx"  # the folder name is the model id
MSGS = [{"role": "user", "content": "Hi"}]
LONG_TEXT = "Hello world! " * 200  # ~600 tokens


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("models") / MODEL, "llama", num_layers=2,
                       hidden_size=64, seed=3,
                       extra_config={"max_position_embeddings": CONTEXT})


@pytest.fixture(scope="module")
def small_server(small_model: Path, tmp_path_factory):
    with start_server(small_model, home=tmp_path_factory.mktemp("home")) as s:
        yield s


@pytest.fixture(scope="module")
def client(small_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=small_server.base_url, api_key="unused", max_retries=0,
                         timeout=60)


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": MSGS, **kw}


def _cmpl(**kw) -> dict:
    return {"model": MODEL, "prompt": "Hi", **kw}


# name: (endpoint, body (dict, or raw text), status, words the message must contain, param)
CASES = {
    "malformed JSON": ("chat/completions", '{"model": "small-ctx", "messages": [', 400,
                       ["json"], None),
    "JSON array body": ("chat/completions", "[1, 2]", 400, ["json object"], None),
    "empty body": ("completions", "", 400, ["empty"], None),
    "missing model": ("chat/completions", {"messages": MSGS}, 400, ["model", "required"], "model"),
    "model is a number": ("chat/completions", {"model": 5, "messages": MSGS}, 400, ["model"],
                          "model"),
    "max_tokens is a word": ("chat/completions", _chat(max_tokens="ten"), 400,
                             ["max_tokens", "integer"], "max_tokens"),
    "max_tokens is fractional": ("completions", _cmpl(max_tokens=1.5), 400,
                                 ["max_tokens", "integer"], "max_tokens"),
    "stream is a word": ("chat/completions", _chat(stream="yes"), 400, ["stream", "boolean"],
                         "stream"),
    "max_tokens is a boolean": ("completions", _cmpl(max_tokens=True), 400,
                                ["max_tokens", "integer"], "max_tokens"),
    "temperature is a numeric string": ("chat/completions", _chat(temperature="0.5"), 400,
                                        ["temperature", "number"], "temperature"),
    "temperature is a word": ("chat/completions", _chat(temperature="hot"), 400,
                              ["temperature", "number"], "temperature"),
    "messages is a string": ("chat/completions", {"model": MODEL, "messages": "hi"}, 400,
                             ["messages", "list"], "messages"),
    "message is a string": ("chat/completions", {"model": MODEL, "messages": ["hi"]}, 400,
                            ["messages.0"], "messages.0"),
    "content is a number": ("chat/completions",
                            {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
                            ["messages.0.content", "string"], "messages.0.content"),
    "stop is a number": ("completions", _cmpl(stop=5), 400, ["stop", "string"], "stop"),
    "stream_options is a string": ("chat/completions", _chat(stream=True, stream_options="yes"),
                                   400, ["stream_options"], "stream_options"),
    "unknown model": ("chat/completions", {"model": "gpt-4o", "messages": MSGS}, 404,
                      ["gpt-4o", MODEL], "model"),
    "unknown model (completions)": ("completions", {"model": "nope", "prompt": "Hi"}, 404,
                                    ["nope"], "model"),
    "empty messages": ("chat/completions", {"model": MODEL, "messages": []}, 400,
                       ["messages", "at least 1"], "messages"),
    "bad role": ("chat/completions",
                 {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
                 ["role", "user"], "messages.0.role"),
    "missing role": ("chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]}, 400,
                     ["role", "required"], "messages.0.role"),
    "image content part": ("chat/completions", {"model": MODEL, "messages": [{
        "role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    }]}, 400, ["image_url", "text"], "messages"),
    "prompt longer than the context": ("completions", _cmpl(prompt=LONG_TEXT), 400,
                                       ["context", str(CONTEXT), "tokens"], "prompt"),
    "chat longer than the context": ("chat/completions", _chat(messages=[
        {"role": "user", "content": LONG_TEXT}]), 400, ["context", str(CONTEXT)], "messages"),
    "streamed prompt longer than the context": ("completions",
                                                _cmpl(prompt=LONG_TEXT, stream=True), 400,
                                                ["context", str(CONTEXT)], "prompt"),
    "token-id prompt longer than the context": ("completions", _cmpl(prompt=[5] * (CONTEXT + 1)),
                                                400, ["context", str(CONTEXT)], "prompt"),
    "max_tokens 0": ("completions", _cmpl(max_tokens=0), 400, ["max_tokens", "1"], "max_tokens"),
    "max_tokens negative": ("completions", _cmpl(max_tokens=-5), 400, ["max_tokens"],
                            "max_tokens"),
    "max_completion_tokens 0": ("chat/completions", _chat(max_completion_tokens=0), 400,
                                ["max_completion_tokens"], "max_completion_tokens"),
    "max_tokens astronomically large": ("completions", _cmpl(max_tokens=2**70), 400,
                                        ["max_tokens"], "max_tokens"),
    "n=9": ("chat/completions", _chat(n=9), 400, ["'n'", "8"], "n"),
    "n=0": ("completions", _cmpl(n=0), 400, ["'n'"], "n"),
    "n=9 streamed": ("completions", _cmpl(n=9, stream=True), 400, ["'n'"], "n"),
    "token id beyond the vocabulary": ("completions", _cmpl(prompt=[1, 2, 99999]), 400,
                                       ["99999", "vocabulary"], "prompt"),
    "negative token id": ("completions", _cmpl(prompt=[-1, 5]), 400, ["-1", "vocabulary"],
                          "prompt"),
    "token id beyond int64": ("completions", _cmpl(prompt=[2**70]), 400, ["prompt"], "prompt"),
    "nested token ids": ("completions", _cmpl(prompt=[[1, 2], [3]]), 400, ["prompt"], "prompt"),
    "mixed prompt list": ("completions", _cmpl(prompt=[1, "a"]), 400, ["prompt"], "prompt"),
    "two prompts": ("completions", _cmpl(prompt=["a", "b"]), 400, ["one prompt"], "prompt"),
    "temperature above 2": ("completions", _cmpl(temperature=3.5), 400, ["temperature", "2"],
                            "temperature"),
    "temperature negative": ("chat/completions", _chat(temperature=-0.1), 400, ["temperature"],
                             "temperature"),
    "temperature NaN": ("completions", '{"model": "small-ctx", "prompt": "Hi", '
                                       '"temperature": NaN}', 400,
                        ["not valid JSON", "NaN", "column 55"], None),
    "repetition_penalty Infinity": ("chat/completions", '{"model": "small-ctx", "messages": '
                                    '[{"role": "user", "content": "Hi"}], '
                                    '"repetition_penalty": Infinity}', 400,
                                    ["not valid JSON", "Infinity"], None),
    "top_p 0": ("completions", _cmpl(top_p=0), 400, ["top_p"], "top_p"),
    "top_p above 1": ("completions", _cmpl(top_p=1.5), 400, ["top_p"], "top_p"),
    "top_k negative": ("completions", _cmpl(top_k=-1), 400, ["top_k"], "top_k"),
    "top_k beyond int32": ("completions", _cmpl(top_k=2**40, max_tokens=2), 400, ["top_k"],
                           "top_k"),
    "top_k beyond int32 streamed": ("completions", _cmpl(top_k=2**40, max_tokens=2, stream=True),
                                    400, ["top_k"], "top_k"),
    "min_p above 1": ("completions", _cmpl(min_p=2), 400, ["min_p"], "min_p"),
    "seed negative": ("completions", _cmpl(seed=-1), 400, ["seed"], "seed"),
    "seed beyond 2**63": ("completions", _cmpl(seed=2**64), 400, ["seed"], "seed"),
    "too many stop strings": ("completions", _cmpl(stop=[str(i) for i in range(17)]), 400,
                              ["stop", "16"], "stop"),
    "stop string too long": ("chat/completions", _chat(stop=["ok", "x" * 1025]), 400,
                             ["stop", "1024", "1025"], "stop"),
    "logprobs above 5": ("completions", _cmpl(logprobs=6), 400, ["logprobs", "5"], "logprobs"),
    "tools on a model without a tool-call format": (
        "chat/completions", _chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400,
        ["cannot call tools"], "tools"),
    "unknown field": ("chat/completions", _chat(temprature=0), 400, ["temprature"],
                      "temprature"),
    "logit_bias": ("completions", _cmpl(logit_bias={"5": 1}), 400, ["not supported"],
                   "logit_bias"),
    "empty prompt": ("completions", _cmpl(prompt=""), 400, ["prompt"], "prompt"),
    "empty token list": ("completions", _cmpl(prompt=[]), 400, ["prompt"], "prompt"),
    "prompt list holding an empty string": ("completions", _cmpl(prompt=[""]), 400,
                                            ["prompt", "no tokens"], "prompt"),
    "lone surrogate in the prompt": ("completions",
                                     '{"model": "small-ctx", "prompt": "Hi \\ud800 there"}', 400,
                                     ["not valid unicode", "surrogate", "column"], None),
    "lone surrogate in a message": ("chat/completions",
                                    '{"model": "small-ctx", "messages": [{"role": "user", '
                                    '"content": "Hi \\udc00"}]}', 400,
                                    ["not valid unicode", "surrogate"], None),
    # Where no tokenizer looks, a grammar compiler or a node's message would fail on one (a
    # schema's key was a 500).
    "lone surrogate in a schema's property name": (
        "chat/completions", '{"model": "small-ctx", "messages": [{"role": "user", "content": '
        '"Hi"}], "response_format": {"type": "json_schema", "json_schema": {"name": "x", '
        '"schema": {"type": "object", "properties": {"a\\ud800": {"type": "string"}}}}}}', 400,
        ["not valid unicode", "surrogate"], None),
    "lone surrogate in a tool call's arguments": (
        "chat/completions", '{"model": "small-ctx", "messages": [{"role": "user", "content": '
        '"Hi"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", '
        '"function": {"name": "f", "arguments": "{\\"a\\": \\"\\ud800\\"}"}}]}]}', 400,
        ["not valid unicode", "surrogate"], None),
    "lone surrogate escaped in a tool call's arguments": (
        "chat/completions", '{"model": "small-ctx", "messages": [{"role": "user", "content": '
        '"Hi"}, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", '
        '"function": {"name": "f", "arguments": "{\\"a\\": \\"\\\\ud800\\"}"}}]}]}',
        400, ["messages.1.tool_calls.0.function.arguments.a", "unicode"],
        "messages.1.tool_calls.0.function.arguments.a"),
    # Bodies the one parser (orjson) refuses: the body is not JSON it takes, said with where.
    "JSON nested 5000 levels deep": ("chat/completions",
                                     '{"model": "small-ctx", "stop": ' + "[" * 5000 + "]" * 5000
                                     + "}", 400, ["nests", "too deeply"], None),
    "a 5000-digit number": ("completions", '{"model": "small-ctx", "prompt": "Hi", "seed": '
                            + "9" * 5000 + "}", 400, ["number", "too large"], None),
    "a body that is not UTF-8": ("completions", b'{"model": "small-ctx", "prompt": "Hi \xff"}',
                                 400, ["utf-8", "0xff", "offset 37"], None),
    "lone surrogate in a stop string": (
        "completions", '{"model": "small-ctx", "prompt": "Hi", "stop": ["ok", "\\udfff"]}', 400,
        ["not valid unicode", "surrogate"], None),
    # Its grammar is over the message a node takes; sent, it would end the worker's Session
    # call and every stream on it (tests/test_worker_session.py holds a bystander to that).
    "schema padded past a node's message limit": (
        "chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
            "name": "padded", "schema": {"type": "object", "description": "d" * (5 << 20)}}}),
        400, ["5.0 MiB", "4 MiB", "schemas"], None),
}


def _post(server: Server, path: str, body, content_type: str = "application/json"):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.base_url}/{path}", content=data, timeout=30,
                      headers={"content-type": content_type})


def _assert_openai_error(r: httpx.Response, status: int, words: list[str],
                         param: str | None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == "invalid_request_error"
    assert isinstance(err["message"], str) and err["message"]
    for w in words:
        assert w.lower() in err["message"].lower(), (w, err["message"])
    assert err["param"] == param, err
    assert "internal error" not in err["message"].lower()
    return err


@pytest.mark.parametrize("name", list(CASES))
def test_bad_request_is_a_clear_4xx(small_server: Server, name: str) -> None:
    path, body, status, words, param = CASES[name]
    err = _assert_openai_error(_post(small_server, path, body), status, words, param)
    if "context" in name and "beyond" not in name and status == 400:
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path, body", [
    ("completions", _cmpl(max_tokens=1000, temperature=0)),
    ("chat/completions", _chat(max_completion_tokens=5000, temperature=0))])
def test_a_limit_past_the_context_is_a_cap(small_server: Server, path: str, body: dict) -> None:
    """Agents send a limit for the largest models they know (OpenCode 32,000): the model's room
    is what they get, not a 400 that fails every turn."""
    r = _post(small_server, path, {**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT, usage
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_body_that_is_not_json_content(small_server: Server) -> None:
    """JSON sent without its content type (curl -d sends form data): the error names the
    header to set, not the body, which is fine."""
    for kind in ("text/plain", "application/x-www-form-urlencoded"):
        r = _post(small_server, "chat/completions", json.dumps(_chat()), content_type=kind)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "Content-Type: application/json" in err["message"] and kind in err["message"]


def test_a_body_past_32_mib_is_refused_before_it_is_read_whole(small_server: Server) -> None:
    """Read before the API key is checked, a body is bounded: one that says it is larger, and
    one sent in chunks without saying, get a 413 that says the limit."""
    big = b'{"model": "x", "prompt": "' + b"a" * (33 << 20) + b'"}'
    r = httpx.post(small_server.base_url + "/completions", content=big, timeout=60,
                   headers={"content-type": "application/json"})
    err = _assert_openai_error(r, 413, ["32 MiB"], None)
    assert err["code"] == "request_too_large"

    def chunks():
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    r = httpx.post(small_server.base_url + "/messages", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and "32 MiB" in r.text, r.text


def test_unknown_path_and_method_are_openai_errors(small_server: Server) -> None:
    r = _post(small_server, "chat/completion", _chat())
    err = _assert_openai_error(r, 404, ["/v1/chat/completion"], None)
    assert "/v1/chat/completions" in err["message"]  # points at the right endpoint
    r = httpx.get(small_server.base_url + "/completions", timeout=10)
    _assert_openai_error(r, 405, ["GET"], None)
    assert r.headers.get("allow") == "POST"


def test_context_boundary(small_server: Server, small_model: Path) -> None:
    """prompt + max_tokens == context is served; one more token is cut to the room, as no
    limit is: whatever fits."""
    prompt = [5 + i % 200 for i in range(CONTEXT - 6)]
    ok = _post(small_server, "completions", _cmpl(prompt=prompt, max_tokens=6, ignore_eos=True,
                                                  temperature=0))
    assert ok.status_code == 200, ok.text
    usage = ok.json()["usage"]
    assert {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")} == {
        "prompt_tokens": CONTEXT - 6, "completion_tokens": 6, "total_tokens": CONTEXT}
    for limit in ({"max_tokens": 7}, {}):
        cut = _post(small_server, "completions", _cmpl(prompt=prompt, ignore_eos=True,
                                                       temperature=0, **limit))
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["completion_tokens"] == 6
        assert cut.json()["choices"][0]["finish_reason"] == "length"
    full = _post(small_server, "completions", _cmpl(prompt=[5] * CONTEXT))
    _assert_openai_error(full, 400, ["context"], "prompt")


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MSGS)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    assert "gpt-4o" in e.value.message

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, n=9)
    assert e.value.param == "n"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG_TEXT)
    assert e.value.code == "context_length_exceeded" and "context" in e.value.message

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=0)
    assert e.value.param == "max_tokens"

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, temperature=9)
    assert e.value.param == "temperature"

    with pytest.raises(openai.BadRequestError) as e:  # streaming: the error comes before SSE
        client.chat.completions.create(model=MODEL, messages=[], stream=True)
    assert e.value.param == "messages"

    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[3, 10**6])
    assert "vocabulary" in e.value.message

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard",
                                                               "content": "x"}])


def test_server_still_serves_after_all_that(small_server: Server, client: openai.OpenAI,
                                            small_model: Path) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    tok = AutoTokenizer.from_pretrained(str(small_model))
    ids = tok.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert r.usage.prompt_tokens == len(ids)
    stream = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                            stream=True, temperature=0,
                                            extra_body={"ignore_eos": True}))
    assert stream[-1].choices[0].finish_reason == "length"
    health = httpx.get(small_server.url + "/health", timeout=10)
    assert health.status_code == 200
    log = small_server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and " 500 " not in log, small_server.log_tail()
