"""A client's mistake is a 4xx that names it, never a 500; and a 500 tells the client an id,
never the exception, which the log keeps under that id (issue 49, part 6)."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path

import pytest

from omlx_coordinator.api import anthropic, openai
from tests.security.inproc import MODEL, app_for, build, client

SECRET_TEXT = "/etc/omlx/secret-path is unreadable"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("models"))


class _Nested(dict):
    """An object schema `depth` objects deep, as JSON text: json.dumps gives up before 500."""

    def __init__(self, depth: int):
        super().__init__()
        self.text = ('{"type": "object", "properties": {"a": ' * depth
                     + '{"type": "object"}' + "}}" * depth)


def _body(body: dict) -> str:
    """`body` as JSON, a _Nested written as its text."""
    if isinstance(body, _Nested):
        return body.text
    if isinstance(body, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_body(v)}" for k, v in body.items()) + "}"
    if isinstance(body, list):
        return "[" + ", ".join(_body(v) for v in body) + "]"
    return json.dumps(body)


def _chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **kw}


def _post(model: Path, path: str, body: dict):
    async def go():
        with app_for(model) as app:
            async with client(app) as http:
                return await http.post(path, content=_body(body),
                                       headers={"content-type": "application/json"})
    return asyncio.run(go())


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


RECURSIVE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
TOOL = {"name": "f", "description": "f",
        "input_schema": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                         "required": ["x"], "$defs": RECURSIVE["$defs"]}}


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", _chat(response_format=_json_schema(_Nested(500))),
     "response_format.json_schema.schema", ["nests too deeply"]),
    ("/v1/chat/completions", _chat(response_format=_json_schema(RECURSIVE)),
     "response_format.json_schema.schema", ["$ref"]),
    ("/v1/chat/completions", _chat(response_format=_json_schema(
        {"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}, {"type": "object"}]}},
         "$ref": "#/$defs/a"})), "response_format.json_schema.schema", ["circular"]),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": RECURSIVE}}], tool_choice="required"),
     "tools.0.function.parameters", ["'f'", "$ref"]),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": _Nested(500)}}]),
     "tools.0.function.parameters", ["nests too deeply"]),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "tools": [TOOL],
                      "tool_choice": {"type": "any"},
                      "messages": [{"role": "user", "content": "Hi"}]},
     None, ["cannot be compiled"]),
], ids=["response_format 500 deep", "response_format recursive $ref",
        "response_format $ref beside siblings", "forced tool recursive $ref",
        "strict tool 500 deep", "anthropic forced tool recursive $ref"])
def test_a_schema_that_cannot_be_compiled_is_a_400_naming_it(model, path, body, param, words):
    r = _post(model, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert all(w in err["message"] for w in words), err
    if param:  # OpenAI's error names the field; Anthropic's shape has no param
        assert err["param"] == param, err
    else:
        assert r.json()["type"] == "error" and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", _chat()),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8,
                      "messages": [{"role": "user", "content": "Hi"}]}),
])
def test_an_internal_error_tells_the_client_an_id_and_the_log_the_rest(model, path, body,
                                                                      monkeypatch, caplog):
    def broken(*_args):
        raise RuntimeError(SECRET_TEXT)

    monkeypatch.setattr(openai, "_tool_setup", broken)
    monkeypatch.setattr(anthropic, "_tool_use", broken)
    with caplog.at_level(logging.ERROR, logger="omlx_coordinator"):
        r = _post(model, path, body)
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert SECRET_TEXT not in r.text and "RuntimeError" not in r.text
    found = re.fullmatch(r"internal error \(id ([0-9a-f]{8})\); the server's log has the "
                         r"details", message)
    assert found, message
    logged = [rec for rec in caplog.records if found.group(1) in rec.getMessage()]
    assert logged and SECRET_TEXT in caplog.text and "RuntimeError" in caplog.text


def test_a_node_errors_grammar_failure_is_a_400_and_any_other_keeps_its_text_in_the_log(caplog):
    """A schema can compile and still outgrow the node's parser mid-generation (a `$ref` that
    must recur forever): the client's to simplify. A sampler's exception is ours."""
    from omlx_coordinator.request.generation import _node_error

    grammar = _node_error("grammar: parser error: Too many items (limit 50000; ff_tokens)")
    assert grammar.status == 400 and "Too many items" in grammar.message
    assert "response_format or tool schemas" in grammar.message
    with caplog.at_level(logging.ERROR, logger="omlx_coordinator"):
        other = _node_error(f"TypeError: {SECRET_TEXT}")
    assert other.status == 500 and SECRET_TEXT not in other.message
    assert other.message.startswith("generation failed on the node (id ")
    assert SECRET_TEXT in caplog.text
