"""The request parsers of /v1/chat/completions, /v1/completions, /v1/messages and Ollama's
/api/chat and /api/generate on generated bodies (deep, wide, huge numbers, invalid UTF-8, wrong types, stray fields, valid-looking
shapes nested at random), sent to the real app in-process: never a 500, always an answer in
the API's own shape, and each within a bound."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.security.inproc import MODEL, app_for, build, client

BOUND_S = 5.0  # no request may take longer (a hang would)
OLLAMA = ["/api/chat", "/api/generate"]
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", *OLLAMA]

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=10**30),
                    st.floats(allow_nan=False), st.text(max_size=20))
keys = st.one_of(st.sampled_from(["model", "messages", "prompt", "max_tokens", "role",
                                  "content", "type", "text", "tools", "tool_choice", "stream",
                                  "response_format", "json_schema", "schema", "stop", "n",
                                  "temperature", "input_schema", "name", "function"]),
                 st.text(max_size=8))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)), max_leaves=20)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                                 "content": st.one_of(st.text(max_size=20), values)})
valid_looking = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), scalars)},
    optional={"messages": st.lists(message, max_size=3), "prompt": values,
              "max_tokens": st.one_of(st.integers(-2, 2**70), scalars),
              "stream": st.booleans(), "response_format": values, "tools": values,
              "tool_choice": values, "stop": values, "extra": values})


def _deep(depth: int) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * depth + b"]" * depth + b"}"


bodies = st.one_of(
    valid_looking.map(lambda b: json.dumps(b).encode()),
    values.map(lambda b: json.dumps(b).encode()),
    st.integers(1, 5000).map(_deep),
    st.binary(max_size=60),  # invalid UTF-8 and no JSON at all
    st.builds(lambda n: b'{"model": "%s", "max_tokens": %s}' % (MODEL.encode(), b"9" * n),
              st.integers(1, 6000)),
    st.just(json.dumps({"model": MODEL, "max_tokens": 4,
                        "messages": [{"role": "user", "content": "Hi"}]}).encode()),
)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with app_for(build(Path(tmp_path_factory.mktemp("models")))) as app:
        yield app


def _well_formed(path: str, status: int, text: str) -> bool:
    if path in OLLAMA:
        # Ollama streams unless told not to: NDJSON, the last line the whole answer's end.
        body = json.loads(text.splitlines()[-1])
        return isinstance(body.get("error"), str) if status >= 400 else body.get("done") is True
    body = json.loads(text)
    if status >= 400:
        err = body.get("error")
        shaped = (body.get("type") == "error" if path == "/v1/messages"
                  else isinstance(err, dict) and "type" in err)
        return shaped and isinstance(err.get("message"), str)
    return body.get("type") == "message" if path == "/v1/messages" else "choices" in body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(path=st.sampled_from(PATHS), body=bodies)
def test_generated_bodies_get_a_shaped_answer_never_a_500(app, path: str, body: bytes) -> None:
    async def send():
        async with client(app, timeout=BOUND_S) as http:
            return await http.post(path, content=body,
                                   headers={"content-type": "application/json"})

    started = time.monotonic()
    r = asyncio.run(asyncio.wait_for(send(), BOUND_S))
    assert time.monotonic() - started < BOUND_S
    # A body with no prompt asks Ollama's routes to load the model: the real load, and no node.
    loads = path in OLLAMA and r.status_code == 503 and "no node has joined" in r.text
    assert r.status_code < 500 or loads, (body[:300], r.text[:500])
    assert _well_formed(path, r.status_code, r.text), (body[:300], r.text[:500])
