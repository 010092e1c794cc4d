"""The real embedded default model (SmolLM2-135M-Instruct) served end to end."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.conftest import start_server


@pytest.mark.slow
def test_default_model_answers_paris(default_model_path, tmp_path):
    with start_server(default_model_path, home=tmp_path / "home", keepalive=None) as server:
        client = OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)
        reply = client.chat.completions.create(
            model=server.model_id,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=30,
        )
        assert "Paris" in reply.choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(
                model=server.model_id, stream=True, temperature=0, max_tokens=30,
                messages=[{"role": "user", "content": "What is the capital of France?"}])
            if c.choices
        )
        assert streamed == reply.choices[0].message.content
