"""The body OpenCode sends for a turn (tests/data/opencode_chat_body.json, recorded from
OpenCode 1.18.33 in the live run of tests/test_opencode.py, its working folder renamed) replayed
into the real gateway app in-process, the generation core stood in for: it is accepted, its
system prompt and every tool reach the prompt, and the stream it asked for comes back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from unittest import mock

import httpx
import pytest

from omlx_coordinator.api import openai
from omlx_coordinator.request.events import Delta, Done
from omlx_coordinator.request.generation import GenerationRequest
from tests.security.inproc import MODEL, app_for, client
from tests.tiny_models import tiny_qwen

BODY = Path(__file__).parent / "data" / "opencode_chat_body.json"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    # Its ~30 KB needs a long context in the tests' small vocabulary (~15k tokens).
    dest = tmp_path_factory.mktemp("models") / MODEL
    return tiny_qwen(dest, num_layers=1, hidden_size=32, context=65536)


def test_opencode_body_replayed(model: Path) -> None:
    body = {**json.loads(BODY.read_text()), "model": MODEL}
    requests: list[GenerationRequest] = []

    async def generate(manager, served, metrics, settings, req: GenerationRequest):
        requests.append(req)
        yield Delta("Hi.")
        yield Done("stop", len(req.prompt), 2)

    async def post(app) -> httpx.Response:
        async with client(app) as http:
            return await http.post("/v1/chat/completions", json=body)

    with app_for(model) as app, mock.patch.object(openai, "generate", generate):
        r = asyncio.run(post(app))
        prompt = app.state.manager.main.model.tokenizer.decode(requests[0].prompt)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[len("data: "):]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"]) == "Hi."
    assert chunks[-1]["usage"]["completion_tokens"] == 2  # stream_options.include_usage
    assert requests[0].max_tokens == body["max_tokens"]
    assert prompt.startswith("system\nYou are opencode, an interactive CLI tool")
    for tool in body["tools"]:
        assert f'"name": "{tool["function"]["name"]}"' in prompt
